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
#include <cstring>
#include <initializer_list>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "strata/dtype.h"

// A kernel's dynamic shared memory (its launch's third argument) as `unsigned char name[]`,
// 128-byte aligned. The CPU emulation of CUDA defines its own (tests/cuda_emu.h).
#ifndef STRATA_CUDA_EMULATION
#define STRATA_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

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

// ---- 16-byte packs ------------------------------------------------------------------------------
// The elementwise and row kernels read and write their arrays 16 bytes at a time (8 bf16/fp16
// or 4 fp32 elements, llm.c's Packed128) where every pointer is 16-byte aligned and the sizes
// allow: one wide access where a thread per element issues eight (four), so that enough bytes
// are in flight to reach the memory's bandwidth with the grid's threads. The arithmetic of each
// element is the same either way; which thread takes which element changes, and with it the
// order of a row's sums in the norms. The one-element kernels stay for misaligned arrays and
// for STRATA_CUDA_PACKED=0 (kPackedAccessEnv, cuda_ops.h).

// The CPU emulation of CUDA (tests/cuda_emu.h) checks each pack's alignment, as a GPU's fault
// would; compiled by nvcc the check is nothing.
#ifndef STRATA_PACK_CHECK
#define STRATA_PACK_CHECK(p) ((void)0)
#endif

// K consecutive elements of an array, loaded or stored in one access (K = 1: one element).
template <typename T, int K>
struct alignas(sizeof(T) * K) Elems {
  T v[K];
};
template <typename T>
inline constexpr int kPack = 16 / int(sizeof(T));  // elements in 16 bytes
template <int K>
struct Width {
  static constexpr int value = K;
};

template <int K, typename T>
__device__ __forceinline__ Elems<T, K> load_elems(const T* p) {
  Elems<T, K> e;
  if constexpr (K == 1) {
    e.v[0] = *p;
  } else {
    static_assert(sizeof(T) * K == 16, "a pack is 16 bytes");
    STRATA_PACK_CHECK(p);
    const uint4 bits = *reinterpret_cast<const uint4*>(p);
    memcpy(&e, &bits, 16);
  }
  return e;
}
// The same where p is 16-byte aligned only if `aligned`: otherwise element by element.
template <int K, typename T>
__device__ __forceinline__ Elems<T, K> load_elems(const T* p, bool aligned) {
  if (aligned) return load_elems<K>(p);
  Elems<T, K> e;
  for (int j = 0; j < K; ++j) e.v[j] = p[j];
  return e;
}
template <int K, typename T>
__device__ __forceinline__ void store_elems(T* p, const Elems<T, K>& e) {
  if constexpr (K == 1) {
    *p = e.v[0];
  } else {
    static_assert(sizeof(T) * K == 16, "a pack is 16 bytes");
    STRATA_PACK_CHECK(p);
    uint4 bits;
    memcpy(&bits, &e, 16);
    *reinterpret_cast<uint4*>(p) = bits;
  }
}

// Whether every pointer (null ones aside) can be accessed in 16-byte packs.
inline bool packs_aligned(std::initializer_list<const void*> ps) {
  for (const void* p : ps) {
    if ((reinterpret_cast<uintptr_t>(p) & 15u) != 0) return false;
  }
  return true;
}

// A row kernel's arrays of rows of C elements of T go in packs when the table offers them, every
// pointer is aligned and C fills whole packs (every row then starts aligned).
template <typename T>
inline bool rows_packed(bool packed, int C, std::initializer_list<const void*> ps) {
  return packed && C % kPack<T> == 0 && packs_aligned(ps);
}

// An elementwise kernel's grid-stride loop over n elements: f(i, Width<K>{}) for elements
// i .. i+K-1, in packs of kPack<T> when `packed` (n / kPack<T> of them), then one at a time.
template <typename T, typename F>
__device__ __forceinline__ void for_each_elems(size_t n, bool packed, F f) {
  constexpr int kN = kPack<T>;
  const size_t t = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t packs = packed ? n / kN : 0;
  for (size_t p = t; p < packs; p += stride) f(p * kN, Width<kN>{});
  for (size_t i = packs * kN + t; i < n; i += stride) f(i, Width<1>{});
}

// The loop of `threads` threads (a warp, a block) over a row of C elements, thread t of them:
// f(c, Width<K>{}) for columns c .. c+K-1, in packs when `packed` (C a multiple of kPack<T>),
// else one column at a time.
template <typename T, typename F>
__device__ __forceinline__ void for_row_elems(int C, bool packed, int t, int threads, F f) {
  constexpr int kN = kPack<T>;
  if (packed) {
    for (int c = t * kN; c < C; c += threads * kN) f(c, Width<kN>{});
  } else {
    for (int c = t; c < C; c += threads) f(c, Width<1>{});
  }
}

inline unsigned grid_for(size_t n, unsigned block) {
  size_t g = (n + block - 1) / block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535u * 32u ? 65535u * 32u : g));
}

// The grid of an elementwise kernel over n elements of T: a thread per pack when `packed`.
template <typename T>
inline unsigned grid_for_elems(size_t n, bool packed, unsigned block) {
  return grid_for(packed ? (n + kPack<T> - 1) / kPack<T> : n, block);
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
