// fp32 GEMM for the CPU kernels, dispatched at run time to the widest vector ISA the CPU has.
//
// strata is built for baseline x86-64 (never -march=native), which would leave Eigen's GEMM on
// SSE2. gemm() instead runs Eigen's GEMM compiled three times -- for AVX-512 (F/DQ/BW/VL + FMA),
// AVX2 + FMA, and the baseline -- each copy in its own renamed Eigen namespace so the copies
// cannot be merged by the linker, and picks one copy once per process from CPUID.
//
// The same CPU always takes the same path, so results are deterministic; different ISAs may
// round differently (FMA), which is within fp32 tolerance.
#pragma once

namespace strata::cpu {

// C = op(A) @ op(B) (or C += when `accumulate`), all row-major fp32.
//   op(A) is [m, k]: A is stored [m, k] with row stride lda, or [k, m] if trans_a.
//   op(B) is [k, n]: B is stored [k, n] with row stride ldb, or [n, k] if trans_b.
//   C is [m, n] with row stride ldc.
// Single-threaded: callers split the output into tiles and run tiles in parallel.
struct GemmArgs {
  int m = 0, n = 0, k = 0;
  const float* a = nullptr;
  int lda = 0;
  bool trans_a = false;
  const float* b = nullptr;
  int ldb = 0;
  bool trans_b = false;
  float* c = nullptr;
  int ldc = 0;
  bool accumulate = false;
};

void gemm(const GemmArgs& g);

// The ISA gemm() dispatches to on this CPU: "avx512", "avx2" or "baseline".
const char* gemm_isa();

// The per-ISA copies (gemm_isa.inc compiled by gemm_<isa>.cc). Callers use gemm().
namespace avx512 {
void gemm(const GemmArgs& g);
}
namespace avx2 {
void gemm(const GemmArgs& g);
}
namespace baseline {
void gemm(const GemmArgs& g);
}

}  // namespace strata::cpu
