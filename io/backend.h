// The raw queue under the Storage engine: what io_uring, libaio, posix and the fault wrapper
// implement. Internal to io/.
//
// A Backend moves single pieces (one contiguous read or write of at most block_size bytes)
// and reports each piece's raw result: bytes transferred (possibly short) or -errno. It does
// no splitting, no retries and no error formatting; the engine (storage_engine.cc) does all of
// that once for every backend. The engine never has more than `queue_depth` pieces in flight.
//
// Thread safety: called from one thread at a time (the engine's caller).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/status.h"
#include "strata/storage.h"

namespace strata::io {

struct RawOp {
  bool write = false;
  int fd = -1;    // the file descriptor
  int slot = -1;  // the engine's file slot (io_uring fixed-file index)
  uint64_t offset = 0;
  void* buffer = nullptr;
  uint32_t length = 0;
  uint64_t tag = 0;  // returned with the result
};

// Requests of at least this many bytes are submitted one per system call. A batch of more than
// two goes to the block layer under a plug, which merges neighbouring requests of one file into
// larger ones: 1 MiB writes at QD 8 reached a virtio disk as 4 MiB requests, fewer in flight, and
// moved 3.1-3.6 GB/s where the same writes one per call moved 4.4 (reads 3.0-3.2 -> 3.5; QD 32
// reads 2.7-2.8 -> 3.1-3.3; `strata probe io` on a 2-core Intel Xeon VM, fio 3.7-4.1 / 3.45
// there; docs/BENCHMARKS.md, storage). Below it a system call per request would cost more than
// the merge saves.
inline constexpr uint32_t kUnbatchedBytes = 256u << 10;

struct RawResult {
  uint64_t tag = 0;
  int64_t result = 0;  // bytes transferred, or -errno
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Whether files for this backend should be opened with O_DIRECT.
  virtual bool direct_io() const = 0;
  virtual bool fixed_files() const { return false; }
  virtual bool registered_buffers() const { return false; }

  // A file was opened into engine slot `slot` (0 <= slot < kMaxFiles) / is being closed.
  virtual Status add_file(int /*slot*/, int /*fd*/) { return Status::ok(); }
  virtual void remove_file(int /*slot*/) {}
  // Registers one buffer region (io_uring fixed buffers); OK and no effect elsewhere.
  virtual Status register_buffer(void* /*base*/, size_t /*length*/) { return Status::ok(); }

  // Starts every op; fails only if the backend itself broke (the ops are then not started).
  virtual Status submit(std::span<const RawOp> ops) = 0;
  // Appends finished ops' results to `out`, waiting until at least `min` arrived (min == 0:
  // only what is ready now). `min` never exceeds the ops in flight.
  virtual Status wait(size_t min, std::vector<RawResult>* out) = 0;
};

inline constexpr int kMaxFiles = 256;

// Each returns the backend or the reason it cannot start here (kUnavailable).
Result<std::unique_ptr<Backend>> make_uring_backend(int queue_depth);
Result<std::unique_ptr<Backend>> make_aio_backend(int queue_depth);
Result<std::unique_ptr<Backend>> make_posix_backend(int threads);
std::unique_ptr<Backend> make_fault_backend(std::unique_ptr<Backend> inner,
                                            std::shared_ptr<FaultPlan> plan);

}  // namespace strata::io
