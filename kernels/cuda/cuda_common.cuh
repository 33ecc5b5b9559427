// Device-side helpers shared by the op files (.cu only).
//
// Storage types: float, __nv_bfloat16, __half. Every kernel loads to fp32 with to_f32, computes
// in fp32 and stores with from_f32<T>, which rounds to nearest even (the _rn intrinsics) like
// strata::store_f32 on the CPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "strata/dtype.h"

namespace strata {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

// Element i of an array whose type is only known at run time (used where templating on every
// combination of dtypes would multiply instantiations, e.g. the optimizer's four dtypes).
__device__ __forceinline__ float load_dt(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return __half2float(static_cast<const __half*>(p)[i]);
  }
}
__device__ __forceinline__ void store_dt(void* p, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    default:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum (or max) over a block of at most 1024 threads, blockDim.x a multiple of 32. Every thread
// gets the result. `shared` holds 32 values; the call synchronizes the block twice, so it may be
// called repeatedly with the same buffer.
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : V(0);
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

inline unsigned grid_for(size_t n, unsigned block) {
  size_t g = (n + block - 1) / block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535u * 32u ? 65535u * 32u : g));
}

}  // namespace strata

// Calls BODY with `scalar_t` bound to the storage type of `dt` (float, __nv_bfloat16, __half).
#define STRATA_DISPATCH_DT(dt, ...)   \
  switch (dt) {                       \
    case ::strata::DType::kF32: {     \
      using scalar_t = float;         \
      __VA_ARGS__;                    \
      break;                          \
    }                                 \
    case ::strata::DType::kBF16: {    \
      using scalar_t = __nv_bfloat16; \
      __VA_ARGS__;                    \
      break;                          \
    }                                 \
    case ::strata::DType::kF16: {     \
      using scalar_t = __half;        \
      __VA_ARGS__;                    \
      break;                          \
    }                                 \
  }
