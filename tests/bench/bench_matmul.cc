// CPU matmul throughput through the Kernels table (what training uses: tiles over TBB, the GEMM
// path of kernels/cpu/gemm.h, bf16 operands read as they are) against Eigen's own plain
// single-threaded GEMM built with the project's baseline flags, at the tiny model's shapes; and
// the CPU's fp32 FMA peak (BM_FmaPeak*: independent register-only FMA chains) to compare with.
//
//   bench_matmul --benchmark_min_time=0.2
//   STRATA_CPU_ISA=onednn bench_matmul ...   # the same cases on another GEMM path (gemm.h)
//
// Each case reports GFLOP/s per wall-clock second and CPU/GFLOP/s per core-second of process CPU
// time (fair on a loaded machine): forward 2*N*C*OC flops, backward 4*N*C*OC (dinp and dweight;
// dbias is O(N*OC)). Args: N (= B*T), C, OC, threads.
#include <benchmark/benchmark.h>
#include <cpuid.h>
#include <fmt/format.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <Eigen/Core>
#include <random>
#include <string_view>
#include <vector>

#include "strata/cpu_optim.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"

namespace strata {
namespace {

std::vector<uint16_t> random_bits(size_t n, DType dt, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> f(n);
  for (auto& x : f) x = u(rng);
  std::vector<uint16_t> out(n * dtype_size(dt) / 2);
  convert(f.data(), DType::kF32, out.data(), dt, n);
  return out;
}

void run_kernels(benchmark::State& state, DType dt, bool backward) {
  const int N = int(state.range(0)), C = int(state.range(1)), OC = int(state.range(2));
  const int threads = int(state.range(3));
  auto dev = create_cpu_device({.capacity = size_t{1} << 20, .threads = threads});
  if (!dev.is_ok()) {
    state.SkipWithError(dev.status().to_string().c_str());
    return;
  }
  Device& d = **dev;
  std::mt19937 rng(1);
  auto x = random_bits(size_t(N) * C, dt, rng), w = random_bits(size_t(OC) * C, dt, rng);
  auto b = random_bits(OC, dt, rng), y = random_bits(size_t(N) * OC, dt, rng);
  auto dx = random_bits(size_t(N) * C, dt, rng);
  std::vector<float> dw(size_t(OC) * C, 0.0f), db(OC, 0.0f);
  Kernels& k = d.kernels();
  Stream& s = d.compute_stream();
  for (auto _ : state) {
    if (backward) {
      k.matmul_backward(s, dt, dx.data(), dw.data(), db.data(), y.data(), x.data(), w.data(), N, C,
                        OC, /*accumulate=*/true);
    } else {
      k.matmul_forward(s, dt, y.data(), x.data(), w.data(), b.data(), N, C, OC);
    }
    if (!d.synchronize(s).is_ok()) state.SkipWithError("synchronize failed");
  }
  double flops = (backward ? 4.0 : 2.0) * N * C * OC;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["flops"] = flops;
}

void BM_KernelsForwardF32(benchmark::State& s) { run_kernels(s, DType::kF32, false); }
void BM_KernelsForwardBF16(benchmark::State& s) { run_kernels(s, DType::kBF16, false); }
void BM_KernelsBackwardF32(benchmark::State& s) { run_kernels(s, DType::kF32, true); }
void BM_KernelsBackwardBF16(benchmark::State& s) { run_kernels(s, DType::kBF16, true); }

// Eigen alone: out = inp * weight^T, one thread (this Eigen has no OpenMP), baseline flags.
void BM_EigenPlainForward(benchmark::State& state) {
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const int N = int(state.range(0)), C = int(state.range(1)), OC = int(state.range(2));
  RowMat A = RowMat::Random(N, C), B = RowMat::Random(OC, C), Cm(N, OC);
  for (auto _ : state) {
    Cm.noalias() = A * B.transpose();
    benchmark::DoNotOptimize(Cm.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * N * C * OC * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The CPU's fp32 FMA peak per core: 12 independent chains of `lanes`-wide FMAs on registers
// (no memory operands), so the loop is bound by the FMA ports alone. 2 * lanes FLOP per FMA.
// (One function per ISA, each compiled for its ISA whole, so the FMAs are inlined.)
__attribute__((target("avx2,fma"))) double fma_chains_avx2(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(1.0f + 1e-7f * float(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  double sum = 0;
  for (int i = 0; i < 12; ++i) sum += _mm256_cvtss_f32(acc[i]);
  return sum;
}
__attribute__((target("avx512f"))) double fma_chains_avx512(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(1.0f + 1e-7f * float(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  double sum = 0;
  for (int i = 0; i < 12; ++i) sum += _mm512_cvtss_f32(acc[i]);
  return sum;
}

// The bf16 dot-product peak (AVX512_BF16's vdpbf16ps: per fp32 lane, two bf16 products added
// to the accumulator, 4 FLOP), the instruction oneDNN's bf16 matmul runs on such CPUs without
// AMX: `lanes` = 32 counts it as 16 lanes x 2 FMAs.
__attribute__((target("avx512f,avx512bf16"))) double bf16_dot_chains(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(1e-7f * float(i));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  double sum = 0;
  for (int i = 0; i < 12; ++i) sum += _mm512_cvtss_f32(acc[i]);
  return sum;
}

void run_fma_peak(benchmark::State& state, const char* isa, int lanes, double (*chains)(int64_t)) {
  const std::string_view name(isa);
  const CpuIsa need = name == "avx2"     ? CpuIsa::kAvx2
                      : name == "avx512" ? CpuIsa::kAvx512
                                         : CpuIsa::kAvx512Bf16;
  if (!cpu_isa_supported(need)) {
    state.SkipWithError(fmt::format("this CPU has no {}", isa).c_str());
    return;
  }
  const int64_t iters = 1 << 20;
  for (auto _ : state) benchmark::DoNotOptimize(chains(iters));
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * lanes * 12 * iters * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

void BM_FmaPeakAvx2(benchmark::State& s) { run_fma_peak(s, "avx2", 8, fma_chains_avx2); }
void BM_FmaPeakAvx512(benchmark::State& s) { run_fma_peak(s, "avx512", 16, fma_chains_avx512); }
BENCHMARK(BM_FmaPeakAvx2)->MeasureProcessCPUTime()->UseRealTime();
void BM_Bf16DotPeakAvx512(benchmark::State& s) {
  run_fma_peak(s, "avx512bf16", 32, bf16_dot_chains);
}
BENCHMARK(BM_FmaPeakAvx512)->MeasureProcessCPUTime()->UseRealTime();
BENCHMARK(BM_Bf16DotPeakAvx512)->MeasureProcessCPUTime()->UseRealTime();

// The AMX bf16 peak (TDPBF16PS, the instruction oneDNN's bf16 matmul runs on CPUs with AMX):
// four independent accumulator tiles of 16 x 16 fp32, each updated from full A (16 x 32 bf16)
// and B (16 pairs x 16) tiles: 2 * 16 * 16 * 32 FLOP per instruction. Linux hands a process
// the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_usable(std::string* why) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) {
    *why = "this CPU has no AMX-BF16";
    return false;
  }
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) {
    *why = "the kernel did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
    return false;
  }
  return true;
}

__attribute__((target("amx-tile,amx-bf16"))) double amx_chains(int64_t iters) {
  struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  alignas(64) static uint16_t ab[16 * 32];
  alignas(64) static float acc[16 * 16];
  for (auto& x : ab) x = 0x3a83;  // bf16 1e-3
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  double sum = 0;
  _tile_stored(0, acc, 64);
  sum += acc[0];
  _tile_stored(3, acc, 64);
  sum += acc[0];
  _tile_release();
  return sum;
}

void BM_AmxBf16Peak(benchmark::State& state) {
  std::string why;
  if (!amx_usable(&why)) {
    state.SkipWithError(why.c_str());
    return;
  }
  const int64_t iters = 1 << 18;
  for (auto _ : state) benchmark::DoNotOptimize(amx_chains(iters));
  state.counters["GFLOP/s"] = benchmark::Counter(4.0 * 2 * 16 * 16 * 32 * iters * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AmxBf16Peak)->MeasureProcessCPUTime()->UseRealTime();

// The linear layers of configs/tiny-cpu.json (N = 4 x 64 tokens, C = 128) and
// configs/bench-25m.json (N = 2 x 128, C = 512): qkv (OC = 3C), attention projection (C),
// MLP up (4C) and down (C = 4C in, C out) and the head (OC = padded vocab 256); then two larger
// GPT-2 small shapes.
void shapes(benchmark::internal::Benchmark* b, bool with_threads) {
  for (auto [N, C, OC] : {std::tuple{256, 128, 384},
                          {256, 128, 128},
                          {256, 128, 512},
                          {256, 512, 128},
                          {256, 128, 256},
                          {256, 512, 1536},
                          {256, 512, 512},
                          {256, 512, 2048},
                          {256, 2048, 512},
                          {256, 512, 256},
                          {2048, 768, 768},
                          {2048, 768, 3072}}) {
    for (int t : {1, 2}) {
      if (!with_threads && t == 2) continue;
      b->Args({N, C, OC, t});
    }
  }
  // Process CPU time counts every thread's work, so GFLOP/s is per core-second: on a shared,
  // loaded machine that is the comparable figure. The Time column is wall-clock.
  b->ArgNames({"N", "C", "OC", "threads"})
      ->Unit(benchmark::kMillisecond)
      ->MeasureProcessCPUTime()
      ->UseRealTime();
}

BENCHMARK(BM_EigenPlainForward)->Apply([](auto* b) { shapes(b, false); });
BENCHMARK(BM_KernelsForwardF32)->Apply([](auto* b) { shapes(b, true); });
BENCHMARK(BM_KernelsForwardBF16)->Apply([](auto* b) { shapes(b, true); });
BENCHMARK(BM_KernelsBackwardF32)->Apply([](auto* b) { shapes(b, true); });
BENCHMARK(BM_KernelsBackwardBF16)->Apply([](auto* b) { shapes(b, true); });

}  // namespace
}  // namespace strata

BENCHMARK_MAIN();
