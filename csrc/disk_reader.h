// DiskReader: reads byte ranges of checkpoint files into host memory on threads of its own.
//
// A read job is a list of file ranges (one per tensor) and a destination region; each range lands at
// its own offset in the region. The file extents the job covers (neighbouring ranges of one file
// merged) are cut into requests of at most chunk_bytes that end at block-aligned file offsets, whatever
// the tensor boundaries (a small tensor shares its neighbour's request instead of costing one of its
// own), and the worker threads read them in parallel, so several large requests are in flight at once. With O_DIRECT (the default wherever the file system accepts it) a chunk is read at
// block-aligned offsets into the worker's aligned bounce buffer, bypassing the page cache, and its
// pieces are copied into place; where O_DIRECT is refused (tmpfs, some network file systems) the file
// falls back to buffered pread straight into the destination. No caller ever holds the GIL while
// waiting, and nothing here prints or exits: every failure is a c10::Error that names the file and
// the tensor.
//
// Each opened file's size and modification time are recorded when it is opened; every later job checks
// them again first, so a checkpoint rewritten under a running offload is refused instead of read.
//
// Every failure to get a checkpoint's bytes (an I/O error, a short read, a file changed or gone) is a
// CheckpointReadFailure, which the bindings raise as fastoffload's CheckpointReadError; a failure of a
// job's `prepare` step (not a read) keeps its own type.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace fastoffload {

// A c10::Error, so every handler of those still catches it; only its Python type differs.
class CheckpointReadFailure : public c10::Error {
 public:
  using c10::Error::Error;
};

// TORCH_CHECK for read failures: throws a CheckpointReadFailure with the arguments' text.
#define FASTOFFLOAD_READ_CHECK(cond, ...)                                                          \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      throw ::fastoffload::CheckpointReadFailure({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, \
                                                 ::c10::str(__VA_ARGS__));                         \
  } while (false)

// Bytes [offset, offset + nbytes) of file `file` go to `dest_offset` in the job's destination.
struct FileRange {
  size_t file = 0;
  uint64_t offset = 0;
  size_t nbytes = 0;
  size_t dest_offset = 0;
  std::string name;  // the tensor, for error messages
};

// The part of a job's destination its reads may overwrite beyond the ranges' own bytes (scratch). With
// one, a job whose ranges all keep one page-aligned distance between file and destination (one file, a
// layout that mirrors the file's) is read with O_DIRECT straight into place, head and tail pages
// included, instead of into the bounce buffer and then copied: one copy of every byte fewer, done by
// the kernel instead of a worker. Without one (or when the job does not mirror), ranges land exactly.
struct DestWindow {
  uint8_t* begin = nullptr;
  uint8_t* end = nullptr;
};

// The page offset at which `ranges`' destination must start for them to land in place: a layout that
// mirrors the file keeps one distance between file and destination offsets, so any range tells it.
inline size_t page_phase(const std::vector<FileRange>& ranges) {
  return ranges.empty() ? 0 : static_cast<size_t>((ranges.front().offset - ranges.front().dest_offset) % 4096);
}

enum class ReadMode { kAuto, kDirect, kBuffered };
ReadMode parse_read_mode(const std::string& name);

struct ReaderStats {
  uint64_t jobs = 0;
  uint64_t chunks = 0;
  uint64_t bytes_read = 0;      // bytes requested by jobs (what landed in destinations)
  uint64_t direct_bytes = 0;    // of which read with O_DIRECT
  uint64_t buffered_bytes = 0;  // of which read through the page cache
  double busy_seconds = 0.0;    // summed over workers: time inside read calls and copies
  // Whether the disk was kept busy: read_seconds / wall_seconds is the mean number of read requests in
  // flight, idle_seconds the wall time with none in flight (both since the reader was made; take
  // differences over a window to judge that window).
  double read_seconds = 0.0;    // summed over workers: time inside read system calls alone
  double idle_seconds = 0.0;    // wall time with no read system call in flight
  double wall_seconds = 0.0;    // wall time since the reader was made
  uint64_t max_in_flight = 0;   // most read system calls in flight at once
  uint64_t bounce_bytes = 0;    // the workers' O_DIRECT bounce buffers that were used (touched)
  uint64_t in_place_bytes = 0;  // of direct_bytes, read straight into the destination (see DestWindow)
  // When the first read system call began and the last one ended, in seconds since the reader was
  // made (-1: none yet): with wall_seconds, how long a start-up spent before and after its reads.
  double first_read_seconds = -1.0;
  double last_read_end_seconds = -1.0;
};

class ReadJob;

class DiskReader {
 public:
  // threads: read requests in flight at once (>= 1). Twice as many workers share them, so that while
  // one worker copies a finished request out of its bounce buffer another has the request slot: the
  // disk is never left with fewer requests than `threads` for want of a worker. chunk_bytes: largest
  // single read (rounded up to the block size).
  DiskReader(size_t threads, size_t chunk_bytes, ReadMode mode);
  ~DiskReader();  // close()
  DiskReader(const DiskReader&) = delete;
  DiskReader& operator=(const DiskReader&) = delete;

  // Lets go of what the reader holds: the jobs already submitted finish, then the worker threads end (their
  // read buffers freed with them) and every opened file is closed. Idempotent. Afterwards open(), submit() and
  // read() refuse with an error that says so; stats() (the last figures), path(), file_size() and
  // check_unchanged() (by name) still answer. The offload engine closes its reader with itself.
  void close();
  bool closed() const;

