// The second pass of a row's LayerNorm and RMSNorm, one warp per row, shared by the norm kernels
// (layernorm.cu, rmsnorm.cu) and the fused residual + norm (residual_norm.cu), so that the fused
// call gives the unfused calls' bits by construction: the same code after the row's first sum.
#pragma once

#include "kernels/cuda/cuda_common.cuh"

namespace strata {

// LayerNorm (eps = 1e-5) of row x (C elements) whose mean is m: the variance around m, then
// out = (x - m) * rstd * weight + bias; lane 0 stores the row's mean and rstd.
template <typename T>
__device__ __forceinline__ void layernorm_row(T* o, float* mean, float* rstd, const T* x,
                                              const T* weight, const T* bias, float m, int row,
                                              int C, int lane) {
  float var = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float d = to_f32(x[c]) - m;
    var += d * d;
  }
  const float s = 1.0f / sqrtf(warp_sum(var) / C + 1e-5f);
  for (int c = lane; c < C; c += 32) {
    const float n = (to_f32(x[c]) - m) * s;
    o[c] = from_f32<T>(n * to_f32(weight[c]) + (bias ? to_f32(bias[c]) : 0.0f));
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// RMSNorm of row x whose lane holds `ss`, its share of the sum of squares: out = x * rstd *
// weight; lane 0 stores the row's rstd.
template <typename T>
__device__ __forceinline__ void rmsnorm_row(T* o, float* rstd, const T* x, const T* weight,
                                            float ss, float eps, int row, int C, int lane) {
  const float s = 1.0f / sqrtf(warp_sum(ss) / C + eps);
  for (int c = lane; c < C; c += 32) o[c] = from_f32<T>(to_f32(x[c]) * s * to_f32(weight[c]));
  if (lane == 0) rstd[row] = s;
}

}  // namespace strata
