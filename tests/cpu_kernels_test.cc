// The CPU kernels (kernels/cpu/) through the Kernels table of a CPU device:
//   - every op against a straightforward double-precision reference written here, on fresh
//     random inputs (never zeros), several shapes including odd ones and shapes that cross the
//     kernels' internal tile and chunk boundaries, in fp32, bf16 and fp16;
//   - backward ops start from non-zero gradients, so the accumulate (+=) contract is checked;
//   - (finite-difference checks of every backward op: cpu_kernels_gradcheck_test.cc);
//   - determinism: the same inputs give the same bits on every run and for 1, 2 or 3 threads;
//   - asynchrony: a call only enqueues; nothing is computed before the stream reaches it.
// The CPU backend's device memory is host memory, so host vectors serve as device buffers.
// Inputs are drawn from a fixed seed per test; STRATA_TEST_SEED=<n> draws different ones.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/gelu.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/ops.h"
#include "strata/cpu_optim.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"
#include "tests/cpu_gemm_test_util.h"
#include "tests/kernel_test_util.h"

namespace strata {
namespace {

using namespace kernel_test;

// ---------------------------------------------------------------------------------------------
// Double-precision references (llm.c train_gpt2.c math).

Vec ref_gelu(const Vec& x) {
  Vec y(x.size());
  const double s = std::sqrt(2.0 / M_PI);
  for (size_t i = 0; i < x.size(); ++i) {
    double v = x[i];
    y[i] = 0.5 * v * (1.0 + std::tanh(s * (v + 0.044715 * v * v * v)));
  }
  return y;
}

Vec ref_gelu_grad(const Vec& x, const Vec& dy) {
  Vec g(x.size());
  const double s = std::sqrt(2.0 / M_PI);
  for (size_t i = 0; i < x.size(); ++i) {
    double v = x[i], a = s * (v + 0.044715 * v * v * v), th = std::tanh(a);
    double local = 0.5 * (1 + th) + 0.5 * v * (1 - th * th) * s * (1 + 3 * 0.044715 * v * v);
    g[i] = local * dy[i];
  }
  return g;
}

struct LnRef {
  Vec out, mean, rstd;
};
LnRef ref_layernorm(const Vec& x, const Vec& w, const Vec& b, int N, int C) {
  LnRef r{Vec(x.size()), Vec(N), Vec(N)};
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += x[n * C + c];
    m /= C;
    for (int c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= C;
    double s = 1.0 / std::sqrt(v + 1e-5);
    for (int c = 0; c < C; ++c) r.out[n * C + c] = (x[n * C + c] - m) * s * w[c] + b[c];
    r.mean[n] = m;
    r.rstd[n] = s;
  }
  return r;
}

struct LnGrad {
  Vec dx, dw, db;
};
LnGrad ref_layernorm_grad(const Vec& dy, const Vec& x, const Vec& w, int N, int C) {
  LnGrad g{Vec(x.size(), 0.0), Vec(C, 0.0), Vec(C, 0.0)};
  LnRef f = ref_layernorm(x, w, Vec(C, 0.0), N, C);
  for (int n = 0; n < N; ++n) {
    double dmean = 0, dnm = 0;
    for (int c = 0; c < C; ++c) {
      double norm = (x[n * C + c] - f.mean[n]) * f.rstd[n];
      dmean += w[c] * dy[n * C + c];
      dnm += w[c] * dy[n * C + c] * norm;
    }
    dmean /= C;
    dnm /= C;
    for (int c = 0; c < C; ++c) {
      double norm = (x[n * C + c] - f.mean[n]) * f.rstd[n];
      g.db[c] += dy[n * C + c];
      g.dw[c] += norm * dy[n * C + c];
      g.dx[n * C + c] = (w[c] * dy[n * C + c] - dmean - norm * dnm) * f.rstd[n];
    }
  }
  return g;
}

struct AttRef {
  Vec out, att;
};
AttRef ref_attention(const Vec& qkv, int B, int T, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(double(hs));
  AttRef r{Vec(size_t(B) * T * C, 0.0), Vec(size_t(B) * NH * T * T, 0.0)};
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < NH; ++h) {
        const double* q = &qkv[(size_t(b) * T + t) * C3 + h * hs];
        double* a = &r.att[((size_t(b) * NH + h) * T + t) * T];
        double mx = -1e300;
        for (int t2 = 0; t2 <= t; ++t2) {
          const double* k = &qkv[(size_t(b) * T + t2) * C3 + C + h * hs];
          double d = 0;
          for (int i = 0; i < hs; ++i) d += q[i] * k[i];
          a[t2] = d * scale;
          mx = std::max(mx, a[t2]);
        }
        double sum = 0;
        for (int t2 = 0; t2 <= t; ++t2) sum += (a[t2] = std::exp(a[t2] - mx));
        for (int t2 = 0; t2 <= t; ++t2) a[t2] /= sum;
        double* o = &r.out[(size_t(b) * T + t) * C + h * hs];
        for (int t2 = 0; t2 <= t; ++t2) {
          const double* v = &qkv[(size_t(b) * T + t2) * C3 + 2 * C + h * hs];
          for (int i = 0; i < hs; ++i) o[i] += a[t2] * v[i];
        }
      }
  return r;
}

// llm.c's loops, in double: datt and dv, then the softmax Jacobian, then dq and dk.
Vec ref_attention_grad(const Vec& dout, const Vec& qkv, const Vec& att, int B, int T, int C,
                       int NH) {
  const int hs = C / NH, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(double(hs));
  Vec g(qkv.size(), 0.0);
  Vec datt(T), dpre(T);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < NH; ++h) {
        const double* a = &att[((size_t(b) * NH + h) * T + t) * T];
        const double* dy = &dout[(size_t(b) * T + t) * C + h * hs];
        const double* q = &qkv[(size_t(b) * T + t) * C3 + h * hs];
        double* dq = &g[(size_t(b) * T + t) * C3 + h * hs];
        for (int t2 = 0; t2 <= t; ++t2) {
          const double* v = &qkv[(size_t(b) * T + t2) * C3 + 2 * C + h * hs];
          double* dv = &g[(size_t(b) * T + t2) * C3 + 2 * C + h * hs];
          datt[t2] = 0;
          for (int i = 0; i < hs; ++i) {
            datt[t2] += v[i] * dy[i];
            dv[i] += a[t2] * dy[i];
          }
        }
        for (int t3 = 0; t3 <= t; ++t3) {
          dpre[t3] = 0;
          for (int t2 = 0; t2 <= t; ++t2) {
            dpre[t3] += a[t2] * ((t2 == t3 ? 1.0 : 0.0) - a[t3]) * datt[t2];
          }
        }
        for (int t2 = 0; t2 <= t; ++t2) {
          const double* k = &qkv[(size_t(b) * T + t2) * C3 + C + h * hs];
          double* dk = &g[(size_t(b) * T + t2) * C3 + C + h * hs];
          for (int i = 0; i < hs; ++i) {
            dq[i] += k[i] * dpre[t2] * scale;
            dk[i] += q[i] * dpre[t2] * scale;
          }
        }
      }
  return g;
}

