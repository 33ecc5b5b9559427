// The simulated fast device (strata/device.h, SimulatedDeviceOptions): a CPU device whose
// kernels cost their modeled time (sim_kernels.h) and whose copies take at least the link's.
//
// Its kernels write nothing (but the cross-entropy's losses, which count as a copy's bytes),
// so device memory holds only what copies put there. A buffer the
// model zeroes (gradients before their first accumulation) may have held a copy's bytes — a
// parameter's bf16, say — which the host would then read back as fp32 gradients; so the device
// remembers which ranges copies wrote since they were last zeroed, and memset_zero clears
// those bytes for real, charging the whole range's modeled time. Gradients then reach the
// host's optimizer as zeros, and its time is the real one.
//
// So every byte outside those ranges is zero (the arena starts as zero pages), and a copy
// within the device moves only the bytes copies wrote: it zeroes the destination's written
// bytes and copies the source's, charging the whole range's modeled time. A device-to-device
// copy of gradients (zero here) then costs the host nothing, as it costs a GPU's host nothing,
// where a real memcpy of every module's gradients each step took the host longer than the
// modeled compute.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/cpu/sim_kernels.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/device_wrapper.h"
#include "strata/simulated_device.h"

namespace strata {
namespace {

// Byte ranges written by copies, disjoint and merged: [first, second).
class DirtyRanges {
 public:
  void add(char* a, size_t n) {
    if (n == 0) return;
    std::lock_guard<std::mutex> l(mu_);
    add_locked(a, n);
  }
  // Zeroes the written bytes within [a, a + n) and forgets them.
  void clear(char* a, size_t n) {
    if (n == 0) return;
    std::lock_guard<std::mutex> l(mu_);
    clear_locked(a, n);
  }
  // memcpy(dst, src, n) for device memory whose unwritten bytes are zero: dst's written bytes
  // are zeroed, then src's written bytes copied (and remembered as written in dst).
  void copy(char* dst, const char* src, size_t n) {
    if (n == 0) return;
    std::lock_guard<std::mutex> l(mu_);
    std::vector<std::pair<size_t, size_t>> parts;  // [offset, end) within src
    const char* end = src + n;
    auto it = r_.upper_bound(const_cast<char*>(src));
    if (it != r_.begin() && std::prev(it)->second > src) --it;
    for (; it != r_.end() && it->first < end; ++it) {
      const char* lo = std::max<const char*>(src, it->first);
      const char* hi = std::min<const char*>(end, it->second);
      if (lo < hi) parts.emplace_back(size_t(lo - src), size_t(hi - src));
    }
    clear_locked(dst, n);
    for (auto [lo, hi] : parts) {
      std::memcpy(dst + lo, src + lo, hi - lo);
      add_locked(dst + lo, hi - lo);
    }
  }

 private:
  void add_locked(char* a, size_t n) {
    char* b = a + n;
    auto it = r_.upper_bound(a);
    if (it != r_.begin() && std::prev(it)->second >= a) --it;
    while (it != r_.end() && it->first <= b) {
      a = std::min(a, it->first);
      b = std::max(b, it->second);
      it = r_.erase(it);
    }
    r_.emplace(a, b);
  }
  void clear_locked(char* a, size_t n) {
    char* b = a + n;
    auto it = r_.upper_bound(a);
    if (it != r_.begin() && std::prev(it)->second > a) --it;
    while (it != r_.end() && it->first < b) {
      char* lo = std::max(a, it->first);
      char* hi = std::min(b, it->second);
      std::memset(lo, 0, size_t(hi - lo));
      char* first = it->first;
      char* second = it->second;
      it = r_.erase(it);
      if (first < lo) r_.emplace(first, lo);
      if (hi < second) {
        it = r_.emplace(hi, second).first;
        ++it;
      }
    }
  }

