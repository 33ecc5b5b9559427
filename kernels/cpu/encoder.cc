// Token + position embedding (llm.c encoder_forward / encoder_backward); without wpe (null:
// rotary models) the token embedding alone. Positions are t, or pos[b,t] where given (packed
// sequences, a decode step).
#include <algorithm>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

void encoder_forward(DType dt, void* out, const int32_t* tokens, const int32_t* pos,
                     const void* wte, const void* wpe, int B, int T, int C) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* o = static_cast<Tp*>(out);
    auto* te = static_cast<const Tp*>(wte);
    auto* pe = static_cast<const Tp*>(wpe);
    size_t rows = size_t(B) * T, grain = std::max<size_t>(1, kElementGrain / std::max(C, 1));
    parallel_ranges(rows, grain, [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        const size_t t = pos ? size_t(pos[r]) : r % T;
        const Tp* e = te + size_t(tokens[r]) * C;
        Tp* y = o + r * C;
        if (pe == nullptr) {
          for (int c = 0; c < C; ++c) y[c] = e[c];
          continue;
        }
        const Tp* p = pe + t * C;
        for (int c = 0; c < C; ++c) y[c] = from_float<Tp>(to_float(e[c]) + to_float(p[c]));
      }
    });
  });
}

// Several (b,t) may share a token, so rows of dwte are not independent: the work is split by
// channel instead, and each channel block walks every (b,t) in order (the llm.c order).
void encoder_backward(DType dt, float* dwte, float* dwpe, const void* dout, const int32_t* tokens,
                      const int32_t* pos, int B, int T, int C) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* d = static_cast<const Tp*>(dout);
    constexpr size_t kChannelBlock = 64;
    parallel_ranges(size_t(C), kChannelBlock, [&](size_t c0, size_t c1) {
      for (int b = 0; b < B; ++b) {
        for (int t = 0; t < T; ++t) {
          size_t r = size_t(b) * T + t;
          const Tp* g = d + r * C;
          float* we = dwte + size_t(tokens[r]) * C;
          if (dwpe == nullptr) {
            for (size_t c = c0; c < c1; ++c) we[c] += to_float(g[c]);
            continue;
          }
          float* pe = dwpe + size_t(pos ? pos[r] : t) * C;
          for (size_t c = c0; c < c1; ++c) {
            float v = to_float(g[c]);
            we[c] += v;
            pe[c] += v;
          }
        }
      }
    });
  });
}

}  // namespace strata::cpu