// ---------------------------------------------------------------------------------------------
// Forward ops and the accumulate (+=) semantics of the backward ops, against the references.

// With positions (packed sequences restart them; any value below T), wpe's row and dwpe's row
// are the token's position instead of t.
TEST(CpuKernels, EncoderForwardAndBackward) {
  struct Shape {
    int B, T, C, Vp;
  };
  for (DType dt : kAllTypes) {
    for (Shape sh : {Shape{1, 1, 1, 3}, Shape{2, 5, 7, 11}, Shape{3, 33, 130, 50}}) {
      for (bool with_pos : {false, true}) {
        SCOPED_TRACE(fmt::format("{} B={} T={} C={} positions={}", dtype_name(dt), sh.B, sh.T, sh.C,
                                 with_pos));
        std::mt19937_64 rng(test_seed(1));
        const int B = sh.B, T = sh.T, C = sh.C, Vp = sh.Vp;
        Typed wte = random_typed(dt, size_t(Vp) * C, rng);
        Typed wpe = random_typed(dt, size_t(T) * C, rng);
        auto tokens = random_tokens(size_t(B) * T, Vp, rng);  // small vocab: tokens repeat
        auto positions = random_tokens(size_t(B) * T, T, rng);
        const int32_t* pos = with_pos ? positions.data() : nullptr;
        Typed out(dt, size_t(B) * T * C), dout = random_typed(dt, size_t(B) * T * C, rng);
        auto dwte = random_f32(wte.n, rng), dwpe = random_f32(wpe.n, rng);
        Vec dwte_ref = as_double(dwte), dwpe_ref = as_double(dwpe);
        Fixture f;
        f.k().encoder_forward(f.s(), dt, out.data(), tokens.data(), pos, wte.data(), wpe.data(), B,
                              T, C);
        f.k().encoder_backward(f.s(), dt, dwte.data(), dwpe.data(), dout.data(), tokens.data(), pos,
                               B, T, C);
        f.sync();
        Vec ref(out.n);
        for (int b = 0; b < B; ++b)
          for (int t = 0; t < T; ++t)
            for (int c = 0; c < C; ++c) {
              size_t r = size_t(b) * T + t;
              const size_t p = with_pos ? size_t(positions[r]) : size_t(t);
              ref[r * C + c] = double(wte.get(size_t(tokens[r]) * C + c)) + wpe.get(p * C + c);
              dwte_ref[size_t(tokens[r]) * C + c] += dout.get(r * C + c);
              dwpe_ref[p * C + c] += dout.get(r * C + c);
            }
        expect_close(out.to_double(), ref, tol_for(dt), "out");
        expect_close(as_double(dwte), dwte_ref, 1e-5, "dwte");
        expect_close(as_double(dwpe), dwpe_ref, 1e-5, "dwpe");
      }
    }
  }
}

