// What the CUDA backend tests share (tests/cuda_backend_test.cc, tests/llama_cuda_test.cc): a
// CPU and a CUDA device side by side, buffers holding the same bytes on both ("twins"), an op run
// on both, and the CUDA result compared with the CPU one within a per-op tolerance. Without a
// visible GPU, CudaBackendTest's tests report SKIPPED with the reason.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"

namespace strata::cuda_test {

inline constexpr size_t kMiB = size_t{1} << 20;

inline std::string skip_reason() {
  std::string why;
  return cuda_device_available(&why) ? std::string() : why;
}

inline uint32_t fresh_seed() { return std::random_device{}(); }

inline std::vector<float> random_floats(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

inline std::vector<uint8_t> to_bytes(const std::vector<float>& v, DType dt) {
  std::vector<uint8_t> b(v.size() * dtype_size(dt));
  convert(v.data(), DType::kF32, b.data(), dt, v.size());
  return b;
}

// Compares the CUDA result `got` with the CPU reference `want` element by element:
// |got - want| <= rtol * (|want| + rms(want)). The rms term stands in for an absolute
// tolerance at the scale of the data, so values that cancel to near zero do not fail on noise.
inline void expect_close(const std::string& what, const std::vector<float>& got,
                         const std::vector<float>& want, double rtol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double ss = 0;
  for (float w : want) ss += double(w) * w;
  const double rms = want.empty() ? 0.0 : std::sqrt(ss / want.size());
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - want[i]);
    const double lim = rtol * (std::fabs(want[i]) + rms);
    const double ratio = lim > 0 ? err / lim : (err > 0 ? INFINITY : 0);
    if (!(err <= lim) && !(std::isnan(got[i]) && std::isnan(want[i]))) ++bad;
    if (ratio > worst_ratio || std::isnan(got[i]) != std::isnan(want[i])) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements outside rtol "
                     << rtol << "; worst at [" << worst << "]: cuda " << got[worst] << " vs cpu "
                     << want[worst] << " (rms " << rms << ")";
}

// One buffer on each device: [0] on the CPU backend, [1] on the CUDA backend.
struct Twin {
  void* p[2] = {nullptr, nullptr};
  size_t bytes = 0;
  template <typename T = void>
  T* at(int i) const {
    return static_cast<T*>(p[i]);
  }
};

// Per-op tolerance: `f32` for fp32; bf16 and fp16 are set by their rounding (one unit in the
// last place of a value near its power of two: 2^-7 for bf16, 2^-10 for fp16), with room for a
// rounding that falls the other way after a different fp32 summation order.
inline double tol(DType dt, double f32) {
  switch (dt) {
    case DType::kF32:
      return f32;
    case DType::kBF16:
      return 1e-2;
    default:
      return 2e-3;
  }
}
inline constexpr double kElementwise = 1e-5;  // fp32: ops with no reduction
inline constexpr double kReduction = 5e-5;    // fp32: sums over a row, a column or a contraction

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = skip_reason();
    if (!why.empty()) GTEST_SKIP() << why;
    auto cpu = create_cpu_device({.capacity = 512 * kMiB, .threads = 2});
    ASSERT_TRUE(cpu.is_ok()) << cpu.status().to_string();
    auto gpu =
        create_cuda_device({.ordinal = 0, .reserve = size_t{1} << 30, .capacity = 1024 * kMiB});
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    dev_[0] = std::move(cpu).value();
    dev_[1] = std::move(gpu).value();
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  void TearDown() override {
    for (int i = 0; i < 2; ++i) {
      if (!dev_[i]) continue;
      for (Twin& t : twins_) dev_[i]->release(t.p[i]);
    }
    twins_.clear();
  }

  // A buffer on both devices holding the same bytes.
  Twin upload(const std::vector<uint8_t>& host) {
    Twin t;
    t.bytes = host.size();
    for (int i = 0; i < 2; ++i) {
      auto p = dev_[i]->allocate(host.size(), "test");
      EXPECT_TRUE(p.is_ok()) << p.status().to_string();
      if (!p.is_ok()) return t;
      t.p[i] = *p;
      dev_[i]->copy_h2d(dev_[i]->h2d_stream(), t.p[i], host.data(), host.size());
      EXPECT_TRUE(dev_[i]->synchronize(dev_[i]->h2d_stream()).is_ok());
    }
    twins_.push_back(t);
    return t;
  }
  Twin upload(const std::vector<float>& v, DType dt) { return upload(to_bytes(v, dt)); }
  Twin random(size_t n, DType dt, float lo = -1.0f, float hi = 1.0f) {
    return upload(random_floats(rng_, n, lo, hi), dt);
  }
  Twin tokens(size_t n, int vocab) {
    std::uniform_int_distribution<int32_t> u(0, vocab - 1);
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = u(rng_);
    std::vector<uint8_t> b(n * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return upload(b);
  }

  // Runs `op(kernels, stream, i)` on both devices and waits for both.
  template <typename Op>
  void run(Op&& op) {
    for (int i = 0; i < 2; ++i) {
      op(dev_[i]->kernels(), dev_[i]->compute_stream(), i);
      Status st = dev_[i]->synchronize(dev_[i]->compute_stream());
      ASSERT_TRUE(st.is_ok()) << (i ? "cuda: " : "cpu: ") << st.to_string();
    }
  }

  std::vector<float> download(const Twin& t, int i, DType dt) {
    std::vector<uint8_t> b(t.bytes);
    dev_[i]->copy_d2h(dev_[i]->d2h_stream(), b.data(), t.p[i], t.bytes);
    EXPECT_TRUE(dev_[i]->synchronize(dev_[i]->d2h_stream()).is_ok());
    std::vector<float> v(t.bytes / dtype_size(dt));
    convert(b.data(), dt, v.data(), DType::kF32, v.size());
    return v;
  }
  // Compares a buffer of `dt` elements after an op: CUDA against CPU.
  void compare(const std::string& what, const Twin& t, DType dt, double rtol) {
    expect_close(what + " (seed " + std::to_string(seed_) + ")", download(t, 1, dt),
                 download(t, 0, dt), rtol);
  }

  std::unique_ptr<Device> dev_[2];
  std::vector<Twin> twins_;
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

}  // namespace strata::cuda_test
