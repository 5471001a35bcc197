// SharedSegment: one POSIX shared-memory object (shm_open) mapped MAP_SHARED into this process.
//
// Why: the ranks of one host (torchrun) each hold the whole model, and each pinned its own host copy,
// so host memory was ranks x model. With a segment per block, one process per host (the owner)
// creates and fills it, the others map the same pages read-only; each process then registers (pins)
// its own mapping with CUDA, because a registration belongs to the process that made it.
//
// Lifetime: a segment's name only exists so that the other processes can open it. Once every local
// rank has mapped it the owner unlinks the name (unlink()); the mappings stay valid and the pages are
// freed by the kernel when the last mapping goes, so a crash or a kill -9 of any rank afterwards leaves
// nothing in /dev/shm. Until then the owner's destructor unlinks a name it still holds, and
// sweep_stale_segments() removes the names of an owner that died before it could.
//
// Names: "/fastoffload-<job token>-<segment token>", both random hex chosen by the caller, so that no
// other process can guess (and take) a name before the owner creates it. While an owner creates and
// shares segments it holds a JobLock, "/fastoffload-<job token>-lock", locked with flock(): the kernel
// drops the lock when the owner dies, whatever PID namespace the sweeper runs in, which is how the
// sweep tells a dead job's names from a live one's.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace fastoffload {

class SharedSegment {
 public:
  // Owner: creates `name` (O_CREAT | O_EXCL, mode 0600), sizes it to `nbytes` and maps it read-write.
  // Throws a c10::Error naming the segment and the cause (name taken, /dev/shm full) and leaves nothing
  // behind.
  static std::unique_ptr<SharedSegment> create(const std::string& name, size_t nbytes);
  // Other ranks: opens the existing `name` read-only, checks that this user owns it and that it holds
  // exactly `nbytes`, and maps it PROT_READ: no rank but the owner can write the host copy.
  static std::unique_ptr<SharedSegment> open(const std::string& name, size_t nbytes);

  ~SharedSegment();  // munmap; an owner also unlinks the name if it still holds it
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // Owner only (no-op otherwise): removes the name from /dev/shm; the mapping stays valid.
  void unlink();

  void* data() const { return base_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }
  bool linked() const { return linked_; }
  bool read_only() const { return !owner_; }

 private:
  SharedSegment(std::string name, void* base, size_t size, bool owner)
      : name_(std::move(name)), base_(base), size_(size), owner_(owner), linked_(owner) {}

  std::string name_;
  void* base_;
  size_t size_;
  bool owner_;
  bool linked_;
};

// The owner's liveness lock for one job token (see above). Created O_EXCL and flock'ed at once; the
// name is removed and the lock dropped by release() or the destructor.
class JobLock {
 public:
  // Throws a c10::Error naming the cause when the lock cannot be created (name taken, /dev/shm not
  // writable) or was removed by a sweep before it was locked.
  explicit JobLock(const std::string& job_token);
  ~JobLock();
  JobLock(const JobLock&) = delete;
  JobLock& operator=(const JobLock&) = delete;

  void release() noexcept;
  bool held() const { return fd_ >= 0; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  int fd_ = -1;
};

// Every name starts with '/' and this prefix (Python reads it as _C.SEGMENT_PREFIX).
constexpr const char* kSegmentPrefix = "fastoffload-";

// Throws unless `name` is "/fastoffload-<hex>-<hex>"-shaped: a leading '/', the "fastoffload-" prefix,
// then only lowercase hex digits and '-', at most 200 characters.
void check_segment_name(const std::string& name);

// Removes the name `name` if it exists; returns whether it did. For clean-up paths: never throws.
bool unlink_segment(const std::string& name) noexcept;

// Removes the names of jobs whose owner provably died: for every /dev/shm/fastoffload-<job>-lock that
// this user owns and whose flock() it can take, every fastoffload-<job>-* of this user, then the lock.
// Names of a job whose owner is alive (in any PID namespace), of another user, or without a lock are
// never touched. Returns how many segment names it removed.
size_t sweep_stale_segments() noexcept;

}  // namespace fastoffload
