// Device: where forward and backward run. One interface, two implementations:
//   - cpu  (kernels/cpu/): the reference. "Device memory" is a host arena with a hard capacity,
//          each stream an in-order task queue on its own thread, events positions in a queue.
//   - cuda (kernels/cuda/): cudaMalloc'd arena, pinned host memory, one compute stream and
//          separate host-to-device / device-to-host copy streams, CUDA events.
// Everything above this interface (model, tier manager, trainer) is written once.
//
// Ownership: the Device owns its streams and its arena; pointers returned by allocate() stay
// valid until release() or the Device is destroyed. Events are owned by whoever created them.
//
// Ordering: work enqueued on one stream runs in order. Work on different streams is unordered
// unless joined with record(event, s1) + wait(s2, event). copy_*, memset_zero, host_fn and every
// Kernels call are asynchronous: they return once enqueued; the pointers they take must stay
// valid until the work has run (synchronize on an event recorded after it).
//
// Errors: allocation and synchronization return Status. A failure inside asynchronous work is
// reported by the next synchronize() on that stream or an event after it.
//
// Thread safety: enqueueing on one stream must come from one thread at a time; different
// streams may be driven from different threads. allocate/release and register_host/
// unregister_host are thread-safe (the host tier makes its undo room ready on a thread of its
// own).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

class Kernels;

enum class DeviceKind { kCpu, kCuda };

// Opaque stream handle; obtained from Device, never created by callers.
class Stream {
 public:
  virtual ~Stream() = default;
};

// Opaque event handle; created by Device::create_event.
class Event {
 public:
  virtual ~Event() = default;
};

