// The Llama-family ops of the CPU kernels (kernels/cpu/{rmsnorm,swiglu,rope,attention}.cc; the
// query/key norms of Qwen3 in rmsnorm.cc)
// through the Kernels table of a CPU device, as tests/cpu_kernels_test.cc does for the GPT ops:
//   - every op against a double-precision reference written here, on fresh random inputs (never
//     zeros), odd shapes included, in fp32, bf16 and fp16;
//   - backward ops start from non-zero gradients (the accumulate (+=) contract), except
//     rope_backward and qk_norm_backward, which the contract defines in place;
//   - finite-difference checks of every backward against its forward (fp32, central
//     differences evaluated in double).
// Inputs are drawn from a fixed seed per test; STRATA_TEST_SEED=<n> draws different ones.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"
#include "tests/kernel_test_util.h"

namespace strata {
namespace {

using namespace kernel_test;

// ---------------------------------------------------------------------------------------------
// Double-precision references (Hugging Face LlamaModel's math).

struct RmsRef {
  Vec out, rstd;
};
RmsRef ref_rmsnorm(const Vec& x, const Vec& w, double eps, int N, int C) {
  RmsRef r{Vec(x.size()), Vec(N)};
  for (int n = 0; n < N; ++n) {
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += x[size_t(n) * C + c] * x[size_t(n) * C + c];
    const double s = 1.0 / std::sqrt(ss / C + eps);
    r.rstd[n] = s;
    for (int c = 0; c < C; ++c) r.out[size_t(n) * C + c] = x[size_t(n) * C + c] * s * w[c];
  }
  return r;
}
// Gradients of sum(out * dy) w.r.t. x and w.
void ref_rmsnorm_grad(const Vec& dy, const Vec& x, const Vec& w, double eps, int N, int C, Vec& dx,
                      Vec& dw) {
  dx.assign(x.size(), 0.0);
  dw.assign(C, 0.0);
  for (int n = 0; n < N; ++n) {
    const double* xr = &x[size_t(n) * C];
    const double* g = &dy[size_t(n) * C];
    double ss = 0, dot = 0;
    for (int c = 0; c < C; ++c) ss += xr[c] * xr[c];
    const double s = 1.0 / std::sqrt(ss / C + eps);
    for (int c = 0; c < C; ++c) dot += w[c] * g[c] * xr[c];
    for (int c = 0; c < C; ++c) {
      dx[size_t(n) * C + c] = s * w[c] * g[c] - xr[c] * s * s * s * dot / C;
      dw[c] += g[c] * xr[c] * s;
    }
  }
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

// out[n,h] = silu(x[n,h]) * x[n,H+h]; and the gradient (added to dx) for dy.
Vec ref_swiglu(const Vec& x, int N, int H) {
  Vec y(size_t(N) * H);
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h)
      y[size_t(n) * H + h] = silu(x[size_t(n) * 2 * H + h]) * x[size_t(n) * 2 * H + H + h];
  return y;
}
void ref_swiglu_grad(const Vec& x, const Vec& dy, int N, int H, Vec& dx) {
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h) {
      const double g = x[size_t(n) * 2 * H + h], u = x[size_t(n) * 2 * H + H + h];
      const double sig = 1.0 / (1.0 + std::exp(-g)), d = dy[size_t(n) * H + h];
      dx[size_t(n) * 2 * H + h] += d * u * (sig + g * sig * (1.0 - sig));
      dx[size_t(n) * 2 * H + H + h] += d * silu(g);
    }
}

// Rotation of the q and k heads of a packed qkv (v untouched); `sign` -1 rotates back.
Vec ref_rope(const Vec& qkv, const RopeParams& p, int B, int T, int NH, int KVH, int hs,
             double sign = 1.0) {
  Vec y = qkv, f(hs / 2);
  rope_inv_freq(p, hs, f.data());
  const size_t W = size_t(NH + 2 * KVH) * hs;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < NH + KVH; ++h)
        for (int i = 0; i < hs / 2; ++i) {
          const size_t o = (size_t(b) * T + t) * W + size_t(h) * hs;
          const double c = std::cos(t * f[i]), s = sign * std::sin(t * f[i]);
          const double a = qkv[o + i], bb = qkv[o + i + hs / 2];
          y[o + i] = a * c - bb * s;
          y[o + i + hs / 2] = bb * c + a * s;
        }
  return y;
}

