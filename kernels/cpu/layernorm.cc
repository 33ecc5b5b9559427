// LayerNorm over the last dimension (llm.c layernorm_forward / layernorm_backward), eps 1e-5.
// The forward's row statistics go eight rows at a time (layernorm.h): on AVX2 CPUs one row per
// lane (layernorm_avx2.cc), else the scalar loop below, with the same bits.
#include "kernels/cpu/layernorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

constexpr float kEps = kLayerNormEps;
// Rows per chunk of the dweight/dbias reduction (fixed: the sums must not depend on threads).
constexpr size_t kRowChunk = 32;

using StatsFn = void (*)(const float*, int, float*, float*);

StatsFn stats_fn() {
  static const StatsFn f = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? &avx2::layernorm_stats8 : &scalar::layernorm_stats8;
  }();
  return f;
}

}  // namespace

namespace scalar {
void layernorm_stats8(const float* rows, int C, float* mean, float* rstd) {
  for (int r = 0; r < 8; ++r) {
    const float* row = rows + size_t(r) * C;
    float m = 0.0f;
    for (int i = 0; i < C; ++i) m += row[i];
    m /= C;
    float v = 0.0f;
    for (int i = 0; i < C; ++i) v += (row[i] - m) * (row[i] - m);
    v /= C;
    mean[r] = m;
    rstd[r] = 1.0f / std::sqrt(v + kEps);
  }
}
}  // namespace scalar

const char* layernorm_isa() { return stats_fn() == &avx2::layernorm_stats8 ? "avx2" : "scalar"; }

void layernorm_forward(DType dt, void* out, float* mean, float* rstd, const void* inp,
                       const void* weight, const void* bias, int N, int C) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* x = static_cast<const Tp*>(inp);
    std::vector<float> w(C), b(C);
    load_span(static_cast<const Tp*>(weight), w.data(), C);
    load_span(static_cast<const Tp*>(bias), b.data(), C);
    size_t grain = std::max<size_t>(1, kElementGrain / 4 / std::max(C, 1));
    parallel_ranges(size_t(N), grain, [&](size_t r0, size_t r1) {
      // Eight rows at a time; a last group of fewer rows is padded with copies of its first.
      std::vector<float> rows(8 * size_t(C));
      float m8[8], s8[8];
      for (size_t g = r0; g < r1; g += 8) {
        const size_t n = std::min<size_t>(8, r1 - g);
        for (size_t r = 0; r < 8; ++r) load_span(x + (g + (r < n ? r : 0)) * C, &rows[r * C], C);
        stats_fn()(rows.data(), C, m8, s8);
        for (size_t r = 0; r < n; ++r) {
          const float* row = &rows[r * C];
          const float m = m8[r], s = s8[r];
          Tp* yr = y + (g + r) * C;
          for (int i = 0; i < C; ++i) yr[i] = from_float<Tp>((row[i] - m) * s * w[i] + b[i]);
          mean[g + r] = m;
          rstd[g + r] = s;
        }
      }
    });
  });
}

// dinp rows are independent. dweight/dbias sum over rows: each fixed chunk of kRowChunk rows
// writes its partial sums, and the partials are then added to dweight/dbias in chunk order.
void layernorm_backward(DType dt, void* dinp, const void* dres, float* dweight, float* dbias,
                        const void* dout, const void* inp, const void* weight, const float* mean,
                        const float* rstd, int N, int C) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dinp);
    auto* dr = static_cast<const Tp*>(dres);
    auto* x = static_cast<const Tp*>(inp);
    auto* dy = static_cast<const Tp*>(dout);
    std::vector<float> w(C);
    load_span(static_cast<const Tp*>(weight), w.data(), C);
    size_t chunks = (size_t(N) + kRowChunk - 1) / kRowChunk;
    std::vector<float> partial(chunks * 2 * size_t(C), 0.0f);  // [chunk][dweight C | dbias C]
    parallel_ranges(size_t(N), kRowChunk, [&](size_t r0, size_t r1) {
      std::vector<float> xr(C), gr(C), dxr(C);
      float* pw = partial.data() + (r0 / kRowChunk) * 2 * C;
      float* pb = pw + C;
      for (size_t r = r0; r < r1; ++r) {
        load_span(x + r * C, xr.data(), C);
        load_span(dy + r * C, gr.data(), C);
        float m = mean[r], s = rstd[r];
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int i = 0; i < C; ++i) {
          float norm = (xr[i] - m) * s;
          float dnorm = w[i] * gr[i];
          dnorm_mean += dnorm;
          dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= C;
        dnorm_norm_mean /= C;
        for (int i = 0; i < C; ++i) {
          float norm = (xr[i] - m) * s;
          float dnorm = w[i] * gr[i];
          pb[i] += gr[i];
          pw[i] += norm * gr[i];
          dxr[i] = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
        add_span(dxr.data(), dr ? dr + r * C : nullptr, dx + r * C, C);
      }
    });
    parallel_ranges(size_t(C), 256, [&](size_t c0, size_t c1) {
      for (size_t k = 0; k < chunks; ++k) {
        const float* pw = partial.data() + k * 2 * C;
        const float* pb = pw + C;
        for (size_t c = c0; c < c1; ++c) {
          dweight[c] += pw[c];
          dbias[c] += pb[c];
        }
      }
    });
  });
}

}  // namespace strata::cpu
