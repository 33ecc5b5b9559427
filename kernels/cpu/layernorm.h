// LayerNorm's row statistics (internal to kernels/cpu): layernorm.cc computes each row's mean
// and 1/std with one sequential sum per row, which leaves the CPU waiting on the adds' latency;
// layernorm_avx2.cc computes eight rows at once, one row per lane, each lane adding its row's
// elements in the same order, so the two give the same bits.
#pragma once

namespace strata::cpu {

constexpr float kLayerNormEps = 1e-5f;

// For rows r < 8 of `rows` (row r at rows + r * C, C >= 1): mean[r] = sum / C and rstd[r] =
// 1 / sqrt(sum((x - mean)^2) / C + eps), every sum in element order.
namespace scalar {
void layernorm_stats8(const float* rows, int C, float* mean, float* rstd);
}
namespace avx2 {
void layernorm_stats8(const float* rows, int C, float* mean, float* rstd);
}

// The implementation layernorm_forward uses on this CPU: "avx2" or "scalar".
const char* layernorm_isa();

}  // namespace strata::cpu
