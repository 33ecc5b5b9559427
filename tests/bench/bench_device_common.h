// What bench_device_ops's modes share (tests/bench/bench_device_ops.cc, and its elementwise
// rows in bench_device_elementwise.cc): the options, the timing of a case, random device
// buffers, number formatting.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::bench {

using json = nlohmann::json;

struct Options {
  std::string mode, backend = "cuda", json_path, md_path;
  bool quick = false;
  int warmup = 1, repeats = 5;
  double peak_tflops = 0;
  double peak_gbs = 0;  // the device memory's bandwidth, for the elementwise rows' share
};

struct Spread {
  double median = 0, min = 0, max = 0;
};

// Seconds per call of fn (which enqueues `iters` calls and synchronizes): the median over
// `repeats` timed passes after `warmup` discarded ones. A case whose first pass takes long gets
// fewer timed passes (at least one), so one slow case cannot eat the run's time budget.
inline Spread time_per_call(const Options& o, int iters, const std::function<Status()>& fn,
                            Status* st) {
  constexpr double kCaseBudgetS = 10.0;
  std::vector<double> s;
  int repeats = o.repeats;
  for (int i = 0; i < o.warmup + repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    Status r = fn();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.is_ok() && st->is_ok()) *st = r;
    if (i == 0) repeats = std::clamp(int(kCaseBudgetS / std::max(dt, 1e-9)), 1, o.repeats);
    if (i >= o.warmup) s.push_back(dt / iters);
  }
  std::sort(s.begin(), s.end());
  return {s[s.size() / 2], s.front(), s.back()};
}

inline json to_json(const Spread& s) {
  return {{"median", s.median}, {"min", s.min}, {"max", s.max}};
}

// A device buffer filled with small random values of dtype dt (never all zeros).
class Buffers {
 public:
  explicit Buffers(Device& d) : dev_(d) {}
  ~Buffers() {
    for (void* p : ptrs_) dev_.release(p);
  }
  Result<void*> random(size_t n, DType dt, float lo = -1.0f, float hi = 1.0f) {
    STRATA_ASSIGN_OR_RETURN(void* p, dev_.allocate(n * dtype_size(dt), "bench"), "bench buffer");
    ptrs_.push_back(p);
    std::vector<float> f(std::min<size_t>(n, size_t{1} << 20));
    std::uniform_real_distribution<float> u(lo, hi);
    for (float& x : f) x = u(rng_);
    std::vector<unsigned char> b(f.size() * dtype_size(dt));
    convert(f.data(), DType::kF32, b.data(), dt, f.size());
    for (size_t off = 0; off < n; off += f.size()) {  // repeat the random block
      const size_t k = std::min(f.size(), n - off);
      dev_.copy_h2d(dev_.h2d_stream(), static_cast<char*>(p) + off * dtype_size(dt), b.data(),
                    k * dtype_size(dt));
      STRATA_RETURN_IF_ERROR(dev_.synchronize(dev_.h2d_stream()), "bench upload");
    }
    return p;
  }
  // Releases p (from dev.allocate) with the others.
  void keep(void* p) { ptrs_.push_back(p); }

 private:
  Device& dev_;
  std::vector<void*> ptrs_;
  std::mt19937 rng_{12345};
};

// v with `prec` decimals, or 3 significant digits when that would show less.
inline std::string fmt_num(double v, int prec = 1) {
  char buf[64];
  if (v != 0 && std::fabs(v) < std::pow(10.0, 2 - prec)) {
    std::snprintf(buf, sizeof buf, "%.3g", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  }
  return buf;
}

// The elementwise rows (bench_device_elementwise.cc) on `dev`, and on `one_element` (a device
// whose kernels take one element a thread's access; null: no such column) beside them.
Status bench_elementwise(Device& dev, Device* one_element, const Options& o, json* out,
                         std::string* md);
// Each of those ops once on `dev` (after its buffers are made, none timed but by the wall clock
// around its call): what a kernel profiler attached to the process sees, op by op.
Status run_kernels_once(Device& dev, const Options& o, json* out, std::string* md);

}  // namespace strata::bench
