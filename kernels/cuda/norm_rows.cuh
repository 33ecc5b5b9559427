// The second pass of a row's LayerNorm and RMSNorm, one warp per row, shared by the norm kernels
// (layernorm.cu, rmsnorm.cu) and the fused residual + norm (residual_norm.cu), so that the fused
// call gives the unfused calls' bits by construction: the same code after the row's first sum,
// whose lanes take the row's columns as for_row_elems hands them out (in packs or one at a
// time: `packed`, the same for both calls of a row). And the backward's row terms, which the
// input-gradient kernels and the one-pass backward (norm_backward.cu) share the same way.
#pragma once

#include "kernels/cuda/cuda_common.cuh"

namespace strata {

// LayerNorm (eps = 1e-5) of row x (C elements) whose mean is m: the variance around m, then
// out = (x - m) * rstd * weight + bias; lane 0 stores the row's mean and rstd.
template <typename T>
__device__ __forceinline__ void layernorm_row(T* o, float* mean, float* rstd, const T* x,
                                              const T* weight, const T* bias, float m, int row,
                                              int C, int lane, bool packed) {
  float var = 0.0f;
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> xs = load_elems<K>(x + c);
    for (int j = 0; j < K; ++j) {
      const float d = to_f32(xs.v[j]) - m;
      var += d * d;
    }
  });
  const float s = 1.0f / sqrtf(warp_sum(var) / C + 1e-5f);
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> xs = load_elems<K>(x + c), ws = load_elems<K>(weight + c);
    Elems<T, K> bs{};
    if (bias) bs = load_elems<K>(bias + c);
    Elems<T, K> os;
    for (int j = 0; j < K; ++j) {
      const float n = (to_f32(xs.v[j]) - m) * s;
      os.v[j] = from_f32<T>(n * to_f32(ws.v[j]) + (bias ? to_f32(bs.v[j]) : 0.0f));
    }
    store_elems(o + c, os);
  });
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// RMSNorm of row x whose lane holds `ss`, its share of the sum of squares: out = x * rstd *
// weight; lane 0 stores the row's rstd.
template <typename T>
__device__ __forceinline__ void rmsnorm_row(T* o, float* rstd, const T* x, const T* weight,
                                            float ss, float eps, int row, int C, int lane,
                                            bool packed) {
  const float s = 1.0f / sqrtf(warp_sum(ss) / C + eps);
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> xs = load_elems<K>(x + c), ws = load_elems<K>(weight + c);
    Elems<T, K> os;
    for (int j = 0; j < K; ++j) os.v[j] = from_f32<T>(to_f32(xs.v[j]) * s * to_f32(ws.v[j]));
    store_elems(o + c, os);
  });
  if (lane == 0) rstd[row] = s;
}

// The input-gradient pass of a norm's backward over one row (its arrays from the row's start):
// dinp = dres + grad(x, weight * dout) element by element (dres null: 0 +; dres may be dinp),
// `grad` the norm's gradient of an element from its input and weighted output gradient.
template <typename T, typename G>
__device__ __forceinline__ void norm_dinp_row(T* dinp, const T* dres, const T* dout, const T* x,
                                              const T* weight, int C, int lane, bool packed,
                                              G grad) {
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> ws = load_elems<K>(weight + c), ds = load_elems<K>(dout + c);
    const Elems<T, K> xs = load_elems<K>(x + c);
    Elems<T, K> rs{};
    if (dres) rs = load_elems<K>(dres + c);
    Elems<T, K> gs;
    for (int j = 0; j < K; ++j) {
      const float g = grad(to_f32(xs.v[j]), to_f32(ws.v[j]) * to_f32(ds.v[j]));
      gs.v[j] = from_f32<T>((dres ? to_f32(rs.v[j]) : 0.0f) + g);
    }
    store_elems(dinp + c, gs);
  });
}

