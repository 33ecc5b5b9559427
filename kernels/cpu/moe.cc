// A mixture of experts' row dispatch (Kernels::gather_rows, scatter_add_rows, row_dots): rows of
// [*, C] matrices picked by an index list, scaled by a per-row factor. CUDA twin:
// kernels/cuda/moe.cu.
#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

namespace {

// out row o(r) = in row i(r) * scale[r] (gather: o = r, i = idx[r]), or += (scatter: o = idx[r],
// i = r; idx's entries are distinct, so rows may be written in parallel).
template <bool kScatter>
void move_rows(DType dt, void* out, const void* in, const int32_t* idx, const float* scale, int n,
               int C) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* x = static_cast<const Tp*>(in);
    parallel_ranges(size_t(n), 1, [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        const float f = scale ? scale[r] : 1.0f;
        const Tp* src = x + (kScatter ? r : size_t(idx[r])) * C;
        Tp* dst = y + (kScatter ? size_t(idx[r]) : r) * C;
        for (int c = 0; c < C; ++c) {
          const float v = to_float(src[c]) * f;
          dst[c] = from_float<Tp>(kScatter ? to_float(dst[c]) + v : v);
        }
      }
    });
  });
}

}  // namespace

void gather_rows(DType dt, void* out, const void* in, const int32_t* idx, const float* scale, int n,
                 int C) {
  move_rows<false>(dt, out, in, idx, scale, n, C);
}

void scatter_add_rows(DType dt, void* out, const void* in, const int32_t* idx, const float* scale,
                      int n, int C) {
  move_rows<true>(dt, out, in, idx, scale, n, C);
}

void row_dots(DType dt, float* out, const void* a, const int32_t* idx, const void* b, int n,
              int C) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* pa = static_cast<const Tp*>(a);
    auto* pb = static_cast<const Tp*>(b);
    parallel_ranges(size_t(n), 1, [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        const Tp* ra = pa + size_t(idx[r]) * C;
        const Tp* rb = pb + r * C;
        float acc = 0.0f;
        for (int c = 0; c < C; ++c) acc += to_float(ra[c]) * to_float(rb[c]);
        out[r] = acc;
      }
    });
  });
}

}  // namespace strata::cpu
