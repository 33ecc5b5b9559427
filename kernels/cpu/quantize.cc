// Block-wise symmetric quantization to 8 or 4 bits with one fp32 scale per block (ZeRO++'s qwZ
// parameter gathers and qgZ gradient reduce-scatters). CUDA twin: kernels/cuda/quantize.cu.
//
// Two paths, the same bits: the scalar reference (quantize_reference, dequantize_reference),
// and an AVX2 (+F16C) one the dispatch picks when the CPU has it. The AVX2 path does the same
// fp32 operations on each element in the same order (an exact division, round to nearest even,
// a clamp; an fp32 multiply, then an add), finds a block's largest magnitude as the largest
// absolute bit pattern (the same value, order-free), and converts to bf16 with the reference's
// integer rounding; fp16 results are stored through the scalar conversion.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/ops.h"
#include "strata/cpu_optim.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STRATA_QUANTIZE_AVX2 1
#endif

namespace strata::cpu {
namespace {

inline int quantize_one(float v, float scale, int qmax) {
  const float r = std::nearbyint(v / scale);  // ties to even
  return int(std::fmin(std::fmax(r, float(-qmax)), float(qmax)));
}

// q for elements [a, b) of a block with `scale` (a is even for 4 bits; b is the block's end
// when odd, its high nibble 0). `zero`: the block is all zeros or not finite, every q is 0.
void quantize_elems(int bits, DType dt, void* q, const void* x, float scale, bool zero, size_t a,
                    size_t b) {
  const int qmax = quantize_qmax(bits);
  auto quant = [&](size_t i) -> int {
    return zero ? 0 : quantize_one(load_f32(x, dt, i), scale, qmax);
  };
  if (bits == 8) {
    for (size_t i = a; i < b; ++i) static_cast<int8_t*>(q)[i] = int8_t(quant(i));
    return;
  }
  for (size_t i = a; i < b; i += 2) {
    const uint8_t lo = uint8_t(quant(i)) & 0x0f;
    const uint8_t hi = i + 1 < b ? uint8_t(quant(i + 1)) & 0x0f : 0;
    static_cast<uint8_t*>(q)[i / 2] = uint8_t(lo | (hi << 4));
  }
}

// The block's scale from its largest magnitude (nan when a value is not finite).
inline float block_scale(int bits, float amax, bool finite) {
  return finite ? amax / float(quantize_qmax(bits)) : NAN;
}

// One block of m elements starting at element i0: its scale, and q for every element.
void quantize_block_reference(int bits, DType dt, void* q, float* scale_out, const void* x,
                              size_t i0, size_t m) {
  float amax = 0.0f;
  bool finite = true;
  for (size_t i = i0; i < i0 + m; ++i) {
    const float v = load_f32(x, dt, i);
    finite &= std::isfinite(v);
    amax = std::fmax(amax, std::fabs(v));
  }
  const float scale = block_scale(bits, amax, finite);
  *scale_out = scale;
  quantize_elems(bits, dt, q, x, scale, !finite || !(scale > 0.0f), i0, i0 + m);
}

inline int load_q(int bits, const void* q, size_t i) {
  if (bits == 8) return static_cast<const int8_t*>(q)[i];
  const uint8_t byte = static_cast<const uint8_t*>(q)[i / 2];
  const int nib = (i % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
  return nib >= 8 ? nib - 16 : nib;  // two's complement
}

void dequantize_elems(int bits, DType dt, void* x, const void* q, const float* scales, size_t b,
                      bool accumulate, size_t i0, size_t i1) {
  for (size_t i = i0; i < i1; ++i) {
    const float v = float(load_q(bits, q, i)) * scales[i / b];
    store_f32(x, dt, i, accumulate ? load_f32(x, dt, i) + v : v);
  }
}

#ifdef STRATA_QUANTIZE_AVX2
#define STRATA_AVX2 __attribute__((target("avx2,f16c")))

// Elements [i, i + 8) of x as fp32 (exact for every dtype).
STRATA_AVX2 inline __m256 load8(DType dt, const void* x, size_t i) {
  if (dt == DType::kF32) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  const __m128i h =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
  if (dt == DType::kBF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_cvtph_ps(h);
}

// f32_to_bf16 of 8 values: nan keeps its top bits with the quiet bit set, else round to
// nearest even on the integer bits.
STRATA_AVX2 inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
  const __m256i bias =
      _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  // 32 -> 16 bits (every value fits): packus works within 128-bit lanes, then the lanes' low
  // halves are joined.
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(p);
}

STRATA_AVX2 inline void store8(DType dt, void* x, size_t i, __m256 v) {
  if (dt == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(x) + i, v);
  } else if (dt == DType::kBF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(x) + i), to_bf16x8(v));
  } else {
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    for (int j = 0; j < 8; ++j) store_f32(x, dt, i + size_t(j), f[j]);
  }
}

