// The Llama-family ops of the CUDA backend (kernels/cuda/{rmsnorm,swiglu,rope,attention}.cu)
// against the CPU backend, as tests/cuda_backend_test.cc does for the GPT ops: fp32, bf16 and
// fp16, fresh random inputs on both devices, outputs compared with a per-op tolerance. Without
// a visible GPU every test reports SKIPPED with the reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"

namespace strata {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

std::string skip_reason() {
  std::string why;
  return cuda_device_available(&why) ? std::string() : why;
}

uint32_t fresh_seed() { return std::random_device{}(); }

std::vector<float> random_floats(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

std::vector<uint8_t> to_bytes(const std::vector<float>& v, DType dt) {
  std::vector<uint8_t> b(v.size() * dtype_size(dt));
  convert(v.data(), DType::kF32, b.data(), dt, v.size());
  return b;
}

// Compares the CUDA result `got` with the CPU reference `want` element by element:
// |got - want| <= rtol * (|want| + rms(want)). The rms term stands in for an absolute
// tolerance at the scale of the data, so values that cancel to near zero do not fail on noise.
void expect_close(const std::string& what, const std::vector<float>& got,
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
double tol(DType dt, double f32) {
  switch (dt) {
    case DType::kF32:
      return f32;
    case DType::kBF16:
      return 1e-2;
    default:
      return 2e-3;
  }
}
constexpr double kElementwise = 1e-5;  // fp32: ops with no reduction
constexpr double kReduction = 5e-5;    // fp32: sums over a row, a column or a contraction

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

class LlamaCudaOpTest : public CudaBackendTest, public ::testing::WithParamInterface<DType> {};

TEST_P(LlamaCudaOpTest, RmsNorm) {
  const DType dt = GetParam();
  const int N = 67, C = 200;
  Twin inp = random(size_t(N) * C, dt, -3, 5), w = random(C, dt, 0.5, 1.5);
  Twin out = random(size_t(N) * C, dt), rstd = random(N, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.rmsnorm_forward(s, dt, out.p[i], rstd.at<float>(i), inp.p[i], w.p[i], 1e-6f, N, C);
  });
  compare("rmsnorm_forward out", out, dt, tol(dt, kReduction));
  compare("rmsnorm_forward rstd", rstd, DType::kF32, kReduction);
  Twin dout = random(size_t(N) * C, dt), dinp = random(size_t(N) * C, dt);
  Twin dw = random(C, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.rmsnorm_backward(s, dt, dinp.p[i], dw.at<float>(i), dout.p[i], inp.p[i], w.p[i],
                       rstd.at<float>(i), N, C);
  });
  compare("rmsnorm_backward dinp", dinp, dt, tol(dt, kReduction));
  compare("rmsnorm_backward dweight", dw, DType::kF32, kReduction);
}

TEST_P(LlamaCudaOpTest, Swiglu) {
  const DType dt = GetParam();
  const int N = 97, H = 301;
  Twin inp = random(size_t(N) * 2 * H, dt, -5, 5), out = random(size_t(N) * H, dt);
  run([&](Kernels& k, Stream& s, int i) { k.swiglu_forward(s, dt, out.p[i], inp.p[i], N, H); });
  compare("swiglu_forward", out, dt, tol(dt, kElementwise));
  Twin dout = random(size_t(N) * H, dt), dinp = random(size_t(N) * 2 * H, dt);
  run([&](Kernels& k, Stream& s, int i) {
    k.swiglu_backward(s, dt, dinp.p[i], inp.p[i], dout.p[i], N, H);
  });
  compare("swiglu_backward", dinp, dt, tol(dt, kElementwise));
}

TEST_P(LlamaCudaOpTest, Rope) {
  const DType dt = GetParam();
  const int B = 2, T = 45, NH = 6, KVH = 2, hs = 64;
  const size_t n = size_t(B) * T * (NH + 2 * KVH) * hs;
  for (RopeParams p :
       {RopeParams{.theta = 1e6},
        RopeParams{.theta = 500000.0, .llama3 = true, .original_max_position = 32}}) {
    Twin x = random(n, dt, -2, 2);
    run([&](Kernels& k, Stream& s, int i) { k.rope_forward(s, dt, x.p[i], p, B, T, NH, KVH, hs); });
    compare("rope_forward", x, dt, tol(dt, kElementwise));
    run([&](Kernels& k, Stream& s, int i) {
      k.rope_backward(s, dt, x.p[i], p, B, T, NH, KVH, hs);
    });
    compare("rope_backward", x, dt, tol(dt, kElementwise));
  }
}

TEST_P(LlamaCudaOpTest, GroupedQueryAttention) {
  const DType dt = GetParam();
  const int B = 2, T = 45, NH = 6, KVH = 2, hs = 16;  // T not a multiple of the warp width
  const size_t W = size_t(NH + 2 * KVH) * hs;
  Twin qkv = random(size_t(B) * T * W, dt, -2, 2), out = random(size_t(B) * T * NH * hs, dt);
  Twin att = random(size_t(B) * NH * T * T, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.attention_gqa_forward(s, dt, out.p[i], att.at<float>(i), qkv.p[i], B, T, NH, KVH, hs);
  });
  compare("attention_gqa_forward out", out, dt, tol(dt, kReduction));
  compare("attention_gqa_forward att", att, DType::kF32, kReduction);
  Twin dout = random(size_t(B) * T * NH * hs, dt), dqkv = random(size_t(B) * T * W, dt);
  Twin scratch = random(size_t(B) * NH * T * T, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.attention_gqa_backward(s, dt, dqkv.p[i], scratch.at<float>(i), dout.p[i], qkv.p[i],
                             att.at<float>(i), B, T, NH, KVH, hs);
  });
  compare("attention_gqa_backward dqkv", dqkv, dt, tol(dt, kReduction));
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, LlamaCudaOpTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& p) {
                           return std::string(dtype_name(p.param));
                         });

}  // namespace
}  // namespace strata
