// RMSNorm over the last dimension (Llama): out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps);
// and over each query and key head of packed q|k|v rows (Qwen3's q_norm, k_norm).
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

// Each query and key head of qkv row n: its input saved, then rmsnorm_forward's arithmetic on it
// in place (the head's sum of squares in element order).
void qk_norm_forward(DType dt, void* qkv, void* saved, float* rstd, const void* qw, const void* kw,
                     float eps, int N, int NH, int NKV, int hs) {
  const int H = NH + NKV;
  const size_t W = size_t(NH + 2 * NKV) * hs;
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(qkv);
    auto* sv = static_cast<Tp*>(saved);
    std::vector<float> wq(hs), wk(hs);
    load_span(static_cast<const Tp*>(qw), wq.data(), hs);
    load_span(static_cast<const Tp*>(kw), wk.data(), hs);
    size_t grain = std::max<size_t>(1, kElementGrain / 4 / std::max<size_t>(W, 1));
    parallel_ranges(size_t(N), grain, [&](size_t r0, size_t r1) {
      std::vector<float> x(hs);
      for (size_t r = r0; r < r1; ++r) {
        for (int h = 0; h < H; ++h) {
          Tp* head = y + r * W + size_t(h) * hs;
          std::copy(head, head + hs, sv + (r * H + h) * hs);
          load_span(head, x.data(), hs);
          float ss = 0.0f;
          for (int i = 0; i < hs; ++i) ss += x[i] * x[i];
          const float s = 1.0f / std::sqrt(ss / hs + eps);
          const float* w = h < NH ? wq.data() : wk.data();
          for (int i = 0; i < hs; ++i) head[i] = from_float<Tp>(x[i] * s * w[i]);
          rstd[r * H + h] = s;
        }
      }
    });
  });
}

// rmsnorm_backward's arithmetic per head, in place on dqkv's query and key heads. The weights'
// gradients sum over rows in fixed chunks of kRowChunk (each chunk's rows and heads in order),
// whose partials are added in chunk order.
void qk_norm_backward(DType dt, void* dqkv, float* dqw, float* dkw, const void* saved,
                      const void* qw, const void* kw, const float* rstd, int N, int NH, int NKV,
                      int hs) {
  const int H = NH + NKV;
  const size_t W = size_t(NH + 2 * NKV) * hs;
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* g = static_cast<Tp*>(dqkv);
    auto* sv = static_cast<const Tp*>(saved);
    std::vector<float> wq(hs), wk(hs);
    load_span(static_cast<const Tp*>(qw), wq.data(), hs);
    load_span(static_cast<const Tp*>(kw), wk.data(), hs);
    const size_t chunks = (size_t(N) + kRowChunk - 1) / kRowChunk;
    std::vector<float> partial(chunks * 2 * size_t(hs), 0.0f);  // [chunk][dqw hs | dkw hs]
    parallel_ranges(size_t(N), kRowChunk, [&](size_t r0, size_t r1) {
      std::vector<float> x(hs), gr(hs), dx(hs);
      float* pq = partial.data() + (r0 / kRowChunk) * 2 * hs;
      for (size_t r = r0; r < r1; ++r) {
        for (int h = 0; h < H; ++h) {
          Tp* head = g + r * W + size_t(h) * hs;
          load_span(sv + (r * H + h) * hs, x.data(), hs);
          load_span(head, gr.data(), hs);
          const float s = rstd[r * H + h];
          const float* w = h < NH ? wq.data() : wk.data();
          float* pw = h < NH ? pq : pq + hs;
          float dot = 0.0f;
          for (int i = 0; i < hs; ++i) dot += w[i] * gr[i] * x[i];
          const float k = dot / hs * s * s;
          for (int i = 0; i < hs; ++i) {
            pw[i] += gr[i] * x[i] * s;
            dx[i] = (w[i] * gr[i] - x[i] * k) * s;
          }
          add_span(dx.data(), static_cast<const Tp*>(nullptr), head, hs);
        }
      }
    });
    for (size_t k = 0; k < chunks; ++k) {
      const float* p = partial.data() + k * 2 * hs;
      for (int c = 0; c < hs; ++c) {
        dqw[c] += p[c];
        dkw[c] += p[hs + c];
      }
    }
  });
}

}  // namespace strata::cpu
