#include "disk_tier.h"

#include <algorithm>
#include <chrono>

#include <c10/util/Exception.h>

namespace fastoffload {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

DiskTier::DiskTier(std::shared_ptr<DiskReader> reader, CopyEngine& copy) : reader_(std::move(reader)), copy_(copy) {
  TORCH_CHECK(reader_ != nullptr, "fastoffload: the disk tier needs a DiskReader");
  stager_ = std::thread([this] { stager_loop(); });
}

DiskTier::~DiskTier() {
  stop_stager();
  Lock lock(mutex_);
  handed_.clear();  // never submitted: nothing reads into those buffers
  drain_locked(lock);
}

void DiskTier::stop_stager() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stopping_ = true;
  }
  handed_cv_.notify_all();
  if (stager_.joinable()) stager_.join();
}

void DiskTier::add_block(size_t block, std::vector<FileRange> ranges) {
  std::lock_guard<std::mutex> guard(mutex_);
  TORCH_CHECK(!has(block), "fastoffload: internal error: block ", std::to_string(block), " is already in the disk tier");
  position_[block] = order_.size();
  order_.push_back(block);
  ranges_.push_back(std::move(ranges));
}

void DiskTier::start(std::vector<std::shared_ptr<PoolAllocation>> buffers, size_t bytes) {
  const size_t count = buffers.size();
  TORCH_CHECK(count >= 1, "fastoffload: the disk tier needs at least one staging buffer, got ", std::to_string(count));
  Lock lock(mutex_);
  // Its thread is gone: a buffer handed off would never be read.
  TORCH_CHECK(!closed_, "fastoffload: the disk tier was closed with its offload engine (offload was disabled, or "
              "its enable failed); enable offload again to stream blocks from disk");
  drain_locked(lock);
  handed_.clear();
  staging_.clear();
  staging_.reserve(count);
  for (auto& memory : buffers) {
    Staging staging;
    staging.memory = std::move(memory);
    staging.copied = std::make_unique<Event>(copy_.device_index());
    staging_.push_back(std::move(staging));
  }
  staging_size_ = bytes + kSlack;
  stats_.staging_count = count;
  stats_.staging_bytes = staging_size_;
  const ReaderStats before = reader_->stats();
  stats_.start_reader_bytes = before.bytes_read;
  stats_.start_reader_wall_seconds = before.wall_seconds;
  stats_.start_reader_last_read_end_seconds = before.last_read_end_seconds;
  next_ = 0;
  refill();
}

void DiskTier::set_order(const std::vector<size_t>& order) {
  Lock lock(mutex_);
  TORCH_CHECK(order.size() == order_.size(), "fastoffload: internal error: the disk tier's new order has ",
              std::to_string(order.size()), " blocks, the tier holds ", std::to_string(order_.size()));
  std::vector<std::vector<FileRange>> ranges;
  std::unordered_map<size_t, size_t> position;
  ranges.reserve(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const auto found = position_.find(order[k]);
    TORCH_CHECK(found != position_.end() && position.count(order[k]) == 0, "fastoffload: internal error: the disk "
                "tier's new order names block ", std::to_string(order[k]), " twice or not in the tier");
    position[order[k]] = k;
    ranges.push_back(ranges_[found->second]);
  }
  order_ = order;
  ranges_ = std::move(ranges);
  position_ = std::move(position);
  next_ = 0;
  if (!started() || order_.empty()) return;
  // The buffers are to hold the blocks needed first in the new order. One that holds a block further on
  // (staged in the old order) is freed, once its read has finished (a read cannot be cancelled), and
  // refill gives it the next block needed.
  const size_t wanted = std::min(staging_.size(), order_.size());
  for (auto& staging : staging_) {
    if (staging.block < 0 || position_.at(static_cast<size_t>(staging.block)) < wanted) continue;
    wait_for_read(staging, lock);
    free_buffer(staging);
  }
  // Past the blocks at the front that are staged already: a buffer freed once one of them is taken reads
  // the next block needed, not that one again.
  while (next_ < order_.size() && staged_index(order_[next_]) >= 0) ++next_;
  next_ %= order_.size();
  refill();
}

