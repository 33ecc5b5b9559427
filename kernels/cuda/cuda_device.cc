// The CUDA device backend: the Device interface (strata/device.h) on one GPU.
//
// Memory: at creation the device measures free HBM, keeps `reserve` bytes of it for CUDA,
// cuBLASLt, NCCL and cuDNN's workspaces (0: cuda_auto_reserve), and takes the rest (or `capacity`
// if smaller) with ONE cudaMalloc. allocate() carves 256-byte-aligned blocks out of that arena
// (first fit over an offset-ordered free list, neighbours merged on release), so the hot path never
// calls cudaMalloc/cudaFree (cudaFree synchronizes the whole GPU) and the tier manager's budget is
// exactly what the arena holds.
//
// Host memory: allocate_host uses cudaHostAlloc; if pinning fails it warns once per failure and
// returns pageable memory (copies still work, only slower). register_host pins caller memory
// with cudaHostRegister, with the same warn-and-continue fallback.
//
// Streams and events: a compute stream and separate host-to-device and device-to-host streams
// (non-blocking: they do not synchronize with the legacy default stream); events are cudaEvents
// created with timing disabled. host_fn uses cudaLaunchHostFunc: the function runs on a CUDA
// driver thread and must not call CUDA.
//
// Errors: allocation and synchronization return Status. Enqueue calls return void, so their
// failures (and kernel launch failures) are kept by a CudaErrorSink and returned by the next
// synchronize() of any stream or event of this device; errors inside running kernels come back
// from cudaStreamSynchronize / cudaEventSynchronize there too.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_optimizer.h"
#include "kernels/device_arena.h"
#include "strata/device.h"
#include "strata/log.h"

namespace strata {

Status cuda_check_status(cudaError_t err, const char* call, const char* file, int line,
                         std::string_view what) {
  if (err == cudaSuccess) return Status::ok();
  // The runtime also keeps a failed call's error as the thread's last error, which the next
  // launch check would read as its own: the failure is reported here, so clear it (a sticky
  // error stays whatever is done).
  (void)cudaGetLastError();
  std::string msg = fmt::format("{} failed at {}:{} while {}: {}: {}", call, file, line, what,
                                cudaGetErrorName(err), cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return out_of_memory(std::move(msg));
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    return unavailable(std::move(msg));
  }
  return internal_error(std::move(msg));
}

Status cublas_check_status(cublasStatus_t st, const char* call, const char* file, int line,
                           std::string_view what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::ok();
  std::string msg = fmt::format("{} failed at {}:{} while {}: cuBLAS status {} ({})", call, file,
                                line, what, static_cast<int>(st), cublasLtGetStatusName(st));
  if (st == CUBLAS_STATUS_ALLOC_FAILED) return out_of_memory(std::move(msg));
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return unavailable(std::move(msg));
  return internal_error(std::move(msg));
}

Status allocate_reduce_scratch(cudaStream_t s, CudaReduceScratch* rs) {
  void* base = nullptr;
  STRATA_CUDA_CHECK(cudaMalloc(&base, CudaReduceScratch::kBytes),
                    "allocating a stream's reduction scratch");
  auto* bytes = static_cast<char*>(base);
  rs->partials = static_cast<float*>(base);
  rs->tile_counts =
      reinterpret_cast<unsigned*>(bytes + CudaReduceScratch::kPartialFloats * sizeof(float));
  rs->rows = reinterpret_cast<int32_t*>(rs->tile_counts + CudaReduceScratch::kTileCounts);
  Status st = STRATA_CUDA_STATUS(
      cudaMemsetAsync(rs->tile_counts, 0, CudaReduceScratch::kTileCounts * sizeof(unsigned), s),
      "zeroing a stream's reduction counters");
  if (st.is_ok()) st = STRATA_CUDA_STATUS(cudaStreamSynchronize(s), "zeroing the counters");
  if (!st.is_ok()) free_reduce_scratch(rs);
  return st;
}

void free_reduce_scratch(CudaReduceScratch* rs) {
  if (rs->partials) cudaFree(rs->partials);
  *rs = CudaReduceScratch{};
}

namespace {

constexpr size_t kAlign = 256;
constexpr size_t kComputeWorkspace = size_t{32} << 20;  // cuBLASLt's recommendation for Hopper

class CudaEvent final : public Event {
 public:
  cudaEvent_t handle = nullptr;
  bool timed = false;                  // created with timing (create_timed_event)
  std::atomic<bool> recorded = false;  // recorded at least once
  ~CudaEvent() override {
    if (handle) cudaEventDestroy(handle);
  }
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {}

  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    for (CudaStream* s : {&compute_, &h2d_, &d2h_}) {
      if (s->handle) cudaStreamSynchronize(s->handle);
    }
    kernels_.reset();
    for (void* p : pinned_) cudaFreeHost(p);
    for (void* p : pageable_) std::free(p);
    for (void* p : registered_) cudaHostUnregister(p);
    for (CudaStream* s : {&compute_, &h2d_, &d2h_}) {
      if (s->scratch) cudaFree(s->scratch);
      free_reduce_scratch(&s->reduce);
      if (s->blas_workspace) cudaFree(s->blas_workspace);
      if (s->handle) cudaStreamDestroy(s->handle);
    }
    if (blas_) cublasLtDestroy(blas_);
    if (arena_.base()) cudaFree(arena_.base());
  }

