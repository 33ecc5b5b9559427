// Gradient-norm accumulation with overflow detection, and in-place scaling.
#include <cmath>
#include <vector>

#include "kernels/cpu/ops.h"

namespace strata::cpu {

// Fixed chunks of kChunk elements each produce a double partial and a non-finite flag; the
// partials are added in chunk order, so the sum does not depend on the thread count.
void norm_sq_and_nonfinite(float* acc, const float* x, size_t n) {
  constexpr size_t kChunk = 1 << 14;
  size_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks, 0.0);
  std::vector<char> bad(chunks, 0);
  parallel_ranges(n, kChunk, [&](size_t i0, size_t i1) {
    // 8 independent lanes let the compiler vectorise; their order is fixed.
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    bool nonfinite = false;
    size_t i = i0;
    for (; i + 8 <= i1; i += 8) {
      for (int j = 0; j < 8; ++j) lane[j] += double(x[i + j]) * double(x[i + j]);
    }
    for (; i < i1; ++i) lane[0] += double(x[i]) * double(x[i]);
    for (size_t k = i0; k < i1; ++k) nonfinite |= !std::isfinite(x[k]);
    double s = 0;
    for (double l : lane) s += l;
    partial[i0 / kChunk] = s;
    bad[i0 / kChunk] = nonfinite;
  });
  double total = 0;
  bool any_bad = false;
  for (size_t c = 0; c < chunks; ++c) {
    total += partial[c];
    any_bad |= bad[c] != 0;
  }
  acc[0] += static_cast<float>(total);
  if (any_bad) acc[1] = 1.0f;
}

void scale(float* x, float factor, size_t n) {
  parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) x[i] *= factor;
  });
}

}  // namespace strata::cpu
