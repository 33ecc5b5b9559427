// The AVX2 + FMA GEMM (gemm.h), built with -mavx2 -mfma -mf16c and run on every CPU that has
// them (AVX-512 CPUs included, so both compute the same bits).
//
// The structure is the BLIS/GotoBLAS one: for each block of kKc inner-dimension steps, a
// [kKc, n] panel of op(B) is packed into kNr-column strips and, for each block of kMc rows, a
// [kMc, kKc] panel of op(A) into kMr-row strips; a 6x16 micro-kernel (12 ymm accumulators)
// multiplies one strip pair. Packing is where bf16/fp16 operands are widened to fp32, so
// typed operands cost no full-size fp32 copy. Strips at the right/bottom edge are zero-padded
// and their micro-tile goes through a small buffer.
//
// Summation order: element (i, j) is C(i,j) op (sum over block 0) + (sum over block 1) + ...,
// each block's sum one FMA chain over k in order, so the bits depend only on kKc and on the
// operands, never on how callers tile m and n or on the thread count.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "kernels/cpu/avx2_transpose.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"
#include "strata/status.h"

namespace strata::cpu::avx2 {
namespace {

constexpr int kMr = 6;     // micro-tile rows
constexpr int kNr = 16;    // micro-tile columns (two ymm)
constexpr int kKc = 256;   // inner-dimension block: a B strip (kKc x kNr fp32, 16 KiB) in L1
constexpr int kMc = 96;    // rows per packed A panel (96 x kKc fp32, 96 KiB) in L2
constexpr int kNc = 1024;  // columns per packed B panel (kKc x kNc fp32, 1 MiB) in L2/L3

// Eight consecutive elements widened to fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Packs a w x kc block (w <= S lines, kc inner steps) into strip layout dst[p * S + r], widened
// to fp32, with lines w..S zero: element (r, p) is src[p * ld + r], or src[r * ld + p] when
// `transpose` (each line then runs along p in memory).
template <int S, typename T>
void pack_strip(const T* src, int ld, bool transpose, int w, int kc, float* dst) {
  if (!transpose) {
    // dst[p * S + r] = src[p * ld + r]: contiguous runs of w per p.
    for (int p = 0; p < kc; ++p) {
      const T* s = src + size_t(p) * ld;
      float* d = dst + size_t(p) * S;
      int r = 0;
      if constexpr (S % 8 == 0) {
        for (; r + 8 <= w; r += 8) _mm256_storeu_ps(d + r, load8(s + r));
      }
      for (; r < w; ++r) d[r] = to_float(s[r]);
      for (; r < S; ++r) d[r] = 0.0f;
    }
    return;
  }
  // dst[p * S + r] = src[r * ld + p]: a transpose; 8x8 blocks through registers.
  int p = 0;
  if constexpr (S % 8 == 0) {
    if (w == S) {
      for (; p + 8 <= kc; p += 8) {
        for (int r0 = 0; r0 < S; r0 += 8) {
          __m256 v[8];
          for (int i = 0; i < 8; ++i) v[i] = load8(src + size_t(r0 + i) * ld + p);
          transpose8(v);
          for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + size_t(p + i) * S + r0, v[i]);
        }
      }
    }
  } else if constexpr (S == 6) {
    // Rows 6 and 7 of the 8x8 block repeat row 5; each 8-wide store of dst[p * 6 ..] spills two
    // lanes into p + 1's slots, which the next store rewrites. The last store of a strip spills
    // two floats past it: the buffer has slack, and the next strip is packed after this one.
    if (w == S) {
      for (; p + 8 <= kc; p += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = load8(src + size_t(std::min(i, S - 1)) * ld + p);
        transpose8(v);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + size_t(p + i) * S, v[i]);
      }
    }
  }
  for (int r = 0; r < w; ++r) {
    const T* s = src + size_t(r) * ld;
    for (int q = p; q < kc; ++q) dst[size_t(q) * S + r] = to_float(s[q]);
  }
  for (int r = w; r < S; ++r) {
    for (int q = p; q < kc; ++q) dst[size_t(q) * S + r] = 0.0f;
  }
}

// acc = sum_p a[p * kMr + i] * b[p * kNr + j] (one FMA chain per element, p in order), then
// c[i * ldc + j] = acc (overwrite) or c + acc.
void micro_kernel(int kc, const float* a, const float* b, float* c, int ldc, bool overwrite) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    __m256 x = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(a + 1);
    c10 = _mm256_fmadd_ps(x, b0, c10);
    c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(a + 2);
    c20 = _mm256_fmadd_ps(x, b0, c20);
    c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(a + 3);
    c30 = _mm256_fmadd_ps(x, b0, c30);
    c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(a + 4);
    c40 = _mm256_fmadd_ps(x, b0, c40);
    c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(a + 5);
    c50 = _mm256_fmadd_ps(x, b0, c50);
    c51 = _mm256_fmadd_ps(x, b1, c51);
    a += kMr;
    b += kNr;
  }
  auto put = [&](float* row, __m256 lo, __m256 hi) {
    if (!overwrite) {
      lo = _mm256_add_ps(_mm256_loadu_ps(row), lo);
      hi = _mm256_add_ps(_mm256_loadu_ps(row + 8), hi);
    }
    _mm256_storeu_ps(row, lo);
    _mm256_storeu_ps(row + 8, hi);
  };
  put(c, c00, c01);
  put(c + ldc, c10, c11);
  put(c + 2 * size_t(ldc), c20, c21);
  put(c + 3 * size_t(ldc), c30, c31);
  put(c + 4 * size_t(ldc), c40, c41);
  put(c + 5 * size_t(ldc), c50, c51);
}