// Grouped-query causal attention: out [B,T,NH*hs], att [B,NH,T,T]; and its gradient.
struct AttRef {
  Vec out, att;
};
AttRef ref_gqa(const Vec& qkv, int B, int T, int NH, int KVH, int hs) {
  const size_t W = size_t(NH + 2 * KVH) * hs, C = size_t(NH) * hs;
  const int rep = NH / KVH;
  const double scale = 1.0 / std::sqrt(double(hs));
  AttRef r{Vec(size_t(B) * T * C, 0.0), Vec(size_t(B) * NH * T * T, 0.0)};
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        const int g = h / rep;
        const double* q = &qkv[(size_t(b) * T + t) * W + size_t(h) * hs];
        double* a = &r.att[((size_t(b) * NH + h) * T + t) * T];
        double mx = -1e300;
        for (int t2 = 0; t2 <= t; ++t2) {
          const double* k = &qkv[(size_t(b) * T + t2) * W + C + size_t(g) * hs];
          double d = 0;
          for (int i = 0; i < hs; ++i) d += q[i] * k[i];
          a[t2] = d * scale;
          mx = std::max(mx, a[t2]);
        }
        double sum = 0;
        for (int t2 = 0; t2 <= t; ++t2) sum += (a[t2] = std::exp(a[t2] - mx));
        for (int t2 = 0; t2 <= t; ++t2) a[t2] /= sum;
        double* o = &r.out[(size_t(b) * T + t) * C + size_t(h) * hs];
        for (int t2 = 0; t2 <= t; ++t2) {
          const double* v = &qkv[(size_t(b) * T + t2) * W + C + size_t(KVH + g) * hs];
          for (int i = 0; i < hs; ++i) o[i] += a[t2] * v[i];
        }
      }
  return r;
}
Vec ref_gqa_grad(const Vec& dout, const Vec& qkv, const Vec& att, int B, int T, int NH, int KVH,
                 int hs) {
  const size_t W = size_t(NH + 2 * KVH) * hs, C = size_t(NH) * hs;
  const int rep = NH / KVH;
  const double scale = 1.0 / std::sqrt(double(hs));
  Vec g(qkv.size(), 0.0), datt(T), dpre(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        const int kv = h / rep;
        const double* a = &att[((size_t(b) * NH + h) * T + t) * T];
        const double* dy = &dout[(size_t(b) * T + t) * C + size_t(h) * hs];
        const double* q = &qkv[(size_t(b) * T + t) * W + size_t(h) * hs];
        double* dq = &g[(size_t(b) * T + t) * W + size_t(h) * hs];
        for (int t2 = 0; t2 <= t; ++t2) {
          const size_t vo = (size_t(b) * T + t2) * W + C + size_t(KVH + kv) * hs;
          datt[t2] = 0;
          for (int i = 0; i < hs; ++i) {
            datt[t2] += qkv[vo + i] * dy[i];
            g[vo + i] += a[t2] * dy[i];
          }
        }
        double s = 0;
        for (int t2 = 0; t2 <= t; ++t2) s += a[t2] * datt[t2];
        for (int t2 = 0; t2 <= t; ++t2) dpre[t2] = a[t2] * (datt[t2] - s);
        for (int t2 = 0; t2 <= t; ++t2) {
          const size_t ko = (size_t(b) * T + t2) * W + C + size_t(kv) * hs;
          for (int i = 0; i < hs; ++i) {
            dq[i] += qkv[ko + i] * dpre[t2] * scale;
            g[ko + i] += q[i] * dpre[t2] * scale;
          }
        }
      }
  return g;
}

RopeParams llama3_rope() {
  return {.theta = 500000.0,
          .llama3 = true,
          .factor = 8.0,
          .low_freq_factor = 1.0,
          .high_freq_factor = 4.0,
          .original_max_position = 64.0};
}

// ---------------------------------------------------------------------------------------------

TEST(LlamaKernels, RmsNormForwardAndBackward) {
  struct Shape {
    int N, C;
  };
  for (DType dt : kAllTypes) {
    for (Shape sh : {Shape{1, 1}, Shape{3, 7}, Shape{37, 64}, Shape{70, 257}}) {
      const int N = sh.N, C = sh.C;
      const float eps = 1e-6f;
      SCOPED_TRACE(fmt::format("{} N={} C={}", dtype_name(dt), N, C));
      std::mt19937_64 rng(test_seed(1));
      Typed x = random_typed(dt, size_t(N) * C, rng, -3, 3), w = random_typed(dt, C, rng, 0.5, 1.5);
      Typed out(dt, x.n), dout = random_typed(dt, x.n, rng), dx = random_typed(dt, x.n, rng);
      std::vector<float> rstd(N, 7.0f), dw = random_f32(C, rng);
      Vec dx0 = dx.to_double(), dw0 = as_double(dw);
      Fixture f;
      f.k().rmsnorm_forward(f.s(), dt, out.data(), rstd.data(), x.data(), w.data(), eps, N, C);
      f.k().rmsnorm_backward(f.s(), dt, dx.data(), dx.data(), dw.data(), dout.data(), x.data(),
                             w.data(), rstd.data(), N, C);
      f.sync();
      RmsRef r = ref_rmsnorm(x.to_double(), w.to_double(), eps, N, C);
      expect_close(out.to_double(), r.out, tol_for(dt), "out");
      expect_close(as_double(rstd), r.rstd, 1e-5, "rstd");
      Vec gx, gw;
      ref_rmsnorm_grad(dout.to_double(), x.to_double(), w.to_double(), eps, N, C, gx, gw);
      for (size_t i = 0; i < gx.size(); ++i) gx[i] += dx0[i];
      for (int c = 0; c < C; ++c) gw[c] += dw0[c];
      expect_close(dx.to_double(), gx, tol_for(dt), "dinp");
      expect_close(as_double(dw), gw, dt == DType::kF32 ? 1e-5 : 1e-4, "dweight");
    }
  }
}

