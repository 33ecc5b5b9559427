#include "src/train/op_profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <utility>

#include "strata/kernels_wrapper.h"

namespace strata {

// Every op of the wrapped kernels through ProfiledDevice::timed while the profile is on, priced
// first by the simulated kernels' tally (which writes nothing and enqueues nothing).
class ProfiledDevice::Timer final : public KernelsWrapper {
 public:
  Timer(ProfiledDevice* device, Kernels* inner, const SimulatedDeviceOptions& rates)
      : KernelsWrapper(inner), d_(device), tally_(create_simulated_kernel_tally(rates, &cost_)) {}

 protected:
  void run_op(Stream& s, const char* op, const KernelCall& call) override {
    if (!d_->on_.load(std::memory_order_relaxed)) {
      call(*wrapped());
      return;
    }
    std::lock_guard<std::recursive_mutex> lock(d_->mu_);
    cost_ = SimTally{};
    call(*tally_);
    d_->timed(s, op, cost_.flops, cost_.bytes, d_->model_ ? cost_.seconds : -1.0,
              [&] { call(*wrapped()); });
  }

 private:
  ProfiledDevice* const d_;
  SimTally cost_;  // the current call's, under d_->mu_
  const std::unique_ptr<Kernels> tally_;
};

ProfiledDevice::ProfiledDevice(std::unique_ptr<Device> inner,
                               std::optional<SimulatedDeviceOptions> model)
    : DeviceWrapper(std::move(inner)), model_(std::move(model)) {
  // Without a model the tally still counts each op's FLOPs and bytes (which do not depend on
  // the rates); its seconds are not shown.
  SimulatedDeviceOptions rates;
  if (model_) {
    rates = *model_;
  } else {
    rates = simulated_device_preset("h200").value();
  }
  timer_ = std::make_unique<Timer>(this, &wrapped().kernels(), rates);
}

ProfiledDevice::~ProfiledDevice() = default;

Kernels& ProfiledDevice::kernels() { return *timer_; }

int ProfiledDevice::stream_index(Stream& s) {
  if (&s == &wrapped().compute_stream()) return 0;
  if (&s == &wrapped().h2d_stream()) return 1;
  if (&s == &wrapped().d2h_stream()) return 2;
  return 3;
}

Event* ProfiledDevice::take_event() {
  if (used_ == events_.size()) events_.push_back(wrapped().create_timed_event());
  return events_[used_++].get();
}

template <typename F>
void ProfiledDevice::timed(Stream& s, const char* op, double flops, double bytes, double model_s,
                           F&& launch) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  Event* begin = take_event();
  Event* end = take_event();
  wrapped().record(*begin, s);
  launch();
  wrapped().record(*end, s);
  calls_.push_back({op, stream_index(s), begin, end, flops, bytes, model_s});
}

void ProfiledDevice::copy_h2d(Stream& s, void* dst, const void* src, size_t n) {
  if (!on_.load(std::memory_order_relaxed)) return wrapped().copy_h2d(s, dst, src, n);
  timed(s, "copy_h2d", 0, double(n), copy_model_s(n, true, false),
        [&] { wrapped().copy_h2d(s, dst, src, n); });
}
void ProfiledDevice::copy_d2h(Stream& s, void* dst, const void* src, size_t n) {
  if (!on_.load(std::memory_order_relaxed)) return wrapped().copy_d2h(s, dst, src, n);
  timed(s, "copy_d2h", 0, double(n), copy_model_s(n, true, false),
        [&] { wrapped().copy_d2h(s, dst, src, n); });
}
void ProfiledDevice::copy_d2d(Stream& s, void* dst, const void* src, size_t n) {
  if (!on_.load(std::memory_order_relaxed)) return wrapped().copy_d2d(s, dst, src, n);
  timed(s, "copy_d2d", 0, 2.0 * double(n), copy_model_s(n, false, true),
        [&] { wrapped().copy_d2d(s, dst, src, n); });
}
void ProfiledDevice::memset_zero(Stream& s, void* dst, size_t n) {
  if (!on_.load(std::memory_order_relaxed)) return wrapped().memset_zero(s, dst, n);
  const double model_s = model_ ? model_->launch_us * 1e-6 + copy_model_s(n, false, false) : -1;
  timed(s, "memset_zero", 0, double(n), model_s, [&] { wrapped().memset_zero(s, dst, n); });
}

void ProfiledDevice::host_fn(Stream& s, std::function<void()> fn) {
  if (!on_.load(std::memory_order_relaxed)) return wrapped().host_fn(s, std::move(fn));
  timed(s, "host_fn", 0, 0, -1.0, [&] { wrapped().host_fn(s, std::move(fn)); });
}

Status ProfiledDevice::synchronize(Event& event) {
  return waited([&] { return wrapped().synchronize(event); });
}
Status ProfiledDevice::synchronize(Stream& stream) {
  return waited([&] { return wrapped().synchronize(stream); });
}

template <typename F>
Status ProfiledDevice::waited(F&& wait) {
  if (!on_.load(std::memory_order_relaxed)) return wait();
  const auto t0 = std::chrono::steady_clock::now();
  Status st = wait();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  ++waits_;
  wait_ms_ += ms;
  return st;
}

double ProfiledDevice::copy_model_s(size_t bytes, bool over_link, bool twice) const {
  if (!model_) return -1;
  const double moved = double(bytes) * (twice ? 2 : 1);
  return moved / ((over_link ? model_->link_gbps : model_->hbm_gbps) * 1e9);
}

