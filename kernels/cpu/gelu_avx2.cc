// GELU's fp32 arithmetic (gelu.cc) eight lanes at a time, built with -mavx2 -mf16c and run on
// every CPU that has AVX2. Each lane performs exactly the scalar code's operations in its order
// (mul, add, div and compares are correctly rounded IEEE operations in both forms), and the
// file is built without -mfma so that no multiply-add can be contracted into an FMA: the
// results are bit for bit those of gelu.cc's scalar loop, which the tests check.
#include <immintrin.h>

#include <cstddef>

#include "kernels/cpu/gelu.h"

namespace strata::cpu::avx2 {
namespace {

inline __m256 set1(float x) { return _mm256_set1_ps(x); }
inline __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }

// gelu.cc's exp_fast, lane by lane.
inline __m256 exp_fast(__m256 x) {
  // x > 88 ? 88 : x, then x < -87 ? -87 : x: MIN/MAXPS return their second operand when either
  // is NaN, so a NaN x stays NaN as in the scalar ternaries.
  x = _mm256_min_ps(set1(88.0f), x);
  x = _mm256_max_ps(set1(-87.0f), x);
  const __m256 t = mul(x, set1(1.44269504088896341f));
  __m256 n = sub(add(t, set1(12582912.0f)), set1(12582912.0f));
  n = _mm256_and_ps(n, _mm256_cmp_ps(n, n, _CMP_ORD_Q));  // NaN -> +0
  const __m256 r = add(sub(x, mul(n, set1(0.693359375f))), mul(n, set1(2.12194440e-4f)));
  __m256 p = set1(1.9875691500e-4f);
  p = add(mul(p, r), set1(1.3981999507e-3f));
  p = add(mul(p, r), set1(8.3334519073e-3f));
  p = add(mul(p, r), set1(4.1665795894e-2f));
  p = add(mul(p, r), set1(1.6666665459e-1f));
  p = add(mul(p, r), set1(5.0000001201e-1f));
  const __m256 e = add(add(mul(mul(p, r), r), r), set1(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return mul(e, _mm256_castsi256_ps(bits));
}

// s = 1 / (1 + exp_fast(-2u)), u = kGeluScale * (v + 0.044715 v^3) (gelu.cc's gelu_gate).
inline __m256 gate(__m256 v) {
  const __m256 cube = mul(mul(mul(set1(0.044715f), v), v), v);
  const __m256 u = mul(set1(kGeluScale), add(v, cube));
  return _mm256_div_ps(set1(1.0f), add(set1(1.0f), exp_fast(mul(set1(-2.0f), u))));
}

inline __m256 forward8(__m256 v) { return mul(v, gate(v)); }

// g * (s + v * 2 * s * (1 - s) * du), du = kGeluScale * (1 + 3 * 0.044715 * v * v).
inline __m256 backward8(__m256 v, __m256 g) {
  const __m256 s = gate(v);
  const __m256 du = mul(set1(kGeluScale), add(set1(1.0f), mul(mul(set1(3.0f * 0.044715f), v), v)));
  const __m256 d = mul(mul(mul(mul(v, set1(2.0f)), s), sub(set1(1.0f), s)), du);
  return mul(g, add(s, d));
}

}  // namespace

void gelu_forward_f32(float* x, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, forward8(_mm256_loadu_ps(x + i)));
  if (i < n) {  // the tail through a lane buffer: the same per-lane arithmetic
    float v[8] = {};
    for (size_t j = 0; j < n - i; ++j) v[j] = x[i + j];
    _mm256_storeu_ps(v, forward8(_mm256_loadu_ps(v)));
    for (size_t j = 0; j < n - i; ++j) x[i + j] = v[j];
  }
}

void gelu_backward_f32(const float* x, float* g, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(g + i, backward8(_mm256_loadu_ps(x + i), _mm256_loadu_ps(g + i)));
  }
  if (i < n) {
    float v[8] = {}, d[8] = {};
    for (size_t j = 0; j < n - i; ++j) {
      v[j] = x[i + j];
      d[j] = g[i + j];
    }
    _mm256_storeu_ps(d, backward8(_mm256_loadu_ps(v), _mm256_loadu_ps(d)));
    for (size_t j = 0; j < n - i; ++j) g[i + j] = d[j];
  }
}

}  // namespace strata::cpu::avx2
