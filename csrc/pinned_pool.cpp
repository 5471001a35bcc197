#include "pinned_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <c10/util/Exception.h>

#ifdef FASTOFFLOAD_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace fastoffload {
namespace {

constexpr size_t kPage = 4096;

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

std::string mib(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

void* map_pages(size_t nbytes) {
  void* base = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return base == MAP_FAILED ? nullptr : base;
}

void* map_pages_or_fail(size_t nbytes, size_t reserved_bytes) {
  void* base = map_pages(nbytes);
  TORCH_CHECK(base != nullptr, "fastoffload: could not map ", mib(nbytes), " MiB of host memory (", mib(reserved_bytes),
              " MiB already reserved by this pool); the host is out of memory");
  return base;
}

#ifdef FASTOFFLOAD_WITH_CUDA
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it (EINVAL) and nothing is done
#endif

// Populated per call: each call holds the process's mmap lock for reading while it faults its range in,
// and an mmap elsewhere in the process (the next block's region, any allocation) waits for it; about
// 2-3 ms of faults at a time.
constexpr size_t kPopulateStep = 8 << 20;

// Faults in every page of a private mapping that is about to be registered. cudaHostRegister would
// fault the missing pages itself, inside the driver's call, which holds the mmap lock for the whole
// range: done here first, in steps, the registration only pins pages that are there (and holds the
// lock briefly), the faults of pins that run on several threads overlap whatever the driver
// serializes, and the pool's stats tell the two costs apart. A refusal (a kernel older than 5.14)
// leaves the faulting to the registration.
void populate_pages(void* base, size_t nbytes) {
  auto* at = static_cast<uint8_t*>(base);
  for (size_t done = 0; done < nbytes; done += kPopulateStep) {
    if (madvise(at + done, std::min(kPopulateStep, nbytes - done), MADV_POPULATE_WRITE) != 0) return;
  }
}

// A failed pin: an error by default; with allow_pageable_fallback a warning, and the caller keeps the
// memory pageable.
void fail_or_warn_pin(bool allow_pageable_fallback, size_t nbytes, const char* backing, const std::string& error,
                      size_t pinned_bytes) {
  TORCH_CHECK(allow_pageable_fallback, "fastoffload: pinning ", mib(nbytes), " MiB of host memory (", backing,
              ") failed: ", error, ". This pool already holds ", mib(pinned_bytes),
              " MiB pinned. Free host memory or raise the locked-memory limit (ulimit -l), or pass "
              "allow_pageable_fallback=True to continue with pageable memory (host-to-device copies then run at "
              "pageable speed, roughly 5-8 GB/s instead of ~50).");
  TORCH_WARN("fastoffload: pinning ", mib(nbytes), " MiB failed (", error,
             "); falling back to pageable memory, so copies from this slab run at pageable speed.");
}

// Pins nbytes with the given backing; returns nullptr and the CUDA error text on failure.
void* pin_pages(Backing backing, size_t nbytes, std::string& error) {
  if (backing == Backing::kHostAlloc) {
    void* base = nullptr;
    cudaError_t status = cudaHostAlloc(&base, nbytes, cudaHostAllocPortable);
    if (status == cudaSuccess) return base;
    error = cudaGetErrorString(status);
    (void)cudaGetLastError();
    return nullptr;
  }
  void* base = map_pages(nbytes);
  if (base == nullptr) {
    error = "mmap failed";
    return nullptr;
  }
  cudaError_t status = cudaHostRegister(base, nbytes, cudaHostRegisterPortable);
  if (status == cudaSuccess) return base;
  error = cudaGetErrorString(status);
  (void)cudaGetLastError();
  munmap(base, nbytes);
  return nullptr;
}

// cudaHostRegisterReadOnly where the device supports it: a non-owner maps a shared copy PROT_READ, and
// without the flag some platforms refuse to register read-only pages. 0 where it is not supported
// (the registration is then attempted without it, and a refusal is reported like any pin failure).
unsigned int read_only_register_flag(int device_index) {
  int supported = 0;
  if (cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterReadOnlySupported, device_index) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return supported != 0 ? cudaHostRegisterReadOnly : 0;
}
#endif

}  // namespace

Backing parse_backing(const std::string& name) {
  if (name == "host_alloc") return Backing::kHostAlloc;
  if (name == "register") return Backing::kRegister;
  if (name == "pageable") return Backing::kPageable;
  TORCH_CHECK(false, "fastoffload: backing must be 'host_alloc', 'register' or 'pageable', got '", name, "'");
}

const char* backing_name(Backing backing) {
  switch (backing) {
    case Backing::kHostAlloc:
      return "host_alloc";
    case Backing::kRegister:
      return "register";
    case Backing::kPageable:
      return "pageable";
  }
  return "unknown";
}

PoolAllocation::PoolAllocation(std::shared_ptr<PinnedPool> pool, size_t slab_id, size_t offset, size_t size,
                               void* ptr, bool pinned)
    : pool_(std::move(pool)),
      slab_id_(slab_id),
      offset_(offset),
      size_(size),
      ptr_(ptr),
      pinned_(pinned),
      begin_(static_cast<uint8_t*>(ptr)) {}

PoolAllocation::~PoolAllocation() { pool_->release(slab_id_, offset_, size_); }

PinnedPool::PinnedPool(int device_index, Backing backing, size_t limit_bytes, bool allow_pageable_fallback,
                       size_t min_slab_bytes)
    : device_index_(device_index),
      backing_(device_index < 0 ? Backing::kPageable : backing),
      limit_bytes_(limit_bytes),
      allow_pageable_fallback_(allow_pageable_fallback),
      min_slab_bytes_(min_slab_bytes) {
#ifndef FASTOFFLOAD_WITH_CUDA
  TORCH_CHECK(device_index < 0 || backing == Backing::kPageable,
              "fastoffload: this build has no CUDA support, so it cannot pin memory for cuda:", std::to_string(device_index),
              "; rebuild with a CUDA toolkit (FASTOFFLOAD_CUDA=1) or use the host device");
#endif
  stats_.backing = backing_name(backing_);
}

PinnedPool::~PinnedPool() {
  reserved_.clear();
  for (auto& entry : slabs_) free_slab(entry.second);
}

std::shared_ptr<PoolAllocation> PinnedPool::allocate(size_t nbytes, bool defer_pin) {
  const size_t size = round_up(std::max<size_t>(nbytes, 1), kAlignment);
  defer_pin = defer_pin && pins() && backing_ == Backing::kRegister;
  std::lock_guard<std::mutex> lock(mutex_);
  size_t slab_id = 0;
  size_t offset = 0;
  bool found = false;
  // First fit over existing slabs: blocks are packed once, at attach, so fragmentation is not a
  // concern worth a smarter policy.
  for (auto& entry : slabs_) {
    if (defer_pin) break;               // it gets a slab of its own
    if (entry.second.exclusive) continue;
    for (auto& range : entry.second.free_ranges) {
      if (range.second >= size) {
        slab_id = entry.first;
        offset = range.first;
        found = true;
        break;
      }
    }
    if (found) break;
  }
  if (!found) {
    slab_id = add_slab(size, defer_pin);
    offset = 0;
  }
  return hand_out(slab_id, offset, size);
}

uint8_t* PinnedPool::placed(uint8_t* begin, size_t phase) {
  constexpr uintptr_t kPage = 4096;
  const auto first = reinterpret_cast<uintptr_t>(begin) + kPage;
  return reinterpret_cast<uint8_t*>(first + (phase % kPage + kPage - first % kPage) % kPage);
}

std::shared_ptr<PoolAllocation> PinnedPool::allocate_placed(size_t nbytes, size_t phase, bool defer_pin) {
  std::shared_ptr<PoolAllocation> allocation = allocate(nbytes + kPlaceSlack, defer_pin);
  allocation->ptr_ = placed(allocation->begin_, phase);
  return allocation;
}

std::shared_ptr<PoolAllocation> PinnedPool::hand_out(size_t slab_id, size_t offset, size_t size) {
  Slab& slab = slabs_.at(slab_id);
  auto range = slab.free_ranges.find(offset);
  const size_t remaining = range->second - size;
  slab.free_ranges.erase(range);
  if (remaining > 0) slab.free_ranges.emplace(offset + size, remaining);
  slab.used += size;
  stats_.in_use_bytes += size;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  stats_.allocation_count += 1;
  const bool pinned = slab.pinned;
  void* ptr = static_cast<char*>(slab.base) + offset;
  return std::make_shared<PoolAllocation>(shared_from_this(), slab_id, offset, size, ptr, pinned);
}

std::shared_ptr<PoolAllocation> PinnedPool::allocate_shared(const std::string& name, size_t nbytes, bool owner) {
  // Both sides must agree on the segment's size: the same rounding as allocate().
  const size_t size = round_up(std::max<size_t>(nbytes, 1), kAlignment);
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<SharedSegment> segment;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto reserved = reserved_.find(name);
    if (owner && reserved != reserved_.end()) {
      TORCH_CHECK(reserved->second->size() >= size, "fastoffload: internal error: the shared segment '", name,
                  "' was reserved with ", std::to_string(reserved->second->size()), " bytes, but its block packs to ",
                  std::to_string(size));
      segment = std::move(reserved->second);
      reserved_.erase(reserved);
    }
  }
  if (segment != nullptr && segment->size() != size) {
    // Reserved at the raw size, filled with the smaller compressed form: the reservation is given up
    // (unmapped and unlinked) and the name created again at the size the other ranks will expect.
    segment.reset();
  }
  if (segment == nullptr) segment = owner ? SharedSegment::create(name, size) : SharedSegment::open(name, size);
  std::lock_guard<std::mutex> lock(mutex_);
  Slab slab;
  slab.base = segment->data();
  slab.size = size;
  slab.backing = Backing::kRegister;
  slab.exclusive = true;  // pin() registers it; no other allocation may land in it
  slab.segment = std::move(segment);
  slab.free_ranges.emplace(0, size);
  stats_.pin_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.reserved_bytes += size;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  stats_.shared_bytes += size;
  if (owner) stats_.shared_owned_bytes += size;
  stats_.slab_count += 1;
  const size_t id = next_slab_id_++;
  slabs_.emplace(id, std::move(slab));
  return hand_out(id, 0, size);
}

