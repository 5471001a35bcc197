// SharedSegment: one POSIX shared-memory object (shm_open) mapped MAP_SHARED into this process.
//
// Why: the ranks of one host (torchrun) each hold the whole model, and each pinned its own host copy,
// so host memory was ranks x model. With a segment per block, one process per host (the owner)
// creates and fills it, the others map the same pages; each process then registers (pins) its own
// mapping with CUDA, because a registration belongs to the process that made it.
//
// Lifetime: a segment's name only exists so that the other processes can open it. Once every local
// rank has mapped it the owner unlinks the name (unlink()); the mappings stay valid and the pages are
// freed by the kernel when the last mapping goes, so a crash or a kill -9 of any rank afterwards leaves
// nothing in /dev/shm. Until then the owner's destructor unlinks a name it still holds, and
// sweep_stale_segments() removes the names of owners that died before they could.
//
// Names: "/fastoffload-<owner pid>-<random hex>-<block index>" (see check_segment_name); the pid is
// what the sweep reads to tell a live owner from a dead one.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace fastoffload {

class SharedSegment {
 public:
  // Owner: creates `name` (O_CREAT | O_EXCL, mode 0600), sizes it to `nbytes` and maps it. Throws a
  // c10::Error naming the segment and the cause (name taken, /dev/shm full) and leaves nothing behind.
  static std::unique_ptr<SharedSegment> create(const std::string& name, size_t nbytes);
  // Other ranks: opens the existing `name`, checks that it holds exactly `nbytes` and maps it.
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

 private:
  SharedSegment(std::string name, void* base, size_t size, bool owner)
      : name_(std::move(name)), base_(base), size_(size), owner_(owner), linked_(owner) {}

  std::string name_;
  void* base_;
  size_t size_;
  bool owner_;
  bool linked_;
};

// Every segment name starts with '/' and this prefix (Python reads it as _C.SEGMENT_PREFIX).
constexpr const char* kSegmentPrefix = "fastoffload-";

// Throws unless `name` is "/fastoffload-<pid>-<hex>-<index>"-shaped: a leading '/', no other '/',
// the "fastoffload-" prefix, at most 200 characters.
void check_segment_name(const std::string& name);

// Removes the name `name` if it exists; returns whether it did. For clean-up paths: never throws.
bool unlink_segment(const std::string& name) noexcept;

// Removes every /dev/shm/fastoffload-<pid>-* whose <pid> is no longer a live process (its owner died
// before it could unlink them, e.g. kill -9 while enabling). Returns how many it removed.
size_t sweep_stale_segments() noexcept;

}  // namespace fastoffload
