#include "shared_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

namespace fastoffload {
namespace {

constexpr const char* kLockSuffix = "-lock";
constexpr const char* kShmDir = "/dev/shm/";

std::string errno_text(int error) { return std::string(std::strerror(error)) + " (errno " + std::to_string(error) + ")"; }

void* map_shared(int fd, size_t nbytes, bool writable) {
  void* base = mmap(nullptr, nbytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  return base == MAP_FAILED ? nullptr : base;
}

bool is_token(const std::string& text) {
  if (text.empty()) return false;
  for (char c : text)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The job token of "fastoffload-<job>-lock", or "" when `entry` is not a job lock.
std::string lock_job_of(const std::string& entry) {
  const size_t prefix = std::strlen(kSegmentPrefix);
  if (entry.compare(0, prefix, kSegmentPrefix) != 0 || !ends_with(entry, kLockSuffix)) return "";
  const std::string job = entry.substr(prefix, entry.size() - prefix - std::strlen(kLockSuffix));
  return is_token(job) ? job : "";
}

// A regular file of this user (the sweep never follows a link nor touches another user's names).
bool ours(const std::string& entry) {
  struct stat info {};
  return lstat((kShmDir + entry).c_str(), &info) == 0 && S_ISREG(info.st_mode) && info.st_uid == geteuid();
}

std::vector<std::string> shm_entries() {
  std::vector<std::string> entries;
  DIR* dir = opendir(kShmDir);
  if (dir == nullptr) return entries;
  while (const dirent* entry = readdir(dir)) {
    if (std::strncmp(entry->d_name, kSegmentPrefix, std::strlen(kSegmentPrefix)) == 0) entries.emplace_back(entry->d_name);
  }
  closedir(dir);
  return entries;
}

// Whether `fd` is still the file linked at `path` (a sweep may have removed it before it was locked).
bool still_linked(int fd, const std::string& path) {
  struct stat held {}, linked {};
  return fstat(fd, &held) == 0 && stat(path.c_str(), &linked) == 0 && held.st_ino == linked.st_ino &&
         held.st_dev == linked.st_dev;
}

// Removes job `job`'s names if its lock file `entry` is this user's and nobody holds it.
size_t sweep_job(const std::string& entry, const std::string& job, const std::vector<std::string>& entries) {
  const std::string path = kShmDir + entry;
  const int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return 0;
  struct stat info {};
  size_t removed = 0;
  // EWOULDBLOCK: the owner (or a child it forked) is alive, in whatever PID namespace.
  if (fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && info.st_uid == geteuid() &&
      flock(fd, LOCK_EX | LOCK_NB) == 0 && still_linked(fd, path)) {
    const std::string prefix = std::string(kSegmentPrefix) + job + "-";
    for (const std::string& other : entries) {
      if (other == entry || other.compare(0, prefix.size(), prefix) != 0 || !ours(other)) continue;
      if (shm_unlink(("/" + other).c_str()) == 0) removed += 1;
    }
    shm_unlink(("/" + entry).c_str());
  }
  close(fd);
  return removed;
}

}  // namespace

void check_segment_name(const std::string& name) {
  const size_t prefix = 1 + std::strlen(kSegmentPrefix);
  bool valid = name.size() > prefix && name.size() <= 200 && name[0] == '/' && name.compare(1, prefix - 1, kSegmentPrefix) == 0;
  for (size_t i = prefix; valid && i < name.size(); ++i)
    valid = (name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f') || name[i] == '-';
  TORCH_CHECK(valid && !ends_with(name, kLockSuffix),
              "fastoffload: a shared segment name must look like '/fastoffload-<job hex>-<segment hex>' (one leading "
              "'/', then lowercase hex digits and '-', at most 200 characters), got '", name, "'");
}

std::unique_ptr<SharedSegment> SharedSegment::create(const std::string& name, size_t nbytes) {
  check_segment_name(name);
  TORCH_CHECK(nbytes > 0, "fastoffload: internal error: a shared segment must hold at least one byte");
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "fastoffload: could not create the shared segment '", name, "': ", errno_text(errno),
              (errno == EEXIST ? ". Another process took that name first (names are random, so it must have seen it); "
                                 "enable again, or use share_host_copy='auto' to fall back to one copy per rank"
                               : ". Check that /dev/shm is mounted and writable"));
  if (ftruncate(fd, static_cast<off_t>(nbytes)) != 0) {
    const int error = errno;
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "fastoffload: could not size the shared segment '", name, "' to ", std::to_string(nbytes),
                " bytes: ", errno_text(error), ". /dev/shm may be too small (df -h /dev/shm; in Docker raise --shm-size), "
                "or enable with share_host_copy=False");
  }
  // Reserve the pages now: tmpfs grants ftruncate beyond its size and then kills the writer with SIGBUS.
  const int reserved = posix_fallocate(fd, 0, static_cast<off_t>(nbytes));
  if (reserved != 0 && reserved != EOPNOTSUPP && reserved != EINVAL) {
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "fastoffload: could not reserve ", std::to_string(nbytes), " bytes for the shared segment '",
                name, "': ", errno_text(reserved), ". /dev/shm is too small for the host copy (df -h /dev/shm; in "
                "Docker raise --shm-size), or enable with share_host_copy=False");
  }
  void* base = map_shared(fd, nbytes, /*writable=*/true);
  const int error = errno;
  close(fd);  // the mapping keeps the object alive
  if (base == nullptr) {
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "fastoffload: could not map the shared segment '", name, "' (", std::to_string(nbytes), " bytes): ",
                errno_text(error));
  }
  return std::unique_ptr<SharedSegment>(new SharedSegment(name, base, nbytes, /*owner=*/true));
}

