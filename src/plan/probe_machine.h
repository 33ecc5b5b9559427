// The machine probe behind `strata probe` (no subcommand): every rate the planner divides by,
// measured on this machine and written as one profile (src/plan/plan.h reads it).
//
// What is measured (each case: `warmup` passes discarded, then `repeats` timed passes; the
// median is the rate, min..max the spread):
//   host.copy_gbps        memcpy of a buffer of `host_bytes` (default probe_span_bytes()),
//                         bytes copied per second (all threads)
//   host.copy_one_thread_gbps  the same by one thread in 16 MiB pieces (a CPU stream's copy)
//   host.rmw_gbps         the optimizer's access pattern: x[i] = a*x[i] + b*y[i] over fp32
//                         arrays (2 reads + 1 write per element, all threads), bytes touched/s
//   cpu_optimizer         optimizer_step (AdamW, fp32 grads/master/moments, bf16 copy-out) on
//                         `optimizer_params` params (default: 18 bytes each fill
//                         probe_span_bytes()), params/s at each thread count; the
//                         headline params_per_s is the best count's
//   device.gemm_flops     matmul_forward + matmul_backward through the device's Kernels table
//                         at a transformer-MLP shape (N=`gemm_n` rows, C, 4C), FLOP/s
//   link                  host<->device copies, pinned and pageable, both directions (CUDA
//                         only; "n/a: no GPU" otherwise)
//   nvme                  run_io_probe (strata/io_probe.h) on `nvme_paths` with a short grid;
//                         the recommended case's read and write medians
//   collectives           run_comm_probe's all_gather / reduce_scatter bus bandwidth, only when
//                         started under mpirun with more than one rank
//
// Profile JSON (format version 1):
//   {"magic": "strata-machine-profile", "version": 1, "host": {"copy_gbps", "rmw_gbps",
//    "threads", ...spreads}, "cpu_optimizer": {"params_per_s", "by_threads": [...]},
//    "device": {"backend": "cpu"|"cuda", "name", "gemm_flops", ...},
//    "link": {"h2d_pinned_gbps", ...} | "n/a: ...", "nvme": {...} | "n/a: ...",
//    "collectives": {"busbw_gbps", ...} | "n/a: ..."}
//
// Thread safety: run_machine_probe is a long blocking call; call it from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "strata/status.h"

namespace strata {

// The whole training micro-batches the probe times on the device: a 2-layer GPT at each width,
// each B x T, from which the planner interpolates a model's compute rate (gemm_rate_at). The
// CPU backend's are small (its per-op costs make small micro-batches slower per FLOP); a GPU's
// are training's sizes (a single 1024-token GEMM ran at 283 TFLOP/s on an H200 whose GPT-2 and
// Llama steps ran their GEMMs at 400-730).
struct ModelProbeShapes {
  std::vector<int> widths;
  std::vector<std::pair<int, int>> batches;  // (B, T)
};
ModelProbeShapes model_probe_shapes(bool cpu_backend);

struct MachineProbeOptions {
  uint64_t host_bytes = 0;  // buffer for the memory-bandwidth cases; 0: probe_span_bytes()
  uint64_t optimizer_params =
      0;  // params per optimizer step; 0: as many as fill probe_span_bytes()
  int gemm_n = 1024, gemm_c = 768;       // GEMM shape: [N,C] x [4C,C]^T
  uint64_t device_optimizer_params = 0;  // a GPU's memory probe (its optimizer); 0: 64 M
  std::vector<std::string> nvme_paths;   // empty: NVMe is "n/a: no --path"
  uint64_t nvme_file_bytes = uint64_t{256} << 20;
  int warmup = 1;
  int repeats = 5;
  bool include_cuda = true;       // try a CUDA device for GEMM and link (falls back to CPU)
  size_t cuda_bytes = 0;          // that device's arena; 0: the GPU's free memory but its reserve
  ModelProbeShapes model_shapes;  // no widths: model_probe_shapes of the device probed
};

// The host memory the bandwidth and optimizer probes span by default: 4x the last-level cache
// the system reports, at least 256 MiB and at most 2 GiB, and at most 1/8 of MemAvailable (at
// least 64 MiB). Training's optimizer state lives in DRAM; a probe its caches hold measures the
// caches (an H200 machine's 16 cores stepped 8 M parameters at 13.4 G/s and its 124 M in
// training at 3.2 G/s).
uint64_t probe_span_bytes();

// One measured quantity: median and spread over the timed repeats.
struct Measured {
  double median = 0, min = 0, max = 0;
  std::vector<double> samples;
};

// Runs the probes; `progress(step, total, what)` is called before each probe and once at the end
// (step == total). Returns the profile JSON text.
Result<std::string> run_machine_probe(
    const MachineProbeOptions& options,
    const std::function<void(int, int, const std::string&)>& progress = {});

// Median/min/max of `samples` (non-empty).
Measured summarize(std::vector<double> samples);

}  // namespace strata
