// The CPU device backend: an emulated GPU on the host.
//
// Device memory is one mapping carved up as the CUDA backend carves its one cudaMalloc
// (kernels/device_arena.h: first fit, neighbours merged on release), so the hot path never
// calls malloc and a training step's buffers land on pages touched once: with malloc, which
// maps and unmaps blocks this large, a step on a tight device (bench-25m's 100 MiB) faulted in
// and cleared ~100 MiB of pages again every step, a sixth of its kernel time. The capacity
// (device.memory_limit, the arena the host-memory summary counts) bounds the bytes in use, as
// cudaMalloc's would; the mapping is twice that, reserved but not committed, so that a block
// fits wherever malloc's would have (the capacity decides what fails, not the layout), and the
// pages of a free block beyond the capacity are given back, so the arena holds at most its
// capacity plus what is live beyond it. Under ASan every block is followed by a poisoned gap
// and a released block is poisoned, as malloc's blocks were.
// Each stream is an in-order task queue
// drained by its own thread; an event is a (stream, sequence number) pair that completes when
// the stream has run that far.
#include <pthread.h>
#include <sanitizer/asan_interface.h>
#include <sys/mman.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"
#include "kernels/device_arena.h"
#include "strata/device.h"
#include "strata/log.h"

namespace strata {
namespace {

constexpr size_t kAlign = 256;
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kRedzone = kAlign;  // ASan: a poisoned gap after every device block
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr size_t kRedzone = kAlign;
#else
constexpr size_t kRedzone = 0;
#endif
#else
constexpr size_t kRedzone = 0;
#endif

class CpuStream final : public Stream {
 public:
  explicit CpuStream(std::string name) : name_(std::move(name)) {
    thread_ = std::thread([this] { run(); });
    // "strata-compute", "strata-h2d", "strata-d2h" in top -H, perf and gdb (15 bytes at most)
    pthread_setname_np(thread_.native_handle(), ("strata-" + name_).substr(0, 15).c_str());
  }
  ~CpuStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Enqueues fn; returns its sequence number (1-based).
  uint64_t enqueue(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(fn));
    uint64_t seq = ++enqueued_;
    cv_.notify_all();
    return seq;
  }
  uint64_t enqueued() {
    std::lock_guard<std::mutex> lock(mu_);
    return enqueued_;
  }
  void wait_done(uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_ >= seq; });
  }
  bool is_done(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    return done_ >= seq;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++done_;
      }
      done_cv_.notify_all();
    }
  }

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0, done_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

class CpuEvent final : public Event {
 public:
  CpuStream* stream = nullptr;  // null: never recorded (complete)
  uint64_t seq = 0;
  // A timed event: when its stream reached the last record (steady clock, ns); shared with the
  // task that stores it, which may run after the event is gone.
  std::shared_ptr<std::atomic<int64_t>> reached;
};

