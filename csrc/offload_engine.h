// OffloadEngine: one offloaded block list on one device. Ties the store (host copies), the slot ring
// (device copies), the copy engine (streams and events) and the binder (what parameters point at).
//
// Python calls it once per block per step with an integer handle:
//   acquire(i)   block i is about to run: make sure it is in a slot (copy now if nothing prefetched
//                it), make the current stream wait for the copy, point the parameters at the slot.
//   prefetch(j)  start copying block j into a free slot on the copy stream; no-op if it is there.
//   release(i)   block i has run: parameters back to placeholders, record the slot's "free" event.
// No list crosses the boundary on that path and the host never waits for the device.
//
// Threads: see thread_gate.h. One forward at a time owns the engine; another thread's per-step call
// raises, and another thread's restore/close/materialize/repack waits for the running blocks.
//
// Autograd: with grad mode on, acquire binds the parameters to a private device copy of the slot
// instead of the slot itself, so tensors that autograd saved from them keep their bytes after later
// blocks reuse the slot (the Python hook keeps the parameters themselves out of the saved tensors).
// Offloaded parameters that require grad are still refused: between forwards they are placeholders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "binder.h"
#include "copy_engine.h"
#include "disk_reader.h"
#include "disk_tier.h"
#include "layer_store.h"
#include "pinned_pool.h"
#include "slot_ring.h"
#include "thread_gate.h"
#include "travel_chooser.h"

namespace fastoffload {

// How blocks travel host -> device (enable_layerwise_offload's `compress`).
enum class CompressMode { kOff, kOn, kAuto };
CompressMode parse_compress_mode(const std::string& name);

// How one block travels now.
enum class Travel : uint8_t { kRaw, kCompressed, kMeasuring };
const char* travel_name(Travel travel);

struct EngineStats {
  uint64_t acquires = 0;
  uint64_t prefetches = 0;         // copies started by prefetch()
  uint64_t prefetch_hits = 0;      // acquires that found their block prefetched
  uint64_t cache_hits = 0;         // acquires that found their block still in a slot from its last run
  uint64_t sync_loads = 0;         // acquires that had to start the copy themselves
  uint64_t skipped_prefetches = 0; // prefetches with no slot to go to
  uint64_t slots_replaced = 0;     // slots given a new buffer: a tensor made in a forward still viewed the old one
  uint64_t decodes = 0;            // copies that went compressed and were decoded into their slot
  // Blocks read from a checkpoint with compression on, encoded while the reads of later blocks were
  // still queued (the start-up pipeline: the disk reads on while the host encodes).
  uint64_t pipelined_encodes = 0;
  // Disk-tier blocks encoded into the spill file while the next one's read ran.
  uint64_t pipelined_spills = 0;
};

// A block's host copy as the codec left it, for stats().
struct BlockCodecInfo {
  Travel travel = Travel::kRaw;
  size_t raw_bytes = 0;         // packed size of the block
  size_t compressed_bytes = 0;  // 0 when it has no compressed copy
  size_t host_bytes = 0;        // host bytes it holds now (raw and/or compressed)
  uint32_t segments = 0;
  uint32_t coded_segments = 0;
  uint64_t exceptions = 0;
  uint64_t checksum = 0;  // the compressed region's (its header's), 0 without one
};

class OffloadEngine {
 public:
  OffloadEngine(at::Device device, size_t num_slots, std::shared_ptr<PinnedPool> pool);
  ~OffloadEngine();

  // Packs the current values of `params` and points them at placeholders. Returns the handle.
  size_t add_block(const std::vector<std::string>& names, const std::vector<at::Tensor>& params);
  // add_block with the host copy in the shared segment `segment_name` (LayerStore::add_shared): the owner
  // packs into it, another rank of the host maps the owner's copy without copying. Either way the
  // parameters become placeholders; slots, streams and events stay this process's own. A shared block
  // cannot be materialized or repacked (its bytes are other processes' weights too).
  // With compression on, the owner encodes the block and the segment holds the compressed bytes
  // (LayerStore::add_shared_compressed); another rank passes the owner's `packed_bytes` and `checksum`
  // for such a block (0: the segment holds raw bytes) and decodes the same bytes on its own device.
  size_t add_block_shared(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                          const std::string& segment_name, bool owner, size_t packed_bytes = 0,
                          uint64_t checksum = 0);