  // Everything that can fail at creation; the destructor undoes whatever part succeeded.
  Status init(const CudaDeviceOptions& o) {
    STRATA_CUDA_CHECK(cudaSetDevice(ordinal_), "selecting the GPU (device.ordinal)");
    cudaDeviceProp prop{};
    STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal_), "reading the GPU's properties");
    gpu_name_ = prop.name;
    sm_ = prop.major * 10 + prop.minor;
    if (sm_ < 80) {
      return unavailable(fmt::format(
          "GPU {} ({}) is sm_{}; strata's CUDA kernels need sm_80 or newer (bf16, A100/H100)",
          ordinal_, gpu_name_, sm_));
    }
    for (CudaStream* s : {&compute_, &h2d_, &d2h_}) {
      STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&s->handle, cudaStreamNonBlocking),
                        "creating a stream");
      STRATA_CUDA_CHECK(cudaMalloc(&s->scratch, kCudaReduceBlocks * sizeof(double)),
                        "allocating a stream's reduction scratch");
      STRATA_RETURN_IF_ERROR(allocate_reduce_scratch(s->handle, &s->reduce), "creating a stream");
    }
    compute_.blas_workspace_bytes = kComputeWorkspace;
    STRATA_CUDA_CHECK(cudaMalloc(&compute_.blas_workspace, kComputeWorkspace),
                      "allocating the cuBLASLt workspace");
    STRATA_CUBLAS_CHECK(cublasLtCreate(&blas_), "creating the cuBLASLt handle");

    size_t free_bytes = 0, total_bytes = 0;
    STRATA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes), "measuring free HBM");
    const size_t reserve = o.reserve > 0 ? o.reserve : cuda_auto_reserve(total_bytes);
    if (free_bytes <= reserve + kAlign) {
      return out_of_memory(fmt::format(
          "GPU {} ({}): only {} of {} HBM is free, not more than the reserve of {}; free the GPU "
          "(other processes?) or lower device.reserve",
          ordinal_, gpu_name_, format_bytes(double(free_bytes)), format_bytes(double(total_bytes)),
          format_bytes(double(reserve))));
    }
    size_t cap = free_bytes - reserve;
    if (o.capacity > 0) cap = std::min(cap, o.capacity);
    cap = cap / kAlign * kAlign;
    void* base = nullptr;
    STRATA_CUDA_CHECK(cudaMalloc(&base, cap),
                      fmt::format("reserving the device arena ({})", format_bytes(double(cap))));
    arena_.reset(static_cast<char*>(base), cap);
    kernels_ = create_cuda_kernels(ordinal_, blas_, &errors_, o.deterministic);
    return Status::ok();
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override {
    return fmt::format("{} (sm_{}, GPU {}, arena {})", gpu_name_, sm_, ordinal_,
                       format_bytes(double(arena_.span())));
  }
  int ordinal() const { return ordinal_; }

  // --- device memory ----------------------------------------------------------------------
  Result<void*> allocate(size_t bytes, std::string_view tag) override {
    const size_t n = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    std::lock_guard<std::mutex> lock(mu_);
    void* p = arena_.allocate(n);
    if (!p) {
      const size_t cap = arena_.span(), used = arena_.used();
      return out_of_memory(fmt::format(
          "device memory (GPU {}): cannot allocate {} for '{}': {} of {} in use ({} free, "
          "largest free block {}); raise device.memory_limit, lower device.reserve, or offload "
          "more state (zero_optimization.offload_*)",
          ordinal_, format_bytes(double(n)), tag, format_bytes(double(used)),
          format_bytes(double(cap)), format_bytes(double(cap - used)),
          format_bytes(double(arena_.largest_free()))));
    }
    return p;
  }
  void release(void* ptr) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_CHECK(arena_.release(ptr).has_value(),
                 "release of a pointer this device did not allocate");
  }
  DeviceMemoryStats memory_stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return {arena_.span(), arena_.used(), arena_.peak()};
  }
  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    arena_.reset_peak();
  }

  // --- host memory ------------------------------------------------------------------------
  Result<void*> allocate_host(size_t bytes) override {
    const size_t n = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
    bind();
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, n, cudaHostAllocPortable);
    std::lock_guard<std::mutex> lock(mu_);
    if (err == cudaSuccess) {
      pinned_.insert(p);
      return p;
    }
    cudaGetLastError();  // not sticky, but leave no trace for the next check
    log_warn(
        "cudaHostAlloc of {} failed ({}); using pageable memory, host<->GPU copies of it "
        "will be slower and synchronous",
        format_bytes(double(n)), cudaGetErrorString(err));
    p = std::aligned_alloc(4096, n);
    if (!p) {
      return out_of_memory(
          fmt::format("host allocation of {} failed (pinned and pageable)", format_bytes(n)));
    }
    pageable_.insert(p);
    return p;
  }
  void release_host(void* ptr) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (pinned_.erase(ptr)) {
      cudaFreeHost(ptr);
    } else {
      STRATA_CHECK(pageable_.erase(ptr) == 1,
                   "release_host of memory this device did not allocate");
      std::free(ptr);
    }
  }
  Status register_host(void* ptr, size_t bytes) override {
    bind();
    cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();
      log_warn("cudaHostRegister of {} at {} failed ({}); copies from it stay pageable (slower)",
               format_bytes(double(bytes)), ptr, cudaGetErrorString(err));
      return Status::ok();
    }
    std::lock_guard<std::mutex> lock(mu_);
    registered_.insert(ptr);
    return Status::ok();
  }
  void unregister_host(void* ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_.erase(ptr)) {
      bind();
      note(STRATA_CUDA_STATUS(cudaHostUnregister(ptr), "unregistering host memory"));
    }
  }

  // --- streams and events -----------------------------------------------------------------
  Stream& compute_stream() override { return compute_; }
  Stream& h2d_stream() override { return h2d_; }
  Stream& d2h_stream() override { return d2h_; }

  std::unique_ptr<Event> create_event() override {
    bind();
    auto e = std::make_unique<CudaEvent>();
    note(STRATA_CUDA_STATUS(cudaEventCreateWithFlags(&e->handle, cudaEventDisableTiming),
                            "creating an event"));
    return e;
  }
  std::unique_ptr<Event> create_timed_event() override {
    bind();
    auto e = std::make_unique<CudaEvent>();
    note(STRATA_CUDA_STATUS(cudaEventCreate(&e->handle), "creating a timed event"));
    e->timed = true;
    return e;
  }
  Result<double> elapsed_ms(Event& from, Event& to) override {
    // An event without timing, or never recorded, is refused here rather than by CUDA, whose
    // refusal is an API error to compute-sanitizer.
    cudaEvent_t a = ev(from), b = ev(to);
    auto &f = static_cast<CudaEvent&>(from), &t = static_cast<CudaEvent&>(to);
    if (!f.timed || !t.timed) {
      return invalid_argument("elapsed_ms: both events must come from create_timed_event");
    }
    if (!f.recorded.load(std::memory_order_relaxed) ||
        !t.recorded.load(std::memory_order_relaxed)) {
      return invalid_argument("elapsed_ms: an event that was never recorded");
    }
    bind();
    float ms = 0;
    STRATA_RETURN_IF_ERROR(
        STRATA_CUDA_STATUS(cudaEventElapsedTime(&ms, a, b),
                           "timing two events (both timed, recorded and completed?)"),
        "elapsed_ms");
    return double(ms);
  }
  void record(Event& event, Stream& stream) override {
    bind();
    note(STRATA_CUDA_STATUS(cudaEventRecord(ev(event), cuda_stream(stream).handle),
                            "recording an event"));
    static_cast<CudaEvent&>(event).recorded.store(true, std::memory_order_relaxed);
  }
  void wait(Stream& stream, const Event& event) override {
    bind();
    note(STRATA_CUDA_STATUS(
        cudaStreamWaitEvent(cuda_stream(stream).handle, ev(const_cast<Event&>(event)), 0),
        "making a stream wait for an event"));
  }
  Status synchronize(Event& event) override {
    bind();
    Status st = STRATA_CUDA_STATUS(cudaEventSynchronize(ev(event)), "waiting for an event");
    return first_error(st);
  }
  Status synchronize(Stream& stream) override {
    bind();
    Status st = STRATA_CUDA_STATUS(cudaStreamSynchronize(cuda_stream(stream).handle),
                                   "waiting for a stream");
    return first_error(st);
  }
  bool query(Event& event) override {
    bind();
    cudaError_t err = cudaEventQuery(ev(event));
    if (err == cudaErrorNotReady) return false;
    // An error is complete work; the error itself reaches the next synchronize.
    note(STRATA_CUDA_STATUS(err, "querying an event"));
    return true;
  }

  // --- transfers --------------------------------------------------------------------------
  void copy_h2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    copy(s, dst, src, bytes, cudaMemcpyHostToDevice, "copying host to device");
  }
  void copy_d2h(Stream& s, void* dst, const void* src, size_t bytes) override {
    copy(s, dst, src, bytes, cudaMemcpyDeviceToHost, "copying device to host");
  }
  void copy_d2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    copy(s, dst, src, bytes, cudaMemcpyDeviceToDevice, "copying device to device");
  }
  void memset_zero(Stream& s, void* dst, size_t bytes) override {
    if (bytes == 0) return;
    bind();
    note(STRATA_CUDA_STATUS(cudaMemsetAsync(dst, 0, bytes, cuda_stream(s).handle),
                            "zeroing device memory"));
  }
  void host_fn(Stream& s, std::function<void()> fn) override {
    bind();
    auto* heap = new std::function<void()>(std::move(fn));
    cudaError_t err = cudaLaunchHostFunc(
        cuda_stream(s).handle,
        [](void* p) {
          auto* f = static_cast<std::function<void()>*>(p);
          (*f)();
          delete f;
        },
        heap);
    if (err != cudaSuccess) {
      delete heap;
      note(STRATA_CUDA_STATUS(err, "enqueuing a host function"));
    }
  }

  Kernels& kernels() override { return *kernels_; }

 private:
  void bind() {
    note(STRATA_CUDA_STATUS(cudaSetDevice(ordinal_), "binding the thread to its GPU"));
  }
  void note(const Status& s) { errors_.note(s); }
  // The synchronize result: a deferred enqueue error first (it happened earlier), else `st`.
  Status first_error(const Status& st) {
    Status deferred = errors_.take();
    if (!deferred.is_ok()) return deferred.with_context(fmt::format("GPU {}", ordinal_));
    return st.is_ok() ? st : st.with_context(fmt::format("GPU {}", ordinal_));
  }
  static cudaEvent_t ev(Event& e) {
    auto* ce = dynamic_cast<CudaEvent*>(&e);
    STRATA_CHECK(ce != nullptr, "an event of another device was given to a CUDA device");
    return ce->handle;
  }
  void copy(Stream& s, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
            const char* what) {
    if (bytes == 0) return;
    bind();
    note(STRATA_CUDA_STATUS(cudaMemcpyAsync(dst, src, bytes, kind, cuda_stream(s).handle), what));
  }

  const int ordinal_;
  std::string gpu_name_;
  int sm_ = 0;
  mutable std::mutex mu_;  // arena_, pinned_, pageable_, registered_
  DeviceArena arena_;
  std::unordered_set<void*> pinned_, pageable_, registered_;
  CudaStream compute_, h2d_, d2h_;
  cublasLtHandle_t blas_ = nullptr;
  CudaErrorSink errors_;
  std::unique_ptr<Kernels> kernels_;
};

