// CPU optimizer throughput beside the memory-bound limit, measured in the same binary.
//
//   BM_Limit/<n>/<threads>/<moment_bits>: Adam's exact access pattern and no arithmetic: read
//     grad (bf16), master, m, v; write master, m, v back in place; write the low-precision
//     output (bf16, non-temporal like the optimizer when aligned). The fastest any fused
//     Adam can be with this many bytes per parameter.
//   BM_AdamW/<n>/<threads>/<moment_bits>: strata::optimizer_step (active ISA), AdamW with
//     weight decay, bf16 grads, bf16 lp_out, fp32 (32) or bf16 (16) moments.
//   BM_AdamW_f32grad/...: the same with fp32 gradients (4 more bytes per parameter).
//   BM_GradStats/<n>/<threads>/<grad_bits>: strata::grad_stats.
// After the runs a summary prints params/s, GB/s, the ratio to the limit and the bf16-moment
// speed-up per size and thread count.
//
// Run: build-optim/tests/bench_cpu_optim [--benchmark_filter=...] [--sizes=1,16,64,256]
// (sizes in Mi parameters; 256 allocates ~4.5 GiB).
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "strata/cpu_optim.h"
#include "strata/dtype.h"

namespace strata {
namespace {

// ------------------------------------------------------------------ buffers (huge pages)

struct Mapping {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Mapping(size_t b) : bytes((b + (2u << 20) - 1) / (2u << 20) * (2u << 20)) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "bench_cpu_optim: mmap of %zu bytes failed\n", bytes);
      std::abort();
    }
    madvise(p, bytes, MADV_HUGEPAGE);
  }
  ~Mapping() { munmap(p, bytes); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

template <class Fn>
void for_tiles(size_t n, int threads, const Fn& f) {
  const size_t tiles = (n + kOptimizerTileElems - 1) / kOptimizerTileElems;
  tbb::task_arena arena(threads);
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, tiles, 1), [&](const auto& r) {
      f(r.begin() * kOptimizerTileElems, std::min(n, r.end() * kOptimizerTileElems));
    });
  });
}

// One shard's buffers, kept while consecutive benchmarks use the same size and moment dtype.
struct State {
  size_t n;
  DType mt;
  Mapping grad, master, m, v, lp;
  State(size_t count, DType moment)
      : n(count),
        mt(moment),
        grad(count * 4),
        master(count * 4),
        m(count * dtype_size(moment)),
        v(count * dtype_size(moment)),
        lp(count * 2) {
    // First touch in parallel (pages land where the threads run), with non-trivial values.
    for_tiles(n, 2, [&](size_t b, size_t e) {
      uint32_t x = static_cast<uint32_t>(b) * 2654435761u + 1;
      for (size_t i = b; i < e; ++i) {
        x = x * 1664525u + 1013904223u;
        const float r = static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f;  // [-.5, .5)
        // A float whose two 16-bit halves are also sane bf16 values: the bf16 view of the
        // same buffer (elements 2i, 2i+1) then holds ordinary gradients too.
        const uint32_t hi = f32_to_bf16(r), lo = f32_to_bf16(-0.5f * r);
        static_cast<uint32_t*>(grad.p)[i] = (hi << 16) | lo;
        static_cast<float*>(master.p)[i] = r * 0.1f;
        store_f32(m.p, mt, i, r * 0.01f);
        store_f32(v.p, mt, i, r * r * 1e-3f + 1e-6f);
        static_cast<uint16_t*>(lp.p)[i] = 0;
      }
    });
  }
  ShardState shard(DType grad_t) const {
    ShardState s;
    s.n = n;
    s.grad = grad.p;
    s.grad_dtype = grad_t;
    s.grad_mult = 0.5f;
    s.master = static_cast<float*>(master.p);
    s.m = m.p;
    s.v = v.p;
    s.moment_dtype = mt;
    s.lp_out = lp.p;
    s.lp_dtype = DType::kBF16;
    return s;
  }
};

State& state_for(size_t n, DType mt) {
  static std::unique_ptr<State> cur;
  if (!cur || cur->n != n || cur->mt != mt) {
    cur.reset();
    cur = std::make_unique<State>(n, mt);
  }
  return *cur;
}

// Bytes moved per parameter by one step: reads + writes.
double bytes_per_param(DType grad_t, DType mt) {
  const double ms = static_cast<double>(dtype_size(mt));
  return static_cast<double>(dtype_size(grad_t)) + 4 + 2 * ms  // read grad, master, m, v
         + 4 + 2 * ms + 2;                                     // write master, m, v, lp
}

// ------------------------------------------------------------------ the limit kernel