  // Checkpoint-backed blocks (see LayerStore::add_from_file): the reader opens the files and reads the
  // bytes; set it before adding such blocks.
  void set_reader(std::shared_ptr<DiskReader> reader);
  // Packs a block straight from the checkpoint into its pinned region (the host tier). Returns once the
  // read is under way; finish_loading waits for it. With compression on, the reads run ahead of the
  // encoder: each call first encodes the oldest blocks whose reads are queued, until at most
  // kEncodeLookahead - 1 are left (their reads run on while it encodes), then queues this block's
  // read; finish_loading encodes the rest. A read failure is thrown by the call that encodes that
  // block, before its own block is added.
  size_t add_block_from_file(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                             const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans);
  // A block of the disk tier: no host copy; it is read into a staging buffer every time it is copied.
  // With a spill file, its read for the spill is queued and the block before it is encoded and written
  // meanwhile (start_disk_tier finishes the last one); a failure of that earlier block is thrown
  // before this one is added.
  size_t add_block_on_disk(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                           const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans);
  // Compressed disk tier: the disk-tier blocks added from now on are encoded and written to a new spill
  // file at `path` (SpillFile), which they read every step instead of the checkpoint; the file is
  // removed by close() or the destructor. Only with compression on.
  void set_spill_file(const std::string& path);
  std::string spill_path() const;
  uint64_t spill_bytes() const;
  // Allocates the disk tier's staging ring (`count` buffers of the largest disk block, pinned while
  // the host tier's reads still run), waits for those reads (finish_loading) and starts reading ahead.
  // Call once every block is added.
  void start_disk_tier(size_t count);
  // The disk tier reads ahead in the order of `blocks` (the offloaded blocks in the order the forward runs
  // them, the one needed next first; those not in the disk tier are skipped).
  void set_disk_order(const std::vector<size_t>& blocks);
  // Waits until every block added from a file is read and pinned (see LayerStore::finish_pins), and
  // encoded when compression is on; throws the first read, pin or encode failure (the blocks not yet
  // encoded then stay raw). Every path that reads, copies or frees a region calls it first.
  void finish_loading();
  bool is_on_disk(size_t block) const { return store_.block(block).on_disk; }
  // Whether acquire(block) would wait for a disk read (so that the caller can release its locks first).
  bool acquire_may_wait(size_t block) const;
  DiskTierStats disk_stats() const { return disk_ ? disk_->stats() : DiskTierStats(); }
  const std::shared_ptr<DiskReader>& reader() const { return reader_; }
  // Compression of the blocks added from now on (and of blocks repacked later). verify: check every
  // compressed block's checksum whenever the host decodes it (debug and tests; costs a pass over it).
  void set_compression(CompressMode mode, bool verify, const codec::EncodeOptions& options);
  CompressMode compress_mode() const { return compress_mode_; }
  bool verify_checksums() const { return verify_; }
  // compress="auto": block `block` travels compressed from now on (true) or raw (false); the copy it
  // will not use is freed.
  void choose_travel(size_t block, bool compressed);
  BlockCodecInfo codec_info(size_t block) const;
  // compress="auto": decide now for the blocks still measuring, from the samples so far (before a
  // CUDA-graph capture, which must not change how blocks travel). No samples: they travel raw.
  void settle_travel();
  // compress="auto": copy time / compute time at or above which blocks travel compressed.
  void set_auto_threshold(double threshold);
  const TravelChooser& chooser() const { return chooser_; }
  // The raw packed bytes of a block as a CPU uint8 tensor (decoded when it is stored compressed).
  at::Tensor raw_host_bytes(size_t block) const;

  void acquire(size_t block);
  bool prefetch(size_t block);
  bool release(size_t block);
  // acquire(block), then prefetch() of each of the `count` blocks at `targets`, in order: the offload
  // hook's one call per block per step instead of 1 + prefetch_depth. When a prefetch fails the block is
  // released again before the error propagates (the hook's cleanup runs only after its entry completed).
  void acquire_and_prefetch(size_t block, const size_t* targets, size_t count);