// A thread's packing buffers, grown on demand and reused across calls. Plain C allocation: this
// file is compiled with AVX2 flags, so it instantiates no library template (std::vector) that
// another, baseline translation unit could end up sharing.
class Scratch {
 public:
  ~Scratch() { std::free(p_); }
  float* get(size_t n) {
    if (n > n_) {
      std::free(p_);
      p_ = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
      STRATA_CHECK(p_ != nullptr, "gemm: out of memory for the packing buffers");
      n_ = n;
    }
    return p_;
  }

 private:
  float* p_ = nullptr;
  size_t n_ = 0;
};

template <typename TA, typename TB>
void gemm_typed(const GemmArgs& g) {
  thread_local Scratch scratch_a, scratch_b;
  const auto* A = static_cast<const TA*>(g.a);
  const auto* B = static_cast<const TB*>(g.b);
  const int nc_max = std::min(kNc, (g.n + kNr - 1) / kNr * kNr);
  const int mc_max = std::min(kMc, (g.m + kMr - 1) / kMr * kMr);
  float* pa = scratch_a.get(size_t(mc_max) * kKc + 8);  // + 8: pack_strip<6>'s spill
  float* pb = scratch_b.get(size_t(nc_max) * kKc);
  float edge[kMr * kNr];
  for (int jc = 0; jc < g.n; jc += kNc) {
    const int nc = std::min(kNc, g.n - jc);
    for (int pc = 0; pc < g.k; pc += kKc) {
      const int kc = std::min(kKc, g.k - pc);
      const bool overwrite = pc == 0 && !g.accumulate;
      // op(B)[pc.., jc + j]: B[p, j] at b[p * ldb + j], or b[j * ldb + p] when trans_b.
      for (int j = 0; j < nc; j += kNr) {
        const int w = std::min(kNr, nc - j);
        const TB* src =
            g.trans_b ? B + size_t(jc + j) * g.ldb + pc : B + size_t(pc) * g.ldb + jc + j;
        pack_strip<kNr>(src, g.ldb, g.trans_b, w, kc, pb + size_t(j) * kc);
      }
      for (int ic = 0; ic < g.m; ic += kMc) {
        const int mc = std::min(kMc, g.m - ic);
        // op(A)[ic + i, pc..]: A[i, p] at a[i * lda + p], or a[p * lda + i] when trans_a.
        for (int i = 0; i < mc; i += kMr) {
          const int h = std::min(kMr, mc - i);
          const TA* src =
              g.trans_a ? A + size_t(pc) * g.lda + ic + i : A + size_t(ic + i) * g.lda + pc;
          pack_strip<kMr>(src, g.lda, !g.trans_a, h, kc, pa + size_t(i) * kc);
        }
        for (int j = 0; j < nc; j += kNr) {
          const int w = std::min(kNr, nc - j);
          for (int i = 0; i < mc; i += kMr) {
            const int h = std::min(kMr, mc - i);
            float* c = g.c + size_t(ic + i) * g.ldc + jc + j;
            if (h == kMr && w == kNr) {
              micro_kernel(kc, pa + size_t(i) * kc, pb + size_t(j) * kc, c, g.ldc, overwrite);
              continue;
            }
            micro_kernel(kc, pa + size_t(i) * kc, pb + size_t(j) * kc, edge, kNr, true);
            for (int r = 0; r < h; ++r) {
              float* row = c + size_t(r) * g.ldc;
              for (int q = 0; q < w; ++q) {
                row[q] = overwrite ? edge[r * kNr + q] : row[q] + edge[r * kNr + q];
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace

void gemm(const GemmArgs& g) {
  if (g.m <= 0 || g.n <= 0) return;
  if (g.k <= 0) {
    if (!g.accumulate) {
      for (int i = 0; i < g.m; ++i) {
        for (int j = 0; j < g.n; ++j) g.c[size_t(i) * g.ldc + j] = 0.0f;
      }
    }
    return;
  }
  dispatch_dtype(g.a_type, [&](auto ta) {
    dispatch_dtype(g.b_type, [&](auto tb) { gemm_typed<decltype(ta), decltype(tb)>(g); });
  });
}

}  // namespace strata::cpu::avx2