int64_t DiskTier::staged_index(size_t block) const {
  for (size_t k = 0; k < staging_.size(); ++k)
    if (staging_[k].block == static_cast<int64_t>(block)) return static_cast<int64_t>(k);
  return -1;
}

void DiskTier::wait_for_read(const Staging& staging, Lock& lock) {
  if (!staging.job) return;
  // A read cannot be cancelled. The tier's thread leaves a buffer with a read alone, so the buffer stays as it
  // is while unlocked.
  const std::shared_ptr<ReadJob> job = staging.job;
  lock.unlock();
  try {
    DiskReader::wait(*job);
  } catch (const c10::Error&) {
  }
  lock.lock();
}

void DiskTier::free_buffer(Staging& staging) {
  staging.block = -1;
  staging.job.reset();
  staging.ticket += 1;  // a hand-off still queued for it is stale now
}

void DiskTier::submit(Staging& staging, size_t block, bool wait_for_copy) {
  std::function<void()> prepare;
  if (wait_for_copy && !copy_.is_host()) {
    // The copy out of this buffer's previous block may still be running on the copy stream.
    Event* copied = staging.copied.get();
    CopyEngine* copy = &copy_;
    prepare = [copy, copied] { copy->host_wait(*copied); };
  }
  const std::vector<FileRange>& ranges = ranges_[position_.at(block)];
  // The block's packed offset 0 is placed so that each byte keeps its file offset's page alignment: the
  // reader then reads the block in place when its layout mirrors the file.
  auto* data = static_cast<uint8_t*>(staging.memory->data());
  uint8_t* base = PinnedPool::placed(data, page_phase(ranges));
  staging.job = reader_->submit(ranges, base, std::move(prepare), DestWindow{data, data + staging_size_});
  staging.base = base;
  staging.block = static_cast<int64_t>(block);  // only once the read is under way: submit may throw
  stats_.reads += 1;
}

void DiskTier::refill() {
  if (order_.empty()) return;
  bool handed = false;
  for (size_t k = 0; k < staging_.size(); ++k) {
    Staging& staging = staging_[k];
    if (staging.block >= 0) continue;
    bool assigned = false;
    for (size_t tries = 0; tries < order_.size() && !assigned; ++tries) {
      const size_t candidate = order_[next_];
      next_ = (next_ + 1) % order_.size();
      if (staged_index(candidate) >= 0) continue;
      staging.block = static_cast<int64_t>(candidate);
      staging.job.reset();
      staging.ticket += 1;
      handed_.emplace_back(k, staging.ticket);
      stats_.handoffs += 1;
      assigned = handed = true;
    }
    if (!assigned) break;  // every disk block is staged already
  }
  if (handed) handed_cv_.notify_one();
}

void DiskTier::stager_loop() {
  Lock lock(mutex_);
  for (;;) {
    handed_cv_.wait(lock, [&] { return stopping_ || !handed_.empty(); });
    if (stopping_) break;
    const auto [k, ticket] = handed_.front();
    handed_.pop_front();
    stager_busy_ = true;
    Event* copied = staging_[k].copied.get();
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    bool copy_failed = false;
    try {
      copy_.host_wait(*copied);
    } catch (const c10::Error&) {
      copy_failed = true;  // the on-demand read waits for the same copy, and raises its error there
    }
    const double waited = seconds_since(start);
    lock.lock();
    stats_.copy_wait_seconds += waited;
    Staging& staging = staging_[k];
    if (staging.ticket == ticket && staging.block >= 0 && !staging.job) {
      bool submitted = false;
      if (!copy_failed) {
        try {
          submit(staging, static_cast<size_t>(staging.block), /*wait_for_copy=*/false);
          submitted = true;
        } catch (const c10::Error&) {
          // (A checkpoint file that changed.) Not this thread's error to raise: see below.
        }
      }
      if (!submitted) {
        // The buffer is free again, and the acquire of its block reads it on demand and raises the
        // error there, on the thread that can report it.
        free_buffer(staging);
      }
    }
    stager_busy_ = false;
    submitted_cv_.notify_all();
  }
  stager_busy_ = false;
  submitted_cv_.notify_all();
}