// q of 8 elements as int32: round(x / scale) to nearest even, clamped to +-qmax.
STRATA_AVX2 inline __m256i quant8(DType dt, const void* x, size_t i, __m256 scale, __m256 lo,
                                  __m256 hi) {
  __m256 r = _mm256_round_ps(_mm256_div_ps(load8(dt, x, i), scale),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
  return _mm256_cvtps_epi32(r);  // exact: r is a whole number
}

// q of 32 elements as int8, in order.
STRATA_AVX2 inline __m256i quant32(DType dt, const void* x, size_t i, __m256 scale, __m256 lo,
                                   __m256 hi) {
  const __m256i ab =
      _mm256_packs_epi32(quant8(dt, x, i, scale, lo, hi), quant8(dt, x, i + 8, scale, lo, hi));
  const __m256i cd = _mm256_packs_epi32(quant8(dt, x, i + 16, scale, lo, hi),
                                        quant8(dt, x, i + 24, scale, lo, hi));
  // packs interleaves the 128-bit lanes: 4-byte groups come out as a0 b0 c0 d0 a1 b1 c1 d1.
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd),
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

STRATA_AVX2 void quantize_block_avx2(int bits, DType dt, void* q, float* scale_out, const void* x,
                                     size_t i0, size_t m) {
  // The largest |x| as the largest absolute bit pattern: for non-negative floats the integer
  // order is the float order, and a pattern above +inf's is a nan.
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i vmax = _mm256_setzero_si256();
  size_t i = i0;
  for (; i + 8 <= i0 + m; i += 8) {
    const __m256i u = _mm256_castps_si256(load8(dt, x, i));
    vmax = _mm256_max_epu32(vmax, _mm256_and_si256(u, abs_mask));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), vmax);
  uint32_t mx = *std::max_element(lanes, lanes + 8);
  for (; i < i0 + m; ++i) mx = std::max(mx, f32_bits(load_f32(x, dt, i)) & 0x7fffffffu);
  const bool finite = mx < 0x7f800000u;
  const float scale = block_scale(bits, f32_from_bits(mx), finite);
  *scale_out = scale;
  const bool zero = !finite || !(scale > 0.0f);
  if (zero) {
    quantize_elems(bits, dt, q, x, scale, true, i0, i0 + m);
    return;
  }
  const float qmax = float(quantize_qmax(bits));
  const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
  i = i0;
  for (; i + 32 <= i0 + m; i += 32) {
    const __m256i b = quant32(dt, x, i, vs, lo, hi);
    if (bits == 8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<int8_t*>(q) + i), b);
      continue;
    }
    // 4 bits: byte pairs (lo, hi) -> lo | hi << 4, then every 16-bit word's low byte.
    const __m256i n = _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
    const __m256i t =
        _mm256_and_si256(_mm256_or_si256(n, _mm256_srli_epi16(n, 4)), _mm256_set1_epi16(0x00ff));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(q) + i / 2),
                     _mm256_castsi256_si128(p));
  }
  quantize_elems(bits, dt, q, x, scale, false, i, i0 + m);
}