void PinnedPool::reserve_shared(const std::string& name, size_t nbytes) {
  const size_t size = round_up(std::max<size_t>(nbytes, 1), kAlignment);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(reserved_.count(name) == 0, "fastoffload: internal error: the shared segment '", name,
                "' is already reserved");
  }
  std::unique_ptr<SharedSegment> segment = SharedSegment::create(name, size);
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_.emplace(name, std::move(segment));
}

size_t PinnedPool::drop_reserved() {
  std::map<std::string, std::unique_ptr<SharedSegment>> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dropped.swap(reserved_);
  }
  return dropped.size();  // their destructors unmap and unlink, outside the lock
}

size_t PinnedPool::unlink_shared() {
  const size_t dropped = drop_reserved();
  std::lock_guard<std::mutex> lock(mutex_);
  size_t count = dropped;
  for (auto& entry : slabs_) {
    SharedSegment* segment = entry.second.segment.get();
    if (segment == nullptr || !segment->owner() || !segment->linked()) continue;
    segment->unlink();
    count += 1;
  }
  return count;
}

std::vector<std::string> PinnedPool::linked_shared_names() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> names;
  for (const auto& entry : reserved_) names.push_back(entry.first);
  for (const auto& entry : slabs_) {
    const SharedSegment* segment = entry.second.segment.get();
    if (segment != nullptr && segment->owner() && segment->linked()) names.push_back(segment->name());
  }
  return names;
}

