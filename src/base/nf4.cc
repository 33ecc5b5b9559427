#include "src/base/nf4.h"

#include <algorithm>
#include <cmath>

namespace strata {

// bitsandbytes' NF4 code book, bit for bit (its fp32 values).
const float kNf4Code[16] = {-1.0f,
                            -0.6961928009986877f,
                            -0.5250730514526367f,
                            -0.39491748809814453f,
                            -0.28444138169288635f,
                            -0.18477343022823334f,
                            -0.09105003625154495f,
                            0.0f,
                            0.07958029955625534f,
                            0.16093020141124725f,
                            0.24611230194568634f,
                            0.33791524171829224f,
                            0.44070982933044434f,
                            0.5626170039176941f,
                            0.7229568362236023f,
                            1.0f};

namespace {

// The index of the code whose midpoint interval holds v: the number of midpoints below v
// (torch.bucketize's left rule: a value equal to a midpoint goes below it).
uint8_t nearest(float v) {
  uint8_t i = 0;
  for (int k = 0; k < 15; ++k) {
    const float mid = (kNf4Code[k] + kNf4Code[k + 1]) / 2.0f;
    i += v > mid;
  }
  return i;
}

}  // namespace

void nf4_quantize(const float* x, size_t n, uint8_t* q, float* absmax) {
  std::fill(q, q + nf4_packed_bytes(n), uint8_t{0});
  for (size_t b = 0; b < nf4_blocks(n); ++b) {
    const size_t lo = b * kNf4Block, hi = std::min(n, lo + kNf4Block);
    float m = 0;
    for (size_t i = lo; i < hi; ++i) m = std::max(m, std::fabs(x[i]));
    absmax[b] = m;
    const float inv = 1.0f / std::max(m, 1e-38f);
    for (size_t i = lo; i < hi; ++i) {
      const uint8_t c = nearest(std::clamp(x[i] * inv, -1.0f, 1.0f));
      q[i / 2] |= uint8_t(i % 2 == 0 ? c << 4 : c);
    }
  }
  // An odd count pads with code 0's index of 0.0 (bitsandbytes pads the scaled values with 0).
  if (n % 2 == 1) q[n / 2] |= nearest(0.0f);
}

void nf4_dequantize(const uint8_t* q, const float* absmax, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const uint8_t c = i % 2 == 0 ? uint8_t(q[i / 2] >> 4) : uint8_t(q[i / 2] & 0xf);
    out[i] = kNf4Code[c] * absmax[i / kNf4Block];
  }
}

}  // namespace strata
