// A double-precision scalar reference of causal attention with grouped-query heads (optionally
// masked per sequence by positions), in the
// layout of Kernels::fused_attention_* (strata/kernels.h), and the helpers the attention tests
// share: typed random buffers and an element-wise comparison with a tolerance.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "strata/dtype.h"

namespace strata::test {

struct AttnShape {
  int B, T, NH, NKV, hs;
  int width() const { return (NH + 2 * NKV) * hs; }  // one row of qkv
  size_t qkv_elems() const { return size_t(B) * T * width(); }
  size_t out_elems() const { return size_t(B) * T * NH * hs; }
  size_t rows() const { return size_t(B) * NH * T; }  // lse and scratch
  std::string name() const {  // appended piece by piece: GCC 12 warns on "lit" + string&&
    std::string n = "B";
    for (auto [tag, v] :
         {std::pair<const char*, int>{"", B}, {"_T", T}, {"_NH", NH}, {"_NKV", NKV}, {"_hs", hs}}) {
      n += tag;
      n += std::to_string(v);
    }
    return n;
  }
};

// n elements of dtype dt, filled uniformly in [lo, hi) and rounded to dt (never exactly 0).
struct Buffer {
  DType dt = DType::kF32;
  std::vector<unsigned char> bytes;
  size_t n = 0;
  Buffer() = default;
  Buffer(DType t, size_t count) : dt(t), bytes(count * dtype_size(t)), n(count) {}
  void* data() { return bytes.data(); }
  float get(size_t i) const { return load_f32(bytes.data(), dt, i); }
  void set(size_t i, float v) { store_f32(bytes.data(), dt, i, v); }
  std::vector<double> values() const {
    std::vector<double> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = get(i);
    return v;
  }
};

inline Buffer random_buffer(DType dt, size_t n, std::mt19937_64& rng, float lo, float hi) {
  Buffer b(dt, n);
  std::uniform_real_distribution<float> u(lo, hi);
  for (size_t i = 0; i < n; ++i) {
    do {
      b.set(i, u(rng));
    } while (b.get(i) == 0.0f);
  }
  return b;
}

// Positions of B rows of T tokens, each row packed with sequences whose lengths cycle through
// `lengths` (row b starting at lengths[b % size]); the last sequence of a row is cut at T.
inline std::vector<int32_t> packed_positions(int B, int T, const std::vector<int>& lengths) {
  std::vector<int32_t> pos(size_t(B) * T);
  for (int b = 0; b < B; ++b) {
    size_t next = size_t(b);
    int p = 0, len = lengths[next % lengths.size()];
    for (int t = 0; t < T; ++t) {
      if (p == len) {
        p = 0;
        len = lengths[++next % lengths.size()];
      }
      pos[size_t(b) * T + t] = p++;
    }
  }
  return pos;
}

// The first key row t of batch row b sees: t - pos[b,t] with positions, else 0.
inline int reference_key_start(const std::vector<int32_t>* pos, int b, int T, int t) {
  return pos == nullptr ? 0 : t - (*pos)[size_t(b) * T + t];
}

// out [B,T,NH*hs] and lse [B,NH,T] of causal attention on qkv (values as doubles), masked per
// sequence when `pos` is given (Kernels::attention_gqa_forward).
inline void reference_attention_forward(const AttnShape& s, const std::vector<double>& qkv,
                                        std::vector<double>* out, std::vector<double>* lse,
                                        const std::vector<int32_t>* pos = nullptr) {
  const int W = s.width(), hs = s.hs, group = s.NH / s.NKV;
  const double scale = 1.0 / std::sqrt(double(hs));
  out->assign(s.out_elems(), 0.0);
  lse->assign(s.rows(), 0.0);
  std::vector<double> sc(s.T);
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.NH; ++h) {
      const int g = h / group;
      for (int t = 0; t < s.T; ++t) {
        const double* q = &qkv[(size_t(b) * s.T + t) * W + size_t(h) * hs];
        const int lo = reference_key_start(pos, b, s.T, t);
        double mx = -INFINITY;
        for (int j = lo; j <= t; ++j) {
          const double* k = &qkv[(size_t(b) * s.T + j) * W + size_t(s.NH + g) * hs];
          double d = 0;
          for (int i = 0; i < hs; ++i) d += q[i] * k[i];
          sc[j] = d * scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int j = lo; j <= t; ++j) sum += std::exp(sc[j] - mx);
        (*lse)[(size_t(b) * s.NH + h) * s.T + t] = mx + std::log(sum);
        double* o = &(*out)[(size_t(b) * s.T + t) * s.NH * hs + size_t(h) * hs];
        for (int j = lo; j <= t; ++j) {
          const double p = std::exp(sc[j] - mx) / sum;
          const double* v = &qkv[(size_t(b) * s.T + j) * W + size_t(s.NH + s.NKV + g) * hs];
          for (int i = 0; i < hs; ++i) o[i] += p * v[i];
        }
      }
    }
  }
}