size_t PinnedPool::add_slab(size_t nbytes, bool defer_pin) {
  const size_t size = round_up(defer_pin ? nbytes : std::max(nbytes, min_slab_bytes_), kPage);
  Slab slab;
  slab.size = size;
  const auto start = std::chrono::steady_clock::now();
  if (defer_pin) {
    slab.base = map_pages_or_fail(size, stats_.reserved_bytes);
    slab.backing = Backing::kRegister;
    slab.exclusive = true;
  } else if (pins()) {
#ifdef FASTOFFLOAD_WITH_CUDA
    std::string error;
    if (limit_bytes_ != 0 && stats_.pinned_bytes + size > limit_bytes_) {
      error = "the pool's limit of " + mib(limit_bytes_) + " MiB would be exceeded";
    } else {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      slab.base = pin_pages(backing_, size, error);
    }
    if (slab.base != nullptr) {
      slab.backing = backing_;
      slab.pinned = true;
    } else {
      fail_or_warn_pin(allow_pageable_fallback_, size, backing_name(backing_), error, stats_.pinned_bytes);
      stats_.fallback_slabs += 1;
    }
#endif
  }
  if (slab.base == nullptr) {
    slab.base = map_pages_or_fail(size, stats_.reserved_bytes);
    slab.backing = Backing::kPageable;
  }
  stats_.pin_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  slab.free_ranges.emplace(0, size);
  stats_.reserved_bytes += size;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  if (slab.pinned) stats_.pinned_bytes += size;
  stats_.slab_count += 1;
  const size_t id = next_slab_id_++;
  slabs_.emplace(id, std::move(slab));
  return id;
}

