#include "disk_tier.h"

#include <chrono>

#include <c10/util/Exception.h>

namespace fastoffload {

DiskTier::DiskTier(std::shared_ptr<DiskReader> reader, CopyEngine& copy) : reader_(std::move(reader)), copy_(copy) {
  TORCH_CHECK(reader_ != nullptr, "fastoffload: the disk tier needs a DiskReader");
}

DiskTier::~DiskTier() { drain(); }

void DiskTier::add_block(size_t block, std::vector<FileRange> ranges) {
  TORCH_CHECK(!has(block), "fastoffload: internal error: block ", std::to_string(block), " is already in the disk tier");
  position_[block] = order_.size();
  order_.push_back(block);
  ranges_.push_back(std::move(ranges));
}

void DiskTier::start(std::vector<std::shared_ptr<PoolAllocation>> buffers, size_t bytes) {
  const size_t count = buffers.size();
  TORCH_CHECK(count >= 1, "fastoffload: the disk tier needs at least one staging buffer, got ", std::to_string(count));
  drain();
  staging_.clear();
  staging_.reserve(count);
  for (auto& memory : buffers) {
    Staging staging;
    staging.memory = std::move(memory);
    staging.copied = std::make_unique<Event>(copy_.device_index());
    staging_.push_back(std::move(staging));
  }
  stats_.staging_count = count;
  stats_.staging_bytes = bytes;
  next_ = 0;
  refill();
}

int64_t DiskTier::staged_index(size_t block) const {
  for (size_t k = 0; k < staging_.size(); ++k)
    if (staging_[k].block == static_cast<int64_t>(block)) return static_cast<int64_t>(k);
  return -1;
}

void DiskTier::submit(Staging& staging, size_t block) {
  std::function<void()> prepare;
  if (!copy_.is_host()) {
    // The copy out of this buffer's previous block may still be running on the copy stream.
    Event* copied = staging.copied.get();
    CopyEngine* copy = &copy_;
    prepare = [copy, copied] { copy->host_wait(*copied); };
  }
  staging.job = reader_->submit(ranges_[position_.at(block)], static_cast<uint8_t*>(staging.memory->data()),
                                std::move(prepare));
  staging.block = static_cast<int64_t>(block);  // only once the read is under way: submit may throw
  stats_.reads += 1;
}

void DiskTier::refill() {
  if (order_.empty()) return;
  for (auto& staging : staging_) {
    if (staging.block >= 0) continue;
    for (size_t tries = 0; tries < order_.size(); ++tries) {
      const size_t candidate = order_[next_];
      next_ = (next_ + 1) % order_.size();
      if (staged_index(candidate) < 0) {
        try {
          submit(staging, candidate);
        } catch (const c10::Error&) {
          // (A checkpoint file that changed.) Not this caller's error: the buffer stays free, and the
          // acquire of `candidate` reads it on demand and raises it there.
          return;
        }
        break;
      }
    }
    if (staging.block < 0) return;  // every disk block is staged already
  }
}

DiskTier::Staging& DiskTier::evict_for(size_t block) {
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
  try {
    DiskReader::wait(*furthest->job);  // a read cannot be cancelled; its bytes are simply not used
  } catch (const c10::Error&) {
  }
  furthest->block = -1;
  furthest->job.reset();
  return *furthest;
}

const uint8_t* DiskTier::take(size_t block, bool wait) {
  TORCH_CHECK(started(), "fastoffload: internal error: the disk tier was not started");
  int64_t k = staged_index(block);
  if (k < 0) {
    if (!wait) return nullptr;
    stats_.out_of_order += 1;
    Staging& staging = evict_for(block);
    submit(staging, block);
    next_ = (position_.at(block) + 1) % order_.size();
    k = staged_index(block);
  }
  Staging& staging = staging_[static_cast<size_t>(k)];
  if (!DiskReader::done(*staging.job)) {
    if (!wait) return nullptr;
    stats_.waits += 1;
    const auto start = std::chrono::steady_clock::now();
    try {
      DiskReader::wait(*staging.job);
    } catch (const c10::Error&) {
    }
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (staging.job->failed()) {
    if (!wait) return nullptr;  // the block's own acquire raises it
    const std::shared_ptr<ReadJob> failed = std::move(staging.job);
    staging.block = -1;  // free again; the block is read anew when it is next needed
    DiskReader::wait(*failed);  // done: throws its error, with its type (a read failure or not)
  }
  return static_cast<const uint8_t*>(staging.memory->data());
}

bool DiskTier::ready(size_t block) const {
  const int64_t k = staged_index(block);
  return k >= 0 && DiskReader::done(*staging_[static_cast<size_t>(k)].job);
}

void DiskTier::consumed(size_t block) {
  const int64_t k = staged_index(block);
  if (k < 0) return;
  Staging& staging = staging_[static_cast<size_t>(k)];
  copy_.record_on_copy(*staging.copied);
  staging.block = -1;
  staging.job.reset();
  refill();
}

void DiskTier::drain() {
  for (auto& staging : staging_) {
    if (!staging.job) continue;
    try {
      DiskReader::wait(*staging.job);
    } catch (const c10::Error&) {
    }
  }
}

DiskTierStats DiskTier::stats() const { return stats_; }

}  // namespace fastoffload
