// Internal: the per-ISA kernel table behind strata/cpu_optim.h.
//
// Each ISA's kernels live in their own translation unit (scalar.cc, avx2.cc, avx512.cc),
// compiled with that ISA's target flags, and expose one IsaKernels table. The dispatcher
// (cpu_optim.cc, compiled with no ISA flags) computes the per-call constants, splits the
// shard into tiles and calls the table of the chosen ISA on each tile.
//
// ODR hazard: an inline function or template instantiated in two TUs compiled with different
// flags is merged by the linker, and the copy kept may contain AVX-512 code. So the ISA TUs
// put everything in an anonymous namespace (step_impl.h) and odr-use no inline library code
// (no std containers, no strata/dtype.h helpers); only the table itself has external linkage.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/optimizer.h"

namespace strata::cpu_optim_internal {

// Lanes of the fp64 sum of squares: element i of a tile adds into lane i % kStatsLanes in
// every ISA, so the partial sums are identical everywhere.
inline constexpr int kStatsLanes = 16;

// Per-call constants, computed once by the dispatcher exactly as the reference computes them.
struct StepConsts {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  float one_minus_beta1 = 0;  // 1 - beta1 (fp32, as the reference's loop evaluates it)
  float one_minus_beta2 = 0;
  float lr_wd = 0;         // lr * weight_decay (fp32)
  float step_size = 0;     // lr / bias_correction1
  float inv_bc2_sqrt = 0;  // 1 / sqrt(bias_correction2)
  bool has_wd = false;     // weight_decay != 0
  bool lp_stream = false;  // lp_out may use non-temporal stores (64-byte aligned at tile starts)
};

// Steps elements [begin, end) of the shard. begin is a multiple of the vector width.
using StepFn = void (*)(const StepConsts& c, const ShardState& s, size_t begin, size_t end);
// Adds the squares of grad[begin, end) into lanes[k] for elements with i % kStatsLanes == k.
// begin is a multiple of kStatsLanes.
using StatsFn = void (*)(const void* grad, DType dtype, size_t begin, size_t end,
                         double lanes[kStatsLanes]);

struct IsaKernels {
  // Indexed by [kind][grad dtype][moment dtype == bf16].
  StepFn step[4][3][2];
  StatsFn stats;
  // Issues a store fence if the kernels used non-temporal stores (no-op otherwise).
  void (*fence)();
};

const IsaKernels& scalar_kernels();
const IsaKernels& avx2_kernels();
const IsaKernels& avx512_kernels();
const IsaKernels& avx512bf16_kernels();

}  // namespace strata::cpu_optim_internal
