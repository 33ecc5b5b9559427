// LayerNorm's row statistics for eight rows at once (layernorm.h), built with -mavx2 and not
// -mfma (no multiply-add contracted into an FMA): lane r adds row r's elements in element order
// with the scalar loop's operations (sub, mul, add, div, sqrt are correctly rounded in both), so
// the bits are layernorm.cc's. Columns come out of 8x8 transposes of the rows.
#include <immintrin.h>

#include "kernels/cpu/layernorm.h"

namespace strata::cpu::avx2 {
namespace {

// Transposes the 8x8 block in r[0..7] (rows become columns).
inline void transpose8(__m256 r[8]) {
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Column i of the eight rows: lane r = rows[r * C + i].
inline __m256 column(const float* rows, int C, int i) {
  return _mm256_set_ps(rows[7 * C + i], rows[6 * C + i], rows[5 * C + i], rows[4 * C + i],
                       rows[3 * C + i], rows[2 * C + i], rows[1 * C + i], rows[i]);
}

// Calls f(column i) for i = 0..C-1 in order.
template <typename F>
inline void for_each_column(const float* rows, int C, F&& f) {
  int i = 0;
  for (; i + 8 <= C; i += 8) {
    __m256 v[8];
    for (int r = 0; r < 8; ++r) v[r] = _mm256_loadu_ps(rows + size_t(r) * C + i);
    transpose8(v);
    for (int j = 0; j < 8; ++j) f(v[j]);
  }
  for (; i < C; ++i) f(column(rows, C, i));
}

}  // namespace

void layernorm_stats8(const float* rows, int C, float* mean, float* rstd) {
  __m256 m = _mm256_setzero_ps();
  for_each_column(rows, C, [&](__m256 x) { m = _mm256_add_ps(m, x); });
  const __m256 c = _mm256_set1_ps(float(C));
  m = _mm256_div_ps(m, c);
  __m256 v = _mm256_setzero_ps();
  for_each_column(rows, C, [&](__m256 x) {
    const __m256 d = _mm256_sub_ps(x, m);
    v = _mm256_add_ps(v, _mm256_mul_ps(d, d));
  });
  v = _mm256_div_ps(v, c);
  const __m256 s = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                 _mm256_sqrt_ps(_mm256_add_ps(v, _mm256_set1_ps(kLayerNormEps))));
  _mm256_storeu_ps(mean, m);
  _mm256_storeu_ps(rstd, s);
}

}  // namespace strata::cpu::avx2
