#include "src/base/safe_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>

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

namespace {

// The names in directory `path` (without "." and ".."); kIo naming it when it cannot be read.
Result<std::vector<std::string>> list_directory(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (!d) return errno_status(errno, fmt::format("reading the directory {}", path));
  std::vector<std::string> out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  ::closedir(d);
  return out;
}

}  // namespace

Status write_directory_atomically(const std::string& dir, const std::vector<std::string>& replaced,
                                  const std::function<Status(const std::string& tmp)>& fill) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path target = fs::path(dir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();
  if (fs::is_symlink(target, ec)) {
    target = fs::canonical(target, ec);
    if (ec) return errno_status(ec.value(), fmt::format("{}: following the link", dir));
  }
  target = fs::absolute(target, ec);
  const fs::path parent = target.parent_path();
  const std::string name = target.filename().string();
  fs::create_directories(parent, ec);
  if (ec) return errno_status(ec.value(), fmt::format("{}: creating {}", dir, parent.string()));
  // A killed writer's directories: removed once their pid is gone.
  const std::string prefix = "." + name + ".strata-";
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> siblings, list_directory(parent.string()), dir);
  for (const std::string& s : siblings) {
    if (s.rfind(prefix, 0) != 0) continue;
    const size_t dash = s.rfind('-');
    const long pid = std::strtol(s.c_str() + dash + 1, nullptr, 10);
    if (pid > 0 && pid != ::getpid() && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) {
      fs::remove_all(parent / s, ec);
    }
  }
  const std::string pid = std::to_string(::getpid());
  const fs::path tmp = parent / (prefix + "new-" + pid);
  const fs::path old = parent / (prefix + "old-" + pid);
  fs::remove_all(tmp, ec);
  if (::mkdir(tmp.c_str(), 0755) != 0) {
    return errno_status(errno, fmt::format("{}: creating {}", dir, tmp.string()));
  }
  auto fail = [&](Status st) {
    fs::remove_all(tmp, ec);
    return st;
  };
  struct stat st {};
  const bool exists = ::lstat(target.c_str(), &st) == 0;
  if (exists && !S_ISDIR(st.st_mode)) {
    return fail(invalid_argument(fmt::format("{} is not a directory", target.string())));
  }
  std::vector<std::string> subdirs;
  if (exists) {
    STRATA_ASSIGN_OR_RETURN(std::vector<std::string> names, list_directory(target.string()), dir);
    for (const std::string& n : names) {
      if (std::find(replaced.begin(), replaced.end(), n) != replaced.end()) continue;
      const fs::path from = target / n;
      struct stat es {};
      if (::lstat(from.c_str(), &es) == 0 && S_ISDIR(es.st_mode)) {
        subdirs.push_back(n);
      } else if (::link(from.c_str(), (tmp / n).c_str()) != 0) {  // a link itself, not followed
        return fail(errno_status(
            errno, fmt::format("{}: keeping {} beside the new files", dir, from.string())));
      }
    }
  }
  if (Status s = fill(tmp.string()); !s.is_ok()) return fail(s);
  if (Status s = fsync_directory(tmp.string()); !s.is_ok()) return fail(s);
  if (!exists) {
    if (::rename(tmp.c_str(), target.c_str()) != 0) {
      return fail(errno_status(errno, fmt::format("{}: moving the new directory into place", dir)));
    }
    return fsync_directory(parent.string());
  }
  for (const std::string& n : subdirs) ::rename((target / n).c_str(), (tmp / n).c_str());
  if (::syscall(SYS_renameat2, AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(),
                2 /* RENAME_EXCHANGE */) == 0) {
    fs::remove_all(tmp, ec);  // the old directory, now at the temporary's name
    return fsync_directory(parent.string());
  }
  // No exchange on this file system: the old directory aside, the new one in.
  if (::rename(target.c_str(), old.c_str()) != 0 || ::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    if (!fs::exists(target, ec)) ::rename(old.c_str(), target.c_str());
    for (const std::string& n : subdirs) ::rename((tmp / n).c_str(), (target / n).c_str());
    return fail(errno_status(err, fmt::format("{}: moving the new directory into place", dir)));
  }
  fs::remove_all(old, ec);
  return fsync_directory(parent.string());
}

Status expect_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return Status::ok();
  return invalid_argument(fmt::format(
      "{} '{}' is {}; give a regular file", what, path,
      S_ISDIR(st.st_mode) ? "a directory" : "not a regular file (a device, a pipe or a socket)"));
}

}  // namespace strata
