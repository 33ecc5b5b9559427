// Swap files, preflight and striping (see strata/swap_space.h).
#include "strata/swap_space.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "strata/checksum.h"
#include "strata/log.h"

namespace strata {
namespace {

constexpr char kMagic[8] = {'S', 'T', 'R', 'S', 'W', 'A', 'P', '1'};

// On-disk header, little-endian, at offset 0 of every swap file; padded to 4096 bytes.
struct SwapHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  int32_t rank;
  int32_t pid;
  uint32_t path_index;
  uint32_t path_count;
  uint64_t data_bytes;
  uint64_t stripe_size;
  uint64_t alignment;
  uint64_t created_unix;
  char host[64];
  uint32_t crc;  // CRC32C of every byte above (the whole version-1 header)
  // Version 2: which process, exactly, owns the file (a pid alone may be reused).
  uint32_t pad;
  uint64_t pid_start_ticks;  // the owner's start time, /proc/<pid>/stat field 22
  char boot_id[40];          // /proc/sys/kernel/random/boot_id when it was written
  uint32_t crc2;             // CRC32C of every byte above
};
static_assert(sizeof(SwapHeader) < kSwapHeaderBytes);
constexpr size_t kHeaderV1Bytes = offsetof(SwapHeader, crc) + sizeof(uint32_t);

double gib(uint64_t b) { return static_cast<double>(b) / double(1 << 30); }

std::string host_name() {
  char h[64] = {};
  gethostname(h, sizeof(h) - 1);
  return h;
}

std::string read_small_file(const std::string& path) {
  char buf[1024];
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  return n > 0 ? std::string(buf, size_t(n)) : "";
}

// Field 3 (state) and field 22 (start time in clock ticks since boot) of /proc/<pid>/stat;
// false when there is no such process.
bool proc_stat(int pid, char* state, uint64_t* start_ticks) {
  const std::string st = read_small_file(fmt::format("/proc/{}/stat", pid));
  const size_t paren = st.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 >= st.size()) return false;
  *state = st[paren + 2];
  // Fields after the name, from field 3 on: state is 3, start time is 22.
  size_t pos = paren + 2;
  for (int field = 3; field < 22; ++field) {
    pos = st.find(' ', pos);
    if (pos == std::string::npos) return false;
    ++pos;
  }
  *start_ticks = std::strtoull(st.c_str() + pos, nullptr, 10);
  return true;
}

// Writes a fresh header page for `file` to a temporary and moves it into place: link(2) for a
// new file (fails if one appeared meanwhile), rename(2) over a reclaimed one. A kill at any
// point leaves either no file, the old valid one, or the new valid one at `file` (and perhaps a
// temporary "<file>.tmp<pid>" that a later create removes).
Status place_swap_file(const std::string& file, const char* page, bool replace) {
  const std::string tmp = fmt::format("{}.tmp{}", file, ::getpid());
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return errno_status(errno, fmt::format("creating swap file {}", tmp));
  Status st;
  if (::pwrite(fd, page, kSwapHeaderBytes, 0) != static_cast<ssize_t>(kSwapHeaderBytes) ||
      ::fdatasync(fd) != 0) {
    st = errno_status(errno, fmt::format("writing swap file header of {}", tmp));
  }
  ::close(fd);
  if (st.is_ok() && replace && ::rename(tmp.c_str(), file.c_str()) != 0) {
    st = errno_status(errno, fmt::format("renaming {} to {}", tmp, file));
  }
  if (st.is_ok() && !replace && ::link(tmp.c_str(), file.c_str()) != 0) {
    st = errno_status(errno, fmt::format("creating swap file {}", file));
  }
  ::unlink(tmp.c_str());  // after rename: already gone
  return st;
}

// Removes "<file>.tmp<pid>" temporaries of creations killed midway (their pid is gone).
void remove_dead_temporaries(const std::string& dir, const std::string& file) {
  const std::string base = file.substr(file.rfind('/') + 1) + ".tmp";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(base, 0) != 0 || name.size() == base.size()) continue;
    const std::string digits = name.substr(base.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) continue;
    char state;
    uint64_t ticks;
    const int pid = std::atoi(digits.c_str());
    if (pid == ::getpid() || (proc_stat(pid, &state, &ticks) && state != 'Z')) continue;
    ::unlink((dir + "/" + name).c_str());
  }
  ::closedir(d);
}

}  // namespace