TEST(LlamaKernels, RmsNormUsesItsEps) {
  // A row of tiny values: the result depends on eps, so a kernel with a hard-coded eps fails.
  const int N = 1, C = 4;
  std::vector<float> x = {1e-3f, -2e-3f, 3e-3f, 1e-3f}, w(C, 1.0f), out(C), rstd(N);
  for (double eps : {1e-5, 1e-6, 1e-2}) {
    Fixture f;
    f.k().rmsnorm_forward(f.s(), DType::kF32, out.data(), rstd.data(), x.data(), w.data(),
                          float(eps), N, C);
    f.sync();
    RmsRef r = ref_rmsnorm(as_double(x), as_double(w), float(eps), N, C);
    expect_close(as_double(out), r.out, 1e-6, fmt::format("out (eps {})", eps));
  }
}

// The query/key norms: each query head of a packed q|k|v row RMS-normalized with qw, each key
// head with kw, the value heads untouched; against ref_rmsnorm over the heads gathered.
TEST(LlamaKernels, QkNormForwardAndBackward) {
  struct Shape {
    int N, NH, NKV, hs;
  };
  for (DType dt : kAllTypes) {
    for (Shape sh :
         {Shape{1, 1, 1, 2}, Shape{3, 4, 2, 6}, Shape{37, 6, 2, 64}, Shape{5, 2, 2, 130}}) {
      const int N = sh.N, NH = sh.NH, NKV = sh.NKV, hs = sh.hs, H = NH + NKV;
      const size_t W = size_t(NH + 2 * NKV) * hs;
      const float eps = 1e-6f;
      SCOPED_TRACE(fmt::format("{} N={} NH={} NKV={} hs={}", dtype_name(dt), N, NH, NKV, hs));
      std::mt19937_64 rng(test_seed(12));
      Typed qkv = random_typed(dt, size_t(N) * W, rng, -3, 3);
      Typed qw = random_typed(dt, hs, rng, 0.5, 1.5), kw = random_typed(dt, hs, rng, 0.5, 1.5);
      Typed dqkv = random_typed(dt, qkv.n, rng), saved(dt, size_t(N) * H * hs);
      std::vector<float> rstd(size_t(N) * H, 7.0f), dqw = random_f32(hs, rng),
                                                    dkw = random_f32(hs, rng);
      const Vec x = qkv.to_double(), g = dqkv.to_double(), dqw0 = as_double(dqw),
                dkw0 = as_double(dkw);
      Fixture f;
      Typed y = qkv;
      f.k().qk_norm_forward(f.s(), dt, y.data(), saved.data(), rstd.data(), qw.data(), kw.data(),
                            eps, N, NH, NKV, hs);
      f.k().qk_norm_backward(f.s(), dt, dqkv.data(), dqw.data(), dkw.data(), saved.data(),
                             qw.data(), kw.data(), rstd.data(), N, NH, NKV, hs);
      f.sync();
      // The heads gathered: q [N NH, hs], k [N NKV, hs] (and their gradients).
      auto gather = [&](const Vec& v, int h0, int nh) {
        Vec out(size_t(N) * nh * hs);
        for (int n = 0; n < N; ++n)
          for (int h = 0; h < nh; ++h)
            for (int c = 0; c < hs; ++c)
              out[(size_t(n) * nh + h) * hs + c] = v[size_t(n) * W + size_t(h0 + h) * hs + c];
        return out;
      };
      const Vec yd = y.to_double(), dd = dqkv.to_double();
      for (int part = 0; part < 2; ++part) {
        const int h0 = part == 0 ? 0 : NH, nh = part == 0 ? NH : NKV;
        const Vec w = (part == 0 ? qw : kw).to_double();
        SCOPED_TRACE(part == 0 ? "query heads" : "key heads");
        RmsRef r = ref_rmsnorm(gather(x, h0, nh), w, eps, N * nh, hs);
        expect_close(gather(yd, h0, nh), r.out, tol_for(dt), "out");
        Vec gx, gw;
        ref_rmsnorm_grad(gather(g, h0, nh), gather(x, h0, nh), w, eps, N * nh, hs, gx, gw);
        expect_close(gather(dd, h0, nh), gx, tol_for(dt), "dinp (replaced)");
        const Vec& w0 = part == 0 ? dqw0 : dkw0;
        for (int c = 0; c < hs; ++c) gw[c] += w0[c];
        expect_close(as_double(part == 0 ? dqw : dkw), gw, dt == DType::kF32 ? 1e-5 : 1e-4,
                     "dweight");
        Vec rs(size_t(N) * nh);
        for (int n = 0; n < N; ++n)
          for (int h = 0; h < nh; ++h) rs[size_t(n) * nh + h] = rstd[size_t(n) * H + h0 + h];
        expect_close(rs, r.rstd, 1e-5, "rstd");
      }
      // The value heads untouched, forward and backward; saved holds the heads' inputs.
      const Vec sd = saved.to_double();
      for (int n = 0; n < N; ++n) {
        for (size_t c = size_t(H) * hs; c < W; ++c) {
          ASSERT_EQ(yd[size_t(n) * W + c], x[size_t(n) * W + c]) << "value head, row " << n;
          ASSERT_EQ(dd[size_t(n) * W + c], g[size_t(n) * W + c]) << "value gradient, row " << n;
        }
        for (size_t c = 0; c < size_t(H) * hs; ++c) {
          ASSERT_EQ(sd[size_t(n) * H * hs + c], x[size_t(n) * W + c]) << "saved, row " << n;
        }
      }
    }
  }
}

