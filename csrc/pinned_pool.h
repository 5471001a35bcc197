// PinnedPool: page-locked host memory in large slabs, handed out at exact (aligned) sizes.
//
// Why not torch's caching host allocator: it rounds every request up to a power of two, so a
// 1.2 GiB block pins 2 GiB, and pinning a model parameter by parameter costs one cudaHostAlloc per
// tensor. Here a request is rounded to kAlignment bytes only, slabs are released back to the OS as
// soon as they are empty, and every byte is accounted for in stats().
//
// Backing, measured on one H200 host (PCIe Gen5 x16, 2026-11-29, fresh 1 GiB): cudaHostAlloc pins at
// 622 ms/GiB, mmap + cudaHostRegister at 382 ms/GiB; H2D from either runs at the same speed (55.5 vs
// 55.4 GB/s at 1 GiB, 35.2 vs 38.5 at 1 MiB). The layerwise layer therefore defaults to kRegister;
// both stay available, and kRegister is also the path that can pin pages shared between processes.
//
// Shared backing: allocate_shared() gives a block a slab of its own inside a named POSIX
// shared-memory segment (SharedSegment), created and filled by one process per host (the owner) and
// mapped read-only by the others; pin() then registers each process's mapping (a read-only one with
// cudaHostRegisterReadOnly where the device supports it). The pool accounts those bytes
// separately (shared_bytes; shared_owned_bytes for the ones this process created) so that a node's
// host memory is the sum of the owners' figures, not of everyone's reserved_bytes.
//
// Without CUDA (a CPU-only build, or a pool for the host "device") the same pool hands out ordinary
// page-aligned memory, so the sub-allocator and its accounting are tested on machines with no GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shared_segment.h"

namespace fastoffload {

// How a slab's memory is obtained.
enum class Backing {
  kHostAlloc,  // cudaHostAlloc (portable)
  kRegister,   // mmap + cudaHostRegister (portable); in-place registration of ordinary pages
  kPageable,   // mmap only; no pinning (host device, or the opt-in fallback when pinning fails)
};

Backing parse_backing(const std::string& name);
const char* backing_name(Backing backing);

struct PoolStats {
  size_t reserved_bytes = 0;       // bytes held in slabs (pinned and pageable)
  size_t pinned_bytes = 0;         // of which page-locked
  size_t in_use_bytes = 0;         // bytes handed out and not yet returned
  size_t peak_in_use_bytes = 0;
  size_t peak_reserved_bytes = 0;
  size_t slab_count = 0;
  size_t allocation_count = 0;     // live allocations
  size_t fallback_slabs = 0;       // slabs that fell back to pageable memory
  size_t shared_bytes = 0;         // of reserved_bytes: mapped from shared segments (see allocate_shared)
  size_t shared_owned_bytes = 0;   // of shared_bytes: in segments this process created (the host's one copy)
  double pin_seconds = 0.0;        // wall time spent obtaining and pinning slabs
  // Of the deferred pins (pin()), summed over the threads that ran them: faulting the slab's pages in
  // before registering them, and the registration itself (cudaHostRegister).
  double populate_seconds = 0.0;
  double register_seconds = 0.0;
  size_t deferred_pins = 0;        // deferred pins that ran
  std::string backing;
};

class PinnedPool;

// One sub-allocation. Returns its range to the pool when destroyed; holds the pool alive, so a
// tensor that views this memory (and owns a shared_ptr to it) can outlive every other owner.
class PoolAllocation {
 public:
  PoolAllocation(std::shared_ptr<PinnedPool> pool, size_t slab_id, size_t offset, size_t size, void* ptr,
                 bool pinned);
  ~PoolAllocation();
  PoolAllocation(const PoolAllocation&) = delete;
  PoolAllocation& operator=(const PoolAllocation&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  // The allocation's first byte: data() itself, except for a placed allocation (allocate_placed), whose
  // data() lies up to two pages in; [begin(), begin() + size()) is what it holds.
  uint8_t* begin() const { return begin_; }
  bool pinned() const { return pinned_; }

 private:
  friend class PinnedPool;
  std::shared_ptr<PinnedPool> pool_;
  size_t slab_id_;
  size_t offset_;
  size_t size_;
  void* ptr_;
  bool pinned_;
  uint8_t* begin_ = nullptr;
};

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  static constexpr size_t kAlignment = 256;

