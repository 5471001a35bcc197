#include "disk_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

namespace fastoffload {

namespace {

// O_DIRECT needs offsets, lengths and addresses aligned to the device's logical block; 4 KiB covers
// every block size in use (512 B and 4 KiB).
constexpr size_t kDirectAlignment = 4096;
// Ranges of one file closer than this are read as one request (the gap is read and dropped).
constexpr uint64_t kMergeGap = 64 * 1024;
// Smallest request a job is cut into: below about 1 MiB a request costs more than it moves.
constexpr size_t kMinChunk = 1 << 20;

uint64_t align_down(uint64_t value) { return value / kDirectAlignment * kDirectAlignment; }
uint64_t align_up(uint64_t value) { return (value + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment; }

std::string error_text(int error_number) { return std::string(std::strerror(error_number)); }

// After the "fastoffload: " prefix of each check that raises it.
constexpr const char* kClosedError =
    "this checkpoint reader was closed with its offload (disable_layerwise_offload, or an enable that "
    "failed): its threads and files are gone. Enable offload again to read the checkpoint";

}  // namespace

ReadMode parse_read_mode(const std::string& name) {
  if (name == "auto") return ReadMode::kAuto;
  if (name == "direct") return ReadMode::kDirect;
  if (name == "buffered") return ReadMode::kBuffered;
  TORCH_CHECK(false, "fastoffload: read mode must be 'auto', 'direct' or 'buffered', got '", name, "'");
}

struct DiskReader::File {
  std::string path;
  int fd = -1;         // buffered
  int direct_fd = -1;  // O_DIRECT, or -1
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
  std::atomic<bool> direct_refused{false};  // the file system refused an O_DIRECT read: buffered from then on
  // The path, size and modification time stay: check_unchanged() works by name.
  void close_descriptors() {
    if (fd >= 0) ::close(fd);
    if (direct_fd >= 0) ::close(direct_fd);
    fd = direct_fd = -1;
  }
  ~File() { close_descriptors(); }
};

struct DiskReader::Chunk {
  struct Piece {
    uint64_t offset;  // in the file
    size_t nbytes;
    uint8_t* dest;
    const std::string* name;
  };
  size_t file = 0;
  uint64_t begin = 0;  // first byte needed
  uint64_t end = 0;    // one past the last byte needed
  std::vector<Piece> pieces;
  // Read in place: where the chunk's first block-aligned byte lands (null: through the bounce buffer).
  uint8_t* in_place = nullptr;
  std::shared_ptr<ReadJob> job;
  std::shared_ptr<std::vector<FileRange>> ranges;  // keeps the piece names alive
};

bool ReadJob::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !error_.empty();
}

std::string ReadJob::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

bool ReadJob::file_changed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return file_changed_;
}

DiskReader::DiskReader(size_t threads, size_t chunk_bytes, ReadMode mode)
    : chunk_bytes_(static_cast<size_t>(align_up(std::max<size_t>(chunk_bytes, kDirectAlignment)))), mode_(mode),
      read_slots_(threads), free_slots_(threads), made_(std::chrono::steady_clock::now()), idle_since_(made_) {
  TORCH_CHECK(threads >= 1 && threads <= 256, "fastoffload: read_threads must be between 1 and 256, got ",
              std::to_string(threads));
  std::vector<Bounce> bounces(2 * threads);
  if (mode_ != ReadMode::kBuffered) {
    for (auto& bounce : bounces) {
      bounce.data = static_cast<uint8_t*>(std::aligned_alloc(kDirectAlignment, chunk_bytes_ + 2 * kDirectAlignment));
      if (bounce.data != nullptr) continue;
      for (auto& made : bounces) std::free(made.data);
      TORCH_CHECK(false, "fastoffload: cannot allocate the reader's ", std::to_string(bounces.size()), " read buffers of ",
                  std::to_string(chunk_bytes_), " bytes; lower DiskOptions.read_threads or chunk_bytes");
    }
  }
  workers_.reserve(bounces.size());
  for (const Bounce& bounce : bounces) workers_.emplace_back([this, bounce] { worker_loop(bounce); });
}

DiskReader::~DiskReader() { close(); }

