// The storage probe behind `strata probe io`: measures sequential read and write throughput of
// each Storage backend over a grid of block sizes and queue depths on one or more paths, and
// writes a profile the planner reads.
//
// Method (Seastar iotune / nccl-tests style): for each path a probe file of `file_bytes` is
// created and written once (not timed; a kept file of the right size is reused). Each case
// (backend, op, block size, queue depth) then moves the whole file set sequentially `warmup +
// repeats` times; a pass is block-size requests all handed to the engine at once, so exactly
// queue_depth are in flight (the engine caps it). With several paths, consecutive blocks alternate
// over the paths (striping). The warm-up passes are discarded; the rest give the median and the
// min/max spread in GB/s (1e9 bytes/s).
//
// Profile JSON (format version 1):
//   {"magic": "strata-io-probe", "version": 1, "paths": [...], "file_bytes": N,
//    "cases": [{"backend", "op": "read"|"write", "block_size", "queue_depth",
//               "gbps_median", "gbps_min", "gbps_max", "gbps": [per repeat]}...],
//    "recommended": {"aio": {"backend", "block_size", "queue_depth"}}}
//
// Thread safety: run_io_probe is a long blocking call; call it from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/status.h"
#include "strata/storage.h"

namespace strata {

inline constexpr int kIoProbeFormatVersion = 1;

struct IoProbeOptions {
  std::vector<std::string> paths;  // directories; probe files are created (and removed) there
  uint64_t file_bytes = uint64_t{1} << 30;  // per path
  std::vector<std::string> backends = {"io_uring", "libaio", "posix"};
  std::vector<size_t> block_sizes = {size_t{256} << 10, size_t{1} << 20, size_t{4} << 20};
  std::vector<int> queue_depths = {4, 8, 32};
  std::vector<IoOp> ops = {IoOp::kRead, IoOp::kWrite};
  int warmup = 1;
  int repeats = 3;
  bool keep_files = false;  // leave the probe files (to reuse them with fio)
};

struct IoProbeCase {
  std::string backend;
  IoOp op = IoOp::kRead;
  size_t block_size = 0;
  int queue_depth = 0;
  std::vector<double> gbps;  // per timed repeat
  double median = 0, min = 0, max = 0;
};

struct IoProbeReport {
  std::vector<std::string> paths;
  uint64_t file_bytes = 0;
  std::vector<IoProbeCase> cases;
  std::vector<std::string> skipped;  // "backend: why" for backends that could not start
  // Best (backend, block size, queue depth) by the harmonic mean of read and write medians.
  std::string rec_backend;
  size_t rec_block_size = 0;
  int rec_queue_depth = 0;
};

// Runs the sweep. `on_case` (optional) is called after each case, for live output.
Result<IoProbeReport> run_io_probe(const IoProbeOptions& options,
                                   const std::function<void(const IoProbeCase&)>& on_case = {});

std::string io_probe_json(const IoProbeReport& report);
Result<IoProbeReport> parse_io_probe_json(const std::string& text, const std::string& origin);

}  // namespace strata