// How many GPUs are visible, or why none is.
int visible_gpus(std::string* why) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (why) {
      *why = fmt::format("no usable CUDA GPU: cudaGetDeviceCount failed: {}: {}",
                         cudaGetErrorName(err), cudaGetErrorString(err));
    }
    return 0;
  }
  if (n == 0 && why) {
    const char* vis = std::getenv("CUDA_VISIBLE_DEVICES");
    *why = fmt::format("no CUDA GPU visible (cudaGetDeviceCount = 0, CUDA_VISIBLE_DEVICES={})",
                       vis ? vis : "<unset>");
  }
  return n;
}

}  // namespace

Result<std::unique_ptr<Device>> create_cuda_device(const CudaDeviceOptions& options) {
  std::string why;
  const int n = visible_gpus(&why);
  if (n == 0) {
    return unavailable(
        fmt::format("device.backend=cuda: {}; run on a machine with a GPU (and its driver), or set "
                    "device.backend=cpu",
                    why));
  }
  if (options.ordinal < 0 || options.ordinal >= n) {
    return invalid_argument(fmt::format(
        "device.ordinal={}: only {} GPU(s) visible (0..{}); under mpirun the ordinal is the local "
        "rank, so run at most {} rank(s) per node",
        options.ordinal, n, n - 1, n));
  }
  auto dev = std::make_unique<CudaDevice>(options.ordinal);
  STRATA_RETURN_IF_ERROR(dev->init(options),
                         fmt::format("creating the CUDA device on GPU {}", options.ordinal));
  return std::unique_ptr<Device>(std::move(dev));
}

bool cuda_device_available(std::string* why) { return visible_gpus(why) > 0; }

Status cuda_device_optimizer_step(Device& device, Stream& stream, const OptimizerHyper& hyper,
                                  const ShardState& shard) {
  auto* dev = dynamic_cast<CudaDevice*>(&device);
  if (!dev) return invalid_argument("cuda_device_optimizer_step: the device is not a CUDA device");
  auto* cs = dynamic_cast<CudaStream*>(&stream);
  if (!cs ||
      (cs != &dev->compute_stream() && cs != &dev->h2d_stream() && cs != &dev->d2h_stream())) {
    return invalid_argument("cuda_device_optimizer_step: the stream is not one of this device's");
  }
  STRATA_CUDA_CHECK(cudaSetDevice(dev->ordinal()), "binding the thread to its GPU");
  return cuda_optimizer_step(cs->handle, hyper, shard)
      .with_context(fmt::format("{} step on a device shard of {} elements",
                                optimizer_kind_name(hyper.kind), shard.n));
}

}  // namespace strata