TEST(CpuKernels, LayerNormForwardAndBackward) {
  for (DType dt : kAllTypes) {
    for (auto [N, C] : {std::pair{1, 1}, {5, 7}, {33, 130}, {70, 768}}) {
      SCOPED_TRACE(fmt::format("{} N={} C={}", dtype_name(dt), N, C));
      std::mt19937_64 rng(test_seed(2));
      Typed x = random_typed(dt, size_t(N) * C, rng, -2.0f, 3.0f);
      Typed w = random_typed(dt, C, rng, 0.5f, 1.5f), b = random_typed(dt, C, rng);
      Typed out(dt, x.n), dout = random_typed(dt, x.n, rng);
      Typed dx = random_typed(dt, x.n, rng);
      Vec dx0 = dx.to_double();
      std::vector<float> mean(N), rstd(N);
      auto dw = random_f32(C, rng), db = random_f32(C, rng);
      Vec dw0 = as_double(dw), db0 = as_double(db);
      Fixture f;
      f.k().layernorm_forward(f.s(), dt, out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                              b.data(), N, C);
      f.k().layernorm_backward(f.s(), dt, dx.data(), dx.data(), dw.data(), db.data(), dout.data(),
                               x.data(), w.data(), mean.data(), rstd.data(), N, C);
      f.sync();
      LnRef r = ref_layernorm(x.to_double(), w.to_double(), b.to_double(), N, C);
      expect_close(out.to_double(), r.out, tol_for(dt), "out");
      expect_close(as_double(mean), r.mean, 1e-5, "mean");
      expect_close(as_double(rstd), r.rstd, 1e-5, "rstd");
      LnGrad g = ref_layernorm_grad(dout.to_double(), x.to_double(), w.to_double(), N, C);
      for (size_t i = 0; i < g.dx.size(); ++i) g.dx[i] += dx0[i];
      for (int c = 0; c < C; ++c) {
        g.dw[c] += dw0[c];
        g.db[c] += db0[c];
      }
      expect_close(dx.to_double(), g.dx, tol_for(dt), "dinp");
      expect_close(as_double(dw), g.dw, 1e-5, "dweight");
      expect_close(as_double(db), g.db, 1e-5, "dbias");
    }
  }
}

TEST(CpuKernels, AttentionForwardAndBackward) {
  struct Shape {
    int B, T, C, NH;
  };
  for (cpu::GemmPath path : available_gemm_paths()) {
    cpu::ScopedGemmPath force(path);
    SCOPED_TRACE(cpu::gemm_path_name(path));
    for (DType dt : kAllTypes) {
      for (Shape sh :
           {Shape{1, 1, 4, 1}, Shape{2, 7, 12, 3}, Shape{3, 17, 32, 4}, Shape{1, 64, 64, 2}}) {
        const int B = sh.B, T = sh.T, C = sh.C, NH = sh.NH;
        SCOPED_TRACE(fmt::format("{} B={} T={} C={} NH={}", dtype_name(dt), B, T, C, NH));
        std::mt19937_64 rng(test_seed(4));
        Typed qkv = random_typed(dt, size_t(B) * T * 3 * C, rng, -2.0f, 2.0f);
        Typed out(dt, size_t(B) * T * C), dout = random_typed(dt, out.n, rng);
        Typed dqkv = random_typed(dt, qkv.n, rng);
        Vec dqkv0 = dqkv.to_double();
        std::vector<float> att(size_t(B) * NH * T * T, 7.0f), scratch(att.size());
        Fixture f;
        f.k().attention_gqa_forward(f.s(), dt, out.data(), att.data(), qkv.data(), nullptr, B, T,
                                    NH, NH, C / NH);
        f.k().attention_gqa_backward(f.s(), dt, dqkv.data(), scratch.data(), dout.data(),
                                     qkv.data(), att.data(), nullptr, B, T, NH, NH, C / NH);
        f.sync();
        AttRef r = ref_attention(qkv.to_double(), B, T, C, NH);
        expect_close(out.to_double(), r.out, tol_for(dt), "out");
        expect_close(as_double(att), r.att, 1e-5, "att");
        Vec g = ref_attention_grad(dout.to_double(), qkv.to_double(), r.att, B, T, C, NH);
        for (size_t i = 0; i < g.size(); ++i) g[i] += dqkv0[i];
        expect_close(dqkv.to_double(), g, tol_for(dt), "dqkv");
      }
    }
  }
}

TEST(CpuKernels, GeluForwardAndBackward) {
  for (DType dt : kAllTypes) {
    for (size_t n : {size_t{1}, size_t{17}, size_t{100003}}) {
      SCOPED_TRACE(fmt::format("{} n={}", dtype_name(dt), n));
      std::mt19937_64 rng(test_seed(5));
      Typed x = random_typed(dt, n, rng, -4.0f, 4.0f), y(dt, n), dy = random_typed(dt, n, rng);
      Typed dx = random_typed(dt, n, rng);
      Vec dx0 = dx.to_double();
      Fixture f;
      f.k().gelu_forward(f.s(), dt, y.data(), x.data(), n);
      f.k().gelu_backward(f.s(), dt, dx.data(), x.data(), dy.data(), n);
      f.sync();
      expect_close(y.to_double(), ref_gelu(x.to_double()), tol_for(dt), "out");
      Vec g = ref_gelu_grad(x.to_double(), dy.to_double());
      for (size_t i = 0; i < n; ++i) g[i] += dx0[i];
      expect_close(dx.to_double(), g, tol_for(dt), "dinp");
    }
  }
}

