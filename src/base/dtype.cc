#include "strata/dtype.h"

#include <cmath>

namespace strata {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
  }
  return "?";
}

bool parse_dtype(std::string_view n, DType* out) {
  if (n == "fp32" || n == "float32" || n == "float") {
    *out = DType::kF32;
  } else if (n == "bf16" || n == "bfloat16") {
    *out = DType::kBF16;
  } else if (n == "fp16" || n == "float16" || n == "half") {
    *out = DType::kF16;
  } else {
    return false;
  }
  return true;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    // zero or subnormal: man * 2^-24
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;   // nan (quiet)
  if (a >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // result is subnormal or zero in fp16: value / 2^-24, rounded to nearest even
    float v = f32_from_bits(a);
    float scaled = v * 16777216.0f;    // exact: power of two scaling of a normal float
    float r = std::nearbyint(scaled);  // default rounding mode: nearest even
    return sign | static_cast<uint16_t>(r);
  }
  // normal: rebias exponent, round mantissa 23 -> 10 bits to nearest even
  uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

void convert(const void* src, DType st, void* dst, DType dt, size_t n) {
  if (st == dt) {
    std::memcpy(dst, src, n * dtype_size(st));
    return;
  }
  for (size_t i = 0; i < n; ++i) store_f32(dst, dt, i, load_f32(src, st, i));
}

}  // namespace strata