  // device_index < 0: the host "device" (no pinning at all). limit_bytes == 0: no limit on pinned
  // bytes. min_slab_bytes: smallest slab to reserve (0: exactly what a request needs, page-rounded).
  PinnedPool(int device_index, Backing backing, size_t limit_bytes, bool allow_pageable_fallback,
             size_t min_slab_bytes);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Thread-safe. Throws c10::Error with the sizes involved when memory cannot be obtained.
  //
  // defer_pin (register backing only): the allocation gets a slab of its own whose pages are not
  // pinned yet; fill it, then call pin(). The fill faults the pages in with their final contents
  // (torch's copy does so on many threads), so registering them skips a separate zero-fill pass.
  std::shared_ptr<PoolAllocation> allocate(size_t nbytes, bool defer_pin = false);
  // What allocate_placed holds beyond its bytes.
  static constexpr size_t kPlaceSlack = 3 * 4096;
  // allocate(nbytes + kPlaceSlack, defer_pin), with data() placed so that data() % 4096 == phase, at
  // least a page after begin() and a page before the end: a region a reader lands in place, whose
  // bytes keep their file offsets' page alignment (DiskReader's DestWindow is [begin(), begin() + size())).
  std::shared_ptr<PoolAllocation> allocate_placed(size_t nbytes, size_t phase, bool defer_pin = false);
  // The first address at least a page after `begin` whose offset in its page is `phase`: where a placed
  // region's data lies in its kPlaceSlack-larger memory (allocate_placed; the disk tier's staging).
  static uint8_t* placed(uint8_t* begin, size_t phase);
  // Pins the slab of an allocation made with defer_pin (no-op otherwise): faults in the pages not yet
  // there (in steps, see populate_seconds), then registers them. Safe while another thread writes into
  // the slab: neither step changes a byte. On failure: the pool's error, or with
  // allow_pageable_fallback a warning and the memory stays pageable.
  void pin(PoolAllocation& allocation);
  // A slab of its own in the shared segment `name`, exactly aligned(nbytes) long. owner: creates the
  // segment (fill it, then pin()); otherwise: maps the existing one, which must have that size (its
  // contents are the owner's). Either way, call pin() next; pinning registers this process's mapping.
  std::shared_ptr<PoolAllocation> allocate_shared(const std::string& name, size_t nbytes, bool owner);
  // Owner: creates the segment `name` of aligned(nbytes) bytes now (pages reserved), for a later
  // allocate_shared(name, nbytes, true) (or a smaller nbytes: a compressed block, whose segment is
  // then created again at its own size). Creating every segment before packing any block makes a
  // failure (a taken name, /dev/shm full) show before any work is done, when the ranks can still agree
  // to keep one copy each instead.
  void reserve_shared(const std::string& name, size_t nbytes);
  // Destroys the reservations not used yet, unlinking their names. Returns how many.
  size_t drop_reserved();
  // Unlinks the names of every shared segment this pool created and still holds (their mappings stay
  // valid), and drops unused reservations. Call once every process that needs them has mapped them.
  // Returns how many names it unlinked.
  size_t unlink_shared();
  // Names of the segments this pool created whose names are still linked.
  std::vector<std::string> linked_shared_names() const;
  PoolStats stats() const;
  int device_index() const { return device_index_; }
  Backing backing() const { return backing_; }
  bool pins() const { return device_index_ >= 0 && backing_ != Backing::kPageable; }
  bool allows_pageable_fallback() const { return allow_pageable_fallback_; }

 private:
  friend class PoolAllocation;
  struct Slab {
    void* base = nullptr;
    size_t size = 0;
    Backing backing = Backing::kPageable;
    bool pinned = false;
    bool exclusive = false;  // made for one deferred-pin allocation; never shared
    std::unique_ptr<SharedSegment> segment;  // set: the slab is this mapping of a shared segment
    size_t used = 0;
    std::map<size_t, size_t> free_ranges;  // offset -> size, coalesced
  };

  void release(size_t slab_id, size_t offset, size_t size);
  // Called with mutex_ held.
  size_t add_slab(size_t nbytes, bool defer_pin);
  void free_slab(Slab& slab);
  // Called with mutex_ held: carves [offset, offset + size) out of the slab's free range at offset.
  std::shared_ptr<PoolAllocation> hand_out(size_t slab_id, size_t offset, size_t size);

  const int device_index_;
  const Backing backing_;
  const size_t limit_bytes_;
  const bool allow_pageable_fallback_;
  const size_t min_slab_bytes_;

  mutable std::mutex mutex_;
  std::map<size_t, Slab> slabs_;  // slab id -> slab
  std::map<std::string, std::unique_ptr<SharedSegment>> reserved_;  // reserve_shared(), not allocated yet
  size_t next_slab_id_ = 0;
  PoolStats stats_;
};

}  // namespace fastoffload