void DiskReader::close() {
  std::lock_guard<std::mutex> closing(close_mutex_);
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_ = true;  // from now on a caller's job is refused (push)
  }
  queue_cv_.notify_all();
  // Each worker runs what is queued (a job's chunks included) before it ends, and frees its read buffer.
  for (auto& worker : workers_)
    if (worker.joinable()) worker.join();
  // No worker is left to read through a descriptor, and open() refuses now: every file is closed for good.
  std::lock_guard<std::mutex> lock(files_mutex_);
  for (auto& file : files_) file->close_descriptors();
}

bool DiskReader::closed() const {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  return stopping_;
}

size_t DiskReader::open(const std::string& path) {
  std::lock_guard<std::mutex> lock(files_mutex_);
  TORCH_CHECK(!closed(), "fastoffload: ", kClosedError, " (asked to open ", path, ")");
  for (size_t i = 0; i < files_.size(); ++i)
    if (files_[i]->path == path) return i;
  auto file = std::make_unique<File>();
  file->path = path;
  file->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FASTOFFLOAD_READ_CHECK(file->fd >= 0, "fastoffload: cannot open checkpoint file ", path, ": ", error_text(errno));
  struct stat st {};
  FASTOFFLOAD_READ_CHECK(::fstat(file->fd, &st) == 0, "fastoffload: cannot stat checkpoint file ", path, ": ",
                         error_text(errno));
  file->size = static_cast<uint64_t>(st.st_size);
  file->mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
  file->inode = static_cast<uint64_t>(st.st_ino);
  (void)::posix_fadvise(file->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  if (mode_ != ReadMode::kBuffered) {
    file->direct_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    const int open_errno = errno;
    TORCH_CHECK(file->direct_fd >= 0 || mode_ != ReadMode::kDirect, "fastoffload: read_mode='direct' but ", path,
                " cannot be opened with O_DIRECT (", error_text(open_errno),
                "); its file system does not support direct I/O. Use read_mode='auto' to fall back to buffered reads");
  }
  files_.push_back(std::move(file));
  return files_.size() - 1;
}

DiskReader::File& DiskReader::file_at(size_t index) const {
  std::lock_guard<std::mutex> lock(files_mutex_);
  TORCH_CHECK(index < files_.size(), "fastoffload: internal error: no opened file ", std::to_string(index));
  return *files_[index];
}

const std::string& DiskReader::path(size_t file) const { return file_at(file).path; }
uint64_t DiskReader::file_size(size_t file) const { return file_at(file).size; }
bool DiskReader::direct(size_t file) const {
  const File& f = file_at(file);
  return f.direct_fd >= 0 && !f.direct_refused;
}

void DiskReader::check_unchanged(size_t index) const {
  const File& file = file_at(index);
  struct stat st {};
  const bool same_path = ::stat(file.path.c_str(), &st) == 0;
  const int64_t mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
  FASTOFFLOAD_READ_CHECK(same_path && static_cast<uint64_t>(st.st_size) == file.size && mtime_ns == file.mtime_ns &&
                             static_cast<uint64_t>(st.st_ino) == file.inode,
                         "fastoffload: checkpoint file ", file.path, same_path ? " changed" : " disappeared",
                         " after offload was enabled (it had ", std::to_string(file.size), " bytes",
                         same_path ? ", now " + std::to_string(static_cast<uint64_t>(st.st_size)) : std::string(),
                         ", or its modification time moved); the weights read from it now could differ from the ones "
                         "checked at enable. Restore the file, or disable offload and enable it again "
                         "(disable_layerwise_offload(model, device='meta') reads nothing from the file)");
}

std::vector<DiskReader::Chunk> DiskReader::make_chunks(const std::shared_ptr<std::vector<FileRange>>& owned,
                                                       uint8_t* dest, const std::shared_ptr<ReadJob>& job,
                                                       size_t limit) const {
  // Sorted by file position: neighbouring tensors share requests.
  std::vector<const FileRange*> order;
  for (const auto& r : *owned)
    if (r.nbytes > 0) order.push_back(&r);
  std::sort(order.begin(), order.end(), [](const FileRange* a, const FileRange* b) {
    return a->file != b->file ? a->file < b->file : a->offset < b->offset;
  });
  for (const FileRange* r : order)
    FASTOFFLOAD_READ_CHECK(r->offset + r->nbytes <= file_at(r->file).size, "fastoffload: tensor '", r->name,
                           "' ends at byte ", std::to_string(r->offset + r->nbytes), " but ", file_at(r->file).path,
                           " has only ", std::to_string(file_at(r->file).size), " bytes: the file is truncated");
  std::vector<Chunk> chunks;
  for (size_t first = 0; first < order.size();) {
    // One extent: ranges of one file with gaps of at most kMergeGap (read and dropped).
    size_t last = first + 1;
    uint64_t extent_end = order[first]->offset + order[first]->nbytes;
    while (last < order.size() && order[last]->file == order[first]->file &&
           order[last]->offset <= extent_end + kMergeGap) {
      extent_end = std::max<uint64_t>(extent_end, order[last]->offset + order[last]->nbytes);
      ++last;
    }
    append_extent_chunks(order, first, last, extent_end, dest, job, owned, limit, chunks);
    first = last;
  }
  return chunks;
}

void DiskReader::append_extent_chunks(const std::vector<const FileRange*>& order, size_t first, size_t last,
                                      uint64_t extent_end, uint8_t* dest, const std::shared_ptr<ReadJob>& job,
                                      const std::shared_ptr<std::vector<FileRange>>& owned, size_t limit,
                                      std::vector<Chunk>& chunks) const {
  // Requests end at block-aligned file offsets whatever the tensor boundaries, so that no request is a
  // small tail of a tensor and no block of the file is read by two requests.
  const size_t base = chunks.size();
  for (uint64_t at = order[first]->offset; at < extent_end;) {
    uint64_t end = align_down(at + limit);
    if (end <= at) end = at + limit;
    Chunk chunk;
    chunk.file = order[first]->file;
    chunk.begin = at;
    chunk.end = std::min<uint64_t>(end, extent_end);
    chunk.job = job;
    chunk.ranges = owned;
    chunks.push_back(std::move(chunk));
    at = chunks.back().end;
  }
  size_t window = base;
  for (size_t i = first; i < last; ++i) {
    const FileRange* r = order[i];
    const uint64_t r_end = r->offset + r->nbytes;
    while (chunks[window].end <= r->offset) ++window;  // ranges are sorted: windows only move forward
    for (size_t w = window; w < chunks.size() && chunks[w].begin < r_end; ++w) {
      const uint64_t from = std::max<uint64_t>(r->offset, chunks[w].begin);
      const uint64_t to = std::min<uint64_t>(r_end, chunks[w].end);
      uint8_t* target = dest + r->dest_offset + (from - r->offset);
      chunks[w].pieces.push_back({from, static_cast<size_t>(to - from), target, &r->name});
    }
  }
  // A window over a gap alone has nothing to read; the others shrink to the bytes their pieces need.
  auto empty = [](const Chunk& c) { return c.pieces.empty(); };
  chunks.erase(std::remove_if(chunks.begin() + static_cast<std::ptrdiff_t>(base), chunks.end(), empty), chunks.end());
  for (size_t w = base; w < chunks.size(); ++w) {
    Chunk& c = chunks[w];
    c.begin = c.pieces.front().offset;
    c.end = c.begin;
    for (const auto& piece : c.pieces) {
      c.begin = std::min(c.begin, piece.offset);
      c.end = std::max<uint64_t>(c.end, piece.offset + piece.nbytes);
    }
  }
}

void DiskReader::place_in_window(const std::vector<FileRange>& ranges, uint8_t* dest, DestWindow window,
                                 std::vector<Chunk>& chunks) const {
  if (window.begin == nullptr || chunks.empty() || mode_ == ReadMode::kBuffered) return;
  // One file and one distance between a byte's place in the file and in the destination, for every
  // range: then a block-aligned read lands every byte of every range where it belongs, and the bytes
  // around them that it also brings (gaps, head and tail pages) land where no range's bytes go.
  const auto base = reinterpret_cast<uintptr_t>(dest);
  uint64_t low = UINT64_MAX, high = 0;
  bool have = false;
  uintptr_t distance = 0;
  for (const auto& r : ranges) {
    if (r.nbytes == 0) continue;
    const uintptr_t d = base + r.dest_offset - static_cast<uintptr_t>(r.offset);
    if (have && (d != distance || r.file != ranges.front().file)) return;
    have = true;
    distance = d;
    low = std::min<uint64_t>(low, r.offset);
    high = std::max<uint64_t>(high, r.offset + r.nbytes);
  }
  if (!have || distance % kDirectAlignment != 0) return;
  const uintptr_t first = distance + static_cast<uintptr_t>(align_down(low));
  const uintptr_t last = distance + static_cast<uintptr_t>(align_up(high));
  if (first < reinterpret_cast<uintptr_t>(window.begin) || last > reinterpret_cast<uintptr_t>(window.end)) return;
  for (auto& chunk : chunks) chunk.in_place = reinterpret_cast<uint8_t*>(distance + align_down(chunk.begin));
}

std::shared_ptr<ReadJob> DiskReader::submit(std::vector<FileRange> ranges, uint8_t* dest,
                                            std::function<void()> prepare, DestWindow window) {
  TORCH_CHECK(!closed(), "fastoffload: ", kClosedError);
  auto job = std::make_shared<ReadJob>();
  auto owned = std::make_shared<std::vector<FileRange>>(std::move(ranges));
  std::vector<size_t> files;
  for (const auto& r : *owned)
    if (std::find(files.begin(), files.end(), r.file) == files.end()) files.push_back(r.file);
  for (size_t f : files) check_unchanged(f);

  // A job smaller than threads x chunk_bytes is cut finer, so that every worker has a request in flight
  // (a block of a small model would otherwise be one or two requests), unless the queue already holds a
  // request for every worker (a checkpoint load queues its blocks back to back): then full-size
  // requests, which the disk serves faster.
  uint64_t total = 0;
  for (const auto& r : *owned) total += r.nbytes;
  size_t queued = 0;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    queued = queue_.size();
  }
  const size_t even = static_cast<size_t>(align_up(total / (2 * read_slots_) + 1));
  const size_t limit = queued >= read_slots_
                           ? chunk_bytes_
                           : std::min(chunk_bytes_, std::max(std::min(kMinChunk, chunk_bytes_), even));
  std::vector<Chunk> chunks = make_chunks(owned, dest, job, limit);
  place_in_window(*owned, dest, window, chunks);
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.jobs += 1;
  }
  job->pending_ = chunks.size() + (prepare ? 1 : 0);
  if (job->pending_ == 0) {
    job->done_ = true;
    return job;
  }
  // The files were checked above, as the job was queued; the last chunk to finish checks them again, so that a
  // write that raced the reads (a file rewritten in place) fails the job instead of leaving the destination a mix
  // of two versions. The workers run only while this reader lives.
  auto job_files = std::make_shared<const std::vector<size_t>>(std::move(files));
  auto finish_one = [this, job_files](ReadJob& j, const std::string& error, size_t count, bool read) {
    std::lock_guard<std::mutex> lock(j.mutex_);
    if (!error.empty() && j.error_.empty()) {
      j.error_ = error;
      j.read_failed_ = read;
    }
    j.pending_ -= count;
    if (j.pending_ != 0) return;
    if (j.error_.empty()) {
      try {
        for (size_t f : *job_files) check_unchanged(f);
      } catch (const c10::Error& e) {
        j.error_ = e.what_without_backtrace();
        j.read_failed_ = true;
        j.file_changed_ = true;
      }
    }
    j.done_ = true;
    j.cv_.notify_all();
  };
  auto shared_chunks = std::make_shared<std::vector<Chunk>>(std::move(chunks));
  auto enqueue_chunks = [this, shared_chunks, finish_one](bool from_worker) {
    std::vector<std::function<void(Bounce&)>> tasks;
    tasks.reserve(shared_chunks->size());
    for (size_t c = 0; c < shared_chunks->size(); ++c) {
      tasks.emplace_back([this, shared_chunks, c, finish_one](Bounce& bounce) {
        const Chunk& chunk = (*shared_chunks)[c];
        std::string error;
        try {
          run_chunk(chunk, bounce);
        } catch (const c10::Error& e) {
          error = e.what_without_backtrace();
        } catch (const std::exception& e) {
          error = std::string("fastoffload: read failed: ") + e.what();
        }
        finish_one(*chunk.job, error, 1, true);
      });
    }
    push(std::move(tasks), from_worker);
  };
  if (!prepare) {
    enqueue_chunks(/*from_worker=*/false);
    return job;
  }
  std::vector<std::function<void(Bounce&)>> start;
  start.emplace_back([job, prepare, enqueue_chunks, finish_one, n = shared_chunks->size()](Bounce&) {
    std::string error;
    try {
      prepare();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = std::string("fastoffload: ") + e.what();
    }
    if (!error.empty()) {
      finish_one(*job, error, n + 1, false);  // nothing is read into a destination that may still be in use
      return;
    }
    enqueue_chunks(/*from_worker=*/true);
    finish_one(*job, std::string(), 1, false);
  });
  push(std::move(start), /*from_worker=*/false);
  return job;
}

