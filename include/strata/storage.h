// Storage: the async engine under the NVMe tier.
//
// A Storage reads and writes aligned extents of files into caller-owned (normally pinned) host
// buffers, asynchronously: get a file id with open(), hand a batch of IoRequests to submit(),
// collect one IoCompletion per request with reap(), matched by the request's cookie. It is the
// liburing shape (prepare -> submit -> reap, a cookie per request) with the engine doing the
// chores every caller would otherwise repeat:
//
//   * A request of any length is split into pieces of at most `block_size` bytes; at most
//     `queue_depth` pieces are in flight at once; the rest wait inside the engine. The caller
//     still sees exactly one completion per request.
//   * A short read or write is resubmitted for the remainder; EINTR and EAGAIN are retried.
//     Any other failure completes the request with a Status naming the path, the offset, the
//     length and the errno text. A read that reaches end of file is an error, never zeros.
//   * With `checksum` on, the CRC32C of every written request is remembered per (file, offset,
//     length) and verified when a read covers exactly that extent; a mismatch completes the
//     read with a kCorrupt Status. Reads of other ranges are not verified (counted in stats).
//
// Backends (StorageOptions::backend):
//   io_uring  liburing, O_DIRECT, batched submits, fixed files, registered buffers when the
//             kernel and RLIMIT_MEMLOCK allow (register_buffer()); the default.
//   libaio    Linux native AIO with O_DIRECT: for kernels or containers without io_uring.
//   posix     pread/pwrite on a small thread pool, buffered I/O: for file systems that refuse
//             O_DIRECT (tmpfs, some network file systems). No alignment needed.
//   auto      io_uring, else libaio, else posix; the choice and the reason each earlier one
//             was refused are logged at info level and kept in capabilities().note.
// A fault-injecting wrapper (StorageOptions::faults) sits between the engine and any backend,
// so the engine's retry and error paths run against the real backend's I/O.
//
// Alignment: for O_DIRECT backends the offset, length and buffer address of every request must
// be multiples of kStorageAlignment (4096); submit() rejects anything else with kInvalidArgument.
//
// Thread safety: a Storage is not thread-safe (like a liburing ring): one thread at a time
// calls its methods. Completions are only produced inside submit()/reap()/run(). Buffers must
// stay valid and untouched until their request's completion has been reaped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata {

inline constexpr size_t kStorageAlignment = 4096;

struct FaultPlan;  // strata/storage_faults.h

// How to build a Storage. Defaults match AioConfig's.
struct StorageOptions {
  std::string backend = "auto";  // auto | io_uring | libaio | posix
  size_t block_size = 1 << 20;   // largest piece of one request, multiple of 4096
  int queue_depth = 8;           // most pieces in flight
  int posix_threads = 4;         // worker threads of the posix backend
  bool checksum = false;         // CRC32C per written extent, verified on read
  // Optional faults injected under the engine (tests only). Shared so the test can change the
  // plan and read its counters while the Storage runs.
  std::shared_ptr<FaultPlan> faults;
};

// What the chosen backend can do.
struct StorageCaps {
  std::string backend;              // "io_uring" | "libaio" | "posix" (+ "+faults")
  bool direct_io = false;           // files are opened with O_DIRECT
  bool fixed_files = false;         // io_uring: files registered with the ring
  bool registered_buffers = false;  // io_uring: register_buffer() took effect
  int max_queue_depth = 0;          // the queue_depth in force
  size_t block_size = 0;            // the block_size in force
  std::string note;                 // why earlier backends were refused (auto), or ""
};

enum class IoOp : uint8_t { kRead, kWrite };

using FileId = int32_t;

struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
  void* buffer = nullptr;  // for writes the data is read from here; for reads written here
  uint64_t cookie = 0;     // returned in the completion; the engine does not interpret it
  // Cut into pieces before every request that is not urgent (after the urgent ones queued
  // earlier): what the compute is about to wait for, ahead of traffic that can wait.
  bool urgent = false;
};

struct IoCompletion {
  uint64_t cookie = 0;
  Status status;  // OK, or what failed (path, offset, length, errno text)
};

struct StorageStats {
  uint64_t requests = 0;            // requests completed (OK or not)
  uint64_t pieces = 0;              // pieces handed to the backend, resubmissions included
  uint64_t bytes_read = 0;          // bytes of successful reads
  uint64_t bytes_written = 0;       // bytes of successful writes
  uint64_t short_resubmits = 0;     // short transfers resubmitted for the remainder
  uint64_t retries = 0;             // EINTR/EAGAIN retried
  uint64_t checksums_verified = 0;  // reads verified against a recorded CRC32C
  uint64_t checksums_skipped = 0;   // reads with checksum on that matched no recorded extent
};

// Flags for Storage::open.
struct OpenOptions {
  bool create = false;    // create the file if missing (mode 0600)
  bool truncate = false;  // truncate to 0 first
};

class Storage {
 public:
  virtual ~Storage() = default;
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  virtual const StorageCaps& capabilities() const = 0;

  // Opens `path` for reading and writing (O_DIRECT when capabilities().direct_io). Fails with
  // kUnavailable naming the path if its file system refuses O_DIRECT (use backend posix).
  virtual Result<FileId> open(const std::string& path, const OpenOptions& options = {}) = 0;
  // Closes a file; no request on it may be in flight. Unknown ids are ignored.
  virtual void close(FileId file) = 0;
  // The path a file id was opened with ("" for unknown ids).
  virtual const std::string& path(FileId file) const = 0;

  // Registers [base, base+length) as a buffer the backend may use without per-I/O page
  // pinning (io_uring fixed buffers). Optional: returns OK and does nothing where unsupported
  // or when the kernel refuses (RLIMIT_MEMLOCK); see capabilities().registered_buffers. The
  // memory must outlive the Storage. At most one region is registered; later calls replace it.
  virtual Status register_buffer(void* base, size_t length) = 0;

  // Queues a batch. Validates every request first: if any is malformed (unknown file,
  // misaligned for O_DIRECT, zero length, null buffer) nothing is queued and the Status names
  // the request. Otherwise all are accepted, pieces are issued up to queue_depth, and each
  // request will produce exactly one completion. Does not wait for completions.
  virtual Status submit(std::span<const IoRequest> requests) = 0;

  // Moves up to out.size() completions into `out`, waiting until at least
  // min(min_complete, pending()+ready) are available. Returns how many were stored.
  virtual size_t reap(std::span<IoCompletion> out, size_t min_complete) = 0;

  // Requests submitted whose completions have not been reaped yet.
  virtual size_t pending() const = 0;

  // Submits `requests` and waits for all of them; returns the first failure (with the context
  // of that request) or OK. Completions of other, earlier requests stay reapable.
  virtual Status run(std::span<const IoRequest> requests) = 0;

  virtual StorageStats stats() const = 0;
};

// Builds a Storage per options.backend (see the backend list at the top). Errors: an unknown
// backend name, or a named backend that cannot start here (message says why and what to pick).
Result<std::unique_ptr<Storage>> open_storage(const StorageOptions& options);

// Whether `backend` ("io_uring" | "libaio" | "posix") was built in and can start on this
// machine now; on false, `why` says what refused it.
bool storage_backend_available(const std::string& backend, std::string* why);

}  // namespace strata
