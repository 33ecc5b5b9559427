// AVX2 + FMA + F16C path (8 lanes). Compiled with -mavx2 -mfma -mf16c -ffp-contract=off (see
// CMakeLists.txt); only called after CPUID says the CPU has these.
#include <immintrin.h>

#include "cpu_optim/step_impl.h"

namespace strata::cpu_optim_internal {
namespace {

struct Avx2Ops {
  static constexpr size_t W = 8;
  static constexpr int kUnroll = 2;  // measured a little faster than 1 (same bits either way)
  using F = __m256;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F sign(F c) {
    const F zero = _mm256_setzero_ps();
    F gt = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    F lt = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
    return _mm256_or_ps(gt, lt);
  }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }

  static F load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // Round to nearest even in integer ops; NaN -> (bits >> 16) | 0x40 (quiet), as f32_to_bf16.
  static __m128i to_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_srli_epi32(r, 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(nan)) [[unlikely]] {
      __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
      r = _mm256_blendv_epi8(r, q, _mm256_castps_si256(nan));
    }
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  using H = __m128i;  // 8 packed bf16
  static void store_h(uint16_t* p, H h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
  static void stream_h(uint16_t* p, H h) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), h); }
  static constexpr bool kBf16Fast = false;  // to_bf16 is exact and the only conversion
  static constexpr bool kBf16Pairs = false;

  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // F16C rounds to nearest even (overflow to Inf, subnormals exact); NaNs are canonicalised to
  // sign | 0x7e00 as f32_to_f16 does (F16C would keep the payload).
  static __m128i to_f16(F x) {
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(nan)) [[unlikely]] {
      const __m256i u = _mm256_castps_si256(x);
      __m256i q =
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                          _mm256_set1_epi32(0x7e00));
      __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      __m256i n32 = _mm256_castps_si256(nan);
      __m128i m16 = _mm_packs_epi32(_mm256_castsi256_si128(n32), _mm256_extracti128_si256(n32, 1));
      h = _mm_blendv_epi8(h, q16, m16);
    }
    return h;
  }
  static void store_f16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(x));
  }
  static void stream_f16(uint16_t* p, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(x));
  }
  static constexpr size_t kPrefetchElems = 0;  // hardware prefetch only
  static void prefetch(const void*) {}
  static void fence() { _mm_sfence(); }

  // 16 fp64 lanes in four registers; vector j (0 or 1) of a group feeds lanes 8j..8j+7.
  struct Acc {
    __m256d d[4];
  };
  static void acc_load(Acc& a, const double* lanes) {
    for (int k = 0; k < 4; ++k) a.d[k] = _mm256_loadu_pd(lanes + 4 * k);
  }
  static void acc_add(Acc& a, size_t j, F x) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    // The square of an fp32 value is exact in fp64, so mul + add rounds once, like the scalar.
    a.d[2 * j] = _mm256_add_pd(a.d[2 * j], _mm256_mul_pd(lo, lo));
    a.d[2 * j + 1] = _mm256_add_pd(a.d[2 * j + 1], _mm256_mul_pd(hi, hi));
  }
  static void acc_store(const Acc& a, double* lanes) {
    for (int k = 0; k < 4; ++k) _mm256_storeu_pd(lanes + 4 * k, a.d[k]);
  }
};

}  // namespace

const IsaKernels& avx2_kernels() {
  static const IsaKernels t = make_table<Avx2Ops>();
  return t;
}

}  // namespace strata::cpu_optim_internal