  // Mutation support: the block's parameters become ordinary device tensors (out of the rotation)
  // until repack() packs whatever parameters the block has then.
  void materialize(size_t block);
  void repack(size_t block, const std::vector<std::string>& names, const std::vector<at::Tensor>& params);
  // Gives the parameters back as real tensors on `target` with their current values; the block's
  // host copy is freed and the handle can no longer be used.
  void restore(size_t block, at::Device target);
  // Like restore(), but nothing is read or copied (a disk-tier block's file may be unreadable or
  // changed): the parameters are left bound to their empty placeholders, for the caller to replace.
  void drop(size_t block);
  // Frees the slots (after restore() of every block, or to drop everything), and lets go of the disk: the disk
  // tier's thread and staging ring, the spill file, and the reader (set_reader's), whose threads end and whose
  // files close. The engine's reader is its own: close() closes it for whoever else holds it. Afterwards a block
  // still in the engine that needs a read (a disk-tier block) refuses with an error; the stats stay readable.
  void close();
  void synchronize();

  // CUDA-graph support (see CopyEngine::begin_capture). A fixed slot per block makes every step copy
  // into the same addresses, which a captured graph needs; `num_slots` may grow for it.
  void set_slot_assignment(const std::vector<int64_t>& assignment, size_t num_slots);
  void begin_capture();
  void end_capture();
  // The current stream waits for every copy issued so far.
  void join_copies();
  // Bumped by every host-side acquire/prefetch/release and by every change to a block's host copy, binding
  // or slots (materialize, repack, restore, drop, close, a travel or slot-assignment change): a captured
  // graph is valid only while it is unchanged since the capture ended.
  uint64_t generation() const { return generation_; }
  // Bumped only by what changes the addresses or bytes a captured graph copies between: a block's host
  // copy (materialize, repack, remove, close), how a block travels, the slot assignment, and a (re)allocation
  // of the slots or the staging buffers. A complete eager step leaves it as it was, so a graph captured
  // before one can replay after it (see OffloadedCUDAGraph).
  uint64_t layout_generation() const { return layout_generation_; }

  size_t num_blocks() const;
  size_t num_slots() const;
  size_t slot_bytes() const;
  size_t block_bytes(size_t block) const;
  size_t total_bytes() const;
  int64_t slot_of(size_t block) const;
  std::string slot_state(size_t slot) const;
  int64_t slot_block(size_t slot) const;
  uint64_t slot_address(size_t slot) const;
  bool is_materialized(size_t block) const;
  // The name of a parameter written in place while the block was offloaded (its placeholder or a slot
  // it no longer holds), cast and cast back, or rebound to a value of another shape, whose change restore()
  // cannot keep; "" when there is none or the block is live.
  std::string edited_in_place(size_t block) const;
  // Raises what the next acquire or materialize would raise for an edit, cast or rebind made while the block
  // was offloaded (nothing when the block is running or materialized, whose parameters hold live values).
  // Changes nothing: a load_state_dict refuses with it before any module has loaded.
  void check_offloaded_bindings(size_t block) const;
  bool is_removed(size_t block) const;
  bool is_shared(size_t block) const;
  // Tensor `j` of the block's host copy (host_views: every tensor, one decode when compressed): views
  // of it for a private block; copies for a shared block, whose pages are other ranks' weights too (and
  // read-only on a non-owner, where a write would crash).
  at::Tensor host_view(size_t block, size_t j) const;
  std::vector<at::Tensor> host_views(size_t block) const;
  // The address of the block's private raw host copy, the storage that host_views() gives views of; 0 when
  // there is none (a block stored only compressed, in the disk tier, or shared with other ranks: its views are
  // copies).
  uint64_t host_copy_address(size_t block) const;
  // The caller wrote into views of the raw host copy at `address` (host_copy_address when the views were
  // taken): the device copies made from the old bytes (the slot the block sits cached in, a prefetch) are
  // forgotten, and a compressed copy kept beside it (compress "auto" still measuring) is encoded again, so
  // the next acquire copies the written values. Returns false, changing nothing, when `address` is no longer
  // that copy (dropped for compressed travel, or replaced by a rebuild): the write reached a copy only. The
  // block must be neither running nor materialized. A graph captured before it no longer replays (layout).
  bool host_written(size_t block, uint64_t address);
  // Bytes of the block's parameters (numel x element size), without touching the host copy.
  size_t weight_bytes(size_t block) const;
  // A shared owner's digests of what it packed (LayerStore's StoredBlock::digests).
  const std::vector<uint64_t>& block_digests(size_t block) const { return store_.block(block).digests; }
  // The block's host copy leaves its shared segment for private memory (LayerStore::make_private).
  void make_private(size_t block);
  EngineStats stats() const;
  const CopyEngine& copy_engine() const { return copy_; }
  const std::shared_ptr<PinnedPool>& pool() const { return store_.pool(); }
  at::Device device() const { return device_; }