class CpuDevice final : public Device {
 public:
  // base: a mapping of `span` bytes (> capacity) the device owns from now on.
  CpuDevice(const CpuDeviceOptions& o, char* base, size_t span)
      : capacity_(o.capacity), threads_(o.threads), compute_("compute"), h2d_("h2d"), d2h_("d2h") {
    arena_.reset(base, span);  // the capacity is checked here, on the bytes asked for
    ASAN_POISON_MEMORY_REGION(base, span);
    if (o.threads > 0) tasks_.emplace(o.threads);
    kernels_ = create_cpu_kernels(*this, o.threads);
  }
  ~CpuDevice() override {
    for (Stream* s : {static_cast<Stream*>(&compute_), static_cast<Stream*>(&h2d_),
                      static_cast<Stream*>(&d2h_)}) {
      synchronize(*s).ignore();
    }
    kernels_.reset();
    ASAN_UNPOISON_MEMORY_REGION(arena_.base(), arena_.span());
    ::munmap(arena_.base(), arena_.span());
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  bool host_addressable() const override { return true; }
  std::string name() const override {
    return fmt::format("cpu (arena {}, {} threads)", format_bytes(double(capacity_)),
                       threads_ > 0 ? std::to_string(threads_) : std::string("all"));
  }

  Result<void*> allocate(size_t bytes, std::string_view tag) override {
    const size_t n = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    std::lock_guard<std::mutex> lock(mu_);
    if (used_ + n > capacity_) {
      return out_of_memory(fmt::format(
          "device memory: cannot allocate {} for '{}': {} of {} in use ({} free); raise "
          "device.memory_limit or offload more state (zero_optimization.offload_*)",
          format_bytes(double(n)), tag, format_bytes(double(used_)),
          format_bytes(double(capacity_)), format_bytes(double(capacity_ - used_))));
    }
    void* p = arena_.allocate(n + kRedzone);
    if (!p) {  // the free bytes of twice the capacity in pieces smaller than n: not seen so far
      return out_of_memory(fmt::format(
          "device memory: cannot place {} for '{}': {} of {} in use, but the arena's free space "
          "is in pieces of at most {}; raise device.memory_limit",
          format_bytes(double(n)), tag, format_bytes(double(used_)),
          format_bytes(double(capacity_)), format_bytes(double(arena_.largest_free()))));
    }
    ASAN_UNPOISON_MEMORY_REGION(p, n);
    used_ += n;
    peak_ = std::max(peak_, used_);
    return p;
  }
  void release(void* ptr) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    const std::optional<DeviceArena::Released> r = arena_.release(ptr);
    STRATA_CHECK(r.has_value(), "release of a pointer this device did not allocate");
    used_ -= r->bytes - kRedzone;
    ASAN_POISON_MEMORY_REGION(ptr, r->bytes);
    // Pages of free space beyond the capacity go back: the arena keeps at most its capacity
    // touched, plus what is live beyond it.
    const size_t page = page_bytes();
    const size_t lo = (std::max(r->merged.offset, capacity_) + page - 1) / page * page;
    const size_t hi = (r->merged.offset + r->merged.bytes) / page * page;
    if (hi > lo) ::madvise(arena_.base() + lo, hi - lo, MADV_DONTNEED);
  }
  DeviceMemoryStats memory_stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return {capacity_, used_, peak_};
  }
  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = used_;
  }

  Result<void*> allocate_host(size_t bytes) override {
    size_t n = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, n);
    if (!p) return out_of_memory(fmt::format("host allocation of {} failed", format_bytes(n)));
    return p;
  }
  void release_host(void* ptr) override { std::free(ptr); }
  Status register_host(void*, size_t) override { return Status::ok(); }
  void unregister_host(void*) override {}

  Stream& compute_stream() override { return compute_; }
  Stream& h2d_stream() override { return h2d_; }
  Stream& d2h_stream() override { return d2h_; }

  std::unique_ptr<Event> create_event() override { return std::make_unique<CpuEvent>(); }
  void record(Event& event, Stream& stream) override {
    auto& e = static_cast<CpuEvent&>(event);
    auto& s = static_cast<CpuStream&>(stream);
    e.stream = &s;
    if (e.reached) {
      e.seq = s.enqueue([at = e.reached] {
        at->store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
      });
    } else {
      e.seq = s.enqueued();
    }
  }
  std::unique_ptr<Event> create_timed_event() override {
    auto e = std::make_unique<CpuEvent>();
    e->reached = std::make_shared<std::atomic<int64_t>>(0);
    return e;
  }
  Result<double> elapsed_ms(Event& from, Event& to) override {
    auto& a = static_cast<CpuEvent&>(from);
    auto& b = static_cast<CpuEvent&>(to);
    if (!a.reached || !b.reached || !a.stream || !b.stream) {
      return invalid_argument("elapsed_ms: both events must be timed events that were recorded");
    }
    if (!query(a) || !query(b)) {
      return invalid_argument("elapsed_ms: an event has not completed yet (synchronize it first)");
    }
    return double(b.reached->load() - a.reached->load()) * 1e-6;
  }
  void wait(Stream& stream, const Event& event) override {
    const auto& e = static_cast<const CpuEvent&>(event);
    if (!e.stream || e.stream == &stream) return;  // same stream: already ordered
    CpuStream* other = e.stream;
    uint64_t seq = e.seq;
    static_cast<CpuStream&>(stream).enqueue([other, seq] { other->wait_done(seq); });
  }
  Status synchronize(Event& event) override {
    auto& e = static_cast<CpuEvent&>(event);
    if (e.stream) e.stream->wait_done(e.seq);
    return Status::ok();
  }
  Status synchronize(Stream& stream) override {
    auto& s = static_cast<CpuStream&>(stream);
    s.wait_done(s.enqueued());
    return Status::ok();
  }
  bool query(Event& event) override {
    auto& e = static_cast<CpuEvent&>(event);
    return !e.stream || e.stream->is_done(e.seq);
  }

  void copy_h2d(Stream& s, void* dst, const void* src, size_t n) override { copy(s, dst, src, n); }
  void copy_d2h(Stream& s, void* dst, const void* src, size_t n) override { copy(s, dst, src, n); }
  void copy_d2d(Stream& s, void* dst, const void* src, size_t n) override { copy(s, dst, src, n); }
  // Zeroing runs on the device's threads, as kernels do: one thread's stores run at a fraction
  // of the memory's bandwidth (bench-25m's step zeroes 200 MB, its gradient accumulators among
  // them: 22.5 ms at 9 GB/s on one core of two, 17.3 ms at 11.8 on both).
  void memset_zero(Stream& s, void* dst, size_t n) override {
    static_cast<CpuStream&>(s).enqueue([this, dst, n] {
      auto zero = [dst, n] {
        cpu::parallel_ranges(n, kZeroGrain, [dst](size_t b, size_t e) {
          std::memset(static_cast<char*>(dst) + b, 0, e - b);
        });
      };
      if (tasks_) {
        tasks_->execute(zero);
      } else {
        zero();
      }
    });
  }
  void host_fn(Stream& s, std::function<void()> fn) override {
    static_cast<CpuStream&>(s).enqueue(std::move(fn));
  }

  Kernels& kernels() override { return *kernels_; }

 private:
  void copy(Stream& s, void* dst, const void* src, size_t n) {
    static_cast<CpuStream&>(s).enqueue([dst, src, n] { std::memcpy(dst, src, n); });
  }

  static size_t page_bytes() {
    static const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    return page;
  }

  const size_t capacity_;
  const int threads_;
  mutable std::mutex mu_;  // arena_, used_, peak_
  DeviceArena arena_;
  size_t used_ = 0, peak_ = 0;  // bytes asked for (rounded to kAlign), without redzones
  CpuStream compute_, h2d_, d2h_;
  // The kernels' thread limit for memset_zero (empty: TBB's default arena, all cores).
  std::optional<tbb::task_arena> tasks_;
  static constexpr size_t kZeroGrain = size_t{1} << 20;
  std::unique_ptr<Kernels> kernels_;
};

}  // namespace