TEST(LlamaKernels, SwigluForwardAndBackward) {
  for (DType dt : kAllTypes) {
    for (auto [N, H] : {std::pair{1, 1}, std::pair{5, 13}, std::pair{64, 300}}) {
      SCOPED_TRACE(fmt::format("{} N={} H={}", dtype_name(dt), N, H));
      std::mt19937_64 rng(test_seed(2));
      Typed x = random_typed(dt, size_t(N) * 2 * H, rng, -4, 4);
      Typed out(dt, size_t(N) * H), dout = random_typed(dt, out.n, rng);
      // dinp is written: what it held (NaN here) is never read.
      Typed dx(dt, x.n);
      for (size_t i = 0; i < dx.n; ++i) dx.set(i, std::nanf(""));
      Vec dx0(x.n, 0.0);
      Fixture f;
      f.k().swiglu_forward(f.s(), dt, out.data(), x.data(), N, H);
      f.k().swiglu_backward(f.s(), dt, dx.data(), x.data(), dout.data(), N, H);
      f.sync();
      expect_close(out.to_double(), ref_swiglu(x.to_double(), N, H), tol_for(dt), "out");
      ref_swiglu_grad(x.to_double(), dout.to_double(), N, H, dx0);
      expect_close(dx.to_double(), dx0, tol_for(dt), "dinp");
    }
  }
}