// matmul_gelu_forward on the CPU backend is matmul_forward then gelu_forward, bit for bit (the
// contract: GPT-2's losses do not move when its MLP calls the fused op).
TEST(CpuKernels, MatmulGeluIsMatmulThenGeluBitForBit) {
  for (DType dt : kAllTypes) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(fmt::format("{} bias={}", dtype_name(dt), with_bias));
      const int N = 37, C = 48, OC = 200;
      std::mt19937_64 rng(test_seed(11));
      Typed x = random_typed(dt, size_t(N) * C, rng), w = random_typed(dt, size_t(OC) * C, rng);
      Typed b = random_typed(dt, OC, rng);
      Typed pre(dt, size_t(N) * OC), out(dt, pre.n), pre2(dt, pre.n), out2(dt, pre.n);
      Fixture f;
      EXPECT_TRUE(f.k().supports(KernelOp::kMatmulGelu, {.dt = dt, .OC = OC}).supported);
      const void* bias = with_bias ? b.data() : nullptr;
      f.k().matmul_gelu_forward(f.s(), dt, out.data(), pre.data(), x.data(), w.data(), bias, N, C,
                                OC);
      f.k().matmul_forward(f.s(), dt, pre2.data(), x.data(), w.data(), bias, N, C, OC);
      f.k().gelu_forward(f.s(), dt, out2.data(), pre2.data(), pre2.n);
      f.sync();
      EXPECT_EQ(pre.bytes, pre2.bytes);
      EXPECT_EQ(out.bytes, out2.bytes);
    }
  }
}

// GELU's AVX2 lanes compute the scalar loop's bits (what keeps training's losses the same on
// every x86-64 CPU): random inputs over GELU's whole interesting range, large and tiny
// magnitudes, signed zeros, infinities and NaN, at lengths that leave every tail size.
TEST(CpuKernels, GeluAvx2MatchesScalarBits) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2"))
    GTEST_SKIP() << "this CPU has no AVX2: only the scalar GELU runs";
  std::mt19937_64 rng(test_seed(22));
  for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{13}, size_t{4096 + 5}}) {
    SCOPED_TRACE(fmt::format("n={}", n));
    std::vector<float> x = random_f32(n, rng, -12.0f, 12.0f), g = random_f32(n, rng);
    const float special[] = {0.0f,     -0.0f,     1e-30f, -1e-42f, 50.0f, -50.0f, 1e30f,  -1e30f,
                             INFINITY, -INFINITY, NAN,    -NAN,    88.5f, -87.5f, 3.0e38f};
    for (size_t i = 0; i < n && i < std::size(special); ++i) x[(i * 7) % n] = special[i];
    auto xs = x, xv = x, gs = g, gv = g;
    cpu::scalar::gelu_forward_f32(xs.data(), n);
    cpu::avx2::gelu_forward_f32(xv.data(), n);
    cpu::scalar::gelu_backward_f32(x.data(), gs.data(), n);
    cpu::avx2::gelu_backward_f32(x.data(), gv.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(f32_bits(xs[i]), f32_bits(xv[i])) << "forward at x = " << x[i];
      ASSERT_EQ(f32_bits(gs[i]), f32_bits(gv[i])) << "backward at x = " << x[i];
    }
  }
  EXPECT_STREQ(cpu::gelu_isa(), "avx2");
}

// LayerNorm's eight-rows-at-once statistics compute the scalar loop's bits, for widths with and
// without a tail past the last 8x8 block, rows of very different scale, and an offset mean.
TEST(CpuKernels, LayerNormStatsAvx2MatchesScalarBits) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2")) {
    GTEST_SKIP() << "this CPU has no AVX2: only the scalar LayerNorm statistics run";
  }
  std::mt19937_64 rng(test_seed(23));
  for (int C : {1, 5, 8, 13, 96, 128, 1000}) {
    SCOPED_TRACE(fmt::format("C={}", C));
    std::vector<float> rows = random_f32(8 * size_t(C), rng, -3.0f, 3.0f);
    for (int i = 0; i < C; ++i) {
      rows[size_t(1) * C + i] *= 1e-3f;                                      // a small row
      rows[size_t(2) * C + i] = rows[size_t(2) * C + i] * 100.0f + 1000.0f;  // large, offset
    }
    float ms[8], ss[8], mv[8], sv[8];
    cpu::scalar::layernorm_stats8(rows.data(), C, ms, ss);
    cpu::avx2::layernorm_stats8(rows.data(), C, mv, sv);
    for (int r = 0; r < 8; ++r) {
      EXPECT_EQ(f32_bits(ms[r]), f32_bits(mv[r])) << "mean of row " << r;
      EXPECT_EQ(f32_bits(ss[r]), f32_bits(sv[r])) << "rstd of row " << r;
    }
  }
  EXPECT_STREQ(cpu::layernorm_isa(), "avx2");
}

TEST(CpuKernels, ResidualAndAddInplace) {
  for (DType dt : kAllTypes) {
    for (size_t n : {size_t{1}, size_t{31}, size_t{200001}}) {
      SCOPED_TRACE(fmt::format("{} n={}", dtype_name(dt), n));
      std::mt19937_64 rng(test_seed(6));
      Typed a = random_typed(dt, n, rng), b = random_typed(dt, n, rng), out(dt, n);
      Typed acc = random_typed(dt, n, rng);
      Vec acc0 = acc.to_double();
      Fixture f;
      f.k().residual_forward(f.s(), dt, out.data(), a.data(), b.data(), n);
      f.k().add_inplace(f.s(), dt, acc.data(), a.data(), n);
      f.sync();
      Vec ra(n), rb(n);
      for (size_t i = 0; i < n; ++i) {
        ra[i] = double(a.get(i)) + b.get(i);
        rb[i] = acc0[i] + a.get(i);
      }
      // Sums of two stored values: exactly the rounded double sum.
      for (size_t i = 0; i < n; ++i) {
        Typed one(dt, 2);
        one.set(0, float(ra[i]));
        one.set(1, float(rb[i]));
        ASSERT_EQ(out.get(i), one.get(0)) << "residual at " << i;
        ASSERT_EQ(acc.get(i), one.get(1)) << "add_inplace at " << i;
      }
    }
  }
}