Result<std::unique_ptr<Device>> create_cpu_device(const CpuDeviceOptions& options) {
  if (options.capacity == 0) {
    return invalid_argument("device.memory_limit: must be > 0 for the cpu backend");
  }
  // Twice the capacity, reserved but not committed (DeviceArena: what fails is decided by the
  // capacity, not by the layout), on 2 MiB pages where the kernel gives them.
  constexpr size_t kHuge = size_t{2} << 20;
  if (options.capacity > (SIZE_MAX >> 2)) {
    return invalid_argument(
        fmt::format("device.memory_limit: {} bytes is more than this "
                    "machine can address; give a size such as \"8GiB\"",
                    options.capacity));
  }
  size_t span = (2 * options.capacity + kHuge - 1) / kHuge * kHuge;
  auto reserve = [&] {
    return ::mmap(nullptr, span, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  };
  void* base = reserve();
  if (base == MAP_FAILED) {  // strict overcommit (vm.overcommit_memory 2) commits it all: the
    span = (options.capacity + kHuge - 1) / kHuge * kHuge;  // capacity alone, as cudaMalloc's
    base = reserve();
  }
  if (base == MAP_FAILED) {
    return out_of_memory(fmt::format(
        "device.memory_limit: cannot reserve {} of address space for the cpu backend's arena of "
        "{}: {}; lower device.memory_limit",
        format_bytes(double(span)), format_bytes(double(options.capacity)), std::strerror(errno)));
  }
  ::madvise(base, span, MADV_HUGEPAGE);  // a hint: 4 KiB pages where refused
  cpu_gemm_path();                       // decided and logged at start, not at the first GEMM
  return std::unique_ptr<Device>(
      std::make_unique<CpuDevice>(options, static_cast<char*>(base), span));
}

const char* cpu_gemm_path() { return cpu::gemm_isa(); }

}  // namespace strata
