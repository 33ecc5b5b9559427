#include "src/base/nf4.h"

#include <algorithm>
#include <cmath>

namespace strata {

const float kNf4Code[16] = {STRATA_NF4_CODE_VALUES};

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
