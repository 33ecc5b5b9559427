// LayerNorm's row statistics for eight rows at once (layernorm.h), built with -mavx2 and not
// -mfma (no multiply-add contracted into an FMA): lane r adds row r's elements in element order
// with the scalar loop's operations (sub, mul, add, div, sqrt are correctly rounded in both), so
// the bits are layernorm.cc's. Columns come out of 8x8 transposes of the rows.
#include <immintrin.h>

#include "kernels/cpu/avx2_transpose.h"
#include "kernels/cpu/layernorm.h"

namespace strata::cpu::avx2 {
namespace {

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
