#include "src/base/safe_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace strata {

Result<int> create_temp_file(const std::string& path, mode_t mode) {
  constexpr int kFlags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int fd = ::open(path.c_str(), kFlags, mode);
  if (fd < 0 && errno == EEXIST) {
    // A temporary of a killed run, or a link planted here: remove the entry (never its target).
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return errno_status(errno, fmt::format("removing the stale temporary {}", path));
    }
    fd = ::open(path.c_str(), kFlags, mode);
  }
  if (fd < 0) return errno_status(errno, fmt::format("creating {}", path));
  return fd;
}

Result<int> open_for_writing(const std::string& path, bool append, mode_t mode) {
  const int flags = O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC | (append ? O_APPEND : O_TRUNC);
  int fd = ::open(path.c_str(), flags, mode);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) {
      return invalid_argument(fmt::format(
          "{} is a symbolic link; strata does not write through links: give the path it points "
          "to, or remove the link",
          path));
    }
    return errno_status(err, fmt::format("opening {} for writing", path));
  }
  return fd;
}

Status write_fully(int fd, const void* data, size_t n, const std::string& path, uint64_t* offset) {
  const char* p = static_cast<const char*>(data);
  const size_t total = n;
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == ENOSPC || err == EDQUOT) {
        return errno_status(err, fmt::format("writing {} at offset {}: {} of {} bytes written; "
                                             "free space on its file system",
                                             path, *offset, total - n, total));
      }
      return errno_status(err, fmt::format("writing {} at offset {}", path, *offset));
    }
    p += w;
    n -= size_t(w);
    *offset += size_t(w);
  }
  return Status::ok();
}

Status fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, fmt::format("opening directory {}", dir));
  Status st;
  if (::fsync(fd) != 0) st = errno_status(errno, fmt::format("fsync of directory {}", dir));
  ::close(fd);
  return st;
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

Status write_file_atomically(const std::string& path, const std::string& text, mode_t mode) {
  const std::string tmp = path + ".tmp";
  STRATA_ASSIGN_OR_RETURN(int fd, create_temp_file(tmp, mode), "");
  uint64_t off = 0;
  Status st = write_fully(fd, text.data(), text.size(), tmp, &off);
  if (st.is_ok() && ::fsync(fd) != 0) st = errno_status(errno, fmt::format("fsync {}", tmp));
  if (::close(fd) != 0 && st.is_ok()) st = errno_status(errno, fmt::format("close {}", tmp));
  if (st.is_ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    st = errno_status(errno, fmt::format("renaming {} to {}", tmp, path));
  }
  if (!st.is_ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  return fsync_directory(directory_of(path));
}

}  // namespace strata
