// Shared by the libFuzzer targets: the input as a file the readers can open by path.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::fuzz {

// An anonymous in-memory file holding `data`; path() names it (/proc/self/fd/N).
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = ::memfd_create("strata-fuzz", MFD_CLOEXEC);
    size_t off = 0;
    while (fd_ >= 0 && off < size) {
      const ssize_t w = ::write(fd_, data + off, size - off);
      if (w <= 0) break;
      off += size_t(w);
    }
  }
  ~MemFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_ = -1;
};

}  // namespace strata::fuzz
