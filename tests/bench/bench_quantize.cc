// Throughput of the CPU quantize kernels (ZeRO++'s qwZ gathers and qgZ reduce-scatters): the
// dispatched path (AVX2 where the CPU has it) beside the scalar reference, on one thread and on
// all of them.
//
//   bench_quantize --benchmark_min_time=0.5
//
// BM_<Op>/<path>/<bits>/<dtype>/<threads>: path 0 the scalar reference, 1 the dispatched one;
// dtype 0 fp32, 1 bf16. The cases are the engine's: qwZ quantizes and dequantizes bf16 with
// 8 bits per 256 elements, qgZ fp32 with 4 bits per 128 (its reduction dequantizes with
// accumulate). GB/s counts the bytes read and written once: the typed values, the q bytes and
// the scales (plus the values read again when accumulating).
#include <benchmark/benchmark.h>
#include <tbb/task_arena.h>

#include <random>
#include <vector>

#include "kernels/cpu/ops.h"
#include "strata/dtype.h"
#include "strata/kernels.h"

namespace strata {
namespace {

constexpr size_t kN = size_t{1} << 22;  // 4 Mi elements: past the caches

struct Buffers {
  std::vector<unsigned char> x, q;
  std::vector<float> scales;
  Buffers(int bits, DType dt, int block) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> f(kN);
    for (auto& v : f) v = u(rng);
    x.resize(kN * dtype_size(dt));
    convert(f.data(), DType::kF32, x.data(), dt, kN);
    q.resize(quantized_bytes(bits, kN));
    scales.resize(quantize_blocks(kN, block));
  }
  size_t bytes(DType dt, bool accumulate) const {
    return kN * dtype_size(dt) * (accumulate ? 2 : 1) + q.size() + scales.size() * 4;
  }
};

DType dtype_of(int64_t i) { return i == 0 ? DType::kF32 : DType::kBF16; }

void BM_Quantize(benchmark::State& state) {
  const bool fast = state.range(0) != 0;
  const int bits = int(state.range(1)), block = bits == 8 ? 256 : 128;
  const DType dt = dtype_of(state.range(2));
  tbb::task_arena arena(int(state.range(3)));
  Buffers b(bits, dt, block);
  for (auto _ : state) {
    arena.execute([&] {
      if (fast) {
        cpu::quantize(bits, dt, b.q.data(), b.scales.data(), b.x.data(), kN, block);
      } else {
        cpu::quantize_reference(bits, dt, b.q.data(), b.scales.data(), b.x.data(), kN, block);
      }
    });
    benchmark::DoNotOptimize(b.q.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(b.bytes(dt, false)));
  state.SetLabel(fast ? cpu::quantize_isa() : "reference");
}

void BM_Dequantize(benchmark::State& state) {
  const bool fast = state.range(0) != 0;
  const int bits = int(state.range(1)), block = bits == 8 ? 256 : 128;
  const DType dt = dtype_of(state.range(2));
  const bool accumulate = bits == 4;  // qgZ sums, qwZ overwrites
  tbb::task_arena arena(int(state.range(3)));
  Buffers b(bits, dt, block);
  cpu::quantize_reference(bits, dt, b.q.data(), b.scales.data(), b.x.data(), kN, block);
  std::vector<unsigned char> out = b.x;
  for (auto _ : state) {
    arena.execute([&] {
      if (fast) {
        cpu::dequantize(bits, dt, out.data(), b.q.data(), b.scales.data(), kN, block, accumulate);
      } else {
        cpu::dequantize_reference(bits, dt, out.data(), b.q.data(), b.scales.data(), kN, block,
                                  accumulate);
      }
    });
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(b.bytes(dt, accumulate)));
  state.SetLabel(fast ? cpu::quantize_isa() : "reference");
}

// qwZ: 8 bits, bf16; qgZ: 4 bits, fp32. One thread and two.
void cases(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) {
    for (int path : {0, 1}) {
      b->Args({path, 8, 1, threads});
      b->Args({path, 4, 0, threads});
    }
  }
}

BENCHMARK(BM_Quantize)->Apply(cases)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Dequantize)->Apply(cases)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace strata

BENCHMARK_MAIN();