void ProfiledDevice::start(int64_t step) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  calls_.clear();
  used_ = 0;
  waits_ = 0;
  wait_ms_ = 0;
  step_ = step;
  t0_ = std::chrono::steady_clock::now();
  on_.store(true);
}

Result<OpProfile> ProfiledDevice::stop() {
  std::vector<Call> calls;
  OpProfile p;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    on_.store(false);
    calls.swap(calls_);
    p.host_waits = waits_;
    p.host_wait_ms = wait_ms_;
    p.host_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  }
  p.step = step_;
  p.device = wrapped().name();
  if (model_) p.model = model_->preset.empty() ? "simulated device" : model_->preset;
  for (Stream* s :
       {&wrapped().compute_stream(), &wrapped().h2d_stream(), &wrapped().d2h_stream()}) {
    STRATA_RETURN_IF_ERROR(wrapped().synchronize(*s), "the op profile's wait for the step's ops");
  }
  const char* kStreams[] = {"compute", "h2d", "d2h", "other"};
  std::map<std::pair<std::string, int>, OpProfileRow> by_op;
  Event* first[3] = {nullptr, nullptr, nullptr};
  Event* last[3] = {nullptr, nullptr, nullptr};
  for (const Call& c : calls) {
    STRATA_ASSIGN_OR_RETURN(double ms, wrapped().elapsed_ms(*c.begin, *c.end),
                            fmt::format("timing {} (flops_profiler)", c.op));
    OpProfileRow& r = by_op[{c.op, c.stream}];
    r.op = c.op;
    r.stream = kStreams[c.stream];
    ++r.calls;
    r.ms += ms;
    r.flops += c.flops;
    r.bytes += c.bytes;
    if (c.model_s >= 0) r.model_ms = std::max(r.model_ms, 0.0) + c.model_s * 1e3;
    if (c.stream < 3) {
      p.busy_ms[c.stream] += ms;
      if (!first[c.stream]) first[c.stream] = c.begin;
      last[c.stream] = c.end;
    }
  }
  for (int i = 0; i < 3; ++i) {
    if (!first[i]) continue;
    STRATA_ASSIGN_OR_RETURN(p.span_ms[i], wrapped().elapsed_ms(*first[i], *last[i]),
                            "timing a stream's span (flops_profiler)");
  }
  for (auto& [key, row] : by_op) p.rows.push_back(std::move(row));
  std::stable_sort(p.rows.begin(), p.rows.end(),
                   [](const OpProfileRow& a, const OpProfileRow& b) { return a.ms > b.ms; });
  return p;
}

std::string format_op_profile(const OpProfile& p) {
  double total = 0;
  int64_t calls = 0;
  double model_total = 0;
  bool any_model = false;
  for (const OpProfileRow& r : p.rows) {
    total += r.ms;
    calls += r.calls;
    if (r.model_ms >= 0) {
      model_total += r.model_ms;
      any_model = true;
    }
  }
  std::string out = fmt::format(
      "{}{} on {}: {:.2f} ms on the host, which waited for the device {} times ({:.2f} "
      "ms); device busy (span): compute {:.2f} ms ({:.2f}), h2d {:.2f} ({:.2f}), d2h {:.2f} "
      "({:.2f})\n",
      kOpProfileTitle, p.step, p.device, p.host_ms, p.host_waits, p.host_wait_ms, p.busy_ms[0],
      p.span_ms[0], p.busy_ms[1], p.span_ms[1], p.busy_ms[2], p.span_ms[2]);
  out += fmt::format("{:<30} {:<8} {:>6} {:>10} {:>6} {:>9} {:>9} {:>10} {:>7}\n", "op", "stream",
                     "calls", "ms", "share", "TFLOP/s", "GB/s",
                     any_model ? fmt::format("{} ms", p.model) : "model ms", "/model");
  auto row = [&](const std::string& op, const std::string& stream, int64_t n, double ms,
                 double flops, double bytes, double model_ms) {
    const double s = ms * 1e-3;
    std::string rates =
        flops > 0 && s > 0 ? fmt::format("{:>9.2f}", flops / s * 1e-12) : fmt::format("{:>9}", "-");
    rates += bytes > 0 && s > 0 ? fmt::format(" {:>9.1f}", bytes / s * 1e-9)
                                : fmt::format(" {:>9}", "-");
    // A ratio only where the model's time is a microsecond or more.
    std::string model = fmt::format("{:>10} {:>7}", "-", "-");
    if (model_ms >= 0) {
      model = fmt::format("{:>10.3f} ", model_ms);
      model +=
          model_ms >= 1e-3 ? fmt::format("{:>7.2f}", ms / model_ms) : fmt::format("{:>7}", "-");
    }
    out += fmt::format("{:<30} {:<8} {:>6} {:>10.3f} {:>5.1f}% {} {}\n", op, stream, n, ms,
                       total > 0 ? 100.0 * ms / total : 0.0, rates, model);
  };
  double flops = 0, bytes = 0;
  for (const OpProfileRow& r : p.rows) {
    row(r.op, r.stream, r.calls, r.ms, r.flops, r.bytes, r.model_ms);
    flops += r.flops;
    bytes += r.bytes;
  }
  row("total", "", calls, total, flops, bytes, any_model ? model_total : -1);
  return out;
}

}  // namespace strata