// Loads, then an empty asm that claims to change the values (so the stores are real and no
// arithmetic is done), then the in-place stores and the lp store. `sink` keeps grad "used".
template <bool kBf16Moments>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void limit_avx512(const ShardState& s,
                                                                       size_t b, size_t e,
                                                                       bool stream) {
  const uint16_t* g = static_cast<const uint16_t*>(s.grad);
  uint16_t* lp = static_cast<uint16_t*>(s.lp_out);
  size_t i = b;
  for (; i + 16 <= e; i += 16) {
    __m256i gv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i));
    __m512 p = _mm512_loadu_ps(s.master + i);
    if constexpr (kBf16Moments) {
      uint16_t* m = static_cast<uint16_t*>(s.m) + i;
      uint16_t* v = static_cast<uint16_t*>(s.v) + i;
      __m256i mv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m));
      __m256i vv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
      asm volatile("" : "+v"(p), "+v"(mv), "+v"(vv) : "v"(gv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(m), mv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v), vv);
    } else {
      float* m = static_cast<float*>(s.m) + i;
      float* v = static_cast<float*>(s.v) + i;
      __m512 mv = _mm512_loadu_ps(m);
      __m512 vv = _mm512_loadu_ps(v);
      asm volatile("" : "+v"(p), "+v"(mv), "+v"(vv) : "v"(gv));
      _mm512_storeu_ps(m, mv);
      _mm512_storeu_ps(v, vv);
    }
    _mm512_storeu_ps(s.master + i, p);
    __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(lp + i), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lp + i), h);
    }
  }
  if (stream) _mm_sfence();
}

template <bool kBf16Moments>
__attribute__((target("avx2"))) void limit_avx2(const ShardState& s, size_t b, size_t e,
                                                bool stream) {
  const uint16_t* g = static_cast<const uint16_t*>(s.grad);
  uint16_t* lp = static_cast<uint16_t*>(s.lp_out);
  for (size_t i = b; i + 8 <= e; i += 8) {
    __m128i gv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i));
    __m256 p = _mm256_loadu_ps(s.master + i);
    if constexpr (kBf16Moments) {
      uint16_t* m = static_cast<uint16_t*>(s.m) + i;
      uint16_t* v = static_cast<uint16_t*>(s.v) + i;
      __m128i mv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m));
      __m128i vv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
      asm volatile("" : "+x"(p), "+x"(mv), "+x"(vv) : "x"(gv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(m), mv);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v), vv);
    } else {
      float* m = static_cast<float*>(s.m) + i;
      float* v = static_cast<float*>(s.v) + i;
      __m256 mv = _mm256_loadu_ps(m);
      __m256 vv = _mm256_loadu_ps(v);
      asm volatile("" : "+x"(p), "+x"(mv), "+x"(vv) : "x"(gv));
      _mm256_storeu_ps(m, mv);
      _mm256_storeu_ps(v, vv);
    }
    _mm256_storeu_ps(s.master + i, p);
    __m128i h = _mm256_castsi256_si128(_mm256_srli_epi32(_mm256_castps_si256(p), 16));
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(lp + i), h);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lp + i), h);
    }
  }
  if (stream) _mm_sfence();
}

void limit_step(const ShardState& s, int threads) {
  const bool bf16m = s.moment_dtype == DType::kBF16;
  const bool avx512 = static_cast<int>(active_cpu_isa()) >= static_cast<int>(CpuIsa::kAvx512);
  const bool stream = reinterpret_cast<uintptr_t>(s.lp_out) % 64 == 0;  // as the optimizer
  for_tiles(s.n, threads, [&](size_t b, size_t e) {
    if (avx512) {
      bf16m ? limit_avx512<true>(s, b, e, stream) : limit_avx512<false>(s, b, e, stream);
    } else {
      bf16m ? limit_avx2<true>(s, b, e, stream) : limit_avx2<false>(s, b, e, stream);
    }
  });
}

// ------------------------------------------------------------------ benchmarks

void BM_Limit(benchmark::State& st) {
  const size_t n = static_cast<size_t>(st.range(0)) << 20;
  const int threads = static_cast<int>(st.range(1));
  const DType mt = st.range(2) == 16 ? DType::kBF16 : DType::kF32;
  State& s = state_for(n, mt);
  const ShardState sh = s.shard(DType::kBF16);
  limit_step(sh, threads);  // warm-up
  for (auto _ : st) limit_step(sh, threads);
  st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * n));
  st.SetBytesProcessed(
      static_cast<int64_t>(st.iterations() * n * bytes_per_param(DType::kBF16, mt)));
}

void adam(benchmark::State& st, DType grad_t) {
  const size_t n = static_cast<size_t>(st.range(0)) << 20;
  const int threads = static_cast<int>(st.range(1));
  const DType mt = st.range(2) == 16 ? DType::kBF16 : DType::kF32;
  State& s = state_for(n, mt);
  const ShardState sh = s.shard(grad_t);
  OptimizerHyper h;
  h.kind = OptimizerKind::kAdamW;
  h.weight_decay = 0.01f;
  h.step = 10;
  optimizer_step(h, sh, threads);  // warm-up
  for (auto _ : st) optimizer_step(h, sh, threads);
  st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * n));
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * n * bytes_per_param(grad_t, mt)));
  st.SetLabel(cpu_isa_name(active_cpu_isa()));
}
void BM_AdamW(benchmark::State& st) { adam(st, DType::kBF16); }
void BM_AdamW_f32grad(benchmark::State& st) { adam(st, DType::kF32); }