TEST(CpuKernels, CrossEntropyForwardBackward) {
  struct Shape {
    int N, V, Vp;
  };
  for (DType dt : kAllTypes) {
    for (Shape sh : {Shape{1, 2, 2}, Shape{3, 5, 8}, Shape{7, 1000, 1024}, Shape{40, 37, 40}}) {
      const int N = sh.N, V = sh.V, Vp = sh.Vp;
      SCOPED_TRACE(fmt::format("{} N={} V={} Vp={}", dtype_name(dt), N, V, Vp));
      std::mt19937_64 rng(test_seed(7));
      Typed logits = random_typed(dt, size_t(N) * Vp, rng, -5.0f, 5.0f);
      Vec l0 = logits.to_double();
      auto targets = random_tokens(N, V, rng);
      for (int n = 2; n < N; n += 3) targets[size_t(n)] = -1;  // masked rows: loss and grad 0
      std::vector<float> losses(N, -1.0f);
      const float dloss = 1.0f / N;
      Fixture f;
      f.k().crossentropy_forward_backward(f.s(), dt, losses.data(), logits.data(), targets.data(),
                                          dloss, N, V, Vp);
      f.sync();
      Vec rl(N), rg(size_t(N) * Vp, 0.0);
      for (int n = 0; n < N; ++n) {
        if (targets[n] < 0) continue;  // rl[n] and its gradient row stay 0
        const double* row = &l0[size_t(n) * Vp];
        double mx = -1e300, sum = 0;
        for (int v = 0; v < V; ++v) mx = std::max(mx, row[v]);
        for (int v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
        rl[n] = std::log(sum) + mx - row[targets[n]];
        for (int v = 0; v < V; ++v) {
          rg[size_t(n) * Vp + v] =
              (std::exp(row[v] - mx) / sum - (v == targets[n] ? 1.0 : 0.0)) * dloss;
        }
      }
      expect_close(as_double(losses), rl, 1e-5, "losses");
      expect_close(logits.to_double(), rg, tol_for(dt), "dlogits");
      for (int n = 0; n < N; ++n) {
        for (int v = V; v < Vp; ++v) ASSERT_EQ(logits.get(size_t(n) * Vp + v), 0.0f);
      }
    }
  }
}

TEST(CpuKernels, CastMatchesScalarReferenceBitForBit) {
  std::mt19937_64 rng(test_seed(8));
  const size_t n = 70001;
  // Wide range plus specials: fp16 overflow/underflow, subnormals, infinities, NaN.
  std::vector<float> src = random_f32(n, rng, -1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-30, 20);
  for (size_t i = 0; i < n; ++i) src[i] = std::ldexp(src[i], e(rng));
  src[0] = INFINITY;
  src[1] = -INFINITY;
  src[2] = NAN;
  src[3] = 70000.0f;
  src[4] = 1e-7f;
  for (DType from : kAllTypes) {
    Typed in(from, n);
    convert(src.data(), DType::kF32, in.data(), from, n);
    for (DType to : kAllTypes) {
      SCOPED_TRACE(fmt::format("{} -> {}", dtype_name(from), dtype_name(to)));
      Typed got(to, n), want(to, n);
      convert(in.data(), from, want.data(), to, n);
      Fixture f;
      f.k().cast(f.s(), got.data(), to, in.data(), from, n);
      f.sync();
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), n * dtype_size(to)));
    }
  }
}

// The squared norm in the host's order: bit for bit strata::grad_stats (the optimizer's), so a
// norm taken on a device clips as one taken on the host does; inf or nan make it non-finite.
TEST(CpuKernels, NormSquaredIsTheHostsBitForBit) {
  std::mt19937_64 rng(test_seed(9));
  for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{65536}, size_t{300007}}) {
    SCOPED_TRACE(fmt::format("n={}", n));
    auto x = random_f32(n, rng);
    double naive = 0;
    for (float v : x) naive += double(v) * v;
    double got = -1;
    Fixture f;
    f.k().norm_sq_and_nonfinite(f.s(), &got, x.data(), n);
    f.sync();
    const double want = grad_stats(x.data(), DType::kF32, n).norm_sq;
    EXPECT_EQ(std::memcmp(&got, &want, sizeof(got)), 0) << got << " vs " << want;
    EXPECT_NEAR(got, naive, 1e-12 * naive);
    if (n == 0) continue;
    for (float bad : {INFINITY, -INFINITY, NAN}) {
      auto y = x;
      y[n / 2] = bad;
      f.k().norm_sq_and_nonfinite(f.s(), &got, y.data(), n);
      f.sync();
      EXPECT_FALSE(std::isfinite(got)) << bad;
    }
  }
}

