// The fast CPU optimizer: one fused, vectorized, multi-threaded pass per shard, and the
// gradient statistics (global norm, inf/nan) that decide clipping and overflow skipping.
//
// This is the drop-in replacement for optimizer_step_reference() / grad_stats_reference()
// (strata/optimizer.h): same OptimizerHyper, same ShardState, same numbers. For every ISA
// path the results are bit-identical to the scalar reference (fp32 arithmetic in the
// reference's exact order, no FMA contraction, IEEE-exact vector sqrt/div), so a run does not
// change when it moves to a machine with a different vector unit or a different thread count.
//
// One call reads, per element: the gradient (fp32, bf16 or fp16), the fp32 master weight and
// the moments (fp32 or bf16); multiplies the gradient by grad_mult (loss-scale unscale times
// the clip coefficient); applies weight decay (decoupled for AdamW and Lion, L2 for Adam and
// Adagrad) and Adam's bias correction; writes master and moments back in place; and writes
// the new low-precision parameter (bf16 or fp16, round to nearest even; or fp32) to lp_out
// when it is set. Everything happens in one pass over memory: the step is memory-bound, and
// each extra pass would cost as much as the whole step.
//
// ISA dispatch: the kernels are compiled once per ISA, each in its own translation unit with
// its own target flags (never -march=native), and the best one the CPU supports is chosen by
// CPUID on first use and logged once. The environment variable STRATA_CPU_ISA=
// scalar|avx2|avx512|avx512bf16 forces a path (a path the CPU lacks is refused with a warning
// and the detected one is used). The same variable picks the CPU kernels' GEMM path
// (kernels/cpu/gemm.h), which also accepts `onednn`; for the optimizer, `onednn` means the
// detected path. Tests force paths with the *_isa() variants below.
//
// Threads: work is split into fixed tiles of kOptimizerTileElems elements (kStatsTileElems for
// grad_stats) and run with oneTBB. `threads` > 0 runs in a private arena of that many threads;
// 0 runs in the calling arena (by default all cores; the trainer passes the config's count,
// which leaves cores to the I/O and copy threads). Results never depend on the thread count:
// the step is elementwise, and grad_stats sums fixed tiles in a fixed order.
//
// Thread safety: calls on disjoint shards may run concurrently from any threads.
// Failure: the step never fails on valid input; check input once with validate_shard()
// (the trainer does this when it sets the shard up). Passing an invalid shard is a bug.
#pragma once

#include <cstddef>
#include <string_view>

#include "strata/optimizer.h"
#include "strata/status.h"

namespace strata {

// An instruction-set path. Ordered: each level needs everything the previous one needs.
//   kScalar      portable C++, any x86-64 (and any other CPU)
//   kAvx2        AVX2 + FMA + F16C (Haswell, Zen 1 and later)
//   kAvx512      AVX-512 F/BW/VL/DQ + F16C (Skylake-SP, Ice Lake); bf16 rounding in integer ops
//   kAvx512Bf16  kAvx512 plus AVX512_BF16 (vcvtneps2bf16 for bf16 stores; Cooper Lake,
//                Sapphire Rapids, Zen 4 and later)
enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// "scalar", "avx2", "avx512", "avx512bf16".
const char* cpu_isa_name(CpuIsa isa);
// Parses the names above (case-sensitive). Returns false for anything else.
bool parse_cpu_isa(std::string_view name, CpuIsa* out);

// The best path this CPU and OS support (CPUID, plus XGETBV for the OS saving AVX/AVX-512
// registers). Computed once; cheap to call.
CpuIsa detect_cpu_isa();
// Whether this CPU can run `isa` (every level up to detect_cpu_isa()).
bool cpu_isa_supported(CpuIsa isa);
// The path optimizer_step()/grad_stats() use: STRATA_CPU_ISA if set and supported, else
// detect_cpu_isa(). Decided (and logged at info level) once, on first call.
CpuIsa active_cpu_isa();

// Elements per optimizer work unit (a multiple of every vector width). Each tile moves about
// 1 MiB at fp32 states; tiles are independent, so any split gives the same bits.
inline constexpr size_t kOptimizerTileElems = 32768;
// Elements per grad_stats tile: partial sums are combined in tile order.
inline constexpr size_t kStatsTileElems = 65536;

// Checks a shard before its first step: n > 0 needs grad and master; Adam/AdamW need m and v,
// Adagrad needs v, Lion needs m; moment_dtype must be fp32 or bf16; beta/lr/eps finite.
// Returns kInvalidArgument naming the field and what to pass instead.
Status validate_shard(const OptimizerHyper& h, const ShardState& s);

// One fused optimizer step on the shard, with the active ISA. Same contract and same bits as
// optimizer_step_reference(). n == 0 does nothing. Blocks until the step is done; lp_out is
// complete and visible to the calling thread on return (non-temporal stores are fenced).
//
// Overflow: this call always steps. To skip an overflowed step (fp16 loss scaling), call
// grad_stats() on the gradient first and do not call optimizer_step() when it reports
// nonfinite: nothing is then touched. (grad_mult of inf/nan would poison the state.)
void optimizer_step(const OptimizerHyper& h, const ShardState& s, int threads = 0);
// The same with a forced path. `isa` must be supported (cpu_isa_supported); a bug otherwise.
void optimizer_step_isa(CpuIsa isa, const OptimizerHyper& h, const ShardState& s, int threads = 0);

// Sum of squares (accumulated in fp64) and an inf/nan flag over n gradient elements; same
// meaning as grad_stats_reference(). Each square of an fp32/bf16/fp16 value is exact in fp64;
// the sum is taken in 16 interleaved lanes per tile, combined in a fixed tree, and tiles are
// added in order, so the result has the same bits for every ISA and thread count (it differs
// from the strictly sequential reference only by summation order, ~1e-15 relative).
// nonfinite is set iff some element is inf or nan (then norm_sq is inf or nan as well).
// Gradient chunks may be summarised as they arrive and merged with GradStats::merge(); the
// merged total then depends on the chunk boundaries only through the order of addition.
GradStats grad_stats(const void* grad, DType dtype, size_t n, int threads = 0);

// acc[i] += x[i] for i < n (fp32; a gradient accumulator and a micro-batch's gradient), in
// tiles of kOptimizerTileElems across `threads` threads as above: the same bits as one loop.
// acc and x must not overlap.
void add_into(float* acc, const float* x, size_t n, int threads = 0);
GradStats grad_stats_isa(CpuIsa isa, const void* grad, DType dtype, size_t n, int threads = 0);

}  // namespace strata
