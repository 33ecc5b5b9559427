// GELU's vector path (internal to kernels/cpu): gelu.cc holds the op and its scalar arithmetic,
// gelu_avx2.cc the same arithmetic eight lanes at a time. The two give the same bits for every
// input (gelu_avx2.cc says how); gelu.cc picks the AVX2 one when the CPU has it.
#pragma once

#include <cstddef>

namespace strata::cpu {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

// The fp32 arithmetic of gelu_forward / gelu_backward on a buffer, in two implementations
// (scalar: any x86-64; avx2: only on a CPU with AVX2) that give the same bits.
//   gelu_forward_f32:  x[i] = gelu(x[i]) for i < n.
//   gelu_backward_f32: g[i] = g[i] * gelu'(x[i]) for i < n.
namespace scalar {
void gelu_forward_f32(float* x, size_t n);
void gelu_backward_f32(const float* x, float* g, size_t n);
}  // namespace scalar
namespace avx2 {
void gelu_forward_f32(float* x, size_t n);
void gelu_backward_f32(const float* x, float* g, size_t n);
}  // namespace avx2

// The implementation gelu_forward / gelu_backward use on this CPU: "avx2" or "scalar".
const char* gelu_isa();

}  // namespace strata::cpu
