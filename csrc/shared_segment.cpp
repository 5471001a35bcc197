#include "shared_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

namespace fastoffload {
namespace {

std::string errno_text(int error) { return std::string(std::strerror(error)) + " (errno " + std::to_string(error) + ")"; }

void* map_shared(int fd, size_t nbytes) {
  void* base = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return base == MAP_FAILED ? nullptr : base;
}

// The owner pid in "fastoffload-<pid>-...", or -1 when the entry is not ours.
long owner_pid_of(const char* entry) {
  const size_t prefix = std::strlen(kSegmentPrefix);
  if (std::strncmp(entry, kSegmentPrefix, prefix) != 0) return -1;
  char* end = nullptr;
  const long pid = std::strtol(entry + prefix, &end, 10);
  if (end == entry + prefix || *end != '-' || pid <= 0) return -1;
  return pid;
}

}  // namespace

void check_segment_name(const std::string& name) {
  TORCH_CHECK(name.size() > 1 && name.size() <= 200 && name[0] == '/' && name.find('/', 1) == std::string::npos &&
                  name.compare(1, std::strlen(kSegmentPrefix), kSegmentPrefix) == 0,
              "fastoffload: a shared segment name must look like '/fastoffload-<pid>-<hex>-<index>' (one leading '/', "
              "at most 200 characters), got '", name, "'");
}

std::unique_ptr<SharedSegment> SharedSegment::create(const std::string& name, size_t nbytes) {
  check_segment_name(name);
  TORCH_CHECK(nbytes > 0, "fastoffload: internal error: a shared segment must hold at least one byte");
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "fastoffload: could not create the shared segment '", name, "': ", errno_text(errno),
              (errno == EEXIST ? ". Another offload owns that name; enable again (names are random per enable)"
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
  void* base = map_shared(fd, nbytes);
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
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "fastoffload: could not open the shared segment '", name, "': ", errno_text(errno),
              ". Its owner (the lowest rank of this host) must create it before the other ranks attach, and must "
              "not have unlinked it yet; every rank must call enable_layerwise_offload together");
  struct stat info {};
  if (fstat(fd, &info) != 0 || static_cast<size_t>(info.st_size) != nbytes) {
    const size_t found = static_cast<size_t>(info.st_size);
    close(fd);
    TORCH_CHECK(false, "fastoffload: the shared segment '", name, "' holds ", std::to_string(found),
                " bytes but this rank's block packs to ", std::to_string(nbytes),
                " bytes: the ranks of this host built different parameters (names, dtypes, shapes or strides) for "
                "this block. Build the same model on every rank, or enable with share_host_copy=False");
  }
  void* base = map_shared(fd, nbytes);
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

size_t sweep_stale_segments() noexcept {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  size_t removed = 0;
  while (const dirent* entry = readdir(dir)) {
    const long pid = owner_pid_of(entry->d_name);
    if (pid < 0) continue;
    // EPERM: alive, owned by someone else. Only ESRCH says the owner is gone.
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    if (shm_unlink((std::string("/") + entry->d_name).c_str()) == 0) removed += 1;
  }
  closedir(dir);
  return removed;
}

}  // namespace fastoffload
