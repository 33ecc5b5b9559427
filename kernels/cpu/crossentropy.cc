// Fused softmax + cross-entropy forward and backward over padded-vocabulary logits
// (llm.c crossentropy_forward + crossentropy_softmax_backward in one pass). Rows are
// independent; each row is widened to fp32 once, reduced, and overwritten with its gradient.
// A negative target masks its row out: loss 0, gradient 0 (transformers' labels = -100).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

void crossentropy_forward_backward(DType dt, float* losses, void* logits_inout,
                                   const int32_t* targets, float dloss, int N, int V, int Vp) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* logits = static_cast<Tp*>(logits_inout);
    size_t grain = std::max<size_t>(1, kElementGrain / std::max(Vp, 1));
    parallel_ranges(size_t(N), grain, [&](size_t r0, size_t r1) {
      std::vector<float> row(V);
      for (size_t r = r0; r < r1; ++r) {
        Tp* lr = logits + r * Vp;
        if (targets[r] < 0) {  // masked out (a loss mask): no loss, no gradient
          losses[r] = 0.0f;
          for (int k = 0; k < Vp; ++k) lr[k] = from_float<Tp>(0.0f);
          continue;
        }
        load_span(lr, row.data(), V);
        float maxval = -INFINITY;
        for (int i = 0; i < V; ++i) maxval = std::max(maxval, row[i]);
        // 8 fixed lanes: vectorisable, and the same order on every run.
        float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int i = 0;
        for (; i + 8 <= V; i += 8) {
          for (int j = 0; j < 8; ++j) {
            row[i + j] = std::exp(row[i + j] - maxval);
            lane[j] += row[i + j];
          }
        }
        for (; i < V; ++i) {
          row[i] = std::exp(row[i] - maxval);
          lane[0] += row[i];
        }
        float sum = 0.0f;
        for (float l : lane) sum += l;
        const float inv = 1.0f / sum;
        const int target = targets[r];
        losses[r] = -std::log(row[target] * inv);
        for (int k = 0; k < V; ++k) {
          float prob = row[k] * inv;
          float indicator = k == target ? 1.0f : 0.0f;
          lr[k] = from_float<Tp>((prob - indicator) * dloss);
        }
        for (int k = V; k < Vp; ++k) lr[k] = from_float<Tp>(0.0f);
      }
    });
  });
}

}  // namespace strata::cpu
