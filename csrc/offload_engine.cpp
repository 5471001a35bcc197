#include "offload_engine.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace fastoffload {
namespace {

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

OffloadEngine::OffloadEngine(at::Device device, size_t num_slots, std::shared_ptr<PinnedPool> pool)
    : device_(device), store_(std::move(pool)), ring_(device, num_slots), copy_(device_index_of(device)),
      binder_(device) {
  const int index = device_index_of(device);
  const auto& pool_ = store_.pool();
  TORCH_CHECK(pool_->device_index() == index || !pool_->pins(), "fastoffload: the pinned pool belongs to device ",
              std::to_string(pool_->device_index()), " but the engine offloads to ", device.str(),
              "; create one pool per device");
}

OffloadEngine::~OffloadEngine() {
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
  const size_t index = store_.add(names, params);
  finish_add(index);
  return index;
}

size_t OffloadEngine::add_block_shared(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                                       const std::string& segment_name, bool owner) {
  const size_t index = store_.add_shared(names, params, segment_name, owner);
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
  TORCH_CHECK(reader_ != nullptr, "fastoffload: add_block_from_file needs set_reader() first");
  const size_t index = store_.add_from_file(names, params, shapes, spans, *reader_);
  finish_add(index);
  return index;
}

size_t OffloadEngine::add_block_on_disk(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        const std::vector<FileSpan>& spans) {
  TORCH_CHECK(reader_ != nullptr, "fastoffload: add_block_on_disk needs set_reader() first");
  TORCH_CHECK(!copy_.capturing(), "fastoffload: blocks cannot be added while a CUDA graph is being captured");
  const size_t index = store_.add_on_disk(names, params, shapes, spans, *reader_);
  if (disk_ == nullptr) disk_ = std::make_unique<DiskTier>(reader_, copy_);
  disk_->add_block(index, store_.block(index).ranges);
  finish_add(index);
  return index;
}

void OffloadEngine::start_disk_tier(size_t count) {
  TORCH_CHECK(disk_ != nullptr, "fastoffload: start_disk_tier: no block was added to the disk tier");
  size_t disk_blocks = 0;
  for (size_t b = 0; b < store_.size(); ++b)
    if (!removed_[b] && store_.block(b).on_disk) disk_blocks += 1;
  finish_loading();
  copy_.synchronize_copies();  // the old staging buffers may still be read by copies in flight
  disk_->start(std::max<size_t>(1, std::min(count, disk_blocks)), store_.max_disk_block_bytes(), *store_.pool());
}

void OffloadEngine::check_not_on_disk(size_t block, const char* what) const {
  TORCH_CHECK(!store_.block(block).on_disk, "fastoffload: block ", std::to_string(block), " cannot be ", what,
              ": it is in the disk tier (its weights are read from the checkpoint every step, and there is no host "
              "copy to rebuild). Raise host_budget so that it fits in host memory, or mutate before enabling offload");
}

const void* OffloadEngine::copy_source(size_t block) {
  const StoredBlock& stored = store_.block(block);
  if (!stored.on_disk) return stored.host->data();
  TORCH_CHECK(disk_ != nullptr && disk_->started(), "fastoffload: block ", std::to_string(block),
              " is in the disk tier, which was not started (start_disk_tier)");
  return disk_->take(block, /*wait=*/true);
}

bool OffloadEngine::acquire_may_wait(size_t block) const {
  if (disk_ == nullptr || block >= store_.size() || removed_[block] || materialized_[block]) return false;
  return store_.block(block).on_disk && ring_.slot_of(block) < 0 && !disk_->ready(block);
}

at::Tensor OffloadEngine::host_view(size_t block, size_t j) const {
  if (store_.block(block).on_disk) return store_.read_tensor(block, j, *reader_);
  return store_.host_view(block, j);
}

void OffloadEngine::check_not_shared(size_t block, const char* what) const {
  TORCH_CHECK(!store_.block(block).shared, "fastoffload: block ", std::to_string(block), " cannot be ", what,
              ": its host copy is shared with the other ranks of this host, whose weights would change under them. "
              "Mutate before enabling offload, or enable with share_host_copy=False");
}

void OffloadEngine::finish_add(size_t index) {
  binder_.set_block(index, store_.block(index));
  materialized_.push_back(0);
  removed_.push_back(0);
  // The original tensors are released here, block by block, so host memory peaks near the model plus
  // one block rather than twice the model.
  binder_.bind_values(index, binder_.placeholders(index));
#if defined(__GLIBC__)
  // glibc keeps freed heap memory (its mmap threshold grows as large tensors are freed), which would
  // leave the released originals counted in RSS until the end; hand it back to the OS now.
  malloc_trim(0);
#endif
  views_stale_ = true;
}

void OffloadEngine::ensure_slots() {
  finish_loading();
  if (!views_stale_ && ring_.slot_bytes() >= store_.max_block_bytes()) return;
  if (!ring_.allocated() || ring_.slot_bytes() < store_.max_block_bytes()) {
    // The copy stream may still be writing into the old slots.
    copy_.synchronize_copies();
    ring_.allocate(store_.max_block_bytes());
  }
  for (size_t b = 0; b < store_.size(); ++b)
    if (!removed_[b]) binder_.build_views(b, store_.block(b), ring_);
  views_stale_ = false;
}

void OffloadEngine::check_grad(size_t block) const {
  const StoredBlock& stored = store_.block(block);
  for (size_t j = 0; j < stored.tensors.size(); ++j) {
    TORCH_CHECK(!stored.tensors[j].requires_grad(), "fastoffload: block ", std::to_string(block), " is offloaded, its parameter '",
                stored.layout[j].name,
                "' requires grad, and grad mode is on. Offloaded weights live in device slots that later blocks "
                "overwrite, so a backward pass would read the wrong bytes. Run the forward under torch.no_grad() or "
                "torch.inference_mode(), or call model.requires_grad_(False); to train, keep the block resident.");
  }
}

void OffloadEngine::issue_copy(size_t block, size_t slot) {
  // First: a disk-tier read that failed throws here, before the slot changes hands.
  const void* source = copy_source(block);
  ring_.assign(slot, block);
  Slot& s = ring_.slot(slot);
  const StoredBlock& stored = store_.block(block);
  copy_.copy_to_device(s.buffer.data_ptr(), source, stored.bytes, *s.free, *s.ready);
  if (stored.on_disk) disk_->consumed(block);
}

void OffloadEngine::acquire(size_t block) {
  check_block(block);
  if (materialized_[block]) return;
  if (at::GradMode::is_enabled()) check_grad(block);
  ensure_slots();
  stats_.acquires += 1;
  generation_ += 1;
  int64_t slot = ring_.slot_of(block);
  if (slot >= 0 && ring_.slot(slot).state == SlotState::kInUse) {
    // The block is already running (re-entrant call): it is bound and its copy was waited for.
    ring_.acquire(static_cast<size_t>(slot));
    return;
  }
  const int64_t foreign = binder_.first_foreign(block);
  TORCH_CHECK(foreign < 0, "fastoffload: parameter '", store_.block(block).layout[foreign].name, "' of block ", std::to_string(block),
              " was replaced while it was offloaded, so its new value would be silently overwritten. Change a "
              "block's parameters inside mutate_params_scope(), which rebuilds the host copy, or disable offload "
              "first.");
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
  ring_.acquire(static_cast<size_t>(slot));
  binder_.bind_slot(block, static_cast<size_t>(slot));
}

bool OffloadEngine::prefetch(size_t block) {
  check_block(block);
  if (materialized_[block]) return false;
  ensure_slots();
  if (ring_.slot_of(block) >= 0) return false;
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
  if (block >= store_.size() || removed_[block] || materialized_[block]) return false;
  const int64_t slot = ring_.slot_of(block);
  if (slot < 0 || ring_.slot(slot).state != SlotState::kInUse) return false;
  generation_ += 1;
  if (ring_.release(static_cast<size_t>(slot))) {
    binder_.bind_placeholders(block);
    copy_.record_on_current(*ring_.slot(slot).free);
  }
  return true;
}

void OffloadEngine::materialize(size_t block) {
  check_block(block);
  finish_loading();
  if (materialized_[block]) return;
  check_not_shared(block, "materialized for mutation");
  check_not_on_disk(block, "materialized for mutation");
  const int64_t slot = ring_.slot_of(block);
  TORCH_CHECK(slot < 0 || ring_.slot(slot).state != SlotState::kInUse, "fastoffload: block ", std::to_string(block),
              " is running a forward; enter mutate_params_scope() between forwards, not inside one");
  ring_.forget_block(block);
  const StoredBlock& stored = store_.block(block);
  at::Tensor buffer = at::empty({static_cast<int64_t>(std::max<size_t>(stored.bytes, 1))},
                                at::TensorOptions().dtype(at::kByte).device(device_));
  if (stored.bytes > 0) buffer.narrow(0, 0, static_cast<int64_t>(stored.bytes)).copy_(stored.host_bytes);
  std::vector<at::Tensor> values;
  values.reserve(stored.layout.size());
  const auto options = at::TensorOptions().device(device_);
  for (const auto& entry : stored.layout) values.push_back(view_of(buffer.storage(), options, 0, entry));
  binder_.bind_values(block, values);
  materialized_[block] = 1;
}

void OffloadEngine::repack(size_t block, const std::vector<std::string>& names, const std::vector<at::Tensor>& params) {
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
  store_.replace(block, names, params);
  binder_.set_block(block, store_.block(block));
  binder_.bind_values(block, binder_.placeholders(block));
  materialized_[block] = 0;
  views_stale_ = true;
}

void OffloadEngine::restore(size_t block, at::Device target) {
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
  for (size_t j = 0; j < stored.layout.size(); ++j) {
    // Current values: a running or materialized block's live tensors (they may have been changed in
    // place), otherwise the host copy.
    const at::Tensor source =
        (running || materialized_[block]) ? stored.tensors[j].variable_data() : host_view(block, j);
    values.push_back(clone_with_layout(source, stored.layout[j], target));
  }
  binder_.bind_values(block, values);
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
  store_.remove(block);
  binder_.drop_block(block);
  removed_[block] = 1;
}

void OffloadEngine::close() {
  try {
    finish_loading();  // no pin may still run on a region freed below
  } catch (const c10::Error&) {
  }
  copy_.synchronize_copies();
  if (disk_ != nullptr) disk_->drain();
  for (size_t b = 0; b < store_.size(); ++b) {
    if (removed_[b]) continue;
    ring_.forget_block(b);
  }
  ring_.clear();
  views_stale_ = true;
}

void OffloadEngine::synchronize() { copy_.synchronize_copies(); }

void OffloadEngine::set_slot_assignment(const std::vector<int64_t>& assignment, size_t num_slots) {
  TORCH_CHECK(ring_.blocks_in_use().empty(), "fastoffload: the slot assignment cannot change while a block is running");
  copy_.synchronize_copies();
  if (num_slots != ring_.size()) ring_.resize(num_slots);
  else ring_.forget_all();
  ring_.set_assignment(assignment);
  views_stale_ = true;
  generation_ += 1;
}

void OffloadEngine::begin_capture() {
  TORCH_CHECK(disk_ == nullptr, "fastoffload: an offload with a disk tier cannot be captured in a CUDA graph (its "
              "reads run on host threads, outside any stream); raise host_budget so every block fits in host memory");
  copy_.begin_capture();
  generation_ += 1;
}

void OffloadEngine::end_capture() {
  copy_.end_capture();
  generation_ += 1;
}

void OffloadEngine::join_copies() { copy_.current_waits_for_copies(); }

std::string OffloadEngine::slot_state(size_t slot) const {
  TORCH_CHECK(slot < ring_.size(), "fastoffload: slot ", std::to_string(slot), " is out of range (", std::to_string(ring_.size()),
              " slots)");
  return state_name(ring_.slot(slot).state);
}

uint64_t OffloadEngine::slot_address(size_t slot) const {
  TORCH_CHECK(slot < ring_.size(), "fastoffload: slot ", std::to_string(slot), " is out of range (", std::to_string(ring_.size()),
              " slots)");
  const at::Tensor& buffer = ring_.slot(slot).buffer;
  return buffer.defined() ? reinterpret_cast<uint64_t>(buffer.data_ptr()) : 0;
}

bool OffloadEngine::is_materialized(size_t block) const {
  check_block(block);
  return materialized_[block] != 0;
}

bool OffloadEngine::is_removed(size_t block) const {
  TORCH_CHECK(block < store_.size(), "fastoffload: block handle ", std::to_string(block), " is out of range");
  return removed_[block] != 0;
}

}  // namespace fastoffload