  std::mutex mu_;
  std::map<char*, char*> r_;
};

double seconds_since(SimClock::Clock::time_point t0) {
  return std::chrono::duration<double>(SimClock::Clock::now() - t0).count();
}

// An event of the wrapped device and the clock time its last record reached (ticks of
// SimClock::Clock; 0 before any), shared with the recording op.
class SimEvent final : public Event {
 public:
  explicit SimEvent(std::unique_ptr<Event> e) : inner(std::move(e)) {}
  const std::unique_ptr<Event> inner;
  const std::shared_ptr<std::atomic<int64_t>> at = std::make_shared<std::atomic<int64_t>>(0);
  // For elapsed_ms: when a GPU's stream would have reached the record, the later of `at` and
  // the record's launch (an idle stream reaches it when it is enqueued); 0 before any.
  const std::shared_ptr<std::atomic<int64_t>> reached = std::make_shared<std::atomic<int64_t>>(0);
};

class SimDevice final : public DeviceWrapper {
 public:
  SimDevice(std::unique_ptr<Device> inner, const SimulatedDeviceOptions& p)
      : DeviceWrapper(std::move(inner)), p_(p) {
    kernels_ = create_sim_kernels(wrapped(), clocks_, p_, [this](void* dst, size_t n) {
      dirty_.add(static_cast<char*>(dst), n);
    });
  }
  ~SimDevice() override {
    // Work still queued on the streams refers to this device's clocks and ranges.
    for (Stream* s : {&compute_stream(), &h2d_stream(), &d2h_stream()}) {
      (void)synchronize(*s);
    }
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  bool host_addressable() const override { return false; }
  std::string name() const override {
    return fmt::format(
        "simulated {} (GEMM {:.0f} TFLOP/s, attention {:.0f}/{:.0f}, HBM {:.0f} GB/s, link "
        "{:.0f} GB/s, {:.0f} us a kernel) over {}",
        p_.preset.empty() ? "device" : p_.preset, p_.gemm_tflops, p_.attention_fwd_tflops,
        p_.attention_bwd_tflops, p_.hbm_gbps, p_.link_gbps, p_.launch_us, wrapped().name());
  }

  // Copies are real (within the device: the written bytes, DirtyRanges::copy); each takes its
  // bytes over the link's rate (within the device: over the HBM's, read and write), or the
  // host's memcpy when that is slower, from its launch or the op before it.
  void copy_h2d(Stream& s, void* dst, const void* src, size_t n) override {
    copy(s, dst, src, n, Direction::kToDevice);
  }
  void copy_d2h(Stream& s, void* dst, const void* src, size_t n) override {
    copy(s, dst, src, n, Direction::kToHost);
  }
  void copy_d2d(Stream& s, void* dst, const void* src, size_t n) override {
    copy(s, dst, src, n, Direction::kWithin);
  }
  void memset_zero(Stream& s, void* dst, size_t n) override {
    SimClock* clock = &clocks_.of(wrapped(), s);
    DirtyRanges* dirty = &dirty_;
    const double t = p_.launch_us * 1e-6 + double(n) / (p_.hbm_gbps * 1e9);
    const auto launched = SimClock::Clock::now();
    wrapped().host_fn(s, [clock, dirty, dst, n, t, launched] {
      const auto t0 = SimClock::Clock::now();
      dirty->clear(static_cast<char*>(dst), n);
      clock->run(std::max(t, seconds_since(t0)), launched);
    });
  }

  // Events carry the time their stream's clock had reached when they were recorded: a stream
  // that waits for one starts its next op no earlier than that (as a GPU's would), whenever its
  // thread got past the wait.
  std::unique_ptr<Event> create_event() override {
    return std::make_unique<SimEvent>(wrapped().create_event());
  }
  void record(Event& event, Stream& s) override {
    auto& e = static_cast<SimEvent&>(event);
    SimClock* clock = &clocks_.of(wrapped(), s);
    const auto launched = SimClock::Clock::now();
    wrapped().host_fn(s, [clock, at = e.at, reached = e.reached, launched] {
      const auto end = clock->end();
      at->store(end.time_since_epoch().count());
      reached->store(std::max(end, launched).time_since_epoch().count());
    });
    wrapped().record(*e.inner, s);
  }
  // Every event is timed: the modeled time between the two records.
  std::unique_ptr<Event> create_timed_event() override { return create_event(); }
  Result<double> elapsed_ms(Event& from, Event& to) override {
    auto& a = static_cast<SimEvent&>(from);
    auto& b = static_cast<SimEvent&>(to);
    if (!query(a) || !query(b) || a.reached->load() == 0 || b.reached->load() == 0) {
      return invalid_argument("elapsed_ms: both events must be recorded and completed");
    }
    const SimClock::Clock::duration d(b.reached->load() - a.reached->load());
    return std::chrono::duration<double, std::milli>(d).count();
  }
  void wait(Stream& s, const Event& event) override {
    const auto& e = static_cast<const SimEvent&>(event);
    wrapped().wait(s, *e.inner);
    SimClock* clock = &clocks_.of(wrapped(), s);
    wrapped().host_fn(s, [clock, at = e.at] {
      clock->run(0.0, SimClock::Clock::time_point(SimClock::Clock::duration(at->load())));
    });
  }
  using DeviceWrapper::synchronize;
  Status synchronize(Event& event) override {
    return wrapped().synchronize(*static_cast<SimEvent&>(event).inner);
  }
  bool query(Event& event) override {
    return wrapped().query(*static_cast<SimEvent&>(event).inner);
  }
  // A host function takes its real time, from its launch or the op before it.
  void host_fn(Stream& s, std::function<void()> fn) override {
    SimClock* clock = &clocks_.of(wrapped(), s);
    const auto launched = SimClock::Clock::now();
    wrapped().host_fn(s, [clock, launched, fn = std::move(fn)] {
      const auto t0 = SimClock::Clock::now();
      fn();
      clock->run(seconds_since(t0), launched);
    });
  }
  Kernels& kernels() override { return *kernels_; }

 private:
  enum class Direction { kToDevice, kToHost, kWithin };
  void copy(Stream& s, void* dst, const void* src, size_t n, Direction d) {
    SimClock* clock = &clocks_.of(wrapped(), s);
    DirtyRanges* dirty = &dirty_;
    const double rate = d == Direction::kWithin ? p_.hbm_gbps * 1e9 / 2 : p_.link_gbps * 1e9;
    const double t = double(n) / rate;
    const auto launched = SimClock::Clock::now();
    wrapped().host_fn(s, [clock, dirty, dst, src, n, t, d, launched] {
      const auto t0 = SimClock::Clock::now();
      if (d == Direction::kWithin) {
        dirty->copy(static_cast<char*>(dst), static_cast<const char*>(src), n);
      } else {
        std::memcpy(dst, src, n);
        if (d == Direction::kToDevice) dirty->add(static_cast<char*>(dst), n);
      }
      clock->run(std::max(t, seconds_since(t0)), launched);
    });
  }

  const SimulatedDeviceOptions p_;
  SimClocks clocks_;
  DirtyRanges dirty_;
  std::unique_ptr<Kernels> kernels_;
};

}  // namespace

Result<SimulatedDeviceOptions> simulated_device_preset(std::string_view name) {
  SimulatedDeviceOptions o;
  o.preset = std::string(name);
  if (name == "h200" || name == "h100") {
    // Measured on an H200 (docs/GPU.md): cuBLASLt 413-694 TFLOP/s at GPT-2 124M's shapes
    // (bench_device_ops), pinned copies 55 GB/s each way; attention as a training step there
    // ran it, cuDNN's fused attention (found beside a PyTorch install): 248 TFLOP/s forward and
    // 180 backward at GPT-2's shape (T 1024, head size 64), 325 and 235 at the Llama's (T 2048)
    // in the op profile (these FLOPs: causal, the backward 2.5x the forward). The own kernels
    // (no cuDNN found, or STRATA_CUDNN=0) reach 45-74 and 27-40: device.simulate_attention_*
    // 55 and 30 model them. The H100 SXM has the same compute peaks and 3.35 TB/s of HBM.
    o.gemm_tflops = 580;
    o.attention_fwd_tflops = 250;
    o.attention_bwd_tflops = 180;
    o.hbm_gbps = name == "h200" ? 3800 : 2700;
    o.link_gbps = 55;
    o.launch_us = 4;
    o.memory = name == "h200" ? (size_t{140} << 30) : (size_t{79} << 30);
  } else if (name == "a100") {
    // The same kernels' share of the A100's peaks (312 TFLOP/s bf16, 2.0 TB/s, PCIe gen 4).
    o.gemm_tflops = 190;
    o.attention_fwd_tflops = 80;
    o.attention_bwd_tflops = 57;
    o.hbm_gbps = 1600;
    o.link_gbps = 25;
    o.launch_us = 5;
    o.memory = size_t{79} << 30;
  } else {
    return invalid_argument(fmt::format(
        "device.simulate '{}' is not a preset: use h200, h100 or a100 (and device.simulate_* to "
        "change its rates)",
        name));
  }
  return o;
}

Result<SimulatedDeviceOptions> simulated_device_options(const DeviceConfig& d) {
  STRATA_ASSIGN_OR_RETURN(SimulatedDeviceOptions sim, simulated_device_preset(d.simulate),
                          "device.simulate");
  for (auto [v, field] : {std::pair{d.simulate_gemm_tflops, &sim.gemm_tflops},
                          std::pair{d.simulate_attention_fwd_tflops, &sim.attention_fwd_tflops},
                          std::pair{d.simulate_attention_bwd_tflops, &sim.attention_bwd_tflops},
                          std::pair{d.simulate_hbm_gbps, &sim.hbm_gbps},
                          std::pair{d.simulate_link_gbps, &sim.link_gbps}}) {
    if (v > 0) *field = v;
  }
  if (d.simulate_launch_us >= 0) sim.launch_us = d.simulate_launch_us;
  if (d.memory_limit > 0) sim.memory = std::min(d.memory_limit, sim.memory);
  return sim;
}

double simulated_attention_seconds(const SimulatedDeviceOptions& p, double square_flops,
                                   bool backward) {
  const double causal = square_flops / 2.0;
  return backward ? 2.5 * causal / (p.attention_bwd_tflops * 1e12)
                  : causal / (p.attention_fwd_tflops * 1e12);
}

Result<std::unique_ptr<Device>> create_simulated_device(const CpuDeviceOptions& cpu,
                                                        const SimulatedDeviceOptions& sim) {
  for (auto [v, key] : {std::pair{sim.gemm_tflops, "simulate_gemm_tflops"},
                        std::pair{sim.attention_fwd_tflops, "simulate_attention_fwd_tflops"},
                        std::pair{sim.attention_bwd_tflops, "simulate_attention_bwd_tflops"},
                        std::pair{sim.hbm_gbps, "simulate_hbm_gbps"},
                        std::pair{sim.link_gbps, "simulate_link_gbps"}}) {
    if (!(v > 0)) {
      return invalid_argument(fmt::format("device.{} must be > 0 (got {})", key, v));
    }
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> inner, create_cpu_device(cpu),
                          "the simulated device's memory and streams");
  return std::unique_ptr<Device>(std::make_unique<SimDevice>(std::move(inner), sim));
}

}  // namespace strata