std::unique_ptr<SharedSegment> SharedSegment::open(const std::string& name, size_t nbytes) {
  check_segment_name(name);
  const int fd = shm_open(name.c_str(), O_RDONLY, 0600);
  TORCH_CHECK(fd >= 0, "fastoffload: could not open the shared segment '", name, "': ", errno_text(errno),
              ". Its owner (the lowest rank of this host) must create it before the other ranks attach, and must "
              "not have unlinked it yet; every rank must call enable_layerwise_offload together");
  struct stat info {};
  if (fstat(fd, &info) == 0 && info.st_uid != geteuid()) {
    close(fd);
    TORCH_CHECK(false, "fastoffload: the shared segment '", name, "' belongs to uid ", std::to_string(info.st_uid),
                ", not to this process's uid ", std::to_string(geteuid()), ": it was not created by this job's owner. "
                "Run every rank of the job as the same user, or enable with share_host_copy=False");
  }
  if (fstat(fd, &info) != 0 || static_cast<size_t>(info.st_size) != nbytes) {
    const size_t found = static_cast<size_t>(info.st_size);
    close(fd);
    TORCH_CHECK(false, "fastoffload: the shared segment '", name, "' holds ", std::to_string(found),
                " bytes but this rank's block packs to ", std::to_string(nbytes),
                " bytes: the ranks of this host built different parameters (names, dtypes, shapes or strides) for "
                "this block. Build the same model on every rank, or enable with share_host_copy=False");
  }
  void* base = map_shared(fd, nbytes, /*writable=*/false);
  const int error = errno;
  close(fd);
  TORCH_CHECK(base != nullptr, "fastoffload: could not map the shared segment '", name, "' (", std::to_string(nbytes),
              " bytes): ", errno_text(error));
  return std::unique_ptr<SharedSegment>(new SharedSegment(name, base, nbytes, /*owner=*/false));
}

SharedSegment::~SharedSegment() {
  if (base_ != nullptr) munmap(base_, size_);
  unlink();
}

void SharedSegment::unlink() {
  if (!owner_ || !linked_) return;
  shm_unlink(name_.c_str());
  linked_ = false;
}

bool unlink_segment(const std::string& name) noexcept { return shm_unlink(name.c_str()) == 0; }

JobLock::JobLock(const std::string& job_token) {
  TORCH_CHECK(is_token(job_token) && job_token.size() <= 64,
              "fastoffload: a job token must be 1 to 64 lowercase hex digits, got '", job_token, "'");
  name_ = "/" + std::string(kSegmentPrefix) + job_token + kLockSuffix;
  const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "fastoffload: could not create the lock '", name_, "' of a shared host copy: ", errno_text(errno),
              ". Check that /dev/shm is mounted and writable, or enable with share_host_copy=False");
  // Between the create and the flock a sweep may take the fresh, unlocked file for a dead job's.
  if (flock(fd, LOCK_EX | LOCK_NB) != 0 || !still_linked(fd, std::string(kShmDir) + name_.substr(1))) {
    close(fd);
    TORCH_CHECK(false, "fastoffload: the lock '", name_, "' of a shared host copy was taken or removed by another "
                "process right after it was created; enable again");
  }
  fd_ = fd;
}

JobLock::~JobLock() { release(); }

void JobLock::release() noexcept {
  if (fd_ < 0) return;
  shm_unlink(name_.c_str());  // the name first: a sweep must never find it unlocked and ours
  close(fd_);
  fd_ = -1;
}

size_t sweep_stale_segments() noexcept {
  size_t removed = 0;
  try {
    const std::vector<std::string> entries = shm_entries();
    for (const std::string& entry : entries) {
      const std::string job = lock_job_of(entry);
      if (!job.empty()) removed += sweep_job(entry, job, entries);
    }
  } catch (...) {
    // Out of memory listing /dev/shm: a sweep is best effort, and a clean-up path must not throw.
  }
  return removed;
}

}  // namespace fastoffload