// Per-device memory statistics, all in bytes.
struct DeviceMemoryStats {
  size_t capacity = 0;  // what allocate() may hand out in total
  size_t used = 0;      // handed out now
  size_t peak = 0;      // highest `used` since creation (or reset_peak)
};

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  // True if device memory is ordinary host memory the CPU may read and write directly (the CPU
  // backend). The host then reads and writes device-resident state in place (checkpoints, the
  // optimizer's undo copies); elsewhere that goes through copies.
  virtual bool host_addressable() const { return false; }
  // Human-readable, e.g. "cpu (arena 512 MiB, 2 threads)" or "NVIDIA H100 80GB HBM3 (sm_90)".
  virtual std::string name() const = 0;

  // --- device memory -------------------------------------------------------------------------
  // Allocates `bytes` (rounded up to 256) of device memory, 256-byte aligned. Fails with
  // kOutOfMemory naming `tag`, the bytes asked, used and capacity; never over-commits.
  virtual Result<void*> allocate(size_t bytes, std::string_view tag) = 0;
  // Returns memory from allocate(). The caller must ensure no enqueued work still uses it.
  virtual void release(void* ptr) = 0;
  virtual DeviceMemoryStats memory_stats() const = 0;
  virtual void reset_peak() = 0;

  // --- host memory for async copies ----------------------------------------------------------
  // Host memory the copy engines can read/write asynchronously (pinned on CUDA; plain aligned
  // memory on the CPU backend). Falls back to pageable memory with a warning if pinning fails.
  virtual Result<void*> allocate_host(size_t bytes) = 0;
  virtual void release_host(void* ptr) = 0;
  // Registers caller-owned host memory (e.g. the storage engine's buffer pool) for fast copies.
  virtual Status register_host(void* ptr, size_t bytes) = 0;
  virtual void unregister_host(void* ptr) = 0;

  // --- streams and events --------------------------------------------------------------------
  virtual Stream& compute_stream() = 0;
  virtual Stream& h2d_stream() = 0;
  virtual Stream& d2h_stream() = 0;

  virtual std::unique_ptr<Event> create_event() = 0;
  // Marks the current end of `stream`; re-recording an event moves it.
  virtual void record(Event& event, Stream& stream) = 0;
  // Makes later work on `stream` wait until `event` has completed.
  virtual void wait(Stream& stream, const Event& event) = 0;
  // Blocks the caller until `event` has completed (an unrecorded event is complete).
  virtual Status synchronize(Event& event) = 0;
  // Blocks the caller until everything enqueued on `stream` has run.
  virtual Status synchronize(Stream& stream) = 0;
  // True if `event` has completed; never blocks.
  virtual bool query(Event& event) = 0;

  // --- timing (the op profile, src/train/op_profile.h) -----------------------------------------
  // An event that also keeps when its stream reached it, for elapsed_ms; recording one may cost
  // more than an ordinary event (CUDA: a cudaEvent with timing). The default is an ordinary
  // event, which elapsed_ms refuses.
  virtual std::unique_ptr<Event> create_timed_event() { return create_event(); }
  // Milliseconds from `from` to `to` (negative when `to` was reached first): two timed events of
  // this device, both recorded and completed, on any of its streams. kUnavailable on a device
  // that does not time its streams; an error when either is not a completed timed event.
  virtual Result<double> elapsed_ms(Event& from, Event& to) {
    (void)from, (void)to;
    return unavailable("this device does not time its streams (Device::elapsed_ms)");
  }

  // --- transfers (async on `stream`) ----------------------------------------------------------
  virtual void copy_h2d(Stream& stream, void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_d2h(Stream& stream, void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_d2d(Stream& stream, void* dst, const void* src, size_t bytes) = 0;
  virtual void memset_zero(Stream& stream, void* dst, size_t bytes) = 0;
  // Runs `fn` on a host thread once all earlier work on `stream` is done; later work on
  // `stream` waits for it to return. `fn` must not enqueue on `stream` and wait for it.
  virtual void host_fn(Stream& stream, std::function<void()> fn) = 0;

  // --- compute -------------------------------------------------------------------------------
  virtual Kernels& kernels() = 0;
};

struct CpuDeviceOptions {
  size_t capacity = size_t{1} << 30;  // emulated device memory, bytes
  int threads = 0;                    // compute threads for kernels; 0 = all cores
};
Result<std::unique_ptr<Device>> create_cpu_device(const CpuDeviceOptions& options);
// The CPU backend's GEMM path: "avx2", "onednn" or "baseline" (kernels/cpu/gemm.h), from
// CPUID and STRATA_CPU_ISA; decided and logged once, when the first CPU device is created.
const char* cpu_gemm_path();

// A fast device simulated on the CPU backend (device.simulate): the GPU's regime — compute
// far faster than the host's optimizer and the disk — on any machine. Its memory, streams,
// events and copies are the CPU backend's (copies real, and no faster than `link_gbps`); its
// kernels do no arithmetic and each costs its modeled time on its stream (kernels/cpu/
// sim_kernels.h: flops over the GEMM or attention rate, bytes over `hbm_gbps`, plus a launch).
// Like a GPU's, its memory is not host-addressable (the host reaches it through copies), so
// the tiers take the paths they take on CUDA. Times and bytes moved are real; losses are not
// (a loss is ln(V); gradients are zeros): the trainer takes the gradient norm from
// device.simulate_grad_norm, which drives the clipping regime.
struct SimulatedDeviceOptions {
  std::string preset;               // "h200", "h100" or "a100": the rates below measured there
  double gemm_tflops = 0;           // dense bf16/fp16 GEMM rate achieved at training shapes
  double attention_fwd_tflops = 0;  // the fused attention kernel's forward rate
  double attention_bwd_tflops = 0;  // and its backward's
  double hbm_gbps = 0;              // bandwidth the elementwise kernels achieve
  double link_gbps = 0;             // pinned host<->device copies, each direction
  double launch_us = 0;             // per kernel: launch and the gap between kernels
  size_t memory = 0;                // device memory, bytes (device.memory_limit caps it)
};
// The preset's rates; kInvalidArgument naming the presets for an unknown name.
Result<SimulatedDeviceOptions> simulated_device_preset(std::string_view name);
// A CPU device of `cpu.capacity` bytes whose kernels and copies take `sim`'s modeled times.
Result<std::unique_ptr<Device>> create_simulated_device(const CpuDeviceOptions& cpu,
                                                        const SimulatedDeviceOptions& sim);

struct CudaDeviceOptions {
  int ordinal = 0;  // which GPU (the local rank under mpirun)
  // Bytes of free HBM left outside the arena for CUDA, cuBLASLt, NCCL and cuDNN's attention
  // workspaces; 0 = kAutoReserve's rule.
  size_t reserve = 0;
  size_t capacity = 0;  // 0 = free HBM minus reserve; else min(that, capacity)
  // cuDNN's fused attention takes its deterministic backward (the same bits run to run; on
  // Hopper a workspace of B·heads·T² bf16 out of the reserve); false: its faster
  // non-deterministic one. The own kernels are deterministic either way.
  bool deterministic = true;
};
// The reserve when CudaDeviceOptions::reserve is 0: 1 GiB, or 1/32 of the GPU's memory where
// that is more (4.4 GiB on an H200: room for cuDNN's deterministic attention backward at B 4,
// T 2048, 32 heads, whose workspace is 1 GiB).
inline size_t cuda_auto_reserve(size_t total_bytes) {
  return std::max(size_t{1} << 30, total_bytes / 32);
}
// kUnavailable when strata was built without CUDA or no GPU is visible (message says which).
Result<std::unique_ptr<Device>> create_cuda_device(const CudaDeviceOptions& options);
// True if built with CUDA and at least one GPU is visible; `why` says otherwise.
bool cuda_device_available(std::string* why);

}  // namespace strata
