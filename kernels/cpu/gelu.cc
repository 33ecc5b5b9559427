// GELU, tanh approximation (GPT-2; llm.c gelu_forward / gelu_backward).
#include <cmath>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

const float kGeluScale = std::sqrt(2.0f / float(M_PI));

}  // namespace

void gelu_forward(DType dt, void* out, const void* inp, size_t n) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* x = static_cast<const Tp*>(inp);
    parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) {
        float v = to_float(x[i]);
        float cube = 0.044715f * v * v * v;
        y[i] = from_float<Tp>(0.5f * v * (1.0f + std::tanh(kGeluScale * (v + cube))));
      }
    });
  });
}

void gelu_backward(DType dt, void* dinp, const void* inp, const void* dout, size_t n) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dinp);
    auto* x = static_cast<const Tp*>(inp);
    auto* dy = static_cast<const Tp*>(dout);
    parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) {
        float v = to_float(x[i]);
        float cube = 0.044715f * v * v * v;
        float arg = kGeluScale * (v + cube);
        float th = std::tanh(arg);
        float ch = std::cosh(arg);
        float sech2 = 1.0f / (ch * ch);
        float grad =
            0.5f * (1.0f + th) + v * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * v * v);
        dx[i] = from_float<Tp>(to_float(dx[i]) + grad * to_float(dy[i]));
      }
    });
  });
}

}  // namespace strata::cpu