SwapOwner current_swap_owner() {
  SwapOwner o;
  o.host = host_name();
  o.boot_id = read_small_file("/proc/sys/kernel/random/boot_id");
  while (!o.boot_id.empty() && (o.boot_id.back() == '\n' || o.boot_id.back() == ' '))
    o.boot_id.pop_back();
  o.pid = ::getpid();
  char state;
  if (!proc_stat(o.pid, &state, &o.start_ticks)) o.start_ticks = 0;
  return o;
}

SwapOwnerState swap_owner_state(const SwapOwner& owner) {
  const SwapOwner me = current_swap_owner();
  if (owner.host != me.host) return SwapOwnerState::kUnknown;
  // Rebooted since: every process of then is gone.
  if (!owner.boot_id.empty() && !me.boot_id.empty() && owner.boot_id != me.boot_id)
    return SwapOwnerState::kGone;
  if (owner.pid <= 0) return SwapOwnerState::kGone;
  char state;
  uint64_t ticks = 0;
  if (!proc_stat(owner.pid, &state, &ticks)) {
    // No /proc (or no such pid): fall back to kill(pid, 0).
    return ::kill(owner.pid, 0) == 0 || errno == EPERM ? SwapOwnerState::kRunning
                                                       : SwapOwnerState::kGone;
  }
  if (state == 'Z' || state == 'X') return SwapOwnerState::kGone;  // exited, not yet reaped
  // The pid was reused by a later process.
  if (owner.start_ticks != 0 && ticks != owner.start_ticks) return SwapOwnerState::kGone;
  return SwapOwnerState::kRunning;
}

std::string swap_file_path(const std::string& dir, int rank) {
  return fmt::format("{}/strata-swap-r{}.bin", dir, rank);
}

Status check_nvme_path(const std::string& path, uint64_t need_bytes, bool need_direct,
                       const std::string& reusable_file) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT)
      return not_found(
          fmt::format("nvme_path {} does not exist; create it (mkdir -p {}) or point "
                      "zero_optimization.offload_*.nvme_path at a directory on an NVMe drive",
                      path, path));
    return errno_status(err, fmt::format("nvme_path {}: cannot stat it", path));
  }
  if (!S_ISDIR(st.st_mode))
    return invalid_argument(fmt::format(
        "nvme_path {} is not a directory; nvme_path must name directories (strata creates its "
        "swap files inside them)",
        path));
  // Writable, and O_DIRECT: create a probe file the way the engine will open swap files.
  // Never through a link planted at the probe's name: O_EXCL | O_NOFOLLOW, after removing it.
  const std::string probe = fmt::format("{}/.strata-probe-{}", path, getpid());
  ::unlink(probe.c_str());
  int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    return Status(err == ENOSPC ? StatusCode::kNoSpace : StatusCode::kInvalidArgument,
                  fmt::format("nvme_path {} is not writable ({}); fix its permissions "
                              "(chown/chmod), remount it read-write, or pick another path",
                              path, std::strerror(err)));
  }
  ::close(fd);
  if (need_direct) {
    fd = ::open(probe.c_str(), O_RDWR | O_DIRECT | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      ::unlink(probe.c_str());
      return unavailable(fmt::format(
          "nvme_path {}: its file system refuses O_DIRECT ({}); put nvme_path on a local "
          "ext4/xfs NVMe file system, or set aio.backend to \"posix\" (buffered, slower)",
          path, std::strerror(err)));
    }
    ::close(fd);
  }
  ::unlink(probe.c_str());
  struct statvfs vfs {};
  if (::statvfs(path.c_str(), &vfs) != 0)
    return errno_status(errno, fmt::format("nvme_path {}: statvfs", path));
  uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  struct stat old {};
  if (!reusable_file.empty() && ::stat(reusable_file.c_str(), &old) == 0)
    avail += static_cast<uint64_t>(old.st_blocks) * 512;
  if (avail < need_bytes)
    return no_space(fmt::format(
        "nvme_path {} needs {:.2f} GiB, has {:.2f} GiB free; free space there, offload less, or "
        "add another directory on another drive to nvme_path",
        path, gib(need_bytes), gib(avail)));
  return Status::ok();
}

