// QLoRA's 4-bit NormalFloat (NF4): blocks of kNf4Block elements, each scaled by its absolute
// maximum (fp32) and rounded to the nearest of 16 code values (kNf4Code, the quantiles of a
// normal distribution normalized to [-1, 1] with an exact zero; Dettmers et al. 2023), two
// 4-bit indices per byte, the first element in the high nibble. The layout and the arithmetic
// are bitsandbytes' (0.50, its CPU path): quantize multiplies by the fp32 reciprocal of the
// block's absmax, clamps to [-1, 1] and takes the code whose interval between midpoints holds
// the value (a value on a midpoint takes the lower code); dequantize is code[q] * absmax in
// fp32. A block of zeros has absmax 0 and dequantizes to zeros. The last block may be partial.
// tests/nf4_test.cc checks the code book, the bytes, the scales and the dequantized bits against
// bitsandbytes' own output (tests/fixtures/nf4, tools/make_nf4_fixture.py).
//
// These are the host reference and the import-time quantizer of a quantized LoRA base
// (lora.base_quantization nf4, src/model/base_quant.h: the tier manager quantizes the base with
// nf4_quantize when it initializes the state); the device dequantizes with
// Kernels::dequantize_nf4, which computes nf4_dequantize's values.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

inline constexpr size_t kNf4Block = 64;
// bitsandbytes' NF4 code book, bit for bit (its fp32 values). A macro of the literals so that
// device code (kernels/cuda/nf4.cu) builds its own copy from the same text.
#define STRATA_NF4_CODE_VALUES                                                                     \
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f, \
      -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f,                    \
      0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f,      \
      0.5626170039176941f, 0.7229568362236023f, 1.0f
extern const float kNf4Code[16];

// Bytes of the packed indices and number of absmax scales for n elements.
inline size_t nf4_packed_bytes(size_t n) { return (n + 1) / 2; }
inline size_t nf4_blocks(size_t n) { return (n + kNf4Block - 1) / kNf4Block; }

// x[0, n) -> q[nf4_packed_bytes(n)], absmax[nf4_blocks(n)].
void nf4_quantize(const float* x, size_t n, uint8_t* q, float* absmax);
// q, absmax -> out[0, n).
void nf4_dequantize(const uint8_t* q, const float* absmax, size_t n, float* out);

}  // namespace strata
