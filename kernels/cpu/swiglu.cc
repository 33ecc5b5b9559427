// SwiGLU (Llama's MLP activation): out = silu(gate) * up over a packed [N, 2H] input whose
// row holds the gate then the up projection. CUDA twin: kernels/cuda/swiglu.cu.
#include <cmath>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

void swiglu_forward(DType dt, void* out, const void* inp, int N, int H) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* x = static_cast<const Tp*>(inp);
    parallel_ranges(size_t(N) * H, kElementGrain, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) {
        const size_t r = i / H, c = i % H;
        const float g = to_float(x[r * 2 * H + c]), u = to_float(x[r * 2 * H + H + c]);
        y[i] = from_float<Tp>(g / (1.0f + std::exp(-g)) * u);
      }
    });
  });
}

// d gate = dout * up * sig(g) * (1 + g * (1 - sig(g))); d up = dout * silu(g); written as
// 0 + the gradient (the bits of accumulating into zeros).
void swiglu_backward(DType dt, void* dinp, const void* inp, const void* dout, int N, int H) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dinp);
    auto* x = static_cast<const Tp*>(inp);
    auto* dy = static_cast<const Tp*>(dout);
    parallel_ranges(size_t(N) * H, kElementGrain, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) {
        const size_t r = i / H, c = i % H;
        const size_t gi = r * 2 * H + c, ui = gi + H;
        const float g = to_float(x[gi]), u = to_float(x[ui]), d = to_float(dy[i]);
        const float sig = 1.0f / (1.0f + std::exp(-g));
        dx[gi] = from_float<Tp>(0.0f + d * u * sig * (1.0f + g * (1.0f - sig)));
        dx[ui] = from_float<Tp>(0.0f + d * g * sig);
      }
    });
  });
}

}  // namespace strata::cpu
