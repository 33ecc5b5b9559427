// The second pass of a row's LayerNorm and RMSNorm, one warp per row, shared by the norm kernels
// (layernorm.cu, rmsnorm.cu) and the fused residual + norm (residual_norm.cu), so that the fused
// call gives the unfused calls' bits by construction: the same code after the row's first sum,
// whose lanes take the row's columns as for_row_elems hands them out (in packs or one at a
// time: `packed`, the same for both calls of a row).
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

}  // namespace strata
