// LayerStore: every offloaded block's tensors packed into one aligned region of pool memory.
//
// Packing a block is what turns "one copy per parameter" into "one copy per block": the region is
// copied to a device slot with a single cudaMemcpyAsync. Each tensor keeps its dtype, sizes and
// strides exactly (its storage span is copied byte for byte, so channels_last, transposed and
// expanded layouts survive), at an offset aligned to PinnedPool::kAlignment so that a view of any
// dtype can start there.
#pragma once

#include <cstddef>
#include <future>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include "disk_reader.h"
#include "codec.h"
#include "pinned_pool.h"
#include "spill_file.h"

namespace fastoffload {

struct TensorLayout {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  size_t offset = 0;  // bytes from the start of the block's region
  size_t nbytes = 0;  // bytes of the tensor's storage span
};

struct StoredBlock {
  std::vector<at::Tensor> tensors;  // the parameters themselves (their identity, not their data)
  std::vector<TensorLayout> layout;
  std::shared_ptr<PoolAllocation> host;
  at::Tensor host_bytes;  // uint8 CPU tensor over `host`; keeps it alive while viewed
  size_t bytes = 0;       // packed size, aligned
  bool removed = false;
  bool shared = false;        // `host` lives in a shared segment (see add_shared)
  bool shared_owner = false;  // ...which this process created and filled
  bool on_disk = false;       // disk tier: no host copy; `ranges` say where each tensor lives in the checkpoint
  std::vector<FileRange> ranges;  // blocks built from a checkpoint: one per tensor, dest_offset = layout offset
  // A disk-tier block stored compressed in the spill file (LayerStore::finish_spill): its region is
  // `packed_bytes` at `spill_offset` there, and `packed` stays null (no host copy at all).
  bool spilled = false;
  uint64_t spill_offset = 0;
  // Owner of a shared block only: digest_bytes() of each tensor's packed bytes, computed while packing
  // (the other ranks compare theirs, from tensor_digests(), before they map the copy). Empty otherwise.
  std::vector<uint64_t> digests;
  // The compressed host copy (codec.h), when the block has one. A compressed block's raw copy (`host`)
  // is dropped once the block is known to travel compressed, which is where the host memory saving
  // comes from; until then (compress="auto" measuring) both are kept.
  std::shared_ptr<PoolAllocation> packed;
  size_t packed_bytes = 0;
  codec::Summary packed_summary;
  bool has_raw() const { return host != nullptr; }
  bool has_packed() const { return packed != nullptr; }
};

// Where tensor j of a block lives in a checkpoint: (file index in the DiskReader, byte offset, byte count).
using FileSpan = std::tuple<size_t, uint64_t, size_t>;

// Layout of `tensors` packed back to back; throws a c10::Error naming the tensor when one cannot be
// stored (meta, sparse, quantized or storage-less tensors).
std::vector<TensorLayout> plan_layout(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                                      size_t* total_bytes);

// digest_bytes() of each tensor's storage span, in order: what an owner's StoredBlock::digests holds for
// the same values. Validates like plan_layout. Tensors on a device are copied to the host one at a time.
std::vector<uint64_t> tensor_digests(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors);

// Blocks from a checkpoint at least this large get a placed region (PinnedPool::allocate_placed), read
// in place when their layout mirrors the file.
constexpr size_t kPlacedMinBytes = 4 << 20;

class LayerStore {
 public:
  explicit LayerStore(std::shared_ptr<PinnedPool> pool);
  // Waits for the loads still running (their bytes land in regions this store frees).
  ~LayerStore();
  LayerStore(const LayerStore&) = delete;
  LayerStore& operator=(const LayerStore&) = delete;

