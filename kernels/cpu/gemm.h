// The GEMM of the CPU kernels: fp32 arithmetic on fp32, bf16 or fp16 operands, fp32 result.
//
// strata is built for baseline x86-64 (never -march=native). gemm() picks its implementation
// once per process from CPUID:
//   - "avx2" (every CPU with AVX2 + FMA, AVX-512 ones included): a hand-written packed GEMM
//     (gemm_avx2.cc) with a 6x16 FMA micro-kernel; bf16/fp16 operands are widened to fp32 while
//     they are packed, so a typed operand is never copied whole;
//   - "baseline" (older CPUs): Eigen's GEMM with the baseline flags, typed operands widened
//     into fp32 copies first (gemm_baseline.cc).
//
// Determinism: element (i, j) of C is C(i, j) op (the sum of op(A)(i, p) * op(B)(p, j) over
// fixed blocks of p, each block one chain in order), so the same operands give the same bits
// however the caller splits m and n into tiles and on however many threads it runs them. The
// two implementations round differently (FMA, block order), within fp32 tolerance; every CPU
// with AVX2 + FMA takes the same path and computes the same bits.
#pragma once

#include "strata/dtype.h"

namespace strata::cpu {

// C = op(A) @ op(B) (or C += when `accumulate`), all row-major.
//   op(A) is [m, k]: A is stored [m, k] with row stride lda, or [k, m] if trans_a.
//   op(B) is [k, n]: B is stored [k, n] with row stride ldb, or [n, k] if trans_b.
//   A and B hold a_type / b_type elements (fp32 unless set); C is fp32 [m, n], row stride ldc.
// Single-threaded: callers split the output into tiles and run tiles in parallel. It may be
// called from any thread; each thread keeps its own packing buffers (about 1.1 MiB).
struct GemmArgs {
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;
  DType a_type = DType::kF32;
  int lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  DType b_type = DType::kF32;
  int ldb = 0;
  bool trans_b = false;
  float* c = nullptr;
  int ldc = 0;
  bool accumulate = false;
};

void gemm(const GemmArgs& g);

// The implementation gemm() dispatches to on this CPU: "avx2" or "baseline".
const char* gemm_isa();

// The implementations. Callers use gemm().
namespace avx2 {
void gemm(const GemmArgs& g);
}
namespace baseline {
void gemm(const GemmArgs& g);
}

}  // namespace strata::cpu
