// dtype conversion between device buffers.
#include <cstring>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

void cast(void* dst, DType dst_t, const void* src, DType src_t, size_t n) {
  if (dst_t == src_t) {
    size_t es = dtype_size(dst_t);
    parallel_ranges(n, kElementGrain * 4, [&](size_t i0, size_t i1) {
      std::memcpy(static_cast<char*>(dst) + i0 * es, static_cast<const char*>(src) + i0 * es,
                  (i1 - i0) * es);
    });
    return;
  }
  dispatch_dtype(src_t, [&](auto stag) {
    using S = decltype(stag);
    dispatch_dtype(dst_t, [&](auto dtag) {
      using D = decltype(dtag);
      auto* s = static_cast<const S*>(src);
      auto* d = static_cast<D*>(dst);
      parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
        for (size_t i = i0; i < i1; ++i) d[i] = from_float<D>(to_float(s[i]));
      });
    });
  });
}

}  // namespace strata::cpu