Result<bool> create_nvme_path(const std::string& path) {
  if (path.empty()) return invalid_argument("nvme_path is empty; name a directory");
  std::vector<std::string> parts;
  for (size_t i = 0; i < path.size();) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    if (j > i) parts.push_back(path.substr(i, j - i));
    i = j + 1;
  }
  int fd = ::open(path[0] == '/' ? "/" : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, fmt::format("nvme_path {}: opening its root", path));
  bool created = false;
  std::string sofar = path[0] == '/' ? "" : ".";
  for (const std::string& part : parts) {
    sofar += "/" + part;
    // Before the first directory strata makes: links are followed (the user's); after: never.
    const int follow = created ? O_NOFOLLOW : 0;
    int next = ::openat(fd, part.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | follow);
    if (next < 0 && errno == ENOENT) {
      if (::mkdirat(fd, part.c_str(), 0755) == 0) {
        created = true;
      } else if (errno != EEXIST) {  // EEXIST: another rank made it (checked below)
        const int err = errno;
        ::close(fd);
        return errno_status(
            err, fmt::format("nvme_path {}: cannot create {} ({}); create it yourself or point "
                             "nvme_path at a directory you can write",
                             path, sofar, std::strerror(err)));
      }
      next = ::openat(fd, part.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    }
    const int err = errno;
    ::close(fd);
    if (next < 0) {
      struct stat st {};
      const bool link =
          ::fstatat(AT_FDCWD, sofar.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode);
      if (link) {
        return invalid_argument(fmt::format(
            "nvme_path {}: {} is a link to a missing or non-directory target; strata does not "
            "create directories through a link it did not make: create the target or fix the "
            "link",
            path, sofar));
      }
      if (err == ENOTDIR) {
        return invalid_argument(fmt::format(
            "nvme_path {}: {} is a file, not a directory; nvme_path must name a directory "
            "(move the file or pick another path)",
            path, sofar));
      }
      return errno_status(err, fmt::format("nvme_path {}: cannot open {}", path, sofar));
    }
    fd = next;
  }
  ::close(fd);
  return created;
}

