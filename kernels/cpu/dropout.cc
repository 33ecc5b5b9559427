// Inverted dropout (Kernels::dropout): the mask from dropout_uniform (strata/kernels.h), so an
// element's fate depends on the key and its index only, not on the split into tasks. And the
// other elementwise scaling in the model's dtype, Kernels::scale_rows.
#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

void dropout(DType dt, void* out, const void* in, size_t n, float p, uint64_t key) {
  const float keep_scale = 1.0f / (1.0f - p);
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* x = static_cast<const Tp*>(in);
    parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) {
        y[i] = dropout_uniform(key, i) >= p ? from_float<Tp>(to_float(x[i]) * keep_scale)
                                            : from_float<Tp>(0.0f);
      }
    });
  });
}

void scale_rows(DType dt, void* x, const float* scale, int rows, size_t row_elems) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(x);
    for (int r = 0; r < rows; ++r) {
      Tp* row = y + size_t(r) * row_elems;
      const float f = scale[r];
      parallel_ranges(row_elems, kElementGrain, [&](size_t i0, size_t i1) {
        for (size_t i = i0; i < i1; ++i) row[i] = from_float<Tp>(to_float(row[i]) * f);
      });
    }
  });
}

}  // namespace strata::cpu