TEST(LlamaKernels, RopeInverseFrequencies) {
  const int hs = 128;
  Vec plain(hs / 2), l3(hs / 2);
  RopeParams p{.theta = 500000.0};
  rope_inv_freq(p, hs, plain.data());
  EXPECT_DOUBLE_EQ(plain[0], 1.0);
  EXPECT_NEAR(plain[1], std::pow(500000.0, -2.0 / hs), 1e-18);
  // Llama 3.1 (factor 8, low 1, high 4, original 8192): high frequencies (wavelength under 2048)
  // unchanged, low ones (over 8192) divided by 8, the band between blended smoothly.
  p.llama3 = true;
  p.original_max_position = 8192;
  rope_inv_freq(p, hs, l3.data());
  const double kTwoPi = 6.283185307179586;
  int high = 0, low = 0, mid = 0;
  for (int i = 0; i < hs / 2; ++i) {
    const double wl = kTwoPi / plain[i];
    if (wl < 2048) {
      EXPECT_EQ(l3[i], plain[i]) << i;
      ++high;
    } else if (wl > 8192) {
      EXPECT_DOUBLE_EQ(l3[i], plain[i] / 8) << i;
      ++low;
    } else {
      EXPECT_LT(l3[i], plain[i]) << i;
      EXPECT_GT(l3[i], plain[i] / 8) << i;
      ++mid;
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(mid, 0);
}

TEST(LlamaKernels, RopeForwardAndBackward) {
  struct Shape {
    int B, T, NH, KVH, hs;
  };
  for (DType dt : kAllTypes) {
    for (Shape sh : {Shape{1, 1, 1, 1, 2}, Shape{2, 7, 4, 2, 6}, Shape{1, 70, 6, 2, 32}}) {
      for (RopeParams p : {RopeParams{}, RopeParams{.theta = 1e6}, llama3_rope()}) {
        SCOPED_TRACE(fmt::format("{} B={} T={} NH={} KVH={} hs={} theta={} llama3={}",
                                 dtype_name(dt), sh.B, sh.T, sh.NH, sh.KVH, sh.hs, p.theta,
                                 p.llama3));
        std::mt19937_64 rng(test_seed(3));
        const size_t n = size_t(sh.B) * sh.T * (sh.NH + 2 * sh.KVH) * sh.hs;
        Typed x = random_typed(dt, n, rng, -2, 2);
        Vec x0 = x.to_double();
        Fixture f;
        f.k().rope_forward(f.s(), dt, x.data(), p, nullptr, sh.B, sh.T, sh.NH, sh.KVH, sh.hs);
        f.sync();
        expect_close(x.to_double(), ref_rope(x0, p, sh.B, sh.T, sh.NH, sh.KVH, sh.hs), tol_for(dt),
                     "rope_forward");
        Typed g = random_typed(dt, n, rng, -2, 2);
        Vec g0 = g.to_double();
        f.k().rope_backward(f.s(), dt, g.data(), p, nullptr, sh.B, sh.T, sh.NH, sh.KVH, sh.hs);
        f.sync();
        expect_close(g.to_double(), ref_rope(g0, p, sh.B, sh.T, sh.NH, sh.KVH, sh.hs, -1.0),
                     tol_for(dt), "rope_backward");
      }
    }
  }
}

// Positions of packed sequences: a row holding sequences of 5, 9 and 3 tokens (positions
// restarting at each) rotates each exactly as a row of that sequence alone does (the same bits),
// forward and backward; a decode step's single token at position 40 as the 41st token of a row.
TEST(LlamaKernels, RopeAtGivenPositions) {
  const int NH = 4, KVH = 2, hs = 8, W = (NH + 2 * KVH) * hs;
  const std::vector<int> lens = {5, 9, 3};
  const int T = 17;
  for (DType dt : kAllTypes) {
    for (bool inverse : {false, true}) {
      SCOPED_TRACE(fmt::format("{} inverse={}", dtype_name(dt), inverse));
      std::mt19937_64 rng(test_seed(5));
      Typed packed = random_typed(dt, size_t(T) * W, rng, -2, 2);
      std::vector<int32_t> pos;
      for (int len : lens) {
        for (int i = 0; i < len; ++i) pos.push_back(i);
      }
      Typed alone = packed;
      Fixture f;
      auto rope = [&](void* x, const int32_t* p, int t) {
        if (inverse) {
          f.k().rope_backward(f.s(), dt, x, llama3_rope(), p, 1, t, NH, KVH, hs);
        } else {
          f.k().rope_forward(f.s(), dt, x, llama3_rope(), p, 1, t, NH, KVH, hs);
        }
      };
      rope(packed.data(), pos.data(), T);
      size_t at = 0;
      for (int len : lens) {
        rope(static_cast<char*>(alone.data()) + at * W * dtype_size(dt), nullptr, len);
        at += size_t(len);
      }
      f.sync();
      EXPECT_EQ(packed.to_double(), alone.to_double());
    }
  }
  // One token at position 40 against the same token as row 41 of 41.
  const int T2 = 41;
  std::mt19937_64 rng(test_seed(6));
  Typed row = random_typed(DType::kF32, size_t(T2) * W, rng, -2, 2);
  Typed last = random_typed(DType::kF32, size_t(W), rng, -2, 2);
  std::copy_n(static_cast<const float*>(last.data()), W,
              static_cast<float*>(row.data()) + size_t(T2 - 1) * W);
  const int32_t p40 = T2 - 1;
  Fixture f;
  f.k().rope_forward(f.s(), DType::kF32, row.data(), RopeParams{}, nullptr, 1, T2, NH, KVH, hs);
  f.k().rope_forward(f.s(), DType::kF32, last.data(), RopeParams{}, &p40, 1, 1, NH, KVH, hs);
  f.sync();
  const Vec r = row.to_double();
  EXPECT_EQ(last.to_double(), Vec(r.end() - W, r.end()));
}

TEST(LlamaKernels, GroupedQueryAttentionForwardAndBackward) {
  struct Shape {
    int B, T, NH, KVH, hs;
  };
  for (DType dt : kAllTypes) {
    for (Shape sh : {Shape{1, 1, 1, 1, 4}, Shape{2, 7, 4, 2, 3}, Shape{1, 70, 6, 2, 16},
                     Shape{2, 17, 8, 1, 8}, Shape{1, 9, 3, 3, 5}}) {
      const int B = sh.B, T = sh.T, NH = sh.NH, KVH = sh.KVH, hs = sh.hs;
      SCOPED_TRACE(
          fmt::format("{} B={} T={} NH={} KVH={} hs={}", dtype_name(dt), B, T, NH, KVH, hs));
      std::mt19937_64 rng(test_seed(4));
      const size_t W = size_t(NH + 2 * KVH) * hs;
      Typed qkv = random_typed(dt, size_t(B) * T * W, rng, -2, 2);
      Typed out(dt, size_t(B) * T * NH * hs), dout = random_typed(dt, out.n, rng);
      Typed dqkv = random_typed(dt, qkv.n, rng);
      Vec dqkv0 = dqkv.to_double();
      std::vector<float> att(size_t(B) * NH * T * T, 7.0f), scratch(att.size());
      Fixture f;
      f.k().attention_gqa_forward(f.s(), dt, out.data(), att.data(), qkv.data(), nullptr, B, T, NH,
                                  KVH, hs);
      f.k().attention_gqa_backward(f.s(), dt, dqkv.data(), scratch.data(), dout.data(), qkv.data(),
                                   att.data(), nullptr, B, T, NH, KVH, hs);
      f.sync();
      AttRef r = ref_gqa(qkv.to_double(), B, T, NH, KVH, hs);
      expect_close(out.to_double(), r.out, tol_for(dt), "out");
      expect_close(as_double(att), r.att, 1e-5, "att");
      Vec g = ref_gqa_grad(dout.to_double(), qkv.to_double(), r.att, B, T, NH, KVH, hs);
      for (size_t i = 0; i < g.size(); ++i) g[i] += dqkv0[i];
      expect_close(dqkv.to_double(), g, dt == DType::kF32 ? 2e-5 : tol_for(dt), "dqkv");
    }
  }
}

// Generation's attention against a key/value cache (Kernels::attention_decode): a prompt of P
// positions into an empty cache, then one position a call, gives the causal attention of the
// whole sequence (the double reference), and the caches hold the key and value heads' bits.
TEST(LlamaKernels, AttentionDecodeIsTheCausalAttention) {
  struct Shape {
    int B, T, P, NH, KVH, hs;
  };
  for (DType dt : kAllTypes) {
    for (Shape sh : {Shape{1, 1, 1, 1, 1, 4}, Shape{2, 9, 4, 4, 2, 3}, Shape{1, 40, 1, 6, 2, 16},
                     Shape{2, 17, 17, 8, 1, 8}}) {
      const int B = sh.B, T = sh.T, NH = sh.NH, KVH = sh.KVH, hs = sh.hs, maxT = T + 3;
      SCOPED_TRACE(fmt::format("{} B={} T={} prompt {} NH={} KVH={} hs={}", dtype_name(dt), B, T,
                               sh.P, NH, KVH, hs));
      std::mt19937_64 rng(test_seed(5));
      const size_t W = size_t(NH + 2 * KVH) * hs, Q = size_t(NH) * hs, KV = size_t(KVH) * hs;
      Typed qkv = random_typed(dt, size_t(B) * T * W, rng, -2, 2);
      Typed out(dt, size_t(B) * T * Q);
      Typed kc = random_typed(dt, size_t(B) * maxT * KV, rng), vc = kc;
      Fixture f;
      ASSERT_TRUE(f.k().supports(KernelOp::kAttentionDecode, {.dt = dt, .hs = hs}));
      const size_t es = dtype_size(dt);
      // Position p's rows of every sequence, packed [B, n, width] as the op reads and writes them.
      auto rows = [&](const Typed& x, size_t width, int p, int n) {
        Typed r(dt, size_t(B) * n * width);
        for (int b = 0; b < B; ++b) {
          std::memcpy(static_cast<char*>(r.data()) + size_t(b) * n * width * es,
                      static_cast<const char*>(x.data()) + (size_t(b) * T + p) * width * es,
                      size_t(n) * width * es);
        }
        return r;
      };
      for (int p = 0; p < T;) {
        const int n = p == 0 ? sh.P : 1;
        Typed in = rows(qkv, W, p, n), o(dt, size_t(B) * n * Q);
        f.k().attention_decode(f.s(), dt, o.data(), kc.data(), vc.data(), in.data(), B, n, p, maxT,
                               NH, KVH, hs);
        f.sync();
        for (int b = 0; b < B; ++b) {
          std::memcpy(static_cast<char*>(out.data()) + (size_t(b) * T + p) * Q * es,
                      static_cast<const char*>(o.data()) + size_t(b) * n * Q * es,
                      size_t(n) * Q * es);
        }
        p += n;
      }
      AttRef r = ref_gqa(qkv.to_double(), B, T, NH, KVH, hs);
      expect_close(out.to_double(), r.out, tol_for(dt), "out");
      const Vec x = qkv.to_double(), k = kc.to_double(), v = vc.to_double();
      for (int b = 0; b < B; ++b) {
        for (int t = 0; t < T; ++t) {
          for (size_t c = 0; c < KV; ++c) {
            const size_t at = (size_t(b) * maxT + t) * KV + c, in = (size_t(b) * T + t) * W + Q + c;
            ASSERT_EQ(k[at], x[in]) << "key " << b << "," << t << "," << c;
            ASSERT_EQ(v[at], x[in + KV]) << "value " << b << "," << t << "," << c;
          }
        }
      }
    }
  }
}

TEST(LlamaKernels, DeterministicAcrossThreadCounts) {
  const int B = 2, T = 40, NH = 4, KVH = 2, hs = 8;
  const size_t W = size_t(NH + 2 * KVH) * hs;
  std::mt19937_64 rng(test_seed(6));
  Typed qkv = random_typed(DType::kBF16, size_t(B) * T * W, rng, -2, 2);
  Typed dout = random_typed(DType::kBF16, size_t(B) * T * NH * hs, rng);
  Typed qw = random_typed(DType::kBF16, hs, rng, 0.5, 1.5),
        kw = random_typed(DType::kBF16, hs, rng, 0.5, 1.5);
  std::vector<unsigned char> got[2];
  for (int threads : {1, 3}) {
    Fixture f(threads);
    Typed x = qkv, dx(DType::kBF16, qkv.n), out(DType::kBF16, dout.n);
    std::vector<float> att(size_t(B) * NH * T * T), scratch(att.size());
    Typed saved(DType::kBF16, size_t(B) * T * (NH + KVH) * hs);
    std::vector<float> rstd(size_t(B) * T * (NH + KVH)), dqw(hs, 0.0f), dkw(hs, 0.0f);
    f.k().qk_norm_forward(f.s(), DType::kBF16, x.data(), saved.data(), rstd.data(), qw.data(),
                          kw.data(), 1e-6f, B * T, NH, KVH, hs);
    f.k().rope_forward(f.s(), DType::kBF16, x.data(), llama3_rope(), nullptr, B, T, NH, KVH, hs);
    f.k().attention_gqa_forward(f.s(), DType::kBF16, out.data(), att.data(), x.data(), nullptr, B,
                                T, NH, KVH, hs);
    f.k().attention_gqa_backward(f.s(), DType::kBF16, dx.data(), scratch.data(), dout.data(),
                                 x.data(), att.data(), nullptr, B, T, NH, KVH, hs);
    f.k().rope_backward(f.s(), DType::kBF16, dx.data(), llama3_rope(), nullptr, B, T, NH, KVH, hs);
    f.k().qk_norm_backward(f.s(), DType::kBF16, dx.data(), dqw.data(), dkw.data(), saved.data(),
                           qw.data(), kw.data(), rstd.data(), B * T, NH, KVH, hs);
    f.sync();
    got[threads == 1 ? 0 : 1] = dx.bytes;
    for (const auto* w : {&dqw, &dkw}) {
      const auto* b = reinterpret_cast<const unsigned char*>(w->data());
      got[threads == 1 ? 0 : 1].insert(got[threads == 1 ? 0 : 1].end(), b, b + hs * 4);
    }
  }
  EXPECT_EQ(got[0], got[1]);
}

// ---------------------------------------------------------------------------------------------
// Finite differences: each backward against its own forward, fp32, loss = sum(out * dout).

struct FdSample {
  float* param;
  size_t n;
  const float* analytic;
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
    const float orig = p.param[i], hi = orig + float(h), lo = orig - float(h);
    p.param[i] = hi;
    const double lp = loss();
    p.param[i] = lo;
    const double lm = loss();
    p.param[i] = orig;
    const double fd = (lp - lm) / (double(hi) - double(lo)), an = p.analytic[i];
    EXPECT_LE(std::fabs(fd - an), 1e-2 * (std::fabs(an) + scale) + 1e-6)
        << p.name << "[" << i << "]: finite difference " << fd << ", backward " << an;
  }
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

TEST(LlamaKernelsGradCheck, RmsNorm) {
  std::mt19937_64 rng(test_seed(11));
  const int N = 4, C = 9;
  auto x = random_f32(size_t(N) * C, rng), w = random_f32(C, rng, 0.5f, 1.5f);
  auto dout = random_f32(x.size(), rng);
  std::vector<float> out(x.size()), rstd(N), dx(x.size(), 0.0f), dw(C, 0.0f);
  Fixture f;
  auto loss = [&] {
    f.k().rmsnorm_forward(f.s(), DType::kF32, out.data(), rstd.data(), x.data(), w.data(), 1e-5f, N,
                          C);
    f.sync();
    return dot(out, dout);
  };
  loss();
  f.k().rmsnorm_backward(f.s(), DType::kF32, dx.data(), dx.data(), dw.data(), dout.data(), x.data(),
                         w.data(), rstd.data(), N, C);
  f.sync();
  fd_check(loss, {x.data(), x.size(), dx.data(), "dinp"}, rng, 1e-3);
  fd_check(loss, {w.data(), w.size(), dw.data(), "dweight"}, rng, 1e-3);
}

TEST(LlamaKernelsGradCheck, QkNorm) {
  std::mt19937_64 rng(test_seed(13));
  const int N = 3, NH = 4, NKV = 2, hs = 6;
  const size_t W = size_t(NH + 2 * NKV) * hs;
  auto x = random_f32(size_t(N) * W, rng), qw = random_f32(hs, rng, 0.5f, 1.5f),
       kw = random_f32(hs, rng, 0.5f, 1.5f), dout = random_f32(x.size(), rng);
  std::vector<float> y(x.size()), saved(size_t(N) * (NH + NKV) * hs), rstd(size_t(N) * (NH + NKV)),
      dx = dout, dqw(hs, 0.0f), dkw(hs, 0.0f);
  Fixture f;
  auto loss = [&] {
    y = x;
    f.k().qk_norm_forward(f.s(), DType::kF32, y.data(), saved.data(), rstd.data(), qw.data(),
                          kw.data(), 1e-5f, N, NH, NKV, hs);
    f.sync();
    return dot(y, dout);
  };
  loss();
  f.k().qk_norm_backward(f.s(), DType::kF32, dx.data(), dqw.data(), dkw.data(), saved.data(),
                         qw.data(), kw.data(), rstd.data(), N, NH, NKV, hs);
  f.sync();
  fd_check(loss, {x.data(), x.size(), dx.data(), "dinp"}, rng, 1e-3, 96);
  fd_check(loss, {qw.data(), qw.size(), dqw.data(), "dqw"}, rng, 1e-3);
  fd_check(loss, {kw.data(), kw.size(), dkw.data(), "dkw"}, rng, 1e-3);
}

TEST(LlamaKernelsGradCheck, Swiglu) {
  std::mt19937_64 rng(test_seed(12));
  const int N = 3, H = 7;
  auto x = random_f32(size_t(N) * 2 * H, rng, -3, 3), dout = random_f32(size_t(N) * H, rng);
  std::vector<float> out(dout.size()), dx(x.size(), 0.0f);
  Fixture f;
  auto loss = [&] {
    f.k().swiglu_forward(f.s(), DType::kF32, out.data(), x.data(), N, H);
    f.sync();
    return dot(out, dout);
  };
  f.k().swiglu_backward(f.s(), DType::kF32, dx.data(), x.data(), dout.data(), N, H);
  f.sync();
  fd_check(loss, {x.data(), x.size(), dx.data(), "dinp"}, rng, 1e-3);
}

TEST(LlamaKernelsGradCheck, Rope) {
  std::mt19937_64 rng(test_seed(13));
  const int B = 2, T = 5, NH = 4, KVH = 2, hs = 6;
  const size_t n = size_t(B) * T * (NH + 2 * KVH) * hs;
  auto x = random_f32(n, rng), dout = random_f32(n, rng);
  std::vector<float> y(n);
  Fixture f;
  const RopeParams p = llama3_rope();
  auto loss = [&] {
    y = x;
    f.k().rope_forward(f.s(), DType::kF32, y.data(), p, nullptr, B, T, NH, KVH, hs);
    f.sync();
    return dot(y, dout);
  };
  std::vector<float> dx = dout;
  f.k().rope_backward(f.s(), DType::kF32, dx.data(), p, nullptr, B, T, NH, KVH, hs);
  f.sync();
  fd_check(loss, {x.data(), x.size(), dx.data(), "dqkv"}, rng, 1e-2, 120);
}

TEST(LlamaKernelsGradCheck, GroupedQueryAttention) {
  std::mt19937_64 rng(test_seed(14));
  const int B = 2, T = 5, NH = 4, KVH = 2, hs = 3;
  const size_t W = size_t(NH + 2 * KVH) * hs;
  auto qkv = random_f32(size_t(B) * T * W, rng), dout = random_f32(size_t(B) * T * NH * hs, rng);
  std::vector<float> out(dout.size()), att(size_t(B) * NH * T * T), scratch(att.size());
  std::vector<float> dqkv(qkv.size(), 0.0f);
  Fixture f;
  auto loss = [&] {
    f.k().attention_gqa_forward(f.s(), DType::kF32, out.data(), att.data(), qkv.data(), nullptr, B,
                                T, NH, KVH, hs);
    f.sync();
    return dot(out, dout);
  };
  loss();
  f.k().attention_gqa_backward(f.s(), DType::kF32, dqkv.data(), scratch.data(), dout.data(),
                               qkv.data(), att.data(), nullptr, B, T, NH, KVH, hs);
  f.sync();
  fd_check(loss, {qkv.data(), qkv.size(), dqkv.data(), "dqkv"}, rng, 1e-2, 160);
}

}  // namespace
}  // namespace strata