DiskTier::Staging& DiskTier::evict_for(size_t block, Lock& lock) {
  for (auto& staging : staging_)
    if (staging.block < 0) return staging;
  const size_t m = order_.size();
  const size_t here = position_.at(block);
  Staging* furthest = &staging_.front();
  size_t distance = 0;
  for (auto& staging : staging_) {
    const size_t ahead = (position_.at(static_cast<size_t>(staging.block)) + m - here) % m;
    if (ahead >= distance) {
      distance = ahead;
      furthest = &staging;
    }
  }
  wait_for_read(*furthest, lock);  // its bytes are simply not used
  free_buffer(*furthest);
  return *furthest;
}

const uint8_t* DiskTier::take(size_t block, bool wait) {
  Lock lock(mutex_);
  TORCH_CHECK(!staging_.empty(), "fastoffload: internal error: the disk tier was not started");
  const auto start = std::chrono::steady_clock::now();
  const double idle_before = wait ? reader_->stats().idle_seconds : 0.0;
  bool waited = false;
  bool read_again = false;
  for (;;) {
    int64_t k = staged_index(block);
    if (k < 0) {
      if (!wait) return nullptr;
      stats_.out_of_order += 1;
      Staging& staging = evict_for(block, lock);
      submit(staging, block, /*wait_for_copy=*/true);
      next_ = (position_.at(block) + 1) % order_.size();
      k = staged_index(block);
    }
    Staging& staging = staging_[static_cast<size_t>(k)];
    if (!staging.job) {
      // Handed off: its read starts once the copy out of the buffer's previous block has finished.
      if (!wait) return nullptr;
      waited = true;
      submitted_cv_.wait(lock, [&] { return staging.job != nullptr || staging.block != static_cast<int64_t>(block); });
      if (!staging.job) continue;  // its submit failed: read on demand, which raises the failure here
    }
    if (!DiskReader::done(*staging.job)) {
      if (!wait) return nullptr;
      waited = true;
      wait_for_read(staging, lock);  // its error is raised below
    }
    if (waited) {
      // The idle time first: its window then lies inside the wait's, so it never exceeds it.
      stats_.idle_in_waits_seconds += reader_->stats().idle_seconds - idle_before;
      stats_.waits += 1;
      stats_.wait_seconds += seconds_since(start);
    }
    if (staging.job->failed()) {
      if (!wait) return nullptr;  // the block's own acquire raises it
      const std::shared_ptr<ReadJob> failed = std::move(staging.job);
      staging.block = -1;  // free again; the block is read anew when it is next needed
      staging.ticket += 1;
      if (failed->file_changed() && !read_again) {
        // Read ahead while the file changed: read it once more now, which raises if the file still differs
        // (and reads bytes of one version if it was put back).
        read_again = true;
        continue;
      }
      DiskReader::wait(*failed);  // done: throws its error, with its type (a read failure or not)
    }
    return staging.base;
  }
}

bool DiskTier::ready(size_t block) const {
  std::lock_guard<std::mutex> guard(mutex_);
  const int64_t k = staged_index(block);
  if (k < 0) return false;
  const Staging& staging = staging_[static_cast<size_t>(k)];
  return staging.job != nullptr && DiskReader::done(*staging.job);
}

void DiskTier::consumed(size_t block) {
  std::lock_guard<std::mutex> guard(mutex_);
  const int64_t k = staged_index(block);
  if (k < 0) return;
  Staging& staging = staging_[static_cast<size_t>(k)];
  copy_.record_on_copy(*staging.copied);
  free_buffer(staging);
  refill();
}

void DiskTier::drain() {
  Lock lock(mutex_);
  drain_locked(lock);
}

void DiskTier::close() {
  stop_stager();
  Lock lock(mutex_);
  handed_.clear();  // never submitted: nothing reads into those buffers
  drain_locked(lock);
  staging_.clear();  // the ring's pool memory goes back with its last reference
  stats_.staging_count = 0;
  stats_.staging_bytes = 0;
  closed_ = true;
}

void DiskTier::drain_locked(Lock& lock) {
  submitted_cv_.wait(lock, [&] { return (handed_.empty() || stopping_) && !stager_busy_; });
  for (auto& staging : staging_) wait_for_read(staging, lock);
}

DiskTierStats DiskTier::stats() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return stats_;
}

}  // namespace fastoffload
