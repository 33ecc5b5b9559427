// Rotary position embeddings, in place on the query and key heads of a packed qkv buffer
// (rotate-half pairs; the frequencies of RopeParams in strata/kernels.h). The cos/sin table of
// a call (its positions: t < T, or up to the largest pos) is computed once, in double, rounded
// to fp32. CUDA twin: kernels/cuda/rope.cu.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"
#include "strata/status.h"

namespace strata::cpu {

void rope(DType dt, void* qkv, const RopeParams& params, const int32_t* pos, int B, int T, int NH,
          int KVH, int hs, bool inverse) {
  STRATA_CHECK(hs % 2 == 0 && hs / 2 <= kMaxRopePairs, "rope: head size must be even and <= 512");
  const int half = hs / 2;
  std::vector<double> inv_freq(half);
  rope_inv_freq(params, hs, inv_freq.data());
  // The table covers positions [0, P): t < T, or every pos[b,t].
  int P = T;
  if (pos != nullptr) {
    P = 0;
    for (size_t r = 0; r < size_t(B) * T; ++r) {
      STRATA_CHECK(pos[r] >= 0, "rope: a position is negative");
      P = std::max(P, pos[r] + 1);
    }
  }
  std::vector<float> cs(size_t(P) * half), sn(size_t(P) * half);  // [position][i]
  for (int t = 0; t < P; ++t) {
    for (int i = 0; i < half; ++i) {
      const double a = double(t) * inv_freq[i];
      cs[size_t(t) * half + i] = float(std::cos(a));
      sn[size_t(t) * half + i] = float(inverse ? -std::sin(a) : std::sin(a));
    }
  }
  const size_t W = size_t(NH + 2 * KVH) * hs;
  const int heads = NH + KVH;  // the query heads then the key heads, contiguous in a row
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* x = static_cast<Tp*>(qkv);
    parallel_ranges(size_t(B) * T, 64, [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        const size_t t = pos ? size_t(pos[r]) : r % T;
        const float* c = cs.data() + t * half;
        const float* s = sn.data() + t * half;
        for (int h = 0; h < heads; ++h) {
          Tp* v = x + r * W + size_t(h) * hs;
          for (int i = 0; i < half; ++i) {
            const float a = to_float(v[i]), b = to_float(v[i + half]);
            v[i] = from_float<Tp>(a * c[i] - b * s[i]);
            v[i + half] = from_float<Tp>(b * c[i] + a * s[i]);
          }
        }
      }
    });
  });
}

}  // namespace strata::cpu