void DiskReader::wait(ReadJob& job) {
  std::unique_lock<std::mutex> lock(job.mutex_);
  job.cv_.wait(lock, [&] { return job.done_; });
  if (job.error_.empty()) return;
  FASTOFFLOAD_READ_CHECK(!job.read_failed_, job.error_);
  TORCH_CHECK(false, job.error_);
}

bool DiskReader::done(const ReadJob& job) {
  std::lock_guard<std::mutex> lock(job.mutex_);
  return job.done_;
}

void DiskReader::read(std::vector<FileRange> ranges, uint8_t* dest, DestWindow window) {
  auto job = submit(std::move(ranges), dest, nullptr, window);
  wait(*job);
}

void DiskReader::push(std::vector<std::function<void(Bounce&)>> tasks, bool from_worker) {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    // Checked with the tasks queued under one lock: a caller's job is either queued whole before close() began,
    // and run by the workers before they end, or refused. The worker that queues a job's chunks runs them itself
    // if the others have ended.
    TORCH_CHECK(from_worker || !stopping_, "fastoffload: ", kClosedError);
    for (auto& task : tasks) queue_.push_back(std::move(task));
  }
  if (tasks.size() == 1) queue_cv_.notify_one();
  else queue_cv_.notify_all();
}

void DiskReader::worker_loop(Bounce bounce) {
  for (;;) {
    std::function<void(Bounce&)> task;
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) break;  // stopping, and every queued read has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task(bounce);
  }
  std::free(bounce.data);
}