void PinnedPool::free_slab(Slab& slab) {
  if (slab.base == nullptr) return;
  if (slab.segment != nullptr) {
#ifdef FASTOFFLOAD_WITH_CUDA
    if (slab.pinned) {
      (void)cudaHostUnregister(slab.base);
      (void)cudaGetLastError();
    }
#endif
    slab.segment.reset();  // munmap; an owner that still holds the name unlinks it
    slab.base = nullptr;
    return;
  }
#ifdef FASTOFFLOAD_WITH_CUDA
  if (slab.backing == Backing::kHostAlloc) {
    (void)cudaFreeHost(slab.base);
    (void)cudaGetLastError();
    slab.base = nullptr;
    return;
  }
  if (slab.backing == Backing::kRegister && slab.pinned) {
    (void)cudaHostUnregister(slab.base);
    (void)cudaGetLastError();
  }
#endif
  munmap(slab.base, slab.size);
  slab.base = nullptr;
}

void PinnedPool::release(size_t slab_id, size_t offset, size_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slabs_.find(slab_id);
  if (it == slabs_.end()) return;
  Slab& slab = it->second;
  auto next = slab.free_ranges.emplace(offset, size).first;
  // Coalesce with the following and the preceding free range.
  auto after = std::next(next);
  if (after != slab.free_ranges.end() && next->first + next->second == after->first) {
    next->second += after->second;
    slab.free_ranges.erase(after);
  }
  if (next != slab.free_ranges.begin()) {
    auto before = std::prev(next);
    if (before->first + before->second == next->first) {
      before->second += next->second;
      slab.free_ranges.erase(next);
    }
  }
  slab.used -= size;
  stats_.in_use_bytes -= size;
  stats_.allocation_count -= 1;
  if (slab.used == 0) {
    // An empty slab goes back to the OS at once: after detach, host memory must actually drop.
    stats_.reserved_bytes -= slab.size;
    if (slab.pinned) stats_.pinned_bytes -= slab.size;
    if (slab.segment != nullptr) {
      stats_.shared_bytes -= slab.size;
      if (slab.segment->owner()) stats_.shared_owned_bytes -= slab.size;
    }
    stats_.slab_count -= 1;
    free_slab(slab);
    slabs_.erase(it);
  }
}

void PinnedPool::pin(PoolAllocation& allocation) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = slabs_.find(allocation.slab_id_);
  TORCH_CHECK(it != slabs_.end(), "fastoffload: internal error: pin() of an allocation whose slab is gone");
  Slab& slab = it->second;  // stays valid unlocked: `allocation` keeps the slab, and map nodes do not move
  // A shared slab is exclusive on every pool; only a pinning pool registers it.
  if (slab.pinned || !slab.exclusive || !pins()) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  if (limit_bytes_ != 0 && stats_.pinned_bytes + slab.size > limit_bytes_) {
    error = "the pool's limit of " + mib(limit_bytes_) + " MiB would be exceeded";
  } else {
    // Counted before registering, so that concurrent pins respect the limit. The registration runs
    // unlocked: a checkpoint build pins block k on another thread while block k+1 is allocated and read.
    stats_.pinned_bytes += slab.size;
    lock.unlock();
    if (slab.segment == nullptr) populate_pages(slab.base, slab.size);  // a shared mapping has its pages
    const auto registering = std::chrono::steady_clock::now();
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    unsigned int flags = cudaHostRegisterPortable;
    if (slab.segment != nullptr && slab.segment->read_only()) flags |= read_only_register_flag(device_index_);
    const cudaError_t status = cudaHostRegister(slab.base, slab.size, flags);
    if (status != cudaSuccess) {
      error = cudaGetErrorString(status);
      (void)cudaGetLastError();
    }
    const auto registered = std::chrono::steady_clock::now();
    lock.lock();
    if (!error.empty()) stats_.pinned_bytes -= slab.size;
    stats_.populate_seconds += std::chrono::duration<double>(registering - start).count();
    stats_.register_seconds += std::chrono::duration<double>(registered - registering).count();
    stats_.deferred_pins += 1;
  }
  stats_.pin_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (error.empty()) {
    slab.pinned = true;
    allocation.pinned_ = true;
    return;
  }
  fail_or_warn_pin(allow_pageable_fallback_, slab.size, backing_name(Backing::kRegister), error, stats_.pinned_bytes);
  slab.backing = Backing::kPageable;
  stats_.fallback_slabs += 1;
#endif
}

PoolStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace fastoffload
