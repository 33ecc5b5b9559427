// Storage element types and exact conversions between them.
//
// strata stores tensors in fp32, bf16 or fp16 and computes in fp32. Conversions to the
// 16-bit types round to nearest, ties to even (the rounding the CUDA intrinsics
// __float2bfloat16_rn / __float2half_rn use), and keep NaN a NaN and +-Inf an Inf, so that the
// CPU and CUDA backends produce the same bits. These scalar versions are the reference;
// vectorized bulk versions live in cpu_optim/ and kernels/cpu/ and are tested against them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace strata {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
const char* dtype_name(DType t);  // "fp32", "bf16", "fp16"
// Accepts "fp32"/"float32"/"float", "bf16"/"bfloat16", "fp16"/"float16"/"half".
bool parse_dtype(std::string_view name, DType* out);

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 <-> fp32.
inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16 <-> fp32, round to nearest even, overflow to Inf, gradual underflow.
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Converts n elements between any two dtypes (same dtype: memcpy). Scalar reference.
void convert(const void* src, DType src_t, void* dst, DType dst_t, size_t n);

// Loads element i of a typed array as fp32 / stores an fp32 as element i.
inline float load_f32(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}
inline void store_f32(void* p, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
      break;
  }
}

}  // namespace strata
