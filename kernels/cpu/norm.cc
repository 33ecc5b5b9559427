// Gradient-norm accumulation with overflow detection, and in-place scaling.
#include <cmath>
#include <vector>

#include "kernels/cpu/ops.h"

namespace strata::cpu {

// The host's order (strata::grad_stats): tiles of kTile elements, 16 lanes in each (element i
// into lane i % 16, in element order), the lanes folded pairwise, the tiles' sums added in tile
// order. Tiles run in parallel; the bits do not depend on the thread count.
void norm_sq_and_nonfinite(double* norm_sq, const float* x, size_t n) {
  constexpr size_t kTile = 65536;  // strata::kStatsTileElems
  constexpr int kLanes = 16;
  std::vector<double> partial((n + kTile - 1) / kTile, 0.0);
  parallel_ranges(n, kTile, [&](size_t i0, size_t i1) {
    double lane[kLanes] = {};
    for (size_t i = i0; i < i1; ++i) lane[(i - i0) % kLanes] += double(x[i]) * double(x[i]);
    for (int w = kLanes / 2; w >= 1; w /= 2) {
      for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
    }
    partial[i0 / kTile] = lane[0];
  });
  double total = 0;
  for (double p : partial) total += p;
  *norm_sq = total;
}

void scale(float* x, float factor, size_t n) {
  parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) x[i] *= factor;
  });
}

}  // namespace strata::cpu