  // Opens `path` for reading (O_DIRECT when the mode and the file system allow it) and returns its
  // index. Opening the same path twice returns the same index.
  size_t open(const std::string& path);
  // Throws when file `file` no longer has the size and modification time it had when opened.
  void check_unchanged(size_t file) const;
  const std::string& path(size_t file) const;
  uint64_t file_size(size_t file) const;
  bool direct(size_t file) const;

  // Starts reading `ranges` into `dest` (which must stay valid until the job is done). `prepare`, when
  // set, runs on a worker before any byte is written (e.g. to wait until `dest` may be overwritten).
  // `window`: the bytes around the ranges that may be overwritten (see DestWindow).
  std::shared_ptr<ReadJob> submit(std::vector<FileRange> ranges, uint8_t* dest,
                                  std::function<void()> prepare = nullptr, DestWindow window = {});
  // Blocks until `job` is done; throws its error, if any (a CheckpointReadFailure when a read failed).
  static void wait(ReadJob& job);
  static bool done(const ReadJob& job);
  // Reads synchronously (submit + wait).
  void read(std::vector<FileRange> ranges, uint8_t* dest, DestWindow window = {});

  // Fault injection for tests: after `after` more chunk reads succeed, the next `count` fail with
  // errno `error_number`.
  void inject_errors(uint64_t after, uint64_t count, int error_number);
  // Fault injection for tests: every chunk read first sleeps this long (a disk shared with others).
  void set_delay_us(uint64_t micros);

  ReaderStats stats() const;
  size_t threads() const { return read_slots_; }
  size_t workers() const { return workers_.size(); }
  size_t chunk_bytes() const { return chunk_bytes_; }

 private:
  struct File;
  struct Chunk;
  // A worker's aligned buffer for O_DIRECT reads. Reserved when the reader is made, before any pin
  // holds the process's mmap lock (a worker's first read would otherwise wait for it to map its
  // buffer); its pages are faulted in by the first read that uses it, and counted then.
  struct Bounce {
    uint8_t* data = nullptr;
    bool used = false;
  };

  void worker_loop(Bounce bounce);
  void run_chunk(const Chunk& chunk, Bounce& bounce);
  // read_direct answers false when the file system refuses O_DIRECT (the caller falls back); both
  // throw on any other failure.
  bool read_direct(File& file, const Chunk& chunk, uint8_t* bounce);
  void read_buffered(File& file, const Chunk& chunk);
  void maybe_fail(const File& file, const Chunk& chunk);
  // pread with the in-flight accounting of ReaderStats around it.
  ssize_t timed_pread(int fd, uint8_t* dest, size_t nbytes, uint64_t offset);
  File& file_at(size_t index) const;
  // Queues `tasks` at once. from_worker: queued by a task the workers run (a job's chunks after its prepare
  // step), which the workers still run after close() began; a caller's tasks are refused then, as no worker
  // may be left to run them.
  void push(std::vector<std::function<void(Bounce&)>> tasks, bool from_worker);
  // The job's ranges cut into requests of at most `limit` bytes, neighbours of one file merged.
  std::vector<Chunk> make_chunks(const std::shared_ptr<std::vector<FileRange>>& ranges, uint8_t* dest,
                                 const std::shared_ptr<ReadJob>& job, size_t limit) const;
  // Marks every chunk to be read in place when the whole job may be (see DestWindow).
  void place_in_window(const std::vector<FileRange>& ranges, uint8_t* dest, DestWindow window,
                       std::vector<Chunk>& chunks) const;
  // The requests of one extent (order[first, last), one file, extent_end its last byte + 1), appended.
  void append_extent_chunks(const std::vector<const FileRange*>& order, size_t first, size_t last,
                            uint64_t extent_end, uint8_t* dest, const std::shared_ptr<ReadJob>& job,
                            const std::shared_ptr<std::vector<FileRange>>& owned, size_t limit,
                            std::vector<Chunk>& chunks) const;

  size_t chunk_bytes_;
  ReadMode mode_;
  std::vector<std::unique_ptr<File>> files_;
  mutable std::mutex files_mutex_;

  mutable std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::function<void(Bounce&)>> queue_;  // a task gets its worker's bounce buffer
  bool stopping_ = false;  // close() began: the workers end once the queue is empty
  std::vector<std::thread> workers_;
  std::mutex close_mutex_;  // one close() at a time joins the workers and closes the files

  // The read request slots (a counting semaphore): a worker holds one only inside a read system call.
  size_t read_slots_;
  std::mutex slot_mutex_;
  std::condition_variable slot_cv_;
  size_t free_slots_;

  mutable std::mutex stats_mutex_;
  ReaderStats stats_;
  std::chrono::steady_clock::time_point made_;        // when the reader was made
  std::chrono::steady_clock::time_point idle_since_;  // when the last read call in flight ended
  uint64_t in_flight_ = 0;                            // read system calls in flight now
  uint64_t fail_after_ = 0;
  uint64_t fail_count_ = 0;
  int fail_errno_ = 0;
  uint64_t delay_us_ = 0;
};

// One submitted read. Shared between the submitter and the workers.
class ReadJob {
 public:
  bool failed() const;
  std::string error() const;
  // Failed because a file changed while the job read it (the check after its last chunk): what it read may mix
  // two versions, and a new read finds out whether the file is still changed.
  bool file_changed() const;

 private:
  friend class DiskReader;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  size_t pending_ = 0;  // chunks (plus the start task) not yet finished
  bool done_ = false;
  std::string error_;
  bool read_failed_ = false;  // error_ came from a read (not from the prepare step)
  bool file_changed_ = false;
};

}  // namespace fastoffload
