// The CPU device backend: an emulated GPU on the host.
//
// Device memory is a capacity-accounted host arena (allocations beyond the capacity fail with a
// Status, exactly as cudaMalloc would on a full GPU). A released block is kept for the next
// allocation of the same size (as a GPU caching allocator keeps its blocks): a training step
// allocates and frees the same buffers every step, and giving them back to malloc, which maps
// and unmaps blocks this large, made every step fault in and clear its pages again (a fifth of
// bench-25m's step in the kernel on a CPU whose GEMM is fast). Kept blocks are free memory to
// the capacity's accounting; when a new block would make in-use + kept exceed the capacity,
// kept ones are returned to malloc first, so the device never holds more than its capacity
// (device.memory_limit, the arena the host-memory summary counts).
// Each stream is an in-order task queue
// drained by its own thread; an event is a (stream, sequence number) pair that completes when
// the stream has run that far.
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/gemm.h"
#include "strata/device.h"
#include "strata/log.h"

namespace strata {
namespace {

constexpr size_t kAlign = 256;

class CpuStream final : public Stream {
 public:
  explicit CpuStream(std::string name) : name_(std::move(name)) {
    thread_ = std::thread([this] { run(); });
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
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const CpuDeviceOptions& o)
      : capacity_(o.capacity), threads_(o.threads), compute_("compute"), h2d_("h2d"), d2h_("d2h") {
    kernels_ = create_cpu_kernels(*this, o.threads);
  }
  ~CpuDevice() override {
    for (Stream* s : {static_cast<Stream*>(&compute_), static_cast<Stream*>(&h2d_),
                      static_cast<Stream*>(&d2h_)}) {
      synchronize(*s).ignore();
    }
    for (auto& [p, n] : allocs_) std::free(p);
    drop_kept(0);
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  bool host_addressable() const override { return true; }
  std::string name() const override {
    return fmt::format("cpu (arena {}, {} threads)", format_bytes(double(capacity_)),
                       threads_ > 0 ? std::to_string(threads_) : std::string("all"));
  }

  Result<void*> allocate(size_t bytes, std::string_view tag) override {
    size_t n = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    std::lock_guard<std::mutex> lock(mu_);
    if (used_ + n > capacity_) {
      return out_of_memory(fmt::format(
          "device memory: cannot allocate {} for '{}': {} of {} in use ({} free); raise "
          "device.memory_limit or offload more state (zero_optimization.offload_*)",
          format_bytes(double(n)), tag, format_bytes(double(used_)),
          format_bytes(double(capacity_)), format_bytes(double(capacity_ - used_))));
    }
    void* p = nullptr;
    auto k = kept_.find(n);
    if (k != kept_.end()) {
      p = k->second.back();
      k->second.pop_back();
      if (k->second.empty()) kept_.erase(k);
      kept_bytes_ -= n;
    } else {
      drop_kept(used_ + n > capacity_ ? 0 : capacity_ - used_ - n);
      p = std::aligned_alloc(kAlign, n);
      if (!p) {
        return out_of_memory(fmt::format("host malloc of {} failed", format_bytes(double(n))));
      }
    }
    allocs_[p] = n;
    used_ += n;
    peak_ = std::max(peak_, used_);
    return p;
  }
  void release(void* ptr) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.find(ptr);
    STRATA_CHECK(it != allocs_.end(), "release of a pointer this device did not allocate");
    used_ -= it->second;
    kept_[it->second].push_back(ptr);
    kept_bytes_ += it->second;
    allocs_.erase(it);
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
    e.seq = s.enqueued();
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
  void memset_zero(Stream& s, void* dst, size_t n) override {
    static_cast<CpuStream&>(s).enqueue([dst, n] { std::memset(dst, 0, n); });
  }
  void host_fn(Stream& s, std::function<void()> fn) override {
    static_cast<CpuStream&>(s).enqueue(std::move(fn));
  }

  Kernels& kernels() override { return *kernels_; }

 private:
  void copy(Stream& s, void* dst, const void* src, size_t n) {
    static_cast<CpuStream&>(s).enqueue([dst, src, n] { std::memcpy(dst, src, n); });
  }

  const size_t capacity_;
  const int threads_;
  mutable std::mutex mu_;
  // Returns kept blocks to malloc until at most `keep` bytes are kept. Caller holds mu_ (or is
  // the destructor).
  void drop_kept(size_t keep) {
    for (auto it = kept_.begin(); it != kept_.end() && kept_bytes_ > keep;) {
      while (!it->second.empty() && kept_bytes_ > keep) {
        std::free(it->second.back());
        it->second.pop_back();
        kept_bytes_ -= it->first;
      }
      it = it->second.empty() ? kept_.erase(it) : std::next(it);
    }
  }

  std::unordered_map<void*, size_t> allocs_;
  std::unordered_map<size_t, std::vector<void*>> kept_;  // released blocks by size
  size_t used_ = 0, peak_ = 0, kept_bytes_ = 0;
  CpuStream compute_, h2d_, d2h_;
  std::unique_ptr<Kernels> kernels_;
};

}  // namespace

Result<std::unique_ptr<Device>> create_cpu_device(const CpuDeviceOptions& options) {
  if (options.capacity == 0) {
    return invalid_argument("device.memory_limit: must be > 0 for the cpu backend");
  }
  cpu_gemm_path();  // decided and logged at start, not at the first GEMM
  return std::unique_ptr<Device>(std::make_unique<CpuDevice>(options));
}

const char* cpu_gemm_path() { return cpu::gemm_isa(); }

}  // namespace strata
