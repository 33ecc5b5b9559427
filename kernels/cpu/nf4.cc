// NF4 dequantization (Kernels::dequantize_nf4): a quantized LoRA base's weights back to the
// model dtype. The arithmetic is src/base/nf4.h's host reference (one fp32 multiply of the code
// value by the block's absmax), then one rounding to dt. CUDA twin: kernels/cuda/nf4.cu.
#include "src/base/nf4.h"

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {

void dequantize_nf4(DType dt, void* x, const uint8_t* q, const float* absmax, size_t n) {
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(x);
    // Chunks of whole bytes (an even start), so each byte's two elements are one chunk's.
    parallel_ranges((n + 1) / 2, kElementGrain, [&](size_t b0, size_t b1) {
      for (size_t b = b0; b < b1; ++b) {
        const size_t i = 2 * b;
        const float s = absmax[i / kNf4Block];  // a block is 64 elements: i and i+1 share it
        out[i] = from_float<T>(kNf4Code[q[b] >> 4] * s);
        if (i + 1 < n) out[i + 1] = from_float<T>(kNf4Code[q[b] & 0xf] * s);
      }
    });
  });
}

}  // namespace strata::cpu
