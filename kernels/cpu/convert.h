// Element access for the CPU kernels: typed storage (fp32 / bf16 / fp16) <-> fp32 compute.
//
// Every CPU op is written once as a template over its storage element type T (float, Bf16 or
// F16) and instantiated for the three dtypes by dispatch_dtype(). Inside an op, values are read
// with to_float(x) and written with from_float<T>(v); both are exact reuses of the scalar
// reference conversions in strata/dtype.h (round to nearest even, NaN stays NaN), so the CPU
// kernels produce the bits the CUDA kernels are tested against.
//
// The span helpers convert whole rows into caller-owned fp32 scratch and back; they are what
// the attention ops use to gather fp32 operands. They are synchronous and single-threaded:
// callers parallelise over rows or chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "strata/dtype.h"

namespace strata::cpu {

// 16-bit storage types: distinct C++ types so templates can tell bf16 from fp16.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2 && sizeof(F16) == 2);

inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) { return bf16_to_f32(x.bits); }
inline float to_float(F16 x) { return f16_to_f32(x.bits); }

template <typename T>
T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline Bf16 from_float<Bf16>(float v) {
  return Bf16{f32_to_bf16(v)};
}
template <>
inline F16 from_float<F16>(float v) {
  return F16{f32_to_f16(v)};
}

// Calls f(T{}) with T the storage type of `dt`; returns what f returns.
template <typename F>
decltype(auto) dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::kF32:
      return f(float{});
    case DType::kBF16:
      return f(Bf16{});
    default:
      return f(F16{});
  }
}

// dst[i] = float(src[i]) for i < n.
template <typename T>
inline void load_span(const T* src, float* dst, size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  }
}

// dst[i] = T(src[i]) for i < n.
template <typename T>
inline void store_span(const float* src, T* dst, size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
  }
}

// dst[i] = T(float(dst[i]) + src[i]) for i < n: the accumulate (+=) of a backward op.
template <typename T>
inline void accumulate_span(const float* src, T* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(dst[i]) + src[i]);
}

// dst[i] = T(float(res[i]) + src[i]) for i < n (res may be dst: accumulate_span); without res,
// T(0 + src[i]): the bits of accumulating into zeros (a -0 comes out +0).
template <typename T>
inline void add_span(const float* src, const T* res, T* dst, size_t n) {
  if (res == nullptr) {
    for (size_t i = 0; i < n; ++i) dst[i] = from_float<T>(0.0f + src[i]);
    return;
  }
  for (size_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(res[i]) + src[i]);
}

// dst[t, :] = src[t * stride + offset .. + n) for t < rows, widened to fp32: one head's columns
// of a [rows, stride] matrix gathered into a dense [rows, n] one (the attention ops' q, k, v).
template <typename T>
inline void gather_columns(const T* src, int rows, size_t stride, size_t offset, int n,
                           float* dst) {
  for (int t = 0; t < rows; ++t) load_span(src + t * stride + offset, dst + size_t(t) * n, n);
}

// dst[t * stride + offset + i] += src[t, i]: gather_columns' way back, accumulating.
template <typename T>
inline void scatter_add_columns(const float* src, int rows, size_t stride, size_t offset, int n,
                                T* dst) {
  for (int t = 0; t < rows; ++t) {
    accumulate_span(src + size_t(t) * n, dst + t * stride + offset, n);
  }
}

}  // namespace strata::cpu