TEST(CpuKernels, Scale) {
  std::mt19937_64 rng(test_seed(10));
  for (size_t n : {size_t{1}, size_t{100003}}) {
    auto x = random_f32(n, rng), y = x;
    Fixture f;
    f.k().scale(f.s(), y.data(), -0.37f, n);
    f.sync();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(y[i], x[i] * -0.37f) << i;
  }
}

// scale_rows: row r times scale[r] (0 and negative factors among them), one fp32 multiply and
// one rounding to dt, bit for bit; the row after the last scaled one is left as it was. Rows
// long enough to be split into several tasks, and short odd ones.
TEST(CpuKernels, ScaleRows) {
  std::mt19937_64 rng(test_seed(11));
  const float factors[] = {0.0f, -1.5f, 0.37f, 3.0f, -0.0625f, 1.0f};
  for (DType dt : kAllTypes)
    for (size_t row_elems : {size_t{7}, size_t{100003}}) {
      SCOPED_TRACE(fmt::format("{} rows of {}", dtype_name(dt), row_elems));
      const int rows = 5;
      Typed x = random_typed(dt, size_t(rows + 1) * row_elems, rng, -4.0f, 4.0f), y = x;
      Typed want = x;
      for (int r = 0; r < rows; ++r)
        for (size_t i = 0; i < row_elems; ++i) {
          const size_t e = size_t(r) * row_elems + i;
          want.set(e, x.get(e) * factors[r]);
        }
      Fixture f;
      f.k().scale_rows(f.s(), dt, y.data(), factors, rows, row_elems);
      f.sync();
      ASSERT_EQ(std::memcmp(y.data(), want.data(), want.bytes.size()), 0);
    }
}

// Block-wise quantization against a double reference: each block's scale is max|x| / qmax,
// every q is x / scale rounded to the nearest integer (within 0.5 + rounding), the block's
// largest element maps to +-qmax, the 4-bit nibbles decode as two's complement, and the round
// trip is within scale / 2 per element (plus the rounding to dt); with accumulate, x + q*scale.
// A block with an inf or nan dequantizes to nan; an all-zero block to zeros.
TEST(CpuKernels, QuantizeDequantizeBlockwiseAgainstReference) {
  std::mt19937_64 rng(test_seed(11));
  for (int bits : {8, 4}) {
    const int qmax = quantize_qmax(bits);
    for (DType dt : kAllTypes) {
      for (auto [n, block] : std::vector<std::pair<size_t, int>>{
               {1, 256}, {255, 256}, {1000, 64}, {7 * 256 + 3, 256}, {100001, 128}}) {
        SCOPED_TRACE(fmt::format("bits={} {} n={} block={}", bits, dtype_name(dt), n, block));
        Typed x = random_typed(dt, n, rng, -3.0f, 3.0f);
        // A wide dynamic range across blocks: block b is scaled by 2^(b % 7 - 3).
        for (size_t i = 0; i < n; ++i)
          x.set(i, x.get(i) * std::ldexp(1.0f, int(i / block % 7) - 3));
        const size_t nb = quantize_blocks(n, block);
        std::vector<uint8_t> q(quantized_bytes(bits, n));
        std::vector<float> scales(nb);
        Typed back(dt, n), acc = random_typed(dt, n, rng), acc0 = acc;
        Fixture f;
        f.k().quantize(f.s(), bits, dt, q.data(), scales.data(), x.data(), n, block);
        f.k().dequantize(f.s(), bits, dt, back.data(), q.data(), scales.data(), n, block, false);
        f.k().dequantize(f.s(), bits, dt, acc.data(), q.data(), scales.data(), n, block, true);
        f.sync();
        for (size_t b = 0; b < nb; ++b) {
          const size_t i0 = b * block, i1 = std::min(n, i0 + size_t(block));
          double amax = 0;
          size_t imax = i0;
          for (size_t i = i0; i < i1; ++i) {
            if (std::fabs(double(x.get(i))) > amax) amax = std::fabs(double(x.get(i))), imax = i;
          }
          const double scale = amax / qmax;
          ASSERT_NEAR(scales[b], scale, 1e-6 * scale) << "block " << b;
          for (size_t i = i0; i < i1; ++i) {
            const int qi = bits == 8 ? int(int8_t(q[i])) : [&] {
              int nib = i % 2 ? q[i / 2] >> 4 : q[i / 2] & 0x0f;
              return nib >= 8 ? nib - 16 : nib;
            }();
            ASSERT_LE(std::abs(qi), qmax) << i;
            ASSERT_LE(std::fabs(qi - x.get(i) / scale), 0.5 + 1e-4) << i;
            if (i == imax) {
              ASSERT_EQ(std::abs(qi), qmax) << "the block's largest element";
            }
            const double deq = double(qi) * double(scales[b]);
            const double eps = dt == DType::kF32 ? 1e-6 : dt == DType::kBF16 ? 8e-3 : 1e-3;
            ASSERT_NEAR(back.get(i), deq, eps * std::fabs(deq) + 1e-30) << i;
            ASSERT_LE(std::fabs(back.get(i) - x.get(i)), scale / 2 * (1 + 1e-5) + eps * amax)
                << "round-trip error of element " << i;
            const double sum = double(acc0.get(i)) + deq;
            ASSERT_NEAR(acc.get(i), sum, eps * (std::fabs(sum) + std::fabs(deq)) + 1e-6) << i;
          }
        }
      }
    }
    // Non-finite and zero blocks, fp32.
    const size_t n = 512;
    const int block = 128;
    std::vector<float> x = random_f32(n, rng), back(n);
    for (size_t i = 256; i < 384; ++i) x[i] = 0.0f;  // block 2: zeros
    x[5] = INFINITY;                                 // block 0
    x[200] = NAN;                                    // block 1
    std::vector<uint8_t> q(quantized_bytes(bits, n));
    std::vector<float> scales(4);
    Fixture f;
    f.k().quantize(f.s(), bits, DType::kF32, q.data(), scales.data(), x.data(), n, block);
    f.k().dequantize(f.s(), bits, DType::kF32, back.data(), q.data(), scales.data(), n, block,
                     false);
    f.sync();
    for (size_t i = 0; i < 256; ++i)
      ASSERT_TRUE(std::isnan(back[i])) << "bits " << bits << " " << i;
    EXPECT_EQ(scales[2], 0.0f);
    for (size_t i = 256; i < 384; ++i) ASSERT_EQ(back[i], 0.0f) << i;
    EXPECT_GT(scales[3], 0.0f);
    for (size_t i = 384; i < n; ++i) ASSERT_TRUE(std::isfinite(back[i])) << i;
  }
}

