// Finite-difference checks of the CPU kernels (kernels/cpu/): each backward op against its own
// forward, through the Kernels table of a CPU device (split from cpu_kernels_test.cc, which checks
// every op against double-precision references). Inputs are drawn from a fixed seed per test;
// STRATA_TEST_SEED=<n> draws different ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "strata/dtype.h"
#include "strata/kernels.h"
#include "tests/kernel_test_util.h"

namespace strata {
namespace {

using namespace kernel_test;

// ---------------------------------------------------------------------------------------------
// Finite differences: each backward op against its own forward (fp32 kernels), with the loss
// L = sum(dout * out) evaluated in double and central differences of +-h.

struct FdSample {
  float* param;
  size_t n;
  const float* analytic;  // dL/dparam from the backward op, started from zero
  const char* name;
};

void fd_check(const std::function<double()>& loss, const FdSample& p, std::mt19937_64& rng,
              double h = 1e-2, size_t samples = 48) {
  std::vector<size_t> idx;
  if (p.n <= samples) {
    for (size_t i = 0; i < p.n; ++i) idx.push_back(i);
  } else {
    std::uniform_int_distribution<size_t> u(0, p.n - 1);
    for (size_t k = 0; k < samples; ++k) idx.push_back(u(rng));
  }
  double scale = 0;
  for (size_t i : idx) scale += std::fabs(p.analytic[i]);
  scale /= idx.size();
  for (size_t i : idx) {
    float orig = p.param[i];
    float hi = orig + float(h), lo = orig - float(h);
    p.param[i] = hi;
    double lp = loss();
    p.param[i] = lo;
    double lm = loss();
    p.param[i] = orig;
    double fd = (lp - lm) / (double(hi) - double(lo));
    double an = p.analytic[i];
    EXPECT_LE(std::fabs(fd - an), 1e-2 * (std::fabs(an) + scale) + 1e-6)
        << p.name << "[" << i << "]: finite difference " << fd << ", backward " << an;
  }
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

TEST(CpuKernelsGradCheck, Encoder) {
  std::mt19937_64 rng(test_seed(11));
  const int B = 2, T = 5, C = 6, Vp = 7;
  auto wte = random_f32(size_t(Vp) * C, rng), wpe = random_f32(size_t(T) * C, rng);
  auto tokens = random_tokens(B * T, Vp, rng);
  auto dout = random_f32(size_t(B) * T * C, rng);
  std::vector<float> out(dout.size()), dwte(wte.size(), 0.0f), dwpe(wpe.size(), 0.0f);
  Fixture f;
  auto loss = [&] {
    f.k().encoder_forward(f.s(), DType::kF32, out.data(), tokens.data(), nullptr, wte.data(),
                          wpe.data(), B, T, C);
    f.sync();
    return dot(out, dout);
  };
  f.k().encoder_backward(f.s(), DType::kF32, dwte.data(), dwpe.data(), dout.data(), tokens.data(),
                         nullptr, B, T, C);
  f.sync();
  fd_check(loss, {wte.data(), wte.size(), dwte.data(), "dwte"}, rng);
  fd_check(loss, {wpe.data(), wpe.size(), dwpe.data(), "dwpe"}, rng);
}

TEST(CpuKernelsGradCheck, LayerNorm) {
  std::mt19937_64 rng(test_seed(12));
  const int N = 4, C = 9;
  auto x = random_f32(size_t(N) * C, rng), w = random_f32(C, rng, 0.5f, 1.5f);
  auto b = random_f32(C, rng), dout = random_f32(x.size(), rng);
  std::vector<float> out(x.size()), mean(N), rstd(N);
  std::vector<float> dx(x.size(), 0.0f), dw(C, 0.0f), db(C, 0.0f);
  Fixture f;
  auto loss = [&] {
    f.k().layernorm_forward(f.s(), DType::kF32, out.data(), mean.data(), rstd.data(), x.data(),
                            w.data(), b.data(), N, C);
    f.sync();
    return dot(out, dout);
  };
  loss();
  f.k().layernorm_backward(f.s(), DType::kF32, dx.data(), dx.data(), dw.data(), db.data(),
                           dout.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  f.sync();
  fd_check(loss, {x.data(), x.size(), dx.data(), "dinp"}, rng, 1e-3);
  fd_check(loss, {w.data(), w.size(), dw.data(), "dweight"}, rng, 1e-3);
  fd_check(loss, {b.data(), b.size(), db.data(), "dbias"}, rng, 1e-3);
}

TEST(CpuKernelsGradCheck, Matmul) {
  std::mt19937_64 rng(test_seed(13));
  const int N = 5, C = 7, OC = 6;
  auto x = random_f32(size_t(N) * C, rng), w = random_f32(size_t(OC) * C, rng);
  auto b = random_f32(OC, rng), dout = random_f32(size_t(N) * OC, rng);
  std::vector<float> out(dout.size()), dx(x.size(), 0.0f), dw(w.size(), 0.0f), db(OC, 0.0f);
  Fixture f;
  auto loss = [&] {
    f.k().matmul_forward(f.s(), DType::kF32, out.data(), x.data(), w.data(), b.data(), N, C, OC);
    f.sync();
    return dot(out, dout);
  };
  f.k().matmul_backward(f.s(), DType::kF32, dx.data(), dw.data(), db.data(), dout.data(), x.data(),
                        w.data(), N, C, OC, /*accumulate=*/true);
  f.sync();
  fd_check(loss, {x.data(), x.size(), dx.data(), "dinp"}, rng);
  fd_check(loss, {w.data(), w.size(), dw.data(), "dweight"}, rng);
  fd_check(loss, {b.data(), b.size(), db.data(), "dbias"}, rng);
}

TEST(CpuKernelsGradCheck, Attention) {
  std::mt19937_64 rng(test_seed(14));
  const int B = 2, T = 5, C = 8, NH = 2;
  auto qkv = random_f32(size_t(B) * T * 3 * C, rng), dout = random_f32(size_t(B) * T * C, rng);
  std::vector<float> out(dout.size()), att(size_t(B) * NH * T * T), scratch(att.size());
  std::vector<float> dqkv(qkv.size(), 0.0f);
  Fixture f;
  auto loss = [&] {
    f.k().attention_gqa_forward(f.s(), DType::kF32, out.data(), att.data(), qkv.data(), nullptr, B,
                                T, NH, NH, C / NH);
    f.sync();
    return dot(out, dout);
  };
  loss();
  f.k().attention_gqa_backward(f.s(), DType::kF32, dqkv.data(), scratch.data(), dout.data(),
                               qkv.data(), att.data(), nullptr, B, T, NH, NH, C / NH);
  f.sync();
  fd_check(loss, {qkv.data(), qkv.size(), dqkv.data(), "dqkv"}, rng, 1e-2, 120);
}

TEST(CpuKernelsGradCheck, Gelu) {
  std::mt19937_64 rng(test_seed(15));
  const size_t n = 40;
  auto x = random_f32(n, rng, -4.0f, 4.0f), dout = random_f32(n, rng);
  std::vector<float> out(n), dx(n, 0.0f);
  Fixture f;
  auto loss = [&] {
    f.k().gelu_forward(f.s(), DType::kF32, out.data(), x.data(), n);
    f.sync();
    return dot(out, dout);
  };
  f.k().gelu_backward(f.s(), DType::kF32, dx.data(), x.data(), dout.data(), n);
  f.sync();
  fd_check(loss, {x.data(), n, dx.data(), "dinp"}, rng, 1e-3);
}

TEST(CpuKernelsGradCheck, CrossEntropy) {
  std::mt19937_64 rng(test_seed(16));
  const int N = 3, V = 11, Vp = 16;
  auto logits = random_f32(size_t(N) * Vp, rng, -3.0f, 3.0f);
  auto targets = random_tokens(N, V, rng);
  const float dloss = 0.7f;
  std::vector<float> losses(N), work;
  Fixture f;
  auto loss = [&] {
    work = logits;  // the op overwrites its input with the gradient
    f.k().crossentropy_forward_backward(f.s(), DType::kF32, losses.data(), work.data(),
                                        targets.data(), dloss, N, V, Vp);
    f.sync();
    double s = 0;
    for (float l : losses) s += double(l) * dloss;
    return s;
  };
  loss();
  std::vector<float> grad = work;
  fd_check(loss, {logits.data(), logits.size(), grad.data(), "dlogits"}, rng, 1e-3);
}

}  // namespace
}  // namespace strata
