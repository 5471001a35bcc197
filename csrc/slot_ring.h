// SlotRing: a fixed set of device buffers ("slots"), each big enough for the largest block, with a
// "ready" and a "free" event per slot and the bookkeeping of which block each slot holds.
//
// Slots are assigned by state, not by `block % num_slots`: that formula breaks as soon as the block
// count is not a multiple of the slot count and the prefetch wraps around from the last block to the
// first. A slot is
//   empty   holds nothing usable,
//   ready   holds a prefetched block that has not run yet,
//   in use  holds a block that is running (acquired and not released),
//   cached  holds a block that ran and was released; its bytes are still an exact copy.
// A new copy goes into an empty slot, else the least recently touched cached one, else the least
// recently touched ready one; never into a slot in use. A cached block that runs again is not copied
// again, so a block that runs twice in a row, a single-block list, or a list that fits in the slots
// costs no transfer after its first; a prefetch of a cached block touches it, so that the copies issued
// beside it take the other cached slots first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "copy_engine.h"

namespace fastoffload {

enum class SlotState { kEmpty, kReady, kInUse, kCached };

struct Slot {
  at::Tensor buffer;  // uint8 on the device; static for the ring's lifetime (or until it grows)
  std::unique_ptr<Event> ready;
  std::unique_ptr<Event> free;
  int64_t block = -1;
  SlotState state = SlotState::kEmpty;
  int refcount = 0;
  uint64_t touched = 0;
};

class SlotRing {
 public:
  SlotRing(at::Device device, size_t num_slots);

  // (Re)allocates every slot with at least `bytes` bytes. Forgets what the slots held; the caller must
  // make sure no copy or kernel still uses them.
  void allocate(size_t bytes);
  // Drops the buffers (the ring can be allocated again later).
  void clear();
  bool allocated() const { return allocated_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t size() const { return slots_.size(); }

  int64_t slot_of(size_t block) const;
  // The slot a copy of `block` should go into, or -1 when none may be used now. With a fixed
  // assignment that is the block's own slot (unless it is in use); otherwise the best by state.
  int64_t choose_slot(size_t block) const;
  // Every block always goes into the same slot (CUDA-graph replay bakes the addresses in). Empty:
  // back to assignment by state.
  void set_assignment(std::vector<int64_t> assignment);
  const std::vector<int64_t>& assignment() const { return assignment_; }
  // Changes the number of slots; forgets what they held and drops their buffers.
  void resize(size_t num_slots);
  void assign(size_t slot, size_t block);  // -> ready
  void acquire(size_t slot);               // -> in use (refcounted)
  bool release(size_t slot);               // -> cached when the last user releases; true then
  void touch(size_t slot);                 // most recently touched: the last of its state a new copy takes
  void forget_block(size_t block);         // its slot, if any, -> empty
  void forget_all();
  // Gives the slot a new buffer of the same size and forgets what it held (it must not be in use); the old
  // memory stays with whatever still refers to it.
  void replace_buffer(size_t index);

  Slot& slot(size_t index) { return slots_[index]; }
  const Slot& slot(size_t index) const { return slots_[index]; }
  std::vector<int64_t> blocks_in_use() const;
  bool any_in_use() const;

 private:
  at::Device device_;
  std::vector<Slot> slots_;
  std::vector<int64_t> block_slot_;  // block -> slot or -1
  std::vector<int64_t> assignment_;  // block -> fixed slot; empty: by state
  size_t slot_bytes_ = 0;
  bool allocated_ = false;
  uint64_t clock_ = 0;
};

}  // namespace fastoffload
