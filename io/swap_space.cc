// Swap files, preflight and striping (see strata/swap_space.h).
#include "strata/swap_space.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
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
  uint32_t crc;  // CRC32C of every byte above
};
static_assert(sizeof(SwapHeader) < kSwapHeaderBytes);

double gib(uint64_t b) { return static_cast<double>(b) / double(1 << 30); }

std::string host_name() {
  char h[64] = {};
  gethostname(h, sizeof(h) - 1);
  return h;
}

}  // namespace

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
  const std::string host = host_name();
  for (size_t i = 0; i < options.paths.size(); ++i) {
    const std::string file = swap_file_path(options.paths[i], options.rank);
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
      const bool valid = n == static_cast<ssize_t>(sizeof(h)) &&
                         std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 &&
                         h.crc == crc32c(0, &h, offsetof(SwapHeader, crc));
      if (!valid)
        return invalid_argument(fmt::format(
            "swap file {} exists but is not a strata swap file (bad magic or header checksum); "
            "strata will not overwrite it: move or delete it, or use another nvme_path",
            file));
      const bool same_host = std::string(h.host, strnlen(h.host, sizeof(h.host))) == host;
      // Our own pid counts as alive: a second SwapSpace on the same path and rank in one
      // process must not truncate the first one's file.
      const bool alive = same_host && (::kill(h.pid, 0) == 0 || errno == EPERM);
      if (alive)
        return invalid_argument(fmt::format(
            "swap file {} is in use by running process {} (rank {}); stop it or give this run "
            "another nvme_path",
            file, h.pid, h.rank));
      log_info("swap space: reclaiming {} left by pid {} (rank {}, {:.2f} GiB), which is gone",
               file, h.pid, h.rank, gib(h.data_bytes));
      s->reclaimed_ = true;
    }
    // A new file exclusively; a reclaimed one without following links, and only if it is still
    // a regular file with one name (a hard link to another file would be truncated with it).
    fd = ::open(file.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC | (existed ? 0 : O_CREAT | O_EXCL),
                0600);
    if (fd < 0) return errno_status(errno, fmt::format("creating swap file {}", file));
    struct stat fst {};
    if (::fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode) || fst.st_nlink != 1) {
      ::close(fd);
      return invalid_argument(fmt::format(
          "swap file {} is not a regular file with a single name (hard link?); strata will not "
          "truncate it: remove it, or use another nvme_path",
          file));
    }
    s->file_paths_.push_back(file);  // from here on the destructor removes it
    if (::ftruncate(fd, 0) != 0 || (::ftruncate(fd, static_cast<off_t>(file_bytes)) != 0)) {
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
    char page[kSwapHeaderBytes] = {};
    SwapHeader h{};
    std::memcpy(h.magic, kMagic, sizeof(kMagic));
    h.version = kSwapFormatVersion;
    h.header_bytes = kSwapHeaderBytes;
    h.rank = options.rank;
    h.pid = getpid();
    h.path_index = static_cast<uint32_t>(i);
    h.path_count = static_cast<uint32_t>(options.paths.size());
    h.data_bytes = options.bytes_per_path;
    h.stripe_size = options.stripe_size;
    h.alignment = kStorageAlignment;
    h.created_unix = static_cast<uint64_t>(std::time(nullptr));
    std::strncpy(h.host, host.c_str(), sizeof(h.host) - 1);
    h.crc = crc32c(0, &h, offsetof(SwapHeader, crc));
    std::memcpy(page, &h, sizeof(h));
    if (::pwrite(fd, page, sizeof(page), 0) != static_cast<ssize_t>(sizeof(page)) ||
        ::fdatasync(fd) != 0) {
      const int err = errno;
      ::close(fd);
      return errno_status(err, fmt::format("writing swap file header of {}", file));
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