// The quantize kernels' fast path (AVX2) gives the scalar reference's bits: q bytes, scales and
// dequantized values (fresh and accumulated), every dtype, 8 and 4 bits, blocks that are and are
// not multiples of 8, sizes with partial blocks and odd tails, values spread over 2^-12..2^12,
// exact ties (x / scale = k + 1/2), a block with inf, one with nan, one of zeros, denormals.
TEST(CpuKernels, QuantizeFastPathMatchesTheScalarReferenceBitForBit) {
  if (std::string(cpu::quantize_isa()) == "scalar") {
    GTEST_SKIP() << "this CPU has no AVX2/F16C: the scalar reference is the only path";
  }
  std::mt19937_64 rng(test_seed(12));
  for (int bits : {8, 4}) {
    for (DType dt : kAllTypes) {
      for (auto [n, block] : std::vector<std::pair<size_t, int>>{{1, 256},
                                                                 {31, 256},
                                                                 {33, 8},
                                                                 {255, 256},
                                                                 {1000, 64},
                                                                 {1000, 100},
                                                                 {7 * 256 + 3, 256},
                                                                 {70001, 128},
                                                                 {100000, 30}}) {
        SCOPED_TRACE(fmt::format("bits={} {} n={} block={}", bits, dtype_name(dt), n, block));
        Typed x = random_typed(dt, n, rng, -3.0f, 3.0f);
        std::uniform_int_distribution<int> e(-12, 12);
        for (size_t i = 0; i < n; ++i) x.set(i, x.get(i) * std::ldexp(1.0f, e(rng)));
        const size_t nb = quantize_blocks(n, block);
        if (nb > 4) {
          // Block 1: a tie for every element (max 2 * qmax + 1 halves: x / scale = k + 1/2).
          const size_t b1 = size_t(block), e1 = std::min(n, 2 * b1);
          const int qmax = quantize_qmax(bits);
          for (size_t i = b1; i < e1; ++i) x.set(i, float(int(i % (2 * qmax + 1)) - qmax) * 0.5f);
          x.set(b1, float(qmax));
          x.set(2 * b1, INFINITY);                                               // block 2
          x.set(3 * b1 + 1, NAN);                                                // block 3
          for (size_t i = 4 * b1; i < std::min(n, 5 * b1); ++i) x.set(i, 0.0f);  // block 4
          if (5 * b1 + 2 < n) x.set(5 * b1 + 2, 1e-40f);  // a denormal (0 in bf16/fp16 or not)
        }
        std::vector<uint8_t> q(quantized_bytes(bits, n), 0xa5), qr = q;
        std::vector<float> sc(nb, -1.0f), scr = sc;
        cpu::quantize(bits, dt, q.data(), sc.data(), x.data(), n, block);
        cpu::quantize_reference(bits, dt, qr.data(), scr.data(), x.data(), n, block);
        ASSERT_EQ(0, std::memcmp(q.data(), qr.data(), q.size())) << "q bytes";
        ASSERT_EQ(0, std::memcmp(sc.data(), scr.data(), nb * 4)) << "scales";
        for (bool accumulate : {false, true}) {
          Typed y = random_typed(dt, n, rng, -2.0f, 2.0f), yr = y;
          cpu::dequantize(bits, dt, y.data(), q.data(), sc.data(), n, block, accumulate);
          cpu::dequantize_reference(bits, dt, yr.data(), q.data(), sc.data(), n, block, accumulate);
          const size_t es = dtype_size(dt);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_EQ(0, std::memcmp(y.bytes.data() + i * es, yr.bytes.data() + i * es, es))
                << "element " << i << " accumulate " << accumulate << ": " << y.get(i) << " vs "
                << yr.get(i);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Determinism and asynchrony.

// Runs a forward+backward chain of the reducing ops; returns every output's bytes.
std::vector<unsigned char> run_chain(int threads, DType dt, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int B = 2, T = 40, C = 96, NH = 4, OC = 3 * C, N = B * T, Vp = 50;
  Typed x = random_typed(dt, size_t(N) * C, rng), w = random_typed(dt, size_t(OC) * C, rng);
  Typed bias = random_typed(dt, OC, rng), lw = random_typed(dt, C, rng), lb(lw);
  Typed wte = random_typed(dt, size_t(Vp) * C, rng), wpe = random_typed(dt, size_t(T) * C, rng);
  auto tokens = random_tokens(N, Vp, rng);
  Typed ln(dt, x.n), qkv(dt, size_t(N) * OC), att_out(dt, size_t(N) * C);
  Typed dqkv(dt, qkv.n), dx(dt, x.n), dln(dt, x.n), emb(dt, x.n);
  std::vector<float> mean(N), rstd(N), att(size_t(B) * NH * T * T), scratch(att.size());
  std::vector<float> dw(w.n, 0.0f), db(OC, 0.0f), dlw(C, 0.0f), dlb(C, 0.0f);
  std::vector<float> dwte(wte.n, 0.0f), dwpe(wpe.n, 0.0f);
  double norm_sq = 0;
  Fixture f(threads);
  Kernels& k = f.k();
  k.encoder_forward(f.s(), dt, emb.data(), tokens.data(), nullptr, wte.data(), wpe.data(), B, T, C);
  k.layernorm_forward(f.s(), dt, ln.data(), mean.data(), rstd.data(), x.data(), lw.data(),
                      lb.data(), N, C);
  k.matmul_forward(f.s(), dt, qkv.data(), ln.data(), w.data(), bias.data(), N, C, OC);
  k.attention_gqa_forward(f.s(), dt, att_out.data(), att.data(), qkv.data(), nullptr, B, T, NH, NH,
                          C / NH);
  k.attention_gqa_backward(f.s(), dt, dqkv.data(), scratch.data(), att_out.data(), qkv.data(),
                           att.data(), nullptr, B, T, NH, NH, C / NH);
  k.matmul_backward(f.s(), dt, dln.data(), dw.data(), db.data(), dqkv.data(), ln.data(), w.data(),
                    N, C, OC, /*accumulate=*/true);
  k.layernorm_backward(f.s(), dt, dx.data(), dx.data(), dlw.data(), dlb.data(), dln.data(),
                       x.data(), lw.data(), mean.data(), rstd.data(), N, C);
  k.encoder_backward(f.s(), dt, dwte.data(), dwpe.data(), dx.data(), tokens.data(), nullptr, B, T,
                     C);
  k.norm_sq_and_nonfinite(f.s(), &norm_sq, dw.data(), dw.size());
  f.sync();
  std::vector<unsigned char> all;
  auto add = [&](const void* p, size_t bytes) {
    auto* c = static_cast<const unsigned char*>(p);
    all.insert(all.end(), c, c + bytes);
  };
  for (const Typed* t : {&emb, &ln, &qkv, &att_out, &dqkv, &dln, &dx})
    add(t->data(), t->n * dtype_size(dt));
  for (const auto* v : {&mean, &rstd, &att, &dw, &db, &dlw, &dlb, &dwte, &dwpe}) {
    add(v->data(), v->size() * 4);
  }
  add(&norm_sq, sizeof(norm_sq));
  return all;
}

// On every GEMM path: a path's bits are the same run to run and for 1, 2 or 3 threads.
TEST(CpuKernels, DeterministicAcrossRunsAndThreadCounts) {
  for (cpu::GemmPath path : available_gemm_paths()) {
    cpu::ScopedGemmPath force(path);
    for (DType dt : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(fmt::format("{} {}", cpu::gemm_path_name(path), dtype_name(dt)));
      auto a = run_chain(2, dt, test_seed(17));
      auto b = run_chain(2, dt, test_seed(17));
      auto c = run_chain(1, dt, test_seed(17));
      auto d = run_chain(3, dt, test_seed(17));  // matmul splits its tiles per thread count
      auto other = run_chain(2, dt, test_seed(18));
      ASSERT_EQ(a.size(), b.size());
      EXPECT_TRUE(a == b) << "two runs with the same inputs differ";
      EXPECT_TRUE(a == c) << "1 and 2 threads differ";
      EXPECT_TRUE(a == d) << "2 and 3 threads differ";
      EXPECT_FALSE(a == other) << "different inputs gave the same bits: the chain computes nothing";
    }
  }
}

TEST(CpuKernels, CallsOnlyEnqueue) {
  std::mt19937_64 rng(test_seed(19));
  const int N = 8, C = 16, OC = 12;
  auto x = random_f32(size_t(N) * C, rng), w = random_f32(size_t(OC) * C, rng);
  std::vector<float> out(size_t(N) * OC, 123.0f);
  Fixture f;
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  f.dev().host_fn(f.s(), [open] { open.wait(); });  // the stream stalls here
  f.k().matmul_forward(f.s(), DType::kF32, out.data(), x.data(), w.data(), nullptr, N, C, OC);
  for (float v : out) ASSERT_EQ(v, 123.0f) << "matmul_forward ran before the stream reached it";
  gate.set_value();
  f.sync();
  expect_close(as_double(out), ref_matmul(as_double(x), as_double(w), nullptr, N, C, OC), 1e-5,
               "out");
}

}  // namespace
}  // namespace strata