  // Packs the current values of `tensors` into a new region and returns the block's index.
  size_t add(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, bool pin = true);
  // Like add(), with the region in the shared segment `segment_name` (see PinnedPool::allocate_shared).
  // owner: creates the segment and packs into it. Otherwise the segment already holds the owner's packed
  // copy: this process only plans the layout of its own `tensors` (which must equal the owner's: same
  // names, dtypes, shapes and strides, so the same offsets), checks the segment's size against it and
  // maps it; nothing is copied.
  size_t add_shared(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                    const std::string& segment_name, bool owner);
  // The owner of a shared block with compression on: packs the block privately (hashing each tensor as
  // add_shared does), encodes it, and writes the compressed region into the shared segment
  // `segment_name`, created at the compressed size; the private raw copy is freed. A block whose coding
  // does not pay goes into the segment raw. *compressed says which.
  size_t add_shared_compressed(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                               const std::string& segment_name, const codec::EncodeOptions& options, bool* compressed);
  // Another rank of the host: maps the owner's compressed segment (`packed_bytes` long), checks that it
  // decodes to this rank's layout of `tensors` and that its bytes hash to `checksum` (what the owner
  // encoded, as the owner reported it), and registers the block with no raw copy.
  size_t attach_shared_compressed(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                                  const std::string& segment_name, size_t packed_bytes, uint64_t checksum);
  // Packs a block straight from a checkpoint: tensor j has `shapes[j]` (contiguous) and the dtype of
  // `tensors[j]` (whose own values are ignored: they may be empty placeholders), and its bytes are
  // `spans[j]`, read into the block's region by `reader`; no other copy of them exists. It returns
  // once the read is under way: the reads of successive blocks queue back to back, so the disk never
  // idles between blocks, and never waits for a pin either: each region's pin is queued on a pin lane
  // at the same time and runs beside the reads (see queue_pin), ahead of them, so that little is left
  // to pin once the last byte has arrived. An error found before the read starts adds nothing; a read
  // or pin failure is thrown by finish_pins.
  // pin=false: the region stays pageable (a raw copy that is about to be compressed and dropped); the
  // read is still queued, and waited for, the same way.
  size_t add_from_file(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                       const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans,
                       const std::shared_ptr<DiskReader>& reader, bool pin = true);
  // Registers a block of the disk tier: laid out like add_from_file, but no host region at all; its
  // bytes are read from `spans` each time it is needed (see DiskTier).
  size_t add_on_disk(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                     const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans,
                     const DiskReader& reader);
  // Pool memory of `nbytes` for the caller to fill later (the disk tier's staging buffers), pinned in
  // the background on a pin lane after the loads' pins queued there, so that its pinning too runs
  // while the loads read. Its pin is waited for by finish_pins.
  std::shared_ptr<PoolAllocation> allocate_pinned_later(size_t nbytes);
  // Waits for every read and pin that add_from_file and allocate_pinned_later started, and throws the
  // first failure (a CheckpointReadFailure for a read). Call it before any of those regions is read,
  // copied or freed. Safe from several threads: a caller returns only once every load has finished.
  void finish_pins() const;
  // Waits for the load of block `index` alone (its read, and its pin) and throws its failure; the other
  // loads keep running. A block with no load still running returns at once.
  void finish_load(size_t index) const;
  // Compressed disk tier, in two halves so that the next block's read runs while this one is encoded
  // and written: start_spill queues the read of on-disk block `index` into a new CPU buffer;
  // finish_spill waits for it (throwing its failure), encodes it and appends the compressed region to
  // `spill` (the block then reads those bytes every step instead), or returns false, changing nothing,
  // when no tensor of the block pays for coding (it keeps reading its raw tensors). A SpillRead must
  // not be dropped before its read is done (wait_spill_read): the reader writes into its buffer.
  struct SpillRead {
    size_t index = 0;
    at::Tensor raw;
    std::shared_ptr<ReadJob> job;
  };
  SpillRead start_spill(size_t index, DiskReader& reader) const;
  bool finish_spill(const SpillRead& read, SpillFile& spill, const codec::EncodeOptions& options);
  // Waits for the read of `read`, ignoring its failure (nobody will use those bytes).
  static void wait_spill_read(const SpillRead& read);
  // The packed bytes of an on-disk block, read now into a new CPU tensor.
  at::Tensor read_block(size_t index, DiskReader& reader) const;
  // Tensor j of an on-disk block, read now into a new CPU tensor.
  at::Tensor read_tensor(size_t index, size_t j, DiskReader& reader) const;
  // Replaces block `index` with the current values of `tensors` (which may be different objects,
  // e.g. after a LoRA conversion replaced submodules). The old region is freed.
  void replace(size_t index, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
               bool pin = true);
  // Moves block `index`'s host copy (raw or compressed) out of its shared segment into private pool
  // memory (same bytes, same layout); a no-op for a private block. How an owner takes its copy back when the ranks decide
  // not to share after it packed.
  void make_private(size_t index);
  // Takes back the block just added (`index` must be the last one) after a later step of adding it failed.
  void discard_last(size_t index);
  // Frees block `index`'s region; the block keeps its index but can no longer be used.
  void remove(size_t index);

