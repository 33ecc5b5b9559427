// The GEMM of the CPU kernels: fp32 arithmetic on fp32, bf16 or fp16 operands, fp32 result.
//
// strata is built for baseline x86-64 (never -march=native). gemm() runs one of three
// implementations ("paths"), chosen once per process (active_gemm_path()) from CPUID and the
// environment variable STRATA_CPU_ISA, and logged once:
//   - "onednn" (the default on CPUs with AVX-512, when the build found oneDNN): one
//     dnnl::matmul per call (gemm_onednn.cc); oneDNN picks its kernel for the CPU (AVX-512,
//     AVX-512-BF16, AMX tiles for bf16 operands; the log line names the instruction set it
//     dispatches to). strata's tests run this path on AVX2 CPUs (STRATA_CPU_ISA=onednn), where
//     oneDNN uses its AVX2 kernels, and on the AVX-512-BF16 and AMX CPUs docs/BENCHMARKS.md
//     measures it on ("CPU GEMM paths");
//   - "avx2" (the default on CPUs with AVX2 + FMA and no AVX-512, and on AVX-512 CPUs when the
//     build has no oneDNN): a hand-written packed GEMM (gemm_avx2.cc) with a 6x16 FMA
//     micro-kernel; bf16/fp16 operands are widened to fp32 while they are packed, so a typed
//     operand is never copied whole;
//   - "baseline" (older CPUs): Eigen's GEMM with the baseline flags, typed operands widened
//     into fp32 copies first (gemm_baseline.cc).
//
// Determinism: for the avx2 and baseline paths, element (i, j) of C is C(i, j) op (the sum of
// op(A)(i, p) * op(B)(p, j) over fixed blocks of p, each block one chain in order), so the same
// operands give the same bits however the caller splits m and n into tiles and on however many
// threads it runs them. The onednn path runs each call on the calling thread alone (never an
// OpenMP team), so a call gives the same bits run to run; whether its bits depend on the
// call's shape is oneDNN's business, so callers that tile an output (matmul.cc) tile it the
// same way on every thread count when this path is active (gemm_tiles_follow_threads()). The
// paths round differently (FMA, block order), within fp32 tolerance; every CPU on a given path
// computes the same bits (for onednn: every CPU on which oneDNN picks the same kernel).
#pragma once

#include <string>
#include <string_view>

#include "strata/cpu_optim.h"
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

// The implementations gemm() can run, in order of preference.
enum class GemmPath { kBaseline, kAvx2, kOneDnn };

// "baseline", "avx2", "onednn".
const char* gemm_path_name(GemmPath p);
// Whether this build and this CPU can run p: avx2 needs AVX2 + FMA + F16C (as cpu_optim's
// avx2 level), onednn a build with oneDNN (STRATA_HAVE_ONEDNN).
bool gemm_path_available(GemmPath p);

// The path for a value of STRATA_CPU_ISA (empty: unset) on a CPU whose best level is
// `detected`, with or without oneDNN in the build. Values (shared with cpu_optim):
//   unset       onednn on AVX-512 CPUs with oneDNN built in, else avx2 on AVX2 CPUs, else
//               baseline
//   scalar      baseline
//   avx2        avx2
//   avx512, avx512bf16
//               onednn (avx2 when the build has no oneDNN): what an AVX-512 CPU runs
//   onednn      onednn on any CPU (how tests and benchmarks run it on AVX2 machines)
// A level the CPU lacks, or an unknown value, falls back to the unset choice. `*note` (if set)
// receives one line for the log: the choice and why.
GemmPath gemm_path_for(std::string_view env, CpuIsa detected, bool have_onednn,
                       std::string* note = nullptr);

// The path gemm() uses: gemm_path_for(STRATA_CPU_ISA, detect_cpu_isa(), built with oneDNN),
// decided and logged (info) once, on first use; or the path a ScopedGemmPath forces.
GemmPath active_gemm_path();
// gemm_path_name(active_gemm_path()).
const char* gemm_isa();
// Whether callers may choose their output tiles by thread count: true on the avx2 and
// baseline paths, whose bits do not depend on tiling (see above), false on onednn.
bool gemm_tiles_follow_threads();

// Forces gemm() onto `p` (which must be available) while it lives, for tests and benchmarks
// that compare the paths in one process. Not for concurrent use with other gemm() callers
// that expect the active path.
class ScopedGemmPath {
 public:
  explicit ScopedGemmPath(GemmPath p);
  ~ScopedGemmPath();
  ScopedGemmPath(const ScopedGemmPath&) = delete;
  ScopedGemmPath& operator=(const ScopedGemmPath&) = delete;

 private:
  int previous_;
};

// The implementations. Callers use gemm().
namespace avx2 {
void gemm(const GemmArgs& g);
}
namespace baseline {
void gemm(const GemmArgs& g);
}
#ifdef STRATA_HAVE_ONEDNN
namespace onednn {
void gemm(const GemmArgs& g);
// Whether oneDNN implements the matmul with both operands of type t on this CPU (else the
// onednn path widens them to fp32 first; see gemm_onednn.cc).
bool typed_matmul_available(DType t);
// "oneDNN X.Y.Z", the library gemm() runs.
const char* library_version();
// The widest instruction set oneDNN dispatches to here (this CPU, capped by
// ONEDNN_MAX_CPU_ISA), as oneDNN names it: "avx512_core_amx" (AMX tiles), "avx512_core_bf16",
// "avx2", ...
const char* effective_isa();
}  // namespace onednn
#endif

}  // namespace strata::cpu