Status check_nvme_config(const Config& config, uint64_t bytes_per_path) {
  const bool direct = config.aio.backend != "posix";
  const std::pair<const char*, const OffloadConfig*> offloads[] = {
      {"zero_optimization.offload_param", &config.zero.offload_param},
      {"zero_optimization.offload_optimizer", &config.zero.offload_optimizer}};
  for (const auto& [key, off] : offloads) {
    if (off->device != "nvme") continue;
    if (off->nvme_path.empty())
      return invalid_argument(fmt::format(
          "{}.device is \"nvme\" but {}.nvme_path is empty; set it to a directory (or a list "
          "of directories, one per drive) on NVMe",
          key, key));
    for (const std::string& p : off->nvme_path)
      STRATA_RETURN_IF_ERROR(check_nvme_path(p, bytes_per_path + kSwapHeaderBytes, direct),
                             fmt::format("{}.nvme_path", key));
  }
  return Status::ok();
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::create(Storage* storage, const SwapOptions& options) {
  if (options.paths.empty())
    return invalid_argument("swap space: nvme_path is empty; give at least one directory");
  if (options.bytes_per_path == 0 || options.bytes_per_path % kStorageAlignment != 0)
    return invalid_argument(
        fmt::format("swap space: bytes_per_path {} must be a positive "
                    "multiple of {}",
                    options.bytes_per_path, kStorageAlignment));
  if (options.stripe_size == 0 || options.stripe_size % kStorageAlignment != 0)
    return invalid_argument(
        fmt::format("swap space: stripe_size {} must be a positive multiple "
                    "of {}",
                    options.stripe_size, kStorageAlignment));
  const bool direct = storage->capabilities().direct_io;
  const uint64_t file_bytes = kSwapHeaderBytes + options.bytes_per_path;
  // Preflight every path before writing anything.
  for (const std::string& p : options.paths)
    STRATA_RETURN_IF_ERROR(check_nvme_path(p, file_bytes, direct, swap_file_path(p, options.rank)),
                           "swap space preflight");

  std::unique_ptr<SwapSpace> s(new SwapSpace());
  s->storage_ = storage;
  s->options_ = options;
  const SwapOwner me = current_swap_owner();
  for (size_t i = 0; i < options.paths.size(); ++i) {
    const std::string file = swap_file_path(options.paths[i], options.rank);
    remove_dead_temporaries(options.paths[i], file);
    // A file left by an earlier run: reclaim it if its owner is gone. A link at the name is
    // refused, never followed (strata would create or truncate whatever it points to).
    struct stat lst {};
    if (::lstat(file.c_str(), &lst) == 0 && !S_ISREG(lst.st_mode)) {
      return invalid_argument(fmt::format(
          "swap file {} exists and is {}; strata creates swap files only as regular files of "
          "its own and will not write through it: remove it, or use another nvme_path",
          file, S_ISLNK(lst.st_mode) ? "a symbolic link" : "not a regular file"));
    }
    int fd = ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    const bool existed = fd >= 0;
    if (fd >= 0) {
      SwapHeader h{};
      const ssize_t n = ::pread(fd, &h, sizeof(h), 0);
      ::close(fd);
      const bool v1 = n >= static_cast<ssize_t>(kHeaderV1Bytes) &&
                      std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 &&
                      h.crc == crc32c(0, &h, offsetof(SwapHeader, crc));
      const bool valid =
          v1 && (h.version < 2 || (n == static_cast<ssize_t>(sizeof(h)) &&
                                   h.crc2 == crc32c(0, &h, offsetof(SwapHeader, crc2))));
      if (!valid)
        return invalid_argument(fmt::format(
            "swap file {} exists but is not a strata swap file (bad magic or header checksum); "
            "strata will not overwrite it: move or delete it, or use another nvme_path",
            file));
      SwapOwner owner;
      owner.host = std::string(h.host, strnlen(h.host, sizeof(h.host)));
      owner.pid = h.pid;
      if (h.version >= 2) {
        owner.start_ticks = h.pid_start_ticks;
        owner.boot_id = std::string(h.boot_id, strnlen(h.boot_id, sizeof(h.boot_id)));
      }
      // Our own pid counts as running: a second SwapSpace on the same path and rank in one
      // process must not truncate the first one's file.
      switch (swap_owner_state(owner)) {
        case SwapOwnerState::kRunning:
          return invalid_argument(fmt::format(
              "swap file {} is in use by running process {} (rank {}); stop it or give this run "
              "another nvme_path",
              file, h.pid, h.rank));
        case SwapOwnerState::kUnknown:
          return invalid_argument(fmt::format(
              "swap file {} belongs to process {} (rank {}) on host {}; from {} strata cannot "
              "tell whether it still runs: if it does not, delete the file, else give this run "
              "another nvme_path",
              file, h.pid, h.rank, owner.host, me.host));
        case SwapOwnerState::kGone:
          break;
      }
      log_info("swap space: reclaiming {} left by pid {} (rank {}, {:.2f} GiB), which is gone",
               file, h.pid, h.rank, gib(h.data_bytes));
      s->reclaimed_ = true;
    }
    // The header goes in first (a temporary moved into place), so a kill at any point never
    // leaves a file at this name that a later run cannot recognise and reclaim.
    char page[kSwapHeaderBytes] = {};
    SwapHeader h{};
    std::memcpy(h.magic, kMagic, sizeof(kMagic));
    h.version = kSwapFormatVersion;
    h.header_bytes = kSwapHeaderBytes;
    h.rank = options.rank;
    h.pid = me.pid;
    h.path_index = static_cast<uint32_t>(i);
    h.path_count = static_cast<uint32_t>(options.paths.size());
    h.data_bytes = options.bytes_per_path;
    h.stripe_size = options.stripe_size;
    h.alignment = kStorageAlignment;
    h.created_unix = static_cast<uint64_t>(std::time(nullptr));
    std::strncpy(h.host, me.host.c_str(), sizeof(h.host) - 1);
    h.crc = crc32c(0, &h, offsetof(SwapHeader, crc));
    h.pid_start_ticks = me.start_ticks;
    std::strncpy(h.boot_id, me.boot_id.c_str(), sizeof(h.boot_id) - 1);
    h.crc2 = crc32c(0, &h, offsetof(SwapHeader, crc2));
    std::memcpy(page, &h, sizeof(h));
    STRATA_RETURN_IF_ERROR(place_swap_file(file, page, /*replace=*/existed), "");
    s->file_paths_.push_back(file);  // from here on the destructor removes it
    // Only a regular file with one name (a hard link to another file would be sized with it).
    fd = ::open(file.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return errno_status(errno, fmt::format("opening swap file {}", file));
    struct stat fst {};
    if (::fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode) || fst.st_nlink != 1) {
      ::close(fd);
      return invalid_argument(fmt::format(
          "swap file {} is not a regular file with a single name (hard link?); strata will not "
          "size it: remove it, or use another nvme_path",
          file));
    }
    if (::ftruncate(fd, static_cast<off_t>(file_bytes)) != 0) {
      const int err = errno;
      ::close(fd);
      return errno_status(err, fmt::format("sizing swap file {} to {} bytes", file, file_bytes));
    }
    int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(file_bytes));
    if (rc == EOPNOTSUPP || rc == EINVAL) {
      log_warn("swap space: {} cannot be preallocated ({}); space is claimed as it is written",
               file, std::strerror(rc));
    } else if (rc != 0) {
      ::close(fd);
      return errno_status(
          rc, fmt::format("preallocating swap file {} ({:.2f} GiB)", file, gib(file_bytes)));
    }
    ::close(fd);
    STRATA_ASSIGN_OR_RETURN(FileId id, storage->open(file), "opening swap file");
    s->files_.push_back(id);
    s->allocs_.push_back(
        std::make_unique<ExtentAllocator>(options.bytes_per_path, kStorageAlignment, file));
  }
  return s;
}

