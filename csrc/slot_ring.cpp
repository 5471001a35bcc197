#include "slot_ring.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace fastoffload {

SlotRing::SlotRing(at::Device device, size_t num_slots) : device_(device) { resize(num_slots); }

void SlotRing::resize(size_t num_slots) {
  TORCH_CHECK(num_slots >= 1, "fastoffload: a slot ring needs at least one slot, got ", std::to_string(num_slots));
  if (!slots_.empty()) clear();
  const int index = device_.is_cpu() ? -1 : device_.index();
  slots_.clear();
  slots_.resize(num_slots);
  for (auto& s : slots_) {
    s.ready = std::make_unique<Event>(index);
    s.free = std::make_unique<Event>(index);
  }
  assignment_.clear();
}

void SlotRing::set_assignment(std::vector<int64_t> assignment) {
  for (size_t b = 0; b < assignment.size(); ++b)
    TORCH_CHECK(assignment[b] >= 0 && static_cast<size_t>(assignment[b]) < slots_.size(), "fastoffload: block ",
                std::to_string(b), " is assigned slot ", std::to_string(assignment[b]), " but the ring has ",
                std::to_string(slots_.size()), " slots");
  assignment_ = std::move(assignment);
}

void SlotRing::allocate(size_t bytes) {
  forget_all();
  // Free the old buffers before allocating the new ones, so growing never needs both at once.
  for (auto& s : slots_) s.buffer = at::Tensor();
  slot_bytes_ = 0;
  allocated_ = false;
  const auto options = at::TensorOptions().dtype(at::kByte).device(device_);
  try {
    for (auto& s : slots_) s.buffer = at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, options);
  } catch (const c10::OutOfMemoryError& error) {
    // All or nothing: the ring stays unallocated and the next acquire tries again.
    for (auto& s : slots_) s.buffer = at::Tensor();
    const std::string cause = error.what_without_backtrace();
    TORCH_CHECK_WITH(OutOfMemoryError, false, "fastoffload: could not allocate ", std::to_string(slots_.size()),
                     " device slots of ", std::to_string((bytes + (1 << 20) - 1) >> 20), " MiB (the largest offloaded "
                     "block, prefetch_depth + 1 slots) on ", device_.str(), ": ", cause.substr(0, cause.find('\n')),
                     " Free device memory, lower prefetch_depth, or split the largest block; the weights are "
                     "untouched and the next forward tries again.");
  } catch (...) {
    for (auto& s : slots_) s.buffer = at::Tensor();
    throw;
  }
  slot_bytes_ = bytes;
  allocated_ = true;
}

void SlotRing::clear() {
  forget_all();
  for (auto& s : slots_) s.buffer = at::Tensor();
  slot_bytes_ = 0;
  allocated_ = false;
}

int64_t SlotRing::slot_of(size_t block) const {
  return block < block_slot_.size() ? block_slot_[block] : -1;
}

int64_t SlotRing::choose_slot(size_t block) const {
  if (block < assignment_.size()) {
    const int64_t fixed = assignment_[block];
    return slots_[fixed].state == SlotState::kInUse ? -1 : fixed;
  }
  int64_t best = -1;
  int best_rank = 3;
  uint64_t best_touched = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    int rank;
    switch (s.state) {
      case SlotState::kEmpty:
        rank = 0;
        break;
      case SlotState::kCached:
        rank = 1;
        break;
      case SlotState::kReady:
        rank = 2;
        break;
      default:
        continue;  // in use: never overwritten
    }
    if (best < 0 || rank < best_rank || (rank == best_rank && s.touched < best_touched)) {
      best = static_cast<int64_t>(i);
      best_rank = rank;
      best_touched = s.touched;
    }
  }
  return best;
}

void SlotRing::assign(size_t slot, size_t block) {
  Slot& s = slots_[slot];
  TORCH_CHECK(s.state != SlotState::kInUse, "fastoffload: internal error: slot ", std::to_string(slot),
              " is in use by block ", std::to_string(s.block));
  if (s.block >= 0) block_slot_[static_cast<size_t>(s.block)] = -1;
  if (block >= block_slot_.size()) block_slot_.resize(block + 1, -1);
  const int64_t previous = block_slot_[block];
  if (previous >= 0 && static_cast<size_t>(previous) != slot) {
    slots_[previous].block = -1;
    slots_[previous].state = SlotState::kEmpty;
  }
  block_slot_[block] = static_cast<int64_t>(slot);
  s.block = static_cast<int64_t>(block);
  s.state = SlotState::kReady;
  s.touched = ++clock_;
}

void SlotRing::acquire(size_t slot) {
  Slot& s = slots_[slot];
  s.state = SlotState::kInUse;
  s.refcount += 1;
  s.touched = ++clock_;
}

bool SlotRing::release(size_t slot) {
  Slot& s = slots_[slot];
  if (s.state != SlotState::kInUse) return false;
  s.refcount -= 1;
  if (s.refcount > 0) return false;
  s.state = SlotState::kCached;
  s.touched = ++clock_;
  return true;
}

void SlotRing::touch(size_t slot) { slots_[slot].touched = ++clock_; }

void SlotRing::forget_block(size_t block) {
  const int64_t index = slot_of(block);
  if (index < 0) return;
  Slot& s = slots_[index];
  TORCH_CHECK(s.state != SlotState::kInUse, "fastoffload: internal error: block ", std::to_string(block), " is in use");
  s.block = -1;
  s.state = SlotState::kEmpty;
  block_slot_[block] = -1;
}

void SlotRing::forget_all() {
  for (auto& s : slots_) {
    TORCH_CHECK(s.state != SlotState::kInUse, "fastoffload: block ", std::to_string(s.block),
                " is running (acquired and not released); release it before the slots are reallocated");
    s.block = -1;
    s.state = SlotState::kEmpty;
    s.refcount = 0;
  }
  std::fill(block_slot_.begin(), block_slot_.end(), -1);
}

void SlotRing::replace_buffer(size_t index) {
  Slot& s = slots_[index];
  TORCH_CHECK(s.state != SlotState::kInUse, "fastoffload: internal error: slot ", std::to_string(index),
              " is in use by block ", std::to_string(s.block));
  // Allocated first: out of memory, the slot stays as it was.
  at::Tensor fresh = at::empty({static_cast<int64_t>(std::max<size_t>(slot_bytes_, 1))},
                               at::TensorOptions().dtype(at::kByte).device(device_));
  if (s.block >= 0) block_slot_[static_cast<size_t>(s.block)] = -1;
  s.block = -1;
  s.state = SlotState::kEmpty;
  s.buffer = std::move(fresh);
}

std::vector<int64_t> SlotRing::blocks_in_use() const {
  std::vector<int64_t> result;
  for (const auto& s : slots_)
    if (s.state == SlotState::kInUse) result.push_back(s.block);
  return result;
}

bool SlotRing::any_in_use() const {
  for (const auto& s : slots_)
    if (s.state == SlotState::kInUse) return true;
  return false;
}

}  // namespace fastoffload