 private:
  // Holds the gate for one call; when the call ends (also by an exception) the calling thread owns
  // the engine if it still has blocks running, and nobody does otherwise.
  struct GateHold {
    const OffloadEngine& engine;
    std::unique_lock<std::mutex> lock;
    ~GateHold() { engine.gate_.settle(engine.ring_.any_in_use()); }
  };
  GateHold step_gate() const { return GateHold{*this, gate_.enter_step()}; }
  GateHold waiting_gate() const { return GateHold{*this, gate_.enter_waiting()}; }

  void check_block(size_t block) const;
  // The end of restore() and drop(): the slot given back (when the block was running), the block forgotten.
  void remove_block(size_t block, int64_t slot, bool running);
  void check_bindings(size_t block) const;
  void bind_for_run(size_t block, size_t slot);
  void choose_travel_held(size_t block, bool compressed);
  // released_originals: the block's original tensors held memory, which binding it gave back.
  void finish_add(size_t index, bool released_originals = true);
  static bool holds_storage(const std::vector<at::Tensor>& params);
  void check_not_shared(size_t block, const char* what) const;
  void ensure_slots();
  void keep_held_slot(size_t slot);
  void issue_copy(size_t block, size_t slot);
  void check_grad(size_t block) const;
  void check_not_on_disk(size_t block, const char* what) const;
  // The bytes to copy for `block`: its host region, or its disk-tier staging buffer (waited for).
  const void* copy_source(size_t block);
  void encode_new(size_t block);
  // Encodes the oldest blocks of pending_encode_ (each once its read is done) until at most `keep` are
  // left; on a failure, the rest are dropped from the list (they stay raw) and it is rethrown.
  void encode_loaded(size_t keep);
  // Spills the oldest pending_spill_ blocks until at most `keep` are left; on a failure, waits for the
  // other reads, drops them (those blocks read their raw tensors) and rethrows.
  void spill_loaded(size_t keep);
  void drop_pending_spills();
  // Spill-file blocks are given to the disk tier once the file is complete (start_disk_tier).
  void register_deferred_disk_blocks();
  void decide_travel();
  // Returns whether the buffers were (re)allocated.
  bool ensure_staging();
  void order_copies_after_current();
  // close(): the disk tier, the spill file and the reader let go of their threads, memory and files.
  void release_disk();

  at::Device device_;
  LayerStore store_;
  SlotRing ring_;
  CopyEngine copy_;
  Binder binder_;
  ThreadGate gate_;
  std::vector<uint8_t> materialized_;
  std::vector<uint8_t> removed_;
  std::vector<Travel> travel_;
  CompressMode compress_mode_ = CompressMode::kOff;
  bool verify_ = false;
  codec::EncodeOptions codec_options_;
  TravelChooser chooser_;
  at::Tensor staging_[2];  // device buffers the compressed bytes land in, alternately, before the decoder reads them
  bool views_stale_ = true;
  // Each slot's storage references when no parameter is bound to it (its buffer, the blocks' views of it), as
  // of the last time the views were built: more after a release means a tensor made in the forward views it.
  std::vector<size_t> slot_uses_;
  uint64_t generation_ = 0;
  uint64_t layout_generation_ = 0;
  EngineStats stats_;
  // Declared last so that the disk tier (whose reads write into pool memory and whose waits use the copy
  // engine's events) is torn down first.
  std::shared_ptr<DiskReader> reader_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<SpillFile> spill_;
  std::vector<size_t> deferred_disk_;  // disk-tier blocks, in order, not yet given to disk_
  std::deque<size_t> pending_encode_;  // blocks added from a file, read queued, to encode (compression on)
  std::deque<LayerStore::SpillRead> pending_spill_;  // disk-tier blocks read for the spill file, to encode
};

}  // namespace fastoffload