SwapSpace::~SwapSpace() {
  for (FileId id : files_) storage_->close(id);
  for (const std::string& f : file_paths_) ::unlink(f.c_str());
}

Result<SwapExtent> SwapSpace::allocate(uint64_t bytes) {
  if (bytes == 0) return invalid_argument("swap space: allocate(0)");
  std::lock_guard lock(mu_);
  SwapExtent e;
  e.bytes = (bytes + kStorageAlignment - 1) & ~(kStorageAlignment - 1);
  const size_t n = allocs_.size();
  if (e.bytes <= options_.stripe_size || n == 1) {
    size_t best = 0;
    for (size_t i = 1; i < n; ++i)
      if (allocs_[i]->free_bytes() > allocs_[best]->free_bytes()) best = i;
    STRATA_ASSIGN_OR_RETURN(uint64_t off, allocs_[best]->allocate(e.bytes), "swap space");
    e.parts.push_back({static_cast<int>(best), off, e.bytes});
    return e;
  }
  // Striped: unit u goes to path u % n at (u / n) * stripe within that path's part.
  e.striped = true;
  const uint64_t stripe = options_.stripe_size;
  const uint64_t units = (e.bytes + stripe - 1) / stripe;
  for (size_t p = 0; p < n && p < units; ++p) {
    const uint64_t mine = (units - p + n - 1) / n;  // units u = p, p+n, ... < units
    auto off = allocs_[p]->allocate(mine * stripe);
    if (!off.is_ok()) {
      for (const auto& part : e.parts) allocs_[part.path]->free(part.offset, part.length);
      return off.status().with_context("swap space: striped extent");
    }
    e.parts.push_back({static_cast<int>(p), *off, mine * stripe});
  }
  return e;
}

void SwapSpace::free(const SwapExtent& extent) {
  std::lock_guard lock(mu_);
  for (const auto& part : extent.parts) allocs_[part.path]->free(part.offset, part.length);
}

size_t SwapSpace::requests(const SwapExtent& extent, IoOp op, void* buffer, uint64_t cookie,
                           std::vector<IoRequest>* out) const {
  char* buf = static_cast<char*>(buffer);
  if (!extent.striped) {
    const auto& part = extent.parts.front();
    out->push_back(
        {op, files_[part.path], kSwapHeaderBytes + part.offset, extent.bytes, buf, cookie});
    return 1;
  }
  const uint64_t stripe = options_.stripe_size;
  const uint64_t n = extent.parts.size();
  size_t added = 0;
  for (uint64_t u = 0, pos = 0; pos < extent.bytes; ++u, pos += stripe) {
    const auto& part = extent.parts[u % n];
    const uint64_t len = std::min(stripe, extent.bytes - pos);
    out->push_back({op, files_[part.path], kSwapHeaderBytes + part.offset + (u / n) * stripe, len,
                    buf + pos, cookie});
    ++added;
  }
  return added;
}

Status SwapSpace::write(const SwapExtent& extent, const void* buffer) {
  std::vector<IoRequest> reqs;
  requests(extent, IoOp::kWrite, const_cast<void*>(buffer), 0, &reqs);
  return storage_->run(reqs);
}

Status SwapSpace::read(const SwapExtent& extent, void* buffer) {
  std::vector<IoRequest> reqs;
  requests(extent, IoOp::kRead, buffer, 0, &reqs);
  return storage_->run(reqs);
}

uint64_t SwapSpace::free_bytes() const {
  std::lock_guard lock(mu_);
  uint64_t f = 0;
  for (const auto& a : allocs_) f += a->free_bytes();
  return f;
}

}  // namespace strata
