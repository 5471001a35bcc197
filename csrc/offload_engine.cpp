#include "offload_engine.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

namespace fastoffload {
namespace {

// Reads queued ahead of the encoder when a compressed host tier is built from a checkpoint: enough that
// the disk has the next blocks to read while one is encoded; each holds a raw region until encoded.
constexpr size_t kEncodeLookahead = 3;
// Disk-tier blocks read ahead of the spill file's encoder: one read runs while the block before it is
// encoded and written. Their raw bytes are pageable host memory, outside the host budget: kept to two.
constexpr size_t kSpillLookahead = 2;

int device_index_of(const at::Device& device) {
  if (device.is_cpu()) return -1;
  TORCH_CHECK(device.is_cuda(), "fastoffload: the offload device must be 'cuda', 'cuda:N' or 'cpu', got '",
              device.str(), "'");
  TORCH_CHECK(device.has_index(), "fastoffload: internal error: CUDA device without an index");
  return device.index();
}

const char* state_name(SlotState state) {
  switch (state) {
    case SlotState::kEmpty:
      return "empty";
    case SlotState::kReady:
      return "ready";
    case SlotState::kInUse:
      return "in_use";
    case SlotState::kCached:
      return "cached";
  }
  return "unknown";
}

}  // namespace

CompressMode parse_compress_mode(const std::string& name) {
  if (name == "off") return CompressMode::kOff;
  if (name == "on") return CompressMode::kOn;
  if (name == "auto") return CompressMode::kAuto;
  TORCH_CHECK(false, "fastoffload: compress mode must be 'off', 'on' or 'auto', got '", name, "'");
}

const char* travel_name(Travel travel) {
  switch (travel) {
    case Travel::kRaw:
      return "raw";
    case Travel::kCompressed:
      return "compressed";
    case Travel::kMeasuring:
      return "measuring";
  }
  return "unknown";
}

OffloadEngine::OffloadEngine(at::Device device, size_t num_slots, std::shared_ptr<PinnedPool> pool)
    : device_(device), store_(std::move(pool)), ring_(device, num_slots), copy_(device_index_of(device)),
      binder_(device), chooser_(copy_) {
  const int index = device_index_of(device);
  const auto& pool_ = store_.pool();
  TORCH_CHECK(pool_->device_index() == index || !pool_->pins(), "fastoffload: the pinned pool belongs to device ",
              std::to_string(pool_->device_index()), " but the engine offloads to ", device.str(),
              "; create one pool per device");
}

OffloadEngine::~OffloadEngine() {
  drop_pending_spills();  // their buffers are freed with this engine: no read may still write there
  try {
    store_.finish_pins();
  } catch (...) {
  }
  try {
    copy_.synchronize_copies();
  } catch (...) {
    // Destructors must not throw; at interpreter exit CUDA may already be shut down.
  }
}

void OffloadEngine::check_block(size_t block) const {
  TORCH_CHECK(block < store_.size(), "fastoffload: block handle ", std::to_string(block),
              " is out of range (the engine holds ", std::to_string(store_.size()), " blocks)");
  TORCH_CHECK(!removed_[block], "fastoffload: block ", std::to_string(block),
              " was detached from the offload engine; re-enable offload to use it again");
}

size_t OffloadEngine::add_block(const std::vector<std::string>& names, const std::vector<at::Tensor>& params) {
  GateHold hold = waiting_gate();
  // A block that will be compressed keeps its raw copy pageable: it is dropped after encoding.
  const size_t index = store_.add(names, params, /*pin=*/compress_mode_ == CompressMode::kOff);
  travel_.push_back(Travel::kRaw);
  encode_new(index);
  finish_add(index);
  return index;
}

void OffloadEngine::encode_new(size_t block) {
  travel_[block] = Travel::kRaw;
  chooser_.forget(block);
  if (compress_mode_ == CompressMode::kOff) return;
  const bool keep_raw = compress_mode_ == CompressMode::kAuto;
  if (!store_.compress(block, codec_options_, keep_raw)) return;
  travel_[block] = keep_raw ? Travel::kMeasuring : Travel::kCompressed;
  if (keep_raw) chooser_.track(block);
}

void OffloadEngine::decide_travel() {
  const bool compressed = chooser_.transfer_bound();
  for (size_t b : chooser_.tracked_blocks()) choose_travel_held(b, compressed);
}

void OffloadEngine::settle_travel() {
  GateHold hold = waiting_gate();
  if (chooser_.tracked() == 0) return;
  if (chooser_.ready()) {
    decide_travel();
    return;
  }
  for (size_t b : chooser_.tracked_blocks()) choose_travel_held(b, false);
}

void OffloadEngine::set_auto_threshold(double threshold) {
  GateHold hold = step_gate();
  TORCH_CHECK(threshold >= 0.0, "fastoffload: the auto-compression threshold must be >= 0, got ", std::to_string(threshold));
  chooser_.set_threshold(threshold);
}

void OffloadEngine::set_compression(CompressMode mode, bool verify, const codec::EncodeOptions& options) {
  GateHold hold = step_gate();
  compress_mode_ = mode;
  verify_ = verify;
  codec_options_ = options;
}

void OffloadEngine::choose_travel(size_t block, bool compressed) {
  GateHold hold = waiting_gate();
  choose_travel_held(block, compressed);
}

void OffloadEngine::choose_travel_held(size_t block, bool compressed) {
  check_block(block);
  const StoredBlock& stored = store_.block(block);
  TORCH_CHECK(!compressed || stored.has_packed(), "fastoffload: block ", std::to_string(block),
              " has no compressed copy to travel with");
  TORCH_CHECK(compressed || stored.has_raw(), "fastoffload: block ", std::to_string(block),
              " no longer has its raw copy (it was chosen to travel compressed)");
  // A copy in flight may still read the host copy that is about to be freed.
  copy_.synchronize_copies();
  chooser_.forget(block);
  if (compressed) {
    store_.drop_raw(block);
    travel_[block] = Travel::kCompressed;
  } else {
    store_.drop_packed(block);
    travel_[block] = Travel::kRaw;
  }
  generation_ += 1;
  layout_generation_ += 1;  // a captured graph copies (or decodes) the host copy just dropped
}

BlockCodecInfo OffloadEngine::codec_info(size_t block) const {
  auto lock = gate_.enter_read();
  check_block(block);
  const StoredBlock& stored = store_.block(block);
  BlockCodecInfo info;
  info.travel = travel_[block];
  info.raw_bytes = stored.bytes;
  info.compressed_bytes = stored.packed_bytes;
  info.host_bytes = stored.on_disk ? 0 : (stored.has_raw() ? stored.bytes : 0) + stored.packed_bytes;
  info.segments = stored.packed_summary.num_segments;
  info.coded_segments = stored.packed_summary.coded_segments;
  info.exceptions = stored.packed_summary.exceptions;
  if (stored.has_packed()) info.checksum = reinterpret_cast<const codec::Header*>(stored.packed->data())->checksum;
  return info;
}

size_t OffloadEngine::weight_bytes(size_t block) const {
  auto lock = gate_.enter_read();
  check_block(block);
  size_t total = 0;
  for (const TensorLayout& entry : store_.block(block).layout) {
    size_t numel = 1;
    for (int64_t size : entry.sizes) numel *= static_cast<size_t>(size);
    total += numel * c10::elementSize(entry.dtype);
  }
  return total;
}

at::Tensor OffloadEngine::raw_host_bytes(size_t block) const {
  auto lock = gate_.enter_read();
  check_block(block);
  store_.finish_pins();
  at::Tensor bytes = store_.raw_bytes(block, verify_);
  // A shared copy's pages are other ranks' weights too (read-only on a non-owner): hand out a copy.
  return store_.block(block).shared ? bytes.clone() : bytes;
}

size_t OffloadEngine::add_block_shared(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                                       const std::string& segment_name, bool owner, size_t packed_bytes,
                                       uint64_t checksum) {
  GateHold hold = waiting_gate();
  TORCH_CHECK(owner || packed_bytes == 0 || compress_mode_ != CompressMode::kOff, "fastoffload: the owner of the "
              "shared host copy compressed block ", std::to_string(store_.size()), " but this rank has compression off; "
              "pass the same compress= on every rank");
  // One set of bytes serves every rank, so "auto" cannot measure per rank and keep whichever copy wins:
  // a shared block travels compressed whenever its coding pays (see docs/DESIGN.md, "Compressed host copies").
  bool compressed = false;
  size_t index = 0;
  if (owner && compress_mode_ != CompressMode::kOff) {
    index = store_.add_shared_compressed(names, params, segment_name, codec_options_, &compressed);
  } else if (!owner && packed_bytes > 0) {
    index = store_.attach_shared_compressed(names, params, segment_name, packed_bytes, checksum);
    compressed = true;
  } else {
    index = store_.add_shared(names, params, segment_name, owner);
  }
  travel_.push_back(compressed ? Travel::kCompressed : Travel::kRaw);
  chooser_.forget(index);
  finish_add(index);
  return index;
}

void OffloadEngine::set_reader(std::shared_ptr<DiskReader> reader) {
  TORCH_CHECK(reader != nullptr, "fastoffload: set_reader needs a DiskReader");
  TORCH_CHECK(disk_ == nullptr || reader == reader_, "fastoffload: the disk tier already reads through another reader");
  reader_ = std::move(reader);
}

size_t OffloadEngine::add_block_from_file(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                                          const std::vector<std::vector<int64_t>>& shapes,
                                          const std::vector<FileSpan>& spans) {
  GateHold hold = waiting_gate();
  TORCH_CHECK(reader_ != nullptr, "fastoffload: add_block_from_file needs set_reader() first");
  // A block that will be compressed keeps its raw region pageable: it is dropped once encoded. The
  // encoder reads a region only once the reader has filled it; meanwhile the reads after it run on.
  const bool compress = compress_mode_ != CompressMode::kOff;
  if (compress) encode_loaded(kEncodeLookahead - 1);
  const size_t index = store_.add_from_file(names, params, shapes, spans, reader_, /*pin=*/!compress);
  travel_.push_back(Travel::kRaw);
  if (compress) pending_encode_.push_back(index);
  finish_add(index, holds_storage(params));
  return index;
}

void OffloadEngine::encode_loaded(size_t keep) {
  while (pending_encode_.size() > keep) {
    const size_t block = pending_encode_.front();
    try {
      store_.finish_load(block);
      encode_new(block);
    } catch (...) {
      pending_encode_.clear();
      throw;
    }
    pending_encode_.pop_front();
    if (!pending_encode_.empty()) stats_.pipelined_encodes += 1;
  }
}

void OffloadEngine::finish_loading() {
  try {
    encode_loaded(0);
  } catch (...) {
    try {
      store_.finish_pins();  // nothing may still be read into a region once the caller sees the failure
    } catch (...) {
      // The first failure is the one to report.
    }
    throw;
  }
  store_.finish_pins();
}

size_t OffloadEngine::add_block_on_disk(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        const std::vector<FileSpan>& spans) {
  GateHold hold = waiting_gate();
  TORCH_CHECK(reader_ != nullptr, "fastoffload: add_block_on_disk needs set_reader() first");
  TORCH_CHECK(!copy_.capturing(), "fastoffload: blocks cannot be added while a CUDA graph is being captured");
  // The spill file's blocks before this one, beyond the look-ahead, are encoded and written first: a
  // failure there leaves this block unadded.
  if (spill_ != nullptr) spill_loaded(kSpillLookahead - 1);
  const size_t index = store_.add_on_disk(names, params, shapes, spans, *reader_);
  if (disk_ == nullptr) disk_ = std::make_unique<DiskTier>(reader_, copy_);
  travel_.push_back(Travel::kRaw);
  if (spill_ != nullptr) {
    try {
      pending_spill_.push_back(store_.start_spill(index, *reader_));
    } catch (...) {
      // Nothing half-added: the engine's per-block lists must stay as long as the store's.
      travel_.pop_back();
      store_.discard_last(index);
      throw;
    }
    deferred_disk_.push_back(index);
  } else {
    disk_->add_block(index, store_.block(index).ranges);
  }
  finish_add(index, holds_storage(params));
  return index;
}

void OffloadEngine::spill_loaded(size_t keep) {
  while (pending_spill_.size() > keep) {
    const LayerStore::SpillRead& read = pending_spill_.front();
    try {
      // A disk read costs far more than a decode, so a disk-tier block travels compressed whenever its
      // coding pays, "auto" included: there is no compute-bound case to protect.
      if (store_.finish_spill(read, *spill_, codec_options_)) travel_[read.index] = Travel::kCompressed;
    } catch (...) {
      drop_pending_spills();
      throw;
    }
    pending_spill_.pop_front();
    if (!pending_spill_.empty()) stats_.pipelined_spills += 1;
  }
}

void OffloadEngine::drop_pending_spills() {
  for (const auto& read : pending_spill_) LayerStore::wait_spill_read(read);
  pending_spill_.clear();
}

void OffloadEngine::set_spill_file(const std::string& path) {
  GateHold hold = waiting_gate();
  TORCH_CHECK(compress_mode_ != CompressMode::kOff, "fastoffload: a spill file holds compressed disk-tier blocks; "
              "set compression on first");
  TORCH_CHECK(spill_ == nullptr, "fastoffload: the disk tier already has a spill file ('", spill_->path(), "')");
  spill_ = std::make_unique<SpillFile>(path);
}

std::string OffloadEngine::spill_path() const {
  auto lock = gate_.enter_read();
  return spill_ != nullptr ? spill_->path() : std::string();
}

uint64_t OffloadEngine::spill_bytes() const {
  auto lock = gate_.enter_read();
  return spill_ != nullptr ? spill_->bytes() : 0;
}

void OffloadEngine::register_deferred_disk_blocks() {
  if (deferred_disk_.empty()) return;
  spill_loaded(0);
  spill_->finish();
  const size_t file = reader_->open(spill_->path());
  for (size_t b : deferred_disk_) {
    const StoredBlock& stored = store_.block(b);
    if (!stored.spilled) {
      disk_->add_block(b, stored.ranges);
      continue;
    }
    FileRange range;
    range.file = file;
    range.offset = stored.spill_offset;
    range.nbytes = stored.packed_bytes;
    range.dest_offset = 0;
    range.name = "block " + std::to_string(b) + " (compressed, in the spill file)";
    disk_->add_block(b, {range});
  }
  deferred_disk_.clear();
}

void OffloadEngine::start_disk_tier(size_t count) {
  GateHold hold = waiting_gate();
  TORCH_CHECK(disk_ != nullptr, "fastoffload: start_disk_tier: no block was added to the disk tier");
  register_deferred_disk_blocks();
  size_t disk_blocks = 0;
  for (size_t b = 0; b < store_.size(); ++b)
    if (!removed_[b] && store_.block(b).on_disk) disk_blocks += 1;
  const size_t buffers = std::max<size_t>(1, std::min(count, disk_blocks));
  const size_t bytes = store_.max_disk_block_bytes();
  // Allocated before waiting for the host tier's reads: pinning the ring costs about as much as
  // reading it would, and runs beside those reads instead of after them.
  std::vector<std::shared_ptr<PoolAllocation>> staging;
  for (size_t k = 0; k < buffers; ++k) staging.push_back(store_.allocate_pinned_later(bytes + DiskTier::kSlack));
  finish_loading();
  copy_.synchronize_copies();  // the old staging buffers may still be read by copies in flight
  disk_->start(std::move(staging), bytes);
}

void OffloadEngine::set_disk_order(const std::vector<size_t>& blocks) {
  GateHold hold = step_gate();
  TORCH_CHECK(disk_ != nullptr && disk_->started(), "fastoffload: set_disk_order: this engine has no disk tier "
              "running");
  std::vector<size_t> order;
  for (size_t b : blocks) {
    TORCH_CHECK(b < store_.size(), "fastoffload: set_disk_order: block ", std::to_string(b), " does not exist");
    if (disk_->has(b)) order.push_back(b);
  }
  // The blocks at the front that a device slot holds were copied already (the prefetch of the block before
  // them): the tier reads them next time round, and reads the ones after them first.
  size_t copied = 0;
  while (copied < order.size() && ring_.slot_of(order[copied]) >= 0) ++copied;
  std::rotate(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(copied), order.end());
  disk_->set_order(order);
}

void OffloadEngine::check_not_on_disk(size_t block, const char* what) const {
  TORCH_CHECK(!store_.block(block).on_disk, "fastoffload: block ", std::to_string(block), " cannot be ", what,
              ": it is in the disk tier (its weights are read from the checkpoint every step, and there is no host "
              "copy to rebuild). Raise host_budget so that it fits in host memory, or mutate before enabling offload");
}

const void* OffloadEngine::copy_source(size_t block) {
  const StoredBlock& stored = store_.block(block);
  if (!stored.on_disk) return stored.has_raw() ? stored.host->data() : nullptr;  // nullptr: it travels compressed
  TORCH_CHECK(disk_ != nullptr && disk_->started(), "fastoffload: block ", std::to_string(block),
              " is in the disk tier, which was not started (start_disk_tier)");
  return disk_->take(block, /*wait=*/true);
}

bool OffloadEngine::acquire_may_wait(size_t block) const {
  if (disk_ == nullptr || block >= store_.size() || removed_[block] || materialized_[block]) return false;
  return store_.block(block).on_disk && ring_.slot_of(block) < 0 && !disk_->ready(block);
}

void OffloadEngine::make_private(size_t block) {
  GateHold hold = waiting_gate();
  check_block(block);
  copy_.synchronize_copies();  // a prefetch may still be reading the shared pages
  store_.make_private(block);
}

void OffloadEngine::check_not_shared(size_t block, const char* what) const {
  TORCH_CHECK(!store_.block(block).shared, "fastoffload: block ", std::to_string(block), " cannot be ", what,
              ": its host copy is shared with the other ranks of this host, whose weights would change under them. "
              "Mutate before enabling offload, or enable with share_host_copy=False");
}

bool OffloadEngine::holds_storage(const std::vector<at::Tensor>& params) {
  return std::any_of(params.begin(), params.end(), [](const at::Tensor& p) {
    return p.defined() && p.has_storage() && p.storage().nbytes() > 0;
  });
}

void OffloadEngine::finish_add(size_t index, bool released_originals) {
  binder_.set_block(index, store_.block(index));
  materialized_.push_back(0);
  removed_.push_back(0);
  // The original tensors are released here, block by block, so host memory peaks near the model plus
  // one block rather than twice the model.
  binder_.bind_values(index, binder_.placeholders(index));
  binder_.record_versions(index);
#if defined(__GLIBC__)
  // glibc keeps freed heap memory (its mmap threshold grows as large tensors are freed), which would
  // leave the released originals counted in RSS until the end; hand it back to the OS now. A block
  // built from a meta model had empty placeholders, nothing to hand back, and the trim (a walk over
  // every arena, under their locks) would only take time beside the reader's threads.
  if (released_originals) malloc_trim(0);
#endif
  views_stale_ = true;
}

bool OffloadEngine::ensure_staging() {
  if (copy_.is_host()) return false;
  const size_t needed = store_.max_packed_bytes();
  if (needed == 0 || (staging_[0].defined() && static_cast<size_t>(staging_[0].numel()) >= needed)) return false;
  // The decoder may still be reading the old buffers.
  copy_.synchronize_copies();
  for (auto& buffer : staging_) buffer = at::Tensor();
  for (auto& buffer : staging_)
    buffer = at::empty({static_cast<int64_t>(needed)}, at::TensorOptions().dtype(at::kByte).device(device_));
  return true;
}

void OffloadEngine::ensure_slots() {
  finish_loading();
  if (!views_stale_ && ring_.slot_bytes() >= store_.max_block_bytes()) return;
  // Packed sizes change only where views go stale too (a block added or repacked).
  bool allocated = ensure_staging();
  if (!ring_.allocated() || ring_.slot_bytes() < store_.max_block_bytes()) {
    // The copy stream may still be writing into the old slots.
    copy_.synchronize_copies();
    ring_.allocate(store_.max_block_bytes());
    allocated = true;
  }
  if (allocated) {
    order_copies_after_current();
    layout_generation_ += 1;  // new slot or staging addresses: a captured graph copies into the old ones
  }
  for (size_t b = 0; b < store_.size(); ++b)
    if (!removed_[b]) binder_.build_views(b, store_.block(b), ring_);
  slot_uses_.assign(ring_.size(), 0);
  for (size_t s = 0; s < ring_.size(); ++s)
    if (ring_.slot(s).buffer.defined()) slot_uses_[s] = ring_.slot(s).buffer.storage().use_count();
  views_stale_ = false;
}

void OffloadEngine::keep_held_slot(size_t slot) {
  // Without grad mode a running block's parameters view its slot, and so can what its forward makes of them and
  // keeps past its release: an output or a cached tensor that is a view of a weight (`self.weight.t()`,
  // `self.table[0]`). The slot's next copy would change that tensor under its holder, where the resident model's
  // keeps its values. Such a slot leaves its memory to that tensor and takes a new buffer; the views are built
  // again at the next acquire or prefetch.
  const at::Tensor& buffer = ring_.slot(slot).buffer;
  if (copy_.capturing() || !buffer.defined() || slot >= slot_uses_.size()) return;
  const size_t uses = buffer.storage().use_count();
  if (uses <= slot_uses_[slot]) {
    // The count taken when the views were built may include a block bound to the slot then (views rebuilt
    // inside a forward): here nothing is bound to it, so the least count seen is the slot's own.
    slot_uses_[slot] = uses;
    return;
  }
  // Its "free" event, just recorded, orders the next copy after every kernel queued so far, which covers
  // any that still use memory the allocator hands out for the new buffer.
  ring_.replace_buffer(slot);
  stats_.slots_replaced += 1;
  views_stale_ = true;
  layout_generation_ += 1;  // a captured graph copies into the old address
}

void OffloadEngine::order_copies_after_current() {
  // The caching allocator hands out memory by the current stream's order: a new slot or staging buffer
  // may be memory that kernels still queued on this stream read or write (a resident block's
  // activations, freed by Python but not yet computed). The copy stream writes into it only after
  // everything queued here so far: each slot's first copy waits for its "free" event, recorded now.
  for (size_t i = 0; i < ring_.size(); ++i) copy_.record_on_current(*ring_.slot(i).free);
  // A compressed block's bytes land in a staging buffer first, ordered only after the decoder's last read.
  if (staging_[0].defined()) copy_.staging_after_current();
}

void OffloadEngine::check_grad(size_t block) const {
  const StoredBlock& stored = store_.block(block);
  for (size_t j = 0; j < stored.tensors.size(); ++j) {
    TORCH_CHECK(!stored.tensors[j].requires_grad(), "fastoffload: block ", std::to_string(block), " is offloaded, its parameter '",
                stored.layout[j].name,
                "' requires grad, and grad mode is on. An offloaded parameter is a placeholder between forwards, so its "
                "gradient would have nowhere to live and an optimizer step would never reach its host copy. Freeze the "
                "offloaded blocks (model.blocks.requires_grad_(False): gradients still flow through them to the input "
                "and to parameters outside the blocks), or run under torch.no_grad() or torch.inference_mode(); to "
                "train a block, keep it resident.");
  }
}

void OffloadEngine::issue_copy(size_t block, size_t slot) {
  // First: a disk-tier read that failed throws here, before the slot changes hands.
  const void* source = copy_source(block);
  ring_.assign(slot, block);
  Slot& s = ring_.slot(slot);
  const StoredBlock& stored = store_.block(block);
  if (travel_[block] == Travel::kCompressed) {
    stats_.decodes += 1;
    void* const staging[2] = {staging_[0].defined() ? staging_[0].data_ptr() : nullptr,
                              staging_[1].defined() ? staging_[1].data_ptr() : nullptr};
    const size_t staging_bytes = staging_[0].defined() ? static_cast<size_t>(staging_[0].numel()) : 0;
    // A disk-tier block's compressed bytes are in its staging buffer, the others' in their host region.
    const void* packed = stored.on_disk ? source : stored.packed->data();
    copy_.decode_to_device(s.buffer.data_ptr(), stored.bytes, packed, stored.packed_bytes, staging, staging_bytes,
                           stored.packed_summary.num_segments, stored.packed_summary.num_tiles, verify_, *s.free,
                           *s.ready);
    if (stored.on_disk) disk_->consumed(block);
    return;
  }
  if (travel_[block] == Travel::kMeasuring && copy_.is_host()) {
    const auto start = std::chrono::steady_clock::now();
    copy_.copy_to_device(s.buffer.data_ptr(), source, stored.bytes, *s.free, *s.ready);
    chooser_.add_host_copy(block, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    if (stored.on_disk) disk_->consumed(block);
    return;
  }
  Event* timing_start = travel_[block] == Travel::kMeasuring ? chooser_.copy_start(block) : nullptr;
  Event* timing_end = travel_[block] == Travel::kMeasuring ? chooser_.copy_end(block) : nullptr;
  copy_.copy_to_device(s.buffer.data_ptr(), source, stored.bytes, *s.free, *s.ready, timing_start, timing_end);
  if (stored.on_disk) disk_->consumed(block);
}

void OffloadEngine::check_bindings(size_t block) const {
  if (binder_.first_unexpected(block) < 0) return;
  const StoredBlock& stored = store_.block(block);
  const int64_t foreign = binder_.first_foreign(block);
  if (foreign >= 0) {
    const at::Tensor& param = stored.tensors[foreign];
    const TensorLayout& entry = stored.layout[foreign];
    TORCH_CHECK(param.scalar_type() == entry.dtype && param.device() == device_, "fastoffload: parameter '", entry.name,
                "' of block ", std::to_string(block), " was cast or moved to ", c10::toString(param.scalar_type()), " on ",
                param.device().str(), " after offload was enabled (its host copy holds ", c10::toString(entry.dtype),
                " for ", device_.str(), "); .half(), .to(dtype) and .to(device) do not reach an offloaded block's host "
                "copy. Cast or move the model before enable_layerwise_offload, or disable offload, cast, and enable "
                "it again.");
    TORCH_CHECK(false, "fastoffload: parameter '", entry.name, "' of block ", std::to_string(block),
                " was replaced while it was offloaded, so its new value would be silently overwritten. Change a "
                "block's parameters inside mutate_params_scope(), which rebuilds the host copy, or disable offload "
                "first.");
  }
  const int64_t written = binder_.first_written(block);
  TORCH_CHECK(written < 0, "fastoffload: parameter '", stored.layout[written].name, "' of block ", std::to_string(block),
              " was changed in place while it was offloaded (its placeholder or device slot holds no lasting copy), "
              "so the change would be silently lost. Change a block's parameters inside mutate_params_scope(), which "
              "rebuilds the host copy, or disable offload first.");
}

void OffloadEngine::bind_for_run(size_t block, size_t slot) {
  if (!at::GradMode::is_enabled()) {
    binder_.bind_slot(block, slot);
    return;
  }
  // Autograd may keep views of the parameters until backward, long after a later block reused the
  // slot: give them bytes of their own. The copy runs on the current stream, after the slot's wait.
  const StoredBlock& stored = store_.block(block);
  at::Tensor buffer = at::empty({static_cast<int64_t>(std::max<size_t>(stored.bytes, 1))},
                                at::TensorOptions().dtype(at::kByte).device(device_));
  if (stored.bytes > 0) {
    const int64_t n = static_cast<int64_t>(stored.bytes);
    buffer.narrow(0, 0, n).copy_(ring_.slot(slot).buffer.narrow(0, 0, n));
  }
  binder_.bind_buffer(block, stored, buffer);
}

void OffloadEngine::acquire(size_t block) {
  GateHold hold = step_gate();
  check_block(block);
  // Refused also for a materialized block (a load that raised inside it, a forward inside
  // mutate_params_scope): its parameters become placeholders again, leaving a gradient nowhere to live.
  if (at::GradMode::is_enabled()) check_grad(block);
  if (materialized_[block]) return;
  int64_t slot = ring_.slot_of(block);
  if (slot >= 0 && ring_.slot(slot).state == SlotState::kInUse) {
    // The block is already running (re-entrant call): it is bound and its copy was waited for.
    ring_.acquire(static_cast<size_t>(slot));
    stats_.acquires += 1;
    generation_ += 1;
    return;
  }
  check_bindings(block);
  ensure_slots();
  stats_.acquires += 1;
  generation_ += 1;
  slot = ring_.slot_of(block);
  if (slot < 0) {
    slot = ring_.choose_slot(block);
    if (slot < 0) {
      std::string running;
      for (int64_t b : ring_.blocks_in_use()) running += " " + std::to_string(b);
      TORCH_CHECK(false, "fastoffload: cannot load block ", std::to_string(block), ": all ", std::to_string(ring_.size()),
                  " slots hold running blocks (", running,
                  " ), acquired and not yet released. Release them first, or enable offload with a larger "
                  "prefetch_depth.");
    }
    issue_copy(block, static_cast<size_t>(slot));
    stats_.sync_loads += 1;
  } else if (ring_.slot(slot).state == SlotState::kReady) {
    stats_.prefetch_hits += 1;
  } else {
    stats_.cache_hits += 1;
  }
  Slot& s = ring_.slot(static_cast<size_t>(slot));
  copy_.wait_on_current(*s.ready);
  bind_for_run(block, static_cast<size_t>(slot));
  ring_.acquire(static_cast<size_t>(slot));
  if (travel_[block] == Travel::kMeasuring) chooser_.compute_started(block);
}

void OffloadEngine::acquire_and_prefetch(size_t block, const size_t* targets, size_t count) {
  acquire(block);
  try {
    for (size_t k = 0; k < count; ++k) prefetch(targets[k]);
  } catch (...) {
    try {
      release(block);
    } catch (...) {
      // The prefetch's error is the one the caller sees.
    }
    throw;
  }
}

bool OffloadEngine::prefetch(size_t block) {
  GateHold hold = step_gate();
  check_block(block);
  if (materialized_[block]) return false;
  ensure_slots();
  const int64_t held = ring_.slot_of(block);
  if (held >= 0) {
    // Wanted again soon: a cached copy becomes the last cached slot a new copy may take (backward runs the
    // blocks a training forward left cached first, while it copies the ones before them).
    if (ring_.slot(static_cast<size_t>(held)).state == SlotState::kCached) ring_.touch(static_cast<size_t>(held));
    return false;
  }
  // A disk-tier block whose read is still running is copied by its own acquire (or a later prefetch).
  if (store_.block(block).on_disk && (disk_ == nullptr || !disk_->started() || disk_->take(block, false) == nullptr))
    return false;
  generation_ += 1;
  const int64_t slot = ring_.choose_slot(block);
  if (slot < 0) {
    stats_.skipped_prefetches += 1;
    return false;
  }
  issue_copy(block, static_cast<size_t>(slot));
  stats_.prefetches += 1;
  return true;
}

bool OffloadEngine::release(size_t block) {
  GateHold hold = step_gate();
  if (block >= store_.size() || removed_[block] || materialized_[block]) return false;
  const int64_t slot = ring_.slot_of(block);
  if (slot < 0 || ring_.slot(slot).state != SlotState::kInUse) return false;
  generation_ += 1;
  if (ring_.release(static_cast<size_t>(slot))) {
    binder_.bind_placeholders(block);
    copy_.record_on_current(*ring_.slot(slot).free);
    keep_held_slot(static_cast<size_t>(slot));
    if (travel_[block] == Travel::kMeasuring) {
      chooser_.compute_ended(block);
      // Once: the copies it does not need are freed (this waits for the copies in flight).
      if (!copy_.capturing() && chooser_.ready()) decide_travel();
    }
  }
  return true;
}

void OffloadEngine::materialize(size_t block) {
  GateHold hold = waiting_gate();
  check_block(block);
  finish_loading();
  if (materialized_[block]) return;
  check_not_shared(block, "materialized for mutation");
  check_not_on_disk(block, "materialized for mutation");
  const int64_t slot = ring_.slot_of(block);
  TORCH_CHECK(slot < 0 || ring_.slot(slot).state != SlotState::kInUse, "fastoffload: block ", std::to_string(block),
              " is running a forward; enter mutate_params_scope() between forwards, not inside one");
  // An edit or cast made since the block last ran would be overwritten by the host copy bound below.
  check_bindings(block);
  ring_.forget_block(block);
  const StoredBlock& stored = store_.block(block);
  // Ordinary tensors inside inference_mode() too (a load_state_dict() there): a parameter bound to an inference
  // tensor would count no versions and refuse requires_grad_() (see Binder::build_views).
  c10::InferenceMode normal_tensors(false);
  at::Tensor buffer = at::empty({static_cast<int64_t>(std::max<size_t>(stored.bytes, 1))},
                                at::TensorOptions().dtype(at::kByte).device(device_));
  if (stored.bytes > 0) buffer.narrow(0, 0, static_cast<int64_t>(stored.bytes)).copy_(store_.raw_bytes(block, verify_));
  std::vector<at::Tensor> values;
  values.reserve(stored.layout.size());
  const auto options = at::TensorOptions().device(device_);
  for (const auto& entry : stored.layout) values.push_back(view_of(buffer.storage(), options, 0, entry));
  binder_.bind_values(block, values);
  materialized_[block] = 1;
  generation_ += 1;
  layout_generation_ += 1;  // a captured graph would copy the host copy over these values
}

void OffloadEngine::repack(size_t block, const std::vector<std::string>& names, const std::vector<at::Tensor>& params) {
  GateHold hold = waiting_gate();
  check_block(block);
  finish_loading();
  check_not_shared(block, "repacked");
  check_not_on_disk(block, "repacked");
  const int64_t slot = ring_.slot_of(block);
  TORCH_CHECK(slot < 0 || ring_.slot(slot).state != SlotState::kInUse, "fastoffload: block ", std::to_string(block),
              " is running a forward and cannot be repacked now");
  // A prefetch of this block may still be reading the host copy that is about to be freed.
  copy_.synchronize_copies();
  ring_.forget_block(block);
  store_.replace(block, names, params, /*pin=*/compress_mode_ == CompressMode::kOff);
  // Re-encoded from the new values; "auto" measures the block again.
  encode_new(block);
  binder_.set_block(block, store_.block(block));
  binder_.bind_values(block, binder_.placeholders(block));
  binder_.record_versions(block);
  materialized_[block] = 0;
  views_stale_ = true;
  generation_ += 1;
  layout_generation_ += 1;  // a captured graph reads the old host copy, now freed
}

void OffloadEngine::restore(size_t block, at::Device target) {
  GateHold hold = waiting_gate();
  check_block(block);
  try {
    finish_loading();
  } catch (const c10::Error&) {
    // Restoring reads the host copy, which is valid whether or not it got pinned.
  }
  const StoredBlock& stored = store_.block(block);
  const int64_t slot = ring_.slot_of(block);
  const bool running = slot >= 0 && ring_.slot(slot).state == SlotState::kInUse;
  std::vector<at::Tensor> values;
  values.reserve(stored.layout.size());
  const bool live = running || materialized_[block];
  c10::InferenceMode normal_tensors(false);  // the caller's parameters from now on: ordinary tensors (see materialize)
  // Decoded once for the whole block when it is stored compressed.
  const at::Tensor host = live                ? at::Tensor()
                          : stored.on_disk ? store_.read_block(block, *reader_)
                                           : store_.raw_bytes(block, verify_);
  for (size_t j = 0; j < stored.layout.size(); ++j) {
    const at::Tensor& param = stored.tensors[j];
    const TensorLayout& entry = stored.layout[j];
    // A value the caller gave an offloaded parameter (`param.data = t`, which the next acquire refuses)
    // is its current value: kept, as on a resident model, rather than the host copy it replaced.
    if (!live && binder_.rebound_by_caller(block, j) && param.scalar_type() == entry.dtype &&
        param.sizes().vec() == entry.sizes) {
      values.push_back(param.variable_data().to(target, /*non_blocking=*/false, /*copy=*/true));
      continue;
    }
    // Current values: a running or materialized block's live tensors (they may have been changed in
    // place), otherwise the host copy.
    const at::Tensor source = live ? param.variable_data()
                                   : view_of(host.storage(), at::TensorOptions().device(at::kCPU), 0, entry);
    // A live tensor whose dtype, shape or strides differ from the stored layout's (`param.data = t` inside a
    // scope whose rebuild then failed) is copied as it is: read with the old layout, its bytes would be garbage.
    const bool as_stored = !live || (source.scalar_type() == entry.dtype && source.sizes().vec() == entry.sizes &&
                                     source.strides().vec() == entry.strides);
    at::Tensor value = as_stored ? clone_with_layout(source, entry, target)
                                 : source.to(target, /*non_blocking=*/false, /*copy=*/true);
    // A cast after enable (model.half()) left a placeholder of the new dtype: the restored model
    // follows the cast, as the resident model would have, rather than silently keeping the old dtype.
    const at::ScalarType now = stored.tensors[j].scalar_type();
    if (!live && now != stored.layout[j].dtype) value = value.to(now);
    values.push_back(std::move(value));
  }
  binder_.bind_values(block, values);
  remove_block(block, slot, running);
}

void OffloadEngine::drop(size_t block) {
  GateHold hold = waiting_gate();
  check_block(block);
  try {
    finish_loading();
  } catch (const c10::Error&) {
    // Nothing is read from the host copy: whether its load finished does not matter.
  }
  const int64_t slot = ring_.slot_of(block);
  const bool running = slot >= 0 && ring_.slot(slot).state == SlotState::kInUse;
  // Off any slot before the slot can be reused; the caller gives the parameters their next values.
  binder_.bind_values(block, binder_.placeholders(block));
  remove_block(block, slot, running);
}

void OffloadEngine::remove_block(size_t block, int64_t slot, bool running) {
  if (running) {
    // Detached mid-forward: the slot is given back now; the kernels already queued on the current
    // stream are ordered before any later copy into it by the free event.
    Slot& s = ring_.slot(slot);
    s.refcount = 1;
    ring_.release(static_cast<size_t>(slot));
    copy_.record_on_current(*s.free);
  }
  copy_.synchronize_copies();
  ring_.forget_block(block);
  chooser_.forget(block);
  store_.remove(block);
  binder_.drop_block(block);
  removed_[block] = 1;
  generation_ += 1;
  layout_generation_ += 1;  // a captured graph reads its freed host copy
}

void OffloadEngine::close() {
  GateHold hold = waiting_gate();
  try {
    finish_loading();  // no pin may still run on a region freed below
  } catch (const c10::Error&) {
  }
  copy_.synchronize_copies();
  drop_pending_spills();
  release_disk();
  for (size_t b = 0; b < store_.size(); ++b) {
    if (removed_[b]) continue;
    ring_.forget_block(b);
  }
  ring_.clear();
  for (auto& buffer : staging_) buffer = at::Tensor();
  views_stale_ = true;
  generation_ += 1;
  layout_generation_ += 1;  // a captured graph copies into the freed slots
}

void OffloadEngine::release_disk() {
  // The tier's thread ends and its staging ring goes back to the pool once the reads into it are done.
  if (disk_ != nullptr) disk_->close();
  if (spill_ != nullptr) spill_->remove();  // the name goes now; its pages go once the reader closes it below
  // Nothing reads any more (the loads and spills were waited for above, the disk tier just now): the reader's
  // threads end and its files, the spill file's among them, are closed, also while the caller still holds this
  // engine (its group). A block left in the engine that needs a read now refuses with the reader's error.
  if (reader_ != nullptr) reader_->close();
}

void OffloadEngine::synchronize() {
  GateHold hold = waiting_gate();
  copy_.synchronize_copies();
}

void OffloadEngine::set_slot_assignment(const std::vector<int64_t>& assignment, size_t num_slots) {
  GateHold hold = step_gate();
  TORCH_CHECK(ring_.blocks_in_use().empty(), "fastoffload: the slot assignment cannot change while a block is running");
  // The same assignment again (a second graph of the same model): the slots, and the graphs captured on
  // them, stay as they are.
  if (num_slots == ring_.size() && assignment == ring_.assignment()) return;
  copy_.synchronize_copies();
  if (num_slots != ring_.size()) ring_.resize(num_slots);
  else ring_.forget_all();
  ring_.set_assignment(assignment);
  views_stale_ = true;
  generation_ += 1;
  layout_generation_ += 1;
}

void OffloadEngine::begin_capture() {
  GateHold hold = step_gate();
  TORCH_CHECK(disk_ == nullptr, "fastoffload: an offload with a disk tier cannot be captured in a CUDA graph (its "
              "reads run on host threads, outside any stream); raise host_budget so every block fits in host memory");
  copy_.begin_capture();
  generation_ += 1;
}

void OffloadEngine::end_capture() {
  GateHold hold = step_gate();
  generation_ += 1;
  copy_.end_capture();
}

void OffloadEngine::join_copies() {
  GateHold hold = step_gate();
  copy_.current_waits_for_copies();
}

size_t OffloadEngine::num_blocks() const {
  auto lock = gate_.enter_read();
  return store_.size();
}

size_t OffloadEngine::num_slots() const {
  auto lock = gate_.enter_read();
  return ring_.size();
}

size_t OffloadEngine::slot_bytes() const {
  auto lock = gate_.enter_read();
  return ring_.slot_bytes();
}

size_t OffloadEngine::block_bytes(size_t block) const {
  auto lock = gate_.enter_read();
  return store_.block(block).bytes;
}

size_t OffloadEngine::total_bytes() const {
  auto lock = gate_.enter_read();
  return store_.total_bytes();
}

int64_t OffloadEngine::slot_of(size_t block) const {
  auto lock = gate_.enter_read();
  return ring_.slot_of(block);
}

int64_t OffloadEngine::slot_block(size_t slot) const {
  auto lock = gate_.enter_read();
  return ring_.slot(slot).block;
}

bool OffloadEngine::is_shared(size_t block) const {
  auto lock = gate_.enter_read();
  return store_.block(block).shared;
}

at::Tensor OffloadEngine::host_view(size_t block, size_t j) const {
  auto lock = gate_.enter_read();
  store_.finish_pins();
  if (store_.block(block).on_disk) return store_.read_tensor(block, j, *reader_);
  at::Tensor view = store_.host_view(block, j);
  if (!store_.block(block).shared) return view;
  return clone_with_layout(view, store_.block(block).layout[j], at::kCPU);
}

std::vector<at::Tensor> OffloadEngine::host_views(size_t block) const {
  auto lock = gate_.enter_read();
  store_.finish_pins();
  const StoredBlock& stored = store_.block(block);
  if (stored.on_disk) {
    const at::Tensor bytes = store_.read_block(block, *reader_);
    std::vector<at::Tensor> read;
    for (const TensorLayout& entry : stored.layout)
      read.push_back(view_of(bytes.storage(), at::TensorOptions().device(at::kCPU), 0, entry));
    return read;
  }
  std::vector<at::Tensor> views = store_.host_views(block);
  if (!stored.shared) return views;
  for (size_t j = 0; j < views.size(); ++j) views[j] = clone_with_layout(views[j], stored.layout[j], at::kCPU);
  return views;
}

uint64_t OffloadEngine::host_copy_address(size_t block) const {
  auto lock = gate_.enter_read();
  const StoredBlock& stored = store_.block(block);
  if (stored.on_disk || stored.shared || !stored.has_raw()) return 0;
  return reinterpret_cast<uint64_t>(stored.host_bytes.storage().data());
}

bool OffloadEngine::host_written(size_t block, uint64_t address) {
  GateHold hold = waiting_gate();
  check_block(block);
  const StoredBlock& stored = store_.block(block);
  if (address == 0 || stored.on_disk || stored.shared || !stored.has_raw() ||
      reinterpret_cast<uint64_t>(stored.host_bytes.storage().data()) != address)
    return false;
  const int64_t slot = ring_.slot_of(block);
  TORCH_CHECK(!materialized_[block] && (slot < 0 || ring_.slot(slot).state != SlotState::kInUse), "fastoffload: block ",
              std::to_string(block), " is running or materialized: a write into its host copy is applied before it "
              "runs next");
  // A prefetch may still be reading the bytes from before the write, into the slot about to be forgotten.
  copy_.synchronize_copies();
  ring_.forget_block(block);
  if (stored.has_packed()) {
    store_.drop_packed(block);
    encode_new(block);
  }
  generation_ += 1;
  // A captured graph replays the old bytes: it decodes a compressed copy just replaced, or, with every block in a
  // slot of its own, copies nothing and reads the slot the old bytes are in.
  layout_generation_ += 1;
  return true;
}

EngineStats OffloadEngine::stats() const {
  auto lock = gate_.enter_read();
  return stats_;
}

std::string OffloadEngine::slot_state(size_t slot) const {
  auto lock = gate_.enter_read();
  TORCH_CHECK(slot < ring_.size(), "fastoffload: slot ", std::to_string(slot), " is out of range (", std::to_string(ring_.size()),
              " slots)");
  return state_name(ring_.slot(slot).state);
}

uint64_t OffloadEngine::slot_address(size_t slot) const {
  auto lock = gate_.enter_read();
  TORCH_CHECK(slot < ring_.size(), "fastoffload: slot ", std::to_string(slot), " is out of range (", std::to_string(ring_.size()),
              " slots)");
  const at::Tensor& buffer = ring_.slot(slot).buffer;
  return buffer.defined() ? reinterpret_cast<uint64_t>(buffer.data_ptr()) : 0;
}

bool OffloadEngine::is_materialized(size_t block) const {
  auto lock = gate_.enter_read();
  check_block(block);
  return materialized_[block] != 0;
}

std::string OffloadEngine::edited_in_place(size_t block) const {
  auto lock = gate_.enter_read();
  check_block(block);
  const int64_t slot = ring_.slot_of(block);
  if (materialized_[block] || (slot >= 0 && ring_.slot(slot).state == SlotState::kInUse)) return "";
  const StoredBlock& stored = store_.block(block);
  const int64_t written = binder_.first_written(block);
  if (written >= 0 && !binder_.rebound_by_caller(block, static_cast<size_t>(written))) return stored.layout[written].name;
  // A placeholder swapped for another tensor of its dtype that is not the parameter's shape (a cast and a cast
  // back, half().float(), or a value of another shape): restore keeps neither and hands back the host copy. A
  // full value given by the caller, or a cast it follows (another dtype), is kept.
  for (size_t j = 0; j < stored.layout.size(); ++j) {
    const at::Tensor& param = stored.tensors[j];
    if (binder_.rebound_by_caller(block, j) && param.scalar_type() == stored.layout[j].dtype &&
        param.sizes().vec() != stored.layout[j].sizes)
      return stored.layout[j].name;
  }
  return "";
}

void OffloadEngine::check_offloaded_bindings(size_t block) const {
  auto lock = gate_.enter_read();
  check_block(block);
  const int64_t slot = ring_.slot_of(block);
  if (materialized_[block] || (slot >= 0 && ring_.slot(slot).state == SlotState::kInUse)) return;
  check_bindings(block);
}

bool OffloadEngine::is_removed(size_t block) const {
  auto lock = gate_.enter_read();
  TORCH_CHECK(block < store_.size(), "fastoffload: block handle ", std::to_string(block), " is out of range");
  return removed_[block] != 0;
}

}  // namespace fastoffload