// The gradient w.r.t. qkv of sum(out * dout).
inline std::vector<double> reference_attention_backward(const AttnShape& s,
                                                        const std::vector<double>& qkv,
                                                        const std::vector<double>& dout,
                                                        const std::vector<int32_t>* pos = nullptr) {
  const int W = s.width(), hs = s.hs, group = s.NH / s.NKV;
  const double scale = 1.0 / std::sqrt(double(hs));
  std::vector<double> dqkv(s.qkv_elems(), 0.0), p(s.T), dp(s.T);
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.NH; ++h) {
      const int g = h / group;
      auto row = [&](int t, size_t off) { return (size_t(b) * s.T + t) * W + off; };
      const size_t qo = size_t(h) * hs, ko = size_t(s.NH + g) * hs,
                   vo = size_t(s.NH + s.NKV + g) * hs;
      for (int t = 0; t < s.T; ++t) {
        const double* q = &qkv[row(t, qo)];
        const double* go = &dout[(size_t(b) * s.T + t) * s.NH * hs + size_t(h) * hs];
        const int lo = reference_key_start(pos, b, s.T, t);
        double mx = -INFINITY;
        for (int j = lo; j <= t; ++j) {
          double d = 0;
          for (int i = 0; i < hs; ++i) d += q[i] * qkv[row(j, ko) + i];
          p[j] = d * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int j = lo; j <= t; ++j) sum += (p[j] = std::exp(p[j] - mx));
        double dot = 0;
        for (int j = lo; j <= t; ++j) {
          p[j] /= sum;
          double d = 0;
          for (int i = 0; i < hs; ++i) d += go[i] * qkv[row(j, vo) + i];
          dp[j] = d;
          dot += p[j] * d;
        }
        for (int j = lo; j <= t; ++j) {
          const double ds = p[j] * (dp[j] - dot) * scale;
          for (int i = 0; i < hs; ++i) {
            dqkv[row(t, qo) + i] += ds * qkv[row(j, ko) + i];
            dqkv[row(j, ko) + i] += ds * q[i];
            dqkv[row(j, vo) + i] += p[j] * go[i];
          }
        }
      }
    }
  }
  return dqkv;
}

// Empty if |got - want| <= rtol * (|want| + rms(want)) everywhere (the rms term is an absolute
// tolerance at the scale of the data); else a line naming the count and the worst element.
inline std::string compare_close(const std::vector<double>& got, const std::vector<double>& want,
                                 double rtol) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  double ss = 0;
  for (double w : want) ss += w * w;
  const double rms = want.empty() ? 0.0 : std::sqrt(ss / double(want.size()));
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const double lim = rtol * (std::fabs(want[i]) + rms);
    const double ratio = std::isnan(got[i]) ? INFINITY : (lim > 0 ? err / lim : 0.0);
    if (!(err <= lim)) ++bad;
    if (ratio > worst_ratio || (std::isnan(got[i]) && bad == 1)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (bad == 0) return "";
  return std::to_string(bad) + " of " + std::to_string(got.size()) + " elements outside rtol " +
         std::to_string(rtol) + "; worst [" + std::to_string(worst) + "]: got " +
         std::to_string(got[worst]) + " want " + std::to_string(want[worst]) + " (rms " +
         std::to_string(rms) + ")";
}

}  // namespace strata::test
