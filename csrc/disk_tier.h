// DiskTier: the blocks that stay on disk, streamed every step through a small ring of pinned staging
// buffers: disk -> staging (reader threads) -> device slot (the copy stream) -> compute.
//
// The ring runs ahead of the forward in the order the blocks were registered (the forward order,
// wrapping around like the slot prefetch; set_order changes it to the order the forward was seen to run): as soon as the copy out of a staging buffer has been
// issued, the buffer is assigned the next disk block not yet staged and handed to the tier's own
// thread, which waits for the event recorded after that copy and submits the read the moment the copy
// has finished. So a buffer is never overwritten while the copy engine still reads it, no reader
// worker ever sits waiting for the device (every worker is reading), and the thread that enqueues
// compute never waits for the device either. It waits for the disk only when a block it must run now
// has not been read yet, which is when the device would have to wait for that read anyway, and so a
// read error is raised before any kernel can use the bytes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "copy_engine.h"
#include "disk_reader.h"
#include "pinned_pool.h"

namespace fastoffload {

struct DiskTierStats {
  uint64_t reads = 0;          // block reads submitted
  uint64_t waits = 0;          // takes that had to wait for their read
  double wait_seconds = 0.0;   // host time spent in those waits
  // Of those waits, the time the reader had no read request in flight at all: the pipeline's own
  // fault (a buffer freed late, a read queued late), since the disk could have been reading.
  double idle_in_waits_seconds = 0.0;
  uint64_t out_of_order = 0;   // takes of a block that was not staged (read on demand)
  uint64_t handoffs = 0;       // buffers handed to the tier's thread once their block's copy was issued
  double copy_wait_seconds = 0.0;  // the tier's thread waiting for those copies before it could read
  size_t staging_count = 0;
  size_t staging_bytes = 0;    // each
  // The reader's counters when the ring was (last) started, i.e. once the host tier was read: what a
  // start-up read before the ring's first fill, and when (seconds since the reader was made).
  uint64_t start_reader_bytes = 0;
  double start_reader_wall_seconds = 0.0;
  double start_reader_last_read_end_seconds = -1.0;
};

class DiskTier {
 public:
  DiskTier(std::shared_ptr<DiskReader> reader, CopyEngine& copy);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // Registers `block` (in forward order) with where its tensors are; dest offsets are packed offsets.
  void add_block(size_t block, std::vector<FileRange> ranges);
  bool has(size_t block) const { return position_.count(block) != 0; }
  // What a staging buffer holds beyond the largest block: each block is placed in its buffer so that its
  // bytes keep their file offsets' alignment (a block read with O_DIRECT lands in place, see DestWindow),
  // with a page before and after for the reads' head and tail pages.
  static constexpr size_t kSlack = PinnedPool::kPlaceSlack;
  // Takes `buffers` (at least one, `bytes` + kSlack each, pinned pool memory) as the staging ring and
  // starts the first reads. Calling it again (more blocks, larger blocks) waits for the reads in flight into the
  // old ring, drops it and starts over.
  void start(std::vector<std::shared_ptr<PoolAllocation>> buffers, size_t bytes);
  bool started() const { return !staging_.empty(); }
  // Reads ahead in `order` from now on (every disk block once, the one needed next first), instead of the
  // order the blocks were added in: the forward runs them in another order (it learns it on its first
  // pass). The buffers then hold the first blocks of `order`: one holding a block further on is freed once
  // its read has finished, and takes the next block needed.
  void set_order(const std::vector<size_t>& order);

  // The staging bytes of `block`, fully read. wait=false: nullptr when the read has not finished yet.
  // Throws the read's error (the buffer is then free again and the block is read anew next time).
  const uint8_t* take(size_t block, bool wait);
  // The copy out of `block`'s staging buffer has been issued on the copy stream: the buffer takes the
  // next read once that copy completes.
  void consumed(size_t block);
  // Whether `block` is staged and its read has finished (take(block, false) would not be null, or would
  // be null only because the read failed).
  bool ready(size_t block) const;
  // Waits for every read in flight (their errors are dropped: nobody will use those bytes).
  void drain();
  // The engine closes: the tier's thread ends, the reads in flight are waited for (drain) and the staging ring
  // goes back to the pool. Idempotent. Afterwards the tier is not started (take() refuses), start() refuses,
  // and stats() keeps its counters, with no staging buffers left.
  void close();

  DiskTierStats stats() const;
  const std::shared_ptr<DiskReader>& reader() const { return reader_; }

 private:
  struct Staging {
    std::shared_ptr<PoolAllocation> memory;
    uint8_t* base = nullptr;        // where the block's packed offset 0 lies in `memory`
    std::unique_ptr<Event> copied;  // recorded on the copy stream after the copy out of this buffer
    int64_t block = -1;             // the block being read into it or held by it; -1: free
    std::shared_ptr<ReadJob> job;   // null while the block waits for the copy out of the buffer's last one
    uint64_t ticket = 0;            // bumped whenever the buffer changes hands (a hand-off may be stale)
  };
  using Lock = std::unique_lock<std::mutex>;

  int64_t staged_index(size_t block) const;
  // prepare: the read first waits for the buffer's last copy on a reader worker (on-demand reads only).
  void submit(Staging& staging, size_t block, bool wait_for_copy);
  // Waits, unlocked, for the read into `staging` if one is in flight (its error dropped: the caller decides
  // what its bytes are for).
  void wait_for_read(const Staging& staging, Lock& lock);
  // The buffer holds no block from now on; a hand-off still queued for it is stale.
  void free_buffer(Staging& staging);
  // Assigns the next unstaged blocks to the free buffers and hands them to the tier's thread.
  void refill();
  // A buffer for an on-demand read: a free one, else the one holding the block furthest ahead.
  Staging& evict_for(size_t block, Lock& lock);
  // The tier's thread: waits for each handed-off buffer's copy, then submits its read.
  void stager_loop();
  void stop_stager();
  // Waits until the tier's thread has nothing handed off; then for every read in flight.
  void drain_locked(Lock& lock);

  std::shared_ptr<DiskReader> reader_;
  CopyEngine& copy_;
  std::vector<size_t> order_;                      // disk blocks in forward order
  std::unordered_map<size_t, size_t> position_;    // block -> index in order_
  std::vector<std::vector<FileRange>> ranges_;     // by index in order_
  std::vector<Staging> staging_;
  size_t staging_size_ = 0;  // each buffer's bytes, kSlack included
  size_t next_ = 0;  // index in order_ of the next block to stage
  DiskTierStats stats_;

  // Guards staging_, next_ and stats_ between the engine's thread and the tier's thread.
  mutable std::mutex mutex_;
  std::condition_variable handed_cv_;     // the tier's thread: a buffer was handed off, or stop
  std::condition_variable submitted_cv_;  // the engine's thread: a handed-off buffer's read was submitted
  std::deque<std::pair<size_t, uint64_t>> handed_;  // (buffer, its ticket then)
  bool stager_busy_ = false;
  bool stopping_ = false;
  bool closed_ = false;
  std::thread stager_;
};

}  // namespace fastoffload