// Elements [i0, i1) (i0 a multiple of 8, block a multiple of 8: each group of 8 has one scale).
STRATA_AVX2 void dequantize_avx2(int bits, DType dt, void* x, const void* q, const float* scales,
                                 size_t b, bool accumulate, size_t i0, size_t i1) {
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256i qi;
    if (bits == 8) {
      qi = _mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(q) + i)));
    } else {
      uint32_t w;
      std::memcpy(&w, static_cast<const uint8_t*>(q) + i / 2, 4);
      const __m128i by = _mm_cvtsi32_si128(int(w));
      const __m128i mask = _mm_set1_epi8(0x0f);
      const __m128i nibbles =
          _mm_unpacklo_epi8(_mm_and_si128(by, mask), _mm_and_si128(_mm_srli_epi16(by, 4), mask));
      const __m256i u = _mm256_cvtepu8_epi32(nibbles);
      const __m256i eight = _mm256_set1_epi32(8);
      qi = _mm256_sub_epi32(_mm256_xor_si256(u, eight), eight);  // two's complement
    }
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), _mm256_set1_ps(scales[i / b]));
    if (accumulate) {
      if (dt == DType::kF16) {
        alignas(32) float f[8];
        _mm256_store_ps(f, v);
        for (int j = 0; j < 8; ++j) f[j] = load_f32(x, dt, i + size_t(j)) + f[j];
        v = _mm256_load_ps(f);
      } else {
        v = _mm256_add_ps(load8(dt, x, i), v);
      }
    }
    store8(dt, x, i, v);
  }
  dequantize_elems(bits, dt, x, q, scales, b, accumulate, i, i1);
}

// AVX2 with FMA and F16C, saved by the OS (cpu_optim's detection; clang's
// __builtin_cpu_supports knows no "f16c").
bool have_avx2() {
  static const bool yes = cpu_isa_supported(CpuIsa::kAvx2);
  return yes;
}
#else
bool have_avx2() { return false; }
#endif

void quantize_impl(bool fast, int bits, DType dt, void* q, float* scales, const void* x, size_t n,
                   int block) {
  const size_t b = size_t(block), blocks = quantize_blocks(n, block);
  // Blocks are independent; 4-bit blocks have an even size, so no byte is shared by two.
  parallel_ranges(blocks, 64, [&](size_t b0, size_t b1) {
    for (size_t k = b0; k < b1; ++k) {
      const size_t i0 = k * b, m = std::min(b, n - i0);
#ifdef STRATA_QUANTIZE_AVX2
      if (fast) {
        quantize_block_avx2(bits, dt, q, &scales[k], x, i0, m);
        continue;
      }
#endif
      quantize_block_reference(bits, dt, q, &scales[k], x, i0, m);
    }
  });
}

void dequantize_impl(bool fast, int bits, DType dt, void* x, const void* q, const float* scales,
                     size_t n, int block, bool accumulate) {
  const size_t b = size_t(block);
  // Pieces of 2^14 elements: each starts at a multiple of 8.
  parallel_ranges(n, size_t{1} << 14, [&](size_t i0, size_t i1) {
#ifdef STRATA_QUANTIZE_AVX2
    if (fast && b % 8 == 0) {
      dequantize_avx2(bits, dt, x, q, scales, b, accumulate, i0, i1);
      return;
    }
#endif
    dequantize_elems(bits, dt, x, q, scales, b, accumulate, i0, i1);
  });
}

}  // namespace

const char* quantize_isa() { return have_avx2() ? "avx2" : "scalar"; }

void quantize(int bits, DType dt, void* q, float* scales, const void* x, size_t n, int block) {
  quantize_impl(have_avx2(), bits, dt, q, scales, x, n, block);
}

void dequantize(int bits, DType dt, void* x, const void* q, const float* scales, size_t n,
                int block, bool accumulate) {
  dequantize_impl(have_avx2(), bits, dt, x, q, scales, n, block, accumulate);
}

void quantize_reference(int bits, DType dt, void* q, float* scales, const void* x, size_t n,
                        int block) {
  quantize_impl(false, bits, dt, q, scales, x, n, block);
}

void dequantize_reference(int bits, DType dt, void* x, const void* q, const float* scales, size_t n,
                          int block, bool accumulate) {
  dequantize_impl(false, bits, dt, x, q, scales, n, block, accumulate);
}

}  // namespace strata::cpu
