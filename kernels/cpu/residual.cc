// Residual add (forward) and in-place add (gradient accumulation of residual branches).
#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

void residual_forward(DType dt, void* out, const void* a, const void* b, size_t n) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* pa = static_cast<const Tp*>(a);
    auto* pb = static_cast<const Tp*>(b);
    parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) y[i] = from_float<Tp>(to_float(pa[i]) + to_float(pb[i]));
    });
  });
}

void add_inplace(DType dt, void* dst, const void* src, size_t n) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* d = static_cast<Tp*>(dst);
    auto* s = static_cast<const Tp*>(src);
    parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) d[i] = from_float<Tp>(to_float(d[i]) + to_float(s[i]));
    });
  });
}

}  // namespace strata::cpu