void DiskReader::maybe_fail(const File& file, const Chunk& chunk) {
  uint64_t delay = 0;
  int error_number = 0;
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    delay = delay_us_;
    if (fail_count_ > 0) {
      if (fail_after_ > 0) {
        fail_after_ -= 1;
      } else {
        fail_count_ -= 1;
        error_number = fail_errno_;
      }
    }
  }
  if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
  FASTOFFLOAD_READ_CHECK(error_number == 0, "fastoffload: reading tensor '", *chunk.pieces.front().name, "' (bytes ",
              std::to_string(chunk.begin), "..", std::to_string(chunk.end), " of ", file.path, ") failed: ",
              error_text(error_number), ". Check the disk; nothing was changed, and a later read tries again");
}

void DiskReader::run_chunk(const Chunk& chunk, Bounce& bounce) {
  File& file = file_at(chunk.file);
  const auto start = std::chrono::steady_clock::now();
  maybe_fail(file, chunk);
  bool direct = file.direct_fd >= 0 && !file.direct_refused;
  if (direct) {
    if (chunk.in_place == nullptr && !bounce.used) {
      bounce.used = true;
      std::lock_guard<std::mutex> lock(stats_mutex_);
      stats_.bounce_bytes += chunk_bytes_ + 2 * kDirectAlignment;
    }
    direct = read_direct(file, chunk, bounce.data);
    if (!direct) file.direct_refused = true;  // benign race: every worker reaches the same answer
  }
  if (!direct) read_buffered(file, chunk);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::lock_guard<std::mutex> lock(stats_mutex_);
  uint64_t bytes = 0;
  for (const auto& piece : chunk.pieces) bytes += piece.nbytes;
  stats_.chunks += 1;
  stats_.bytes_read += bytes;
  (direct ? stats_.direct_bytes : stats_.buffered_bytes) += bytes;
  if (direct && chunk.in_place != nullptr) stats_.in_place_bytes += bytes;
  stats_.busy_seconds += seconds;
}

