#include "spill_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

namespace fastoffload {
namespace {

bool is_full(int error) { return error == ENOSPC || error == EDQUOT || error == EFBIG; }

uint64_t align_up(uint64_t value) { return (value + SpillFile::kAlignment - 1) / SpillFile::kAlignment * SpillFile::kAlignment; }

}  // namespace

SpillFile::SpillFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  const int error = errno;
  TORCH_CHECK(fd_ >= 0, "fastoffload: cannot create the spill file '", path_, "' of the compressed disk tier: ",
              std::strerror(error), "; pass DiskOptions(spill_dir=...) a writable directory with room for the "
              "compressed disk-tier blocks, or compress=False");
  linked_ = true;
}

SpillFile::~SpillFile() { remove(); }

uint64_t SpillFile::append(const uint8_t* data, size_t nbytes) {
  TORCH_CHECK(fd_ >= 0, "fastoffload: internal error: the spill file '", path_, "' was already finished");
  const uint64_t offset = end_;
  const uint64_t padded = align_up(nbytes);
  // The padding is written too: O_DIRECT reads whole aligned blocks, which must exist in the file.
  std::vector<uint8_t> tail;
  size_t done = 0;
  while (done < padded) {
    const uint8_t* source = data + done;
    size_t length = nbytes > done ? nbytes - done : 0;
    if (length == 0) {
      tail.assign(padded - done, 0);
      source = tail.data();
      length = tail.size();
    }
    const ssize_t wrote = ::pwrite(fd_, source, length, static_cast<off_t>(offset + done));
    if (wrote < 0 && errno == EINTR) continue;
    const int error = wrote < 0 ? errno : ENOSPC;  // a short write of 0 bytes: no room left
    if (wrote <= 0) {
      // Keep the file as it was before this block: later blocks are not written at all.
      (void)::ftruncate(fd_, static_cast<off_t>(offset));
      TORCH_CHECK(false, "fastoffload: writing ", std::to_string(padded), " bytes to the spill file '", path_,
                  "' of the compressed disk tier failed: ", std::strerror(error),
                  is_full(error) ? " (the disk is full or a limit was reached); free space there, or pass "
                                   "DiskOptions(spill_dir=...) a directory on a disk with room, or compress=False"
                                 : "; pass DiskOptions(spill_dir=...) another directory, or compress=False");
    }
    done += static_cast<size_t>(wrote);
  }
  end_ = offset + padded;
  return offset;
}

void SpillFile::finish() {
  if (fd_ < 0) return;
  const int synced = ::fdatasync(fd_);
  const int error = errno;
  if (synced == 0) (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd_);
  fd_ = -1;
  TORCH_CHECK(synced == 0, "fastoffload: flushing the spill file '", path_, "' of the compressed disk tier failed: ",
              std::strerror(error), is_full(error) ? " (the disk is full); free space there, or pass "
                                                     "DiskOptions(spill_dir=...) a directory on a disk with room"
                                                   : "");
}

void SpillFile::remove() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (linked_) {
    ::unlink(path_.c_str());
    linked_ = false;
  }
}

}  // namespace fastoffload
