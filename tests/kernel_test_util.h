// What the CPU kernel tests share (tests/cpu_kernels_test.cc, tests/cpu_gemm_paths_test.cc,
// tests/llama_kernels_test.cc): typed buffers with fp32 access to single elements, random inputs
// from a per-test seed, relative comparison against double-precision references, and a CPU
// device to run the Kernels table on.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"

namespace strata::kernel_test {

using Vec = std::vector<double>;

// The test's fixed seed; STRATA_TEST_SEED=<n> draws different inputs.
inline uint64_t test_seed(uint64_t fallback) {
  const char* s = std::getenv("STRATA_TEST_SEED");
  return s ? std::strtoull(s, nullptr, 10) + fallback : fallback;
}

// A typed buffer: n elements of dtype dt, with fp32 read/write of single elements. An index
// past the end throws (the test fails naming it) instead of writing past the buffer.
struct Typed {
  DType dt = DType::kF32;
  size_t n = 0;
  std::vector<unsigned char> bytes;

  Typed() = default;
  Typed(DType t, size_t count) : dt(t), n(count), bytes(count * dtype_size(t) + 1) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  float get(size_t i) const { return load_f32(bytes.data(), dt, check(i)); }
  void set(size_t i, float v) { store_f32(bytes.data(), dt, check(i), v); }
  Vec to_double() const {
    Vec v(n);
    for (size_t i = 0; i < n; ++i) v[i] = get(i);
    return v;
  }

 private:
  size_t check(size_t i) const {
    if (i >= n) throw std::out_of_range(fmt::format("Typed: element {} of {}", i, n));
    return i;
  }
};

// Uniform in [lo, hi), rounded to dt, redrawn while it rounds to zero (inputs are never zero).
inline Typed random_typed(DType dt, size_t n, std::mt19937_64& rng, float lo = -1.0f,
                          float hi = 1.0f) {
  Typed t(dt, n);
  std::uniform_real_distribution<float> u(lo, hi);
  for (size_t i = 0; i < n; ++i) {
    do {
      t.set(i, u(rng));
    } while (t.get(i) == 0.0f);
  }
  return t;
}

inline std::vector<float> random_f32(size_t n, std::mt19937_64& rng, float lo = -1.0f,
                                     float hi = 1.0f) {
  Typed t = random_typed(DType::kF32, n, rng, lo, hi);
  std::vector<float> v(n);
  std::memcpy(v.data(), t.data(), n * 4);
  return v;
}

inline std::vector<int32_t> random_tokens(size_t n, int vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> u(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = u(rng);
  return t;
}

inline Vec as_double(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

// Relative tolerance of a result stored in dt.
inline double tol_for(DType dt) {
  switch (dt) {
    case DType::kF32:
      return 1e-5;
    case DType::kBF16:
      return 1e-2;
    default:
      return 1e-3;
  }
}

// Every |got - ref| must be <= tol * (|ref| + rms(ref)): relative, with the array's typical
// magnitude as the floor so that entries near zero (cancellation) are judged on its scale.
inline void expect_close(const Vec& got, const Vec& ref, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double ss = 0;
  for (double r : ref) ss += r * r;
  const double rms = ref.empty() ? 0 : std::sqrt(ss / ref.size());
  size_t bad = 0, worst_i = 0;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]) / (std::fabs(ref[i]) + rms + 1e-30);
    if (!(err <= tol)) ++bad;
    if (!(err <= worst)) {
      worst = err;
      worst_i = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << ref.size() << " entries off; worst at "
                     << worst_i << ": got " << got[worst_i] << ", want " << ref[worst_i]
                     << " (relative error " << worst << " > " << tol << ")";
}

// A CPU device (1 MiB) and its kernels and compute stream.
class Fixture {
 public:
  explicit Fixture(int threads = 2) {
    auto d = create_cpu_device({.capacity = size_t{1} << 20, .threads = threads});
    EXPECT_TRUE(d.is_ok()) << d.status().to_string();
    dev_ = std::move(d).value();
  }
  Kernels& k() { return dev_->kernels(); }
  Stream& s() { return dev_->compute_stream(); }
  Device& dev() { return *dev_; }
  void sync() { ASSERT_TRUE(dev_->synchronize(dev_->compute_stream()).is_ok()); }

 private:
  std::unique_ptr<Device> dev_;
};

inline const DType kAllTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

}  // namespace strata::kernel_test
