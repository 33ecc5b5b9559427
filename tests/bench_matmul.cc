// CPU matmul throughput through the Kernels table (what training uses: tiles over TBB, Eigen GEMM
// dispatched to the CPU's vector ISA, bf16 widened to fp32) against Eigen's own plain
// single-threaded GEMM built with the project's baseline flags, at the tiny model's shapes.
//
//   bench_matmul --benchmark_min_time=0.2
//
// Each case reports GFLOP/s per wall-clock second and CPU/GFLOP/s per core-second of process CPU
// time (fair on a loaded machine): forward 2*N*C*OC flops, backward 4*N*C*OC (dinp and dweight;
// dbias is O(N*OC)). Args: N (= B*T), C, OC, threads.
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <random>
#include <vector>

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
                        OC);
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
