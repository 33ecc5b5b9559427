// RMSNorm over the last dimension (Llama): out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
// CUDA twin: kernels/cuda/rmsnorm.cu.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

// Rows per chunk of the dweight reduction (fixed: the sums must not depend on threads).
constexpr size_t kRowChunk = 32;

}  // namespace

void rmsnorm_forward(DType dt, void* out, float* rstd, const void* inp, const void* weight,
                     float eps, int N, int C) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* x = static_cast<const Tp*>(inp);
    std::vector<float> w(C);
    load_span(static_cast<const Tp*>(weight), w.data(), C);
    size_t grain = std::max<size_t>(1, kElementGrain / 4 / std::max(C, 1));
    parallel_ranges(size_t(N), grain, [&](size_t r0, size_t r1) {
      std::vector<float> row(C);
      for (size_t r = r0; r < r1; ++r) {
        load_span(x + r * C, row.data(), C);
        float ss = 0.0f;
        for (int i = 0; i < C; ++i) ss += row[i] * row[i];
        const float s = 1.0f / std::sqrt(ss / C + eps);
        Tp* yr = y + r * C;
        for (int i = 0; i < C; ++i) yr[i] = from_float<Tp>(row[i] * s * w[i]);
        rstd[r] = s;
      }
    });
  });
}

// dinp[i] += rstd * (w[i] g[i] - x[i] rstd^2 mean_j(w[j] g[j] x[j])); dweight[i] += g[i] x[i] rstd.
// dweight sums over rows in fixed chunks of kRowChunk, whose partials are added in chunk order.
void rmsnorm_backward(DType dt, void* dinp, const void* dres, float* dweight, const void* dout,
                      const void* inp, const void* weight, const float* rstd, int N, int C) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dinp);
    auto* dr = static_cast<const Tp*>(dres);
    auto* x = static_cast<const Tp*>(inp);
    auto* dy = static_cast<const Tp*>(dout);
    std::vector<float> w(C);
    load_span(static_cast<const Tp*>(weight), w.data(), C);
    size_t chunks = (size_t(N) + kRowChunk - 1) / kRowChunk;
    std::vector<float> partial(chunks * size_t(C), 0.0f);  // [chunk][dweight C]
    parallel_ranges(size_t(N), kRowChunk, [&](size_t r0, size_t r1) {
      std::vector<float> xr(C), gr(C), dxr(C);
      float* pw = partial.data() + (r0 / kRowChunk) * C;
      for (size_t r = r0; r < r1; ++r) {
        load_span(x + r * C, xr.data(), C);
        load_span(dy + r * C, gr.data(), C);
        const float s = rstd[r];
        float dot = 0.0f;
        for (int i = 0; i < C; ++i) dot += w[i] * gr[i] * xr[i];
        const float k = dot / C * s * s;
        for (int i = 0; i < C; ++i) {
          pw[i] += gr[i] * xr[i] * s;
          dxr[i] = (w[i] * gr[i] - xr[i] * k) * s;
        }
        add_span(dxr.data(), dr ? dr + r * C : nullptr, dx + r * C, C);
      }
    });
    parallel_ranges(size_t(C), 256, [&](size_t c0, size_t c1) {
      for (size_t k = 0; k < chunks; ++k) {
        const float* pw = partial.data() + k * C;
        for (size_t c = c0; c < c1; ++c) dweight[c] += pw[c];
      }
    });
  });
}

}  // namespace strata::cpu