// A norm's backward row terms (Norm of norm_backward_dinp_row and of norm_backward.cu's one
// pass): Row row(r); dots(row, x, dn, d) over a row's elements (dn = weight * dout; kDots sums);
// Row finish(row, d0 / C, d1 / C) after the warp's sums; grad(row, x, dn), an element's input
// gradient; params(row, x, g, t), an element's terms of the parameter gradients (g = dout).
// LayerNorm's: dinp = dres + (w*dout - mean(w*dout) - norm * mean(w*dout*norm)) * rstd; the
// weight and bias gradients' terms norm * dout and dout.
struct LayerNormGrad {
  static constexpr int kDots = 2;
  const float* mean;
  const float* rstd;
  struct Row {
    float m, s, a, b;
  };
  __device__ Row row(int r) const { return {mean[r], rstd[r], 0.0f, 0.0f}; }
  __device__ void dots(const Row& st, float x, float dn, float (&d)[2]) const {
    d[0] += dn;
    d[1] += dn * (x - st.m) * st.s;
  }
  __device__ Row finish(Row st, float dnorm_mean, float dnorm_norm_mean) const {
    st.a = dnorm_mean;
    st.b = dnorm_norm_mean;
    return st;
  }
  __device__ float grad(const Row& st, float x, float dn) const {
    const float n = (x - st.m) * st.s;
    return (dn - st.a - n * st.b) * st.s;
  }
  __device__ void params(const Row& st, float x, float g, float (&t)[2]) const {
    t[0] = (x - st.m) * st.s * g;
    t[1] = g;
  }
};

// RMSNorm's: dinp = dres + (w*dout - x * rstd^2 * mean(w*dout*x)) * rstd; the weight's x * rstd *
// dout.
struct RmsNormGrad {
  static constexpr int kDots = 1;
  const float* rstd;
  struct Row {
    float s, k;
  };
  __device__ Row row(int r) const { return {rstd[r], 0.0f}; }
  __device__ void dots(const Row&, float x, float dn, float (&d)[2]) const { d[0] += dn * x; }
  __device__ Row finish(Row st, float dot_mean, float) const {
    st.k = dot_mean * st.s * st.s;
    return st;
  }
  __device__ float grad(const Row& st, float x, float dn) const { return (dn - x * st.k) * st.s; }
  __device__ void params(const Row& st, float x, float g, float (&t)[1]) const {
    t[0] = x * st.s * g;
  }
};

// A row's terms after its dots: the warp's sums (kDots of them) over C.
template <typename Norm>
__device__ __forceinline__ typename Norm::Row norm_finish(const Norm& norm, typename Norm::Row st,
                                                          float (&d)[2], int C) {
  const float d0 = warp_sum(d[0]) / C;
  return norm.finish(st, d0, Norm::kDots > 1 ? warp_sum(d[1]) / C : 0.0f);
}

// The input-gradient pass of a norm's backward over row `row`, one warp (lane `lane` of it):
// the row's dots, the warp's sums, then norm_dinp_row with the norm's gradient.
template <typename T, typename Norm>
__device__ __forceinline__ void norm_backward_dinp_row(const Norm& norm, T* dinp, const T* dres,
                                                       const T* dout, const T* inp, const T* weight,
                                                       int row, int C, int lane, bool packed) {
  const size_t off = size_t(row) * C;
  auto st = norm.row(row);
  float d[2] = {0.0f, 0.0f};
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> ws = load_elems<K>(weight + c), ds = load_elems<K>(dout + off + c);
    const Elems<T, K> xs = load_elems<K>(inp + off + c);
    for (int j = 0; j < K; ++j)
      norm.dots(st, to_f32(xs.v[j]), to_f32(ws.v[j]) * to_f32(ds.v[j]), d);
  });
  st = norm_finish(norm, st, d, C);
  norm_dinp_row(dinp + off, dres ? dres + off : nullptr, dout + off, inp + off, weight, C, lane,
                packed, [&](float x, float dn) { return norm.grad(st, x, dn); });
}

}  // namespace strata
