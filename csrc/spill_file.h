// SpillFile: the compressed disk tier's own file, written once at enable and read every step.
//
// With compression on, the disk-tier blocks are encoded at enable and their compressed regions appended
// here, so the disk holds and reads the compressed bytes: fewer bytes per step than the checkpoint's
// raw tensors. Every region starts at a multiple of kAlignment and is padded to one, so the DiskReader
// can read it with O_DIRECT (block-aligned offsets and lengths). The file is created exclusively (a
// name nobody else uses), opened for reading by the DiskReader only once it is complete (the reader
// refuses a file whose size or mtime changed after it opened it), and removed by remove() or the
// destructor, so a detach leaves nothing behind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastoffload {

class SpillFile {
 public:
  static constexpr size_t kAlignment = 4096;

  // Creates `path` (O_CREAT | O_EXCL, mode 0600). Throws a c10::Error naming the path and the cause
  // (directory missing or not writable, name taken) and saying what to do.
  explicit SpillFile(std::string path);
  ~SpillFile();  // closes and removes the file
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  // Writes `nbytes` at the next aligned offset and returns that offset. Throws a c10::Error naming the
  // path and the cause (the disk full, a quota or file-size limit) and leaves the file as it was.
  uint64_t append(const uint8_t* data, size_t nbytes);
  // The file is complete: flushed to disk, its pages dropped from the page cache (each step then reads
  // from the disk, as the checkpoint's disk tier does), closed for writing. append() is refused after.
  void finish();
  // Removes the file (idempotent; never throws).
  void remove() noexcept;

  const std::string& path() const { return path_; }
  uint64_t bytes() const { return end_; }
  bool finished() const { return fd_ < 0; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t end_ = 0;
  bool linked_ = false;
};

}  // namespace fastoffload