  // Encodes block `index` into a compressed region of pool memory, pinned. Returns false, changing
  // nothing, when no tensor of the block pays for coding (the block then travels raw). keep_raw: keep
  // the raw copy too (drop one of them later with drop_raw or drop_packed).
  bool compress(size_t index, const codec::EncodeOptions& options, bool keep_raw);
  void drop_raw(size_t index);
  void drop_packed(size_t index);
  // The raw packed bytes of block `index` as a CPU uint8 tensor: the raw copy itself when the block has
  // one, else a freshly decoded copy (verify: check the checksum first).
  at::Tensor raw_bytes(size_t index, bool verify) const;

  // A CPU tensor viewing tensor `j` of block `index` in pool memory (keeps the region alive). A shared
  // block's view is other processes' weights too (read-only pages on a non-owner): for internal reads.
  at::Tensor host_view(size_t index, size_t j) const;
  // Views of every tensor of block `index` (one decode for all of them when it is stored compressed).
  std::vector<at::Tensor> host_views(size_t index) const;

  const StoredBlock& block(size_t index) const;
  size_t size() const { return blocks_.size(); }
  size_t max_block_bytes() const;
  // Largest block of the disk tier (0 when there is none).
  size_t max_disk_block_bytes() const;
  size_t max_packed_bytes() const;
  size_t total_bytes() const;
  const std::shared_ptr<PinnedPool>& pool() const { return pool_; }

 private:
  // segment_name empty: private pool memory.
  // pin: pin the raw copy now (false when it is about to be compressed and dropped).
  // digest: fill StoredBlock::digests for a private region too (a shared owner's is always hashed).
  StoredBlock pack(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                   const std::string& segment_name = std::string(), bool owner = true, bool pin = true,
                   bool digest = false);

  StoredBlock plan_from_file(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                             const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans,
                             const DiskReader& reader) const;

  // The pin of `host`, queued on the next of kPinLanes lanes after the pins queued there before it.
  // Pinning a fresh region (its pages faulted in, then registered) runs at about the speed of a disk
  // read, so one lane could fall behind the reads it runs beside; with several it keeps ahead of them.
  // Four, not two: W4 with half its blocks on disk pins one host block and two staging buffers, and
  // on two lanes the second staging buffer queued behind the host block and finished 29-82 ms after
  // the last read (H200), a tenth to a quarter of that start-up; on four every pin runs at once.
  std::shared_future<void> queue_pin(std::shared_ptr<PoolAllocation> host);

  // A load still running: its read (or null: a staging buffer) and its pin (or none: a region kept
  // pageable), running side by side.
  struct PendingLoad {
    size_t block = SIZE_MAX;  // the block it fills (SIZE_MAX: a staging buffer's pin)
    std::shared_ptr<ReadJob> read;
    std::shared_future<void> pin;
  };

  std::shared_ptr<PinnedPool> pool_;
  std::vector<StoredBlock> blocks_;
  mutable std::mutex pending_mutex_;  // held while waiting, so that no caller returns before the loads end
  mutable std::vector<PendingLoad> pending_;
  // Waits for `load`, returning its failure instead of throwing it.
  static std::exception_ptr wait_load(const PendingLoad& load);
  static constexpr size_t kPinLanes = 4;
  std::shared_future<void> pin_lanes_[kPinLanes];  // the tail of each lane's queue
  size_t next_lane_ = 0;
};

// A tensor of `layout`'s dtype, sizes and strides over `storage`, starting `base_offset + layout.offset`
// bytes in.
at::Tensor view_of(const c10::Storage& storage, const at::TensorOptions& options, size_t base_offset,
                   const TensorLayout& layout);

// A new tensor on `target` with `layout`'s dtype, sizes and strides and the values of `src` (which has
// that layout): its storage span is copied byte for byte, so any stride pattern survives.
at::Tensor clone_with_layout(const at::Tensor& src, const TensorLayout& layout, at::Device target);

}  // namespace fastoffload