bool DiskReader::read_direct(File& file, const Chunk& chunk, uint8_t* bounce) {
  const uint64_t first = align_down(chunk.begin);
  const uint64_t length = align_up(chunk.end) - first;
  uint8_t* const target = chunk.in_place != nullptr ? chunk.in_place : bounce;
  uint64_t got = 0;
  while (got < length) {
    const ssize_t n = timed_pread(file.direct_fd, target + got, length - got, first + got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL && got == 0) return false;  // refused at read time (alignment rules differ)
    FASTOFFLOAD_READ_CHECK(n >= 0, "fastoffload: reading tensor '", *chunk.pieces.front().name, "' (bytes ",
                           std::to_string(chunk.begin), "..", std::to_string(chunk.end), " of ", file.path,
                           ") failed: ", error_text(errno));
    if (n == 0) break;
    got += static_cast<uint64_t>(n);
  }
  FASTOFFLOAD_READ_CHECK(first + got >= chunk.end, "fastoffload: ", file.path, " ends at byte ", std::to_string(first + got),
              ", before the end of tensor '", *chunk.pieces.back().name, "' (byte ", std::to_string(chunk.end),
              "): the file is truncated or was rewritten after offload was enabled");
  if (chunk.in_place == nullptr)
    for (const auto& piece : chunk.pieces) std::memcpy(piece.dest, bounce + (piece.offset - first), piece.nbytes);
  return true;
}