void BM_GradStats(benchmark::State& st) {
  const size_t n = static_cast<size_t>(st.range(0)) << 20;
  const int threads = static_cast<int>(st.range(1));
  const DType gt = st.range(2) == 16 ? DType::kBF16 : DType::kF32;
  State& s = state_for(n, DType::kF32);
  double sink = 0;
  for (auto _ : st) sink += grad_stats(s.grad.p, gt, n, threads).norm_sq;
  benchmark::DoNotOptimize(sink);
  st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * n));
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * n * dtype_size(gt)));
}

// Collects items/s and bytes/s per benchmark name for the summary.
class Collector : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, std::pair<double, double>> rates;  // name -> (items/s, bytes/s)
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration) continue;
      auto it = r.counters.find("items_per_second");
      auto bt = r.counters.find("bytes_per_second");
      if (it != r.counters.end() && bt != r.counters.end()) {
        rates[r.benchmark_name()] = {it->second.value, bt->second.value};
      }
    }
  }
};

std::vector<int64_t> parse_sizes(int* argc, char** argv) {
  std::vector<int64_t> sizes = {1, 16, 64, 256};
  for (int i = 1; i < *argc; ++i) {
    if (std::strncmp(argv[i], "--sizes=", 8) == 0) {
      sizes.clear();
      for (const char* p = argv[i] + 8; *p;) {
        char* end;
        sizes.push_back(std::strtoll(p, &end, 10));
        p = *end == ',' ? end + 1 : end;
      }
      for (int j = i; j + 1 < *argc; ++j) argv[j] = argv[j + 1];
      --*argc;
      break;
    }
  }
  return sizes;
}

std::string name(const char* bm, int64_t n, int t, int mb) {
  return std::string(bm) + "/" + std::to_string(n) + "/" + std::to_string(t) + "/" +
         std::to_string(mb) + "/real_time";
}

void print_summary(const Collector& c, const std::vector<int64_t>& sizes) {
  auto get = [&](const std::string& k) -> std::pair<double, double> {
    auto it = c.rates.find(k);
    return it == c.rates.end() ? std::pair<double, double>{0, 0} : it->second;
  };
  std::printf("\nSummary (ISA %s; bf16 grads, bf16 lp_out; Mparams/s, GB/s)\n",
              cpu_isa_name(active_cpu_isa()));
  std::printf("%7s %3s %8s | %17s | %17s | %8s | %13s\n", "params", "thr", "moments",
              "limit Mp/s  GB/s", "AdamW Mp/s  GB/s", "of limit", "bf16/fp32 m.");
  for (int64_t n : sizes) {
    for (int t : {1, 2}) {
      const double adam32 = get(name("BM_AdamW", n, t, 32)).first;
      for (int mb : {32, 16}) {
        auto lim = get(name("BM_Limit", n, t, mb));
        auto ad = get(name("BM_AdamW", n, t, mb));
        if (ad.first == 0) continue;
        std::printf("%6lldM %3d %8s | %9.0f %7.1f | %9.0f %7.1f | %7.1f%% | ",
                    static_cast<long long>(n), t, mb == 16 ? "bf16" : "fp32", lim.first / 1e6,
                    lim.second / 1e9, ad.first / 1e6, ad.second / 1e9,
                    lim.first ? 100.0 * ad.first / lim.first : 0.0);
        if (mb == 16 && adam32 > 0) {
          std::printf("%12.2fx\n", ad.first / adam32);
        } else {
          std::printf("%13s\n", "");
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  const std::vector<int64_t> sizes = parse_sizes(&argc, argv);
  for (int64_t n : sizes) {
    const double min_time = n >= 64 ? 1.0 : 0.5;
    for (int mb : {32, 16}) {
      for (int t : {1, 2}) {
        benchmark::RegisterBenchmark("BM_Limit", BM_Limit)
            ->Args({n, t, mb})
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(min_time);
        benchmark::RegisterBenchmark("BM_AdamW", BM_AdamW)
            ->Args({n, t, mb})
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(min_time);
        if (n == 16 || n == 64) {
          benchmark::RegisterBenchmark("BM_AdamW_f32grad", BM_AdamW_f32grad)
              ->Args({n, t, mb})
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond)
              ->MinTime(min_time);
        }
      }
    }
    if (n == 16 || n == 64) {
      for (int t : {1, 2}) {
        for (int gb : {32, 16}) {
          benchmark::RegisterBenchmark("BM_GradStats", BM_GradStats)
              ->Args({n, t, gb})
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond)
              ->MinTime(0.3);
        }
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  Collector c;
  benchmark::RunSpecifiedBenchmarks(&c);
  print_summary(c, sizes);
  benchmark::Shutdown();
  return 0;
}
