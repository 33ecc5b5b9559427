// Block-wise symmetric quantization to 8 or 4 bits with one fp32 scale per block (ZeRO++'s qwZ
// parameter gathers and qgZ gradient reduce-scatters). CUDA twin: kernels/cuda/quantize.cu.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

// One block of m elements starting at element i0: its scale, and q for every element.
void quantize_block(int bits, DType dt, void* q, float* scale_out, const void* x, size_t i0,
                    size_t m) {
  const int qmax = quantize_qmax(bits);
  float amax = 0.0f;
  bool finite = true;
  for (size_t i = i0; i < i0 + m; ++i) {
    const float v = load_f32(x, dt, i);
    finite &= std::isfinite(v);
    amax = std::fmax(amax, std::fabs(v));
  }
  const float scale = finite ? amax / float(qmax) : NAN;
  *scale_out = scale;
  auto quant = [&](size_t i) -> int {
    if (!finite || !(scale > 0.0f)) return 0;
    const float r = std::nearbyint(load_f32(x, dt, i) / scale);  // ties to even
    return int(std::fmin(std::fmax(r, float(-qmax)), float(qmax)));
  };
  if (bits == 8) {
    for (size_t i = i0; i < i0 + m; ++i) static_cast<int8_t*>(q)[i] = int8_t(quant(i));
    return;
  }
  // 4 bits: whole bytes, element pairs (i0 is even); an odd tail leaves its high nibble 0.
  for (size_t i = i0; i < i0 + m; i += 2) {
    const uint8_t lo = uint8_t(quant(i)) & 0x0f;
    const uint8_t hi = i + 1 < i0 + m ? uint8_t(quant(i + 1)) & 0x0f : 0;
    static_cast<uint8_t*>(q)[i / 2] = uint8_t(lo | (hi << 4));
  }
}

inline int load_q(int bits, const void* q, size_t i) {
  if (bits == 8) return static_cast<const int8_t*>(q)[i];
  const uint8_t byte = static_cast<const uint8_t*>(q)[i / 2];
  const int nib = (i % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
  return nib >= 8 ? nib - 16 : nib;  // two's complement
}

}  // namespace

void quantize(int bits, DType dt, void* q, float* scales, const void* x, size_t n, int block) {
  const size_t b = size_t(block), blocks = quantize_blocks(n, block);
  // Blocks are independent; 4-bit blocks have an even size, so no byte is shared by two.
  parallel_ranges(blocks, 64, [&](size_t b0, size_t b1) {
    for (size_t k = b0; k < b1; ++k) {
      const size_t i0 = k * b;
      quantize_block(bits, dt, q, &scales[k], x, i0, std::min(b, n - i0));
    }
  });
}

void dequantize(int bits, DType dt, void* x, const void* q, const float* scales, size_t n,
                int block, bool accumulate) {
  const size_t b = size_t(block);
  parallel_ranges(n, size_t{1} << 14, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) {
      const float v = float(load_q(bits, q, i)) * scales[i / b];
      store_f32(x, dt, i, accumulate ? load_f32(x, dt, i) + v : v);
    }
  });
}

}  // namespace strata::cpu
