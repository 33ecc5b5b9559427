// AVX-512 paths (16 lanes): kAvx512 (F/BW/VL/DQ, bf16 rounding in integer ops) and kAvx512Bf16
// (the same plus vcvtneps2bf16 for bf16 stores). Compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mavx512bf16 -mfma -mf16c -ffp-contract=off (see CMakeLists.txt); the kAvx512
// table never executes an AVX512_BF16 instruction, and each table is only called after CPUID
// says the CPU has what it needs. Tails are handled by the shared code in step_impl.h.
#include <immintrin.h>

#include "cpu_optim/step_impl.h"

namespace strata::cpu_optim_internal {
namespace {

template <bool kHwBf16>
struct Avx512Ops {
  static constexpr size_t W = 16;
  // Two vectors per iteration: the bf16 outputs of a pair convert with one vcvtne2ps2bf16 and
  // store as one 64-byte line (measured: 1 and 4 slower).
  static constexpr int kUnroll = 2;
  using F = __m512;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F sign(F c) {
    const F zero = _mm512_setzero_ps();
    __mmask16 gt = _mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ);
    __mmask16 lt = _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ);
    F r = _mm512_mask_mov_ps(zero, lt, _mm512_set1_ps(-1.0f));
    return _mm512_mask_mov_ps(r, gt, _mm512_set1_ps(1.0f));
  }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }

  static F load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // Round to nearest even in integer ops; NaN -> (bits >> 16) | 0x40, as f32_to_bf16.
  static __m256i to_bf16_int(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan,
                              _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
  }
  static __m256i to_bf16(F x) {
    if constexpr (kHwBf16) {
      // vcvtneps2bf16 rounds to nearest even and quiets NaNs like f32_to_bf16, but flushes
      // fp32 subnormal inputs to zero: those lanes (rare) take the integer path.
      __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
      const __mmask16 sub = _mm512_fpclass_ps_mask(x, 0x20);  // 0x20: subnormal
      if (sub) [[unlikely]]
        h = _mm256_mask_blend_epi16(sub, h, to_bf16_int(x));
      return h;
    } else {
      return to_bf16_int(x);
    }
  }
  using H = __m256i;  // 16 packed bf16
  static void store_h(uint16_t* p, H h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
  static void stream_h(uint16_t* p, H h) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h); }
  // With AVX512_BF16: vcvtneps2bf16 alone, exact except on fp32 subnormal inputs, which show in
  // the check vector (one test and branch per group of vectors, in step_impl.h).
  static constexpr bool kBf16Fast = kHwBf16;
  // The check, in integer vector ops on the converted words (a vfpclassps, or any mask test,
  // per vector measured slower): vcvtneps2bf16 turns exactly the subnormal inputs into words
  // that are +-0, so a group whose words (shifted left by one, dropping the sign) have a
  // nonzero minimum needs no fix-up. Zero inputs also give +-0 and take the exact redo, which
  // returns the same words.
  using Chk = __m512i;
  static Chk chk_init() { return _mm512_set1_epi32(-1); }
  static H to_bf16_fast(F x, Chk& chk) {
    if constexpr (kHwBf16) {
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
      // Masked: the upper 16 words of chk keep their value.
      chk = _mm512_mask_min_epu16(chk, 0xffff, chk, _mm512_castsi256_si512(_mm256_add_epi16(h, h)));
      return h;
    } else {
      return to_bf16_int(x);
    }
  }
  static bool chk_any(Chk chk) { return _mm512_cmpeq_epi16_mask(chk, _mm512_setzero_si512()) != 0; }
  // Two vectors at once: 2W packed bf16, a first (low addresses), b second.
  static constexpr bool kBf16Pairs = kHwBf16;
  using H2 = __m512i;
  static H2 to_bf16_pair_fast(F a, F b, Chk& chk) {
    const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
    chk = _mm512_min_epu16(chk, _mm512_add_epi16(h, h));
    return h;
  }
  static H2 to_bf16_pair(F a, F b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(a)), to_bf16(b), 1);
  }
  static void store_h2(uint16_t* p, H2 h) { _mm512_storeu_si512(p, h); }
  static void stream_h2(uint16_t* p, H2 h) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), h);
  }

  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // Round to nearest even (overflow to Inf, subnormals exact); NaN -> sign | 0x7e00 as
  // f32_to_f16 (the instruction would keep the payload).
  static __m256i to_f16(F x) {
    __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (nan) [[unlikely]] {
      const __m512i u = _mm512_castps_si512(x);
      __m512i q =
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
                          _mm512_set1_epi32(0x7e00));
      h = _mm256_mask_blend_epi16(nan, h, _mm512_cvtepi32_epi16(q));
    }
    return h;
  }
  static void store_f16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(x));
  }
  static void stream_f16(uint16_t* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_f16(x));
  }
  static void fence() { _mm_sfence(); }
  // 1024 elements = 4 KiB ahead on fp32 streams (measured: 0, 1024, 2048; 1024 best).
  static constexpr size_t kPrefetchElems = 1024;
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

  // 16 fp64 lanes in two registers: element k of the 16-float vector feeds lane k.
  struct Acc {
    __m512d lo, hi;
  };
  static void acc_load(Acc& a, const double* lanes) {
    a.lo = _mm512_loadu_pd(lanes);
    a.hi = _mm512_loadu_pd(lanes + 8);
  }
  static void acc_add(Acc& a, size_t, F x) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    // The square of an fp32 value is exact in fp64, so mul + add rounds once, like the scalar.
    a.lo = _mm512_add_pd(a.lo, _mm512_mul_pd(lo, lo));
    a.hi = _mm512_add_pd(a.hi, _mm512_mul_pd(hi, hi));
  }
  static void acc_store(const Acc& a, double* lanes) {
    _mm512_storeu_pd(lanes, a.lo);
    _mm512_storeu_pd(lanes + 8, a.hi);
  }
};

}  // namespace

const IsaKernels& avx512_kernels() {
  static const IsaKernels t = make_table<Avx512Ops<false>>();
  return t;
}

const IsaKernels& avx512bf16_kernels() {
  static const IsaKernels t = make_table<Avx512Ops<true>>();
  return t;
}

}  // namespace strata::cpu_optim_internal