ssize_t DiskReader::timed_pread(int fd, uint8_t* dest, size_t nbytes, uint64_t offset) {
  {
    std::unique_lock<std::mutex> lock(slot_mutex_);
    slot_cv_.wait(lock, [&] { return free_slots_ > 0; });
    free_slots_ -= 1;
  }
  const auto start = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    if (in_flight_ == 0) stats_.idle_seconds += std::chrono::duration<double>(start - idle_since_).count();
    if (stats_.first_read_seconds < 0) stats_.first_read_seconds = std::chrono::duration<double>(start - made_).count();
    in_flight_ += 1;
    stats_.max_in_flight = std::max(stats_.max_in_flight, in_flight_);
  }
  const ssize_t n = ::pread(fd, dest, nbytes, static_cast<off_t>(offset));
  const int saved = errno;
  const auto end = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    in_flight_ -= 1;
    if (in_flight_ == 0) idle_since_ = end;
    stats_.read_seconds += std::chrono::duration<double>(end - start).count();
    stats_.last_read_end_seconds =
        std::max(stats_.last_read_end_seconds, std::chrono::duration<double>(end - made_).count());
  }
  {
    // Given back only once counted out, so that in_flight_ never exceeds the slots.
    std::lock_guard<std::mutex> lock(slot_mutex_);
    free_slots_ += 1;
  }
  slot_cv_.notify_one();
  errno = saved;
  return n;
}

void DiskReader::read_buffered(File& file, const Chunk& chunk) {
  for (const auto& piece : chunk.pieces) {
    size_t got = 0;
    while (got < piece.nbytes) {
      const ssize_t n = timed_pread(file.fd, piece.dest + got, piece.nbytes - got, piece.offset + got);
      if (n < 0 && errno == EINTR) continue;
      FASTOFFLOAD_READ_CHECK(n >= 0, "fastoffload: reading tensor '", *piece.name, "' (bytes ", std::to_string(piece.offset),
                  "..", std::to_string(piece.offset + piece.nbytes), " of ", file.path, ") failed: ", error_text(errno));
      FASTOFFLOAD_READ_CHECK(n > 0, "fastoffload: ", file.path, " ends at byte ", std::to_string(piece.offset + got),
                  ", before the end of tensor '", *piece.name, "' (byte ", std::to_string(piece.offset + piece.nbytes),
                  "): the file is truncated or was rewritten after offload was enabled");
      got += static_cast<size_t>(n);
    }
  }
}

void DiskReader::inject_errors(uint64_t after, uint64_t count, int error_number) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  fail_after_ = after;
  fail_count_ = count;
  fail_errno_ = error_number;
}

void DiskReader::set_delay_us(uint64_t micros) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  delay_us_ = micros;
}

ReaderStats DiskReader::stats() const {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(stats_mutex_);
  ReaderStats s = stats_;
  // The idle stretch still running counts up to now.
  if (in_flight_ == 0) s.idle_seconds += std::chrono::duration<double>(now - idle_since_).count();
  s.wall_seconds = std::chrono::duration<double>(now - made_).count();
  return s;
}

}  // namespace fastoffload
