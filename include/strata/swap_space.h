// SwapSpace: the NVMe tier's backing store. One preallocated swap file per configured path,
// an extent allocator per file, and striping of large extents over all paths.
//
// Files. For rank R each path P gets `P/strata-swap-r<R>.bin`: a 4096-byte header, then the
// data area of `bytes_per_path` bytes, preallocated with fallocate so a full disk is found at
// start, not mid-run. The header (little-endian, see SwapHeader in swap_space.cc) holds the
// magic "STRSWAP1", format version 2, the owner rank and pid, host name, this file's index and
// the path count, the data size, stripe size and alignment, and a CRC32C of that (version 1
// ends there); then the owner's start time (/proc/<pid>/stat) and the boot id, and a CRC32C of
// the whole. The header is written to "<file>.tmp<pid>" and moved into place (link, or rename
// over a reclaimed file) before the file is sized, so a kill at any moment leaves a file a
// later run recognises. Swap files are never created or opened through a symbolic link, and
// only a regular file with a single name is reclaimed.
//
// Lifetime. The files are removed when the SwapSpace is destroyed (clean exit). After a crash
// the next create() on the same path and rank finds the file: if its owner is gone (see
// swap_owner_state: a pid reused by a later process or a zombie counts as gone) it is
// reclaimed and reused, with a log line; if the owner runs the create fails naming the pid; if
// it was written on another host the create fails naming that host (strata cannot tell from
// here); a file with the name but no valid header is left alone and reported, never deleted.
//
// Preflight. Before writing anything create() checks every path: it exists, is a directory, is
// writable, accepts O_DIRECT (when the Storage uses it) and has room for the swap file. Each
// failure is a Status naming the path and the fix, e.g.
//   "nvme_path /mnt/nvme0 needs 64.00 GiB, has 12.50 GiB free; free space there, lower what is
//    offloaded, or add another path to nvme_path".
// check_nvme_path() runs the same checks alone (for a plan/preflight before building engines).
//
// Extents. allocate(bytes) rounds up to the alignment. An extent no larger than stripe_size
// lives in one file (the one with the most free space); a larger one is cut into stripe_size
// units dealt round-robin over all paths, so a read or write of it runs on every drive at once.
// Each path's units of one extent are contiguous in that file. requests() turns an extent plus
// a host buffer of extent.bytes bytes into Storage requests (one per stripe unit, or one for an
// unstriped extent).
//
// Thread safety: allocate/free are internally locked; read/write/requests use the Storage,
// which is single-threaded (see strata/storage.h). The Storage must outlive the SwapSpace.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/extent_allocator.h"
#include "strata/status.h"
#include "strata/storage.h"

namespace strata {

inline constexpr uint32_t kSwapFormatVersion = 2;
inline constexpr uint64_t kSwapHeaderBytes = 4096;

struct SwapOptions {
  std::vector<std::string> paths;            // directories (nvme_path); at least one
  int rank = 0;                              // owner rank: names the file
  uint64_t bytes_per_path = 0;               // data area of each swap file
  uint64_t stripe_size = uint64_t{4} << 20;  // multiple of 4096
};

// One logical extent: `bytes` (aligned) spread over parts, each a contiguous range of one file.
struct SwapExtent {
  struct Part {
    int path = 0;         // index into SwapOptions::paths
    uint64_t offset = 0;  // within that file's data area
    uint64_t length = 0;
  };
  uint64_t bytes = 0;
  bool striped = false;
  std::vector<Part> parts;  // one per path used
};

// Preflight for one path: exists, is a directory, is writable, supports O_DIRECT (if
// `need_direct`), and has `need_bytes` free (plus what an existing swap file `reusable_file`
// already holds, if given). The Status names the path and the fix.
Status check_nvme_path(const std::string& path, uint64_t need_bytes, bool need_direct,
                       const std::string& reusable_file = "");

// Creates the directory `path` and any missing parents, as DeepSpeed creates its swap folder
// (mode 0755). Existing parts of the path are followed as `mkdir -p` follows them (a mount
// point may be a link); from the first part it creates on, each directory is made with mkdirat
// and entered with O_NOFOLLOW, so nothing is created through a link strata did not make: a
// dangling link, a file or a link planted at a name it creates is an error naming the part and
// the fix. Another rank creating the same path at once is fine. Returns whether it created
// anything.
Result<bool> create_nvme_path(const std::string& path);

// Start-up preflight from the config: for each of zero_optimization.offload_param and
// offload_optimizer whose device is "nvme", checks every nvme_path (as check_nvme_path, O_DIRECT
// required unless aio.backend is "posix") for `bytes_per_path` free. An nvme offload with an
// empty nvme_path is an error too. The Status names the config key, the path and the fix.
Status check_nvme_config(const Config& config, uint64_t bytes_per_path);

// Who created a swap file, as its header records it.
struct SwapOwner {
  std::string host;
  std::string boot_id;  // "" unknown (version-1 header)
  int pid = 0;
  uint64_t start_ticks = 0;  // the process's start time in clock ticks; 0 unknown
};
// This process.
SwapOwner current_swap_owner();
enum class SwapOwnerState {
  kGone,     // no such process here (exited, a zombie, its pid reused, or the host rebooted)
  kRunning,  // that very process runs on this host (this process included)
  kUnknown,  // written on another host: cannot tell
};
SwapOwnerState swap_owner_state(const SwapOwner& owner);

class SwapSpace {
 public:
  static Result<std::unique_ptr<SwapSpace>> create(Storage* storage, const SwapOptions& options);
  ~SwapSpace();  // closes and removes the swap files

  Result<SwapExtent> allocate(uint64_t bytes);
  void free(const SwapExtent& extent);

  // Appends the requests that move the whole extent between the files and `buffer` (which
  // holds extent.bytes bytes, 4096-aligned), all with `cookie`. Returns how many were added.
  size_t requests(const SwapExtent& extent, IoOp op, void* buffer, uint64_t cookie,
                  std::vector<IoRequest>* out) const;
  // Synchronous helpers over requests() + Storage::run().
  Status write(const SwapExtent& extent, const void* buffer);
  Status read(const SwapExtent& extent, void* buffer);

  const std::vector<std::string>& files() const { return file_paths_; }
  uint64_t free_bytes() const;
  uint64_t capacity() const { return options_.bytes_per_path * options_.paths.size(); }
  // Whether create() reclaimed a swap file left behind by a crashed run.
  bool reclaimed() const { return reclaimed_; }

 private:
  SwapSpace() = default;
  Storage* storage_ = nullptr;
  SwapOptions options_;
  std::vector<std::string> file_paths_;
  std::vector<FileId> files_;
  std::vector<std::unique_ptr<ExtentAllocator>> allocs_;
  mutable std::mutex mu_;
  bool reclaimed_ = false;
};

// The swap file name for a rank inside `dir`.
std::string swap_file_path(const std::string& dir, int rank);

}  // namespace strata
