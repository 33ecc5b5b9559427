// CPU optimizer throughput beside the memory-bound limit, measured in the same binary.
//
//   BM_Limit[Pf]/<n>/<threads>/<moment_bits>: Adam's exact access pattern and no arithmetic: read
//     grad (bf16), master, m, v; write master, m, v back in place; write the low-precision
//     output (bf16, non-temporal like the optimizer when aligned). The fastest any fused
//     Adam can be with this many bytes per parameter. Pf: with the optimizer's software
//     prefetch; the summary's limit is the faster of the two.
//   BM_AdamW/<n>/<threads>/<moment_bits>: strata::optimizer_step (active ISA), AdamW with
//     weight decay, bf16 grads, bf16 lp_out, fp32 (32) or bf16 (16) moments.
//   BM_AdamW_f32grad/...: the same with fp32 gradients (4 more bytes per parameter).
//   BM_GradStats/<n>/<threads>/<grad_bits>: strata::grad_stats.
// After the runs a summary prints params/s, GB/s, the ratio to the limit and the bf16-moment
// speed-up per size and thread count.
//
// bench_cpu_optim --pairs=N instead prints the interleaved fastest-pass table;
// bench_cpu_optim --ab=N instead prints the bf16-vs-fp32-moment A/B table (median of N rounds);
// bench_cpu_optim --accuracy=1 instead prints the bf16-moment accuracy experiment (CPU_OPTIM.md).
// Run: build-optim/tests/bench_cpu_optim [--sizes=1,16,64,256] [--threads=1,2] [--rounds=3]
//        [--benchmark_filter=...]   (sizes in Mi parameters; 256 allocates ~4.5 GiB).
#include <benchmark/benchmark.h>
// GCC 12 warns inside its own avx512fintrin.h (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <sys/mman.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <random>
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
// Two vectors (32 elements) per iteration with whole-line (64-byte) stores on every stream, as
// the optimizer's AVX-512 loop does (its bf16 outputs of a vector pair go out as one line).
// kPrefetch: the same software prefetch as the optimizer's AVX-512 loop (1024 elements ahead,
// one per line of every stream); the summary takes the faster of the two variants as the limit.
template <bool kBf16Moments, bool kPrefetch>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void limit_avx512(const ShardState& s,
                                                                       size_t b, size_t e,
                                                                       bool stream) {
  const uint16_t* g = static_cast<const uint16_t*>(s.grad);
  uint16_t* lp = static_cast<uint16_t*>(s.lp_out);
  constexpr size_t ms = kBf16Moments ? 2 : 4;
  size_t i = b;
  for (; i + 32 <= e; i += 32) {
    if constexpr (kPrefetch) {
      const size_t a = i + 1024;
      if (a + 32 <= e) {
        _mm_prefetch(reinterpret_cast<const char*>(g + a), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(s.master + a), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(s.master + a + 16), _MM_HINT_T0);
        for (size_t l = 0; l < 32 * ms; l += 64) {
          _mm_prefetch(static_cast<const char*>(s.m) + a * ms + l, _MM_HINT_T0);
          _mm_prefetch(static_cast<const char*>(s.v) + a * ms + l, _MM_HINT_T0);
        }
      }
    }
    __m512i gv = _mm512_loadu_si512(g + i);
    __m512 p0 = _mm512_loadu_ps(s.master + i), p1 = _mm512_loadu_ps(s.master + i + 16);
    if constexpr (kBf16Moments) {
      uint16_t* m = static_cast<uint16_t*>(s.m) + i;
      uint16_t* v = static_cast<uint16_t*>(s.v) + i;
      __m512i mv = _mm512_loadu_si512(m);
      __m512i vv = _mm512_loadu_si512(v);
      asm volatile("" : "+v"(p0), "+v"(p1), "+v"(mv), "+v"(vv) : "v"(gv));
      _mm512_storeu_si512(m, mv);
      _mm512_storeu_si512(v, vv);
    } else {
      float* m = static_cast<float*>(s.m) + i;
      float* v = static_cast<float*>(s.v) + i;
      __m512 m0 = _mm512_loadu_ps(m), m1 = _mm512_loadu_ps(m + 16);
      __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      asm volatile("" : "+v"(p0), "+v"(p1), "+v"(m0), "+v"(m1), "+v"(v0), "+v"(v1) : "v"(gv));
      _mm512_storeu_ps(m, m0);
      _mm512_storeu_ps(m + 16, m1);
      _mm512_storeu_ps(v, v0);
      _mm512_storeu_ps(v + 16, v1);
    }
    _mm512_storeu_ps(s.master + i, p0);
    _mm512_storeu_ps(s.master + i + 16, p1);
    // The high halves of p0 and p1 as 32 packed words (truncation: no arithmetic to speak of).
    const __m512i idx =
        _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                         25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i h =
        _mm512_permutex2var_epi16(_mm512_castps_si512(p0), idx, _mm512_castps_si512(p1));
    if (stream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(lp + i), h);
    } else {
      _mm512_storeu_si512(lp + i, h);
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

void limit_step(const ShardState& s, int threads, bool prefetch) {
  const bool bf16m = s.moment_dtype == DType::kBF16;
  const bool avx512 = static_cast<int>(active_cpu_isa()) >= static_cast<int>(CpuIsa::kAvx512);
  const bool stream = reinterpret_cast<uintptr_t>(s.lp_out) % 64 == 0;  // as the optimizer
  for_tiles(s.n, threads, [&](size_t b, size_t e) {
    if (avx512 && prefetch) {
      bf16m ? limit_avx512<true, true>(s, b, e, stream)
            : limit_avx512<false, true>(s, b, e, stream);
    } else if (avx512) {
      bf16m ? limit_avx512<true, false>(s, b, e, stream)
            : limit_avx512<false, false>(s, b, e, stream);
    } else {
      bf16m ? limit_avx2<true>(s, b, e, stream) : limit_avx2<false>(s, b, e, stream);
    }
  });
}

// ------------------------------------------------------------------ benchmarks

void limit(benchmark::State& st, bool prefetch) {
  const size_t n = static_cast<size_t>(st.range(0)) << 20;
  const int threads = static_cast<int>(st.range(1));
  const DType mt = st.range(2) == 16 ? DType::kBF16 : DType::kF32;
  State& s = state_for(n, mt);
  const ShardState sh = s.shard(DType::kBF16);
  limit_step(sh, threads, prefetch);  // warm-up
  for (auto _ : st) limit_step(sh, threads, prefetch);
  st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * n));
  st.SetBytesProcessed(
      static_cast<int64_t>(st.iterations() * n * bytes_per_param(DType::kBF16, mt)));
}

void BM_Limit(benchmark::State& st) { limit(st, false); }
void BM_LimitPf(benchmark::State& st) { limit(st, true); }

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
        // Best of the rounds: on a shared machine the fastest round is the least disturbed.
        auto& best = rates[r.run_name.function_name + "/" + r.run_name.args];
        if (it->second.value > best.first) best = {it->second.value, bt->second.value};
      }
    }
  }
};

// Removes --name=value from argv and returns value, or "" when absent.
std::string take_flag(int* argc, char** argv, const char* flag) {
  const size_t len = std::strlen(flag);
  for (int i = 1; i < *argc; ++i) {
    if (std::strncmp(argv[i], flag, len) == 0 && argv[i][len] == '=') {
      std::string v = argv[i] + len + 1;
      for (int j = i; j + 1 < *argc; ++j) argv[j] = argv[j + 1];
      --*argc;
      return v;
    }
  }
  return "";
}

std::vector<int64_t> parse_list(const std::string& s, std::vector<int64_t> dflt) {
  if (s.empty()) return dflt;
  std::vector<int64_t> out;
  for (const char* p = s.c_str(); *p;) {
    char* end;
    out.push_back(std::strtoll(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

void print_summary(const Collector& c, const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& threads, int rounds) {
  auto get = [&](const char* bm, int64_t n, int64_t t, int mb) -> std::pair<double, double> {
    auto it = c.rates.find(std::string(bm) + "/" + std::to_string(n) + "/" + std::to_string(t) +
                           "/" + std::to_string(mb));
    return it == c.rates.end() ? std::pair<double, double>{0, 0} : it->second;
  };
  std::printf(
      "\nSummary: ISA %s, best of %d rounds; AdamW with bf16 grads (f32grad: fp32) and bf16 "
      "lp_out; Mparams/s and GB/s (1e9 B/s, reads + writes)\n",
      cpu_isa_name(active_cpu_isa()), rounds);
  std::printf("%7s %3s %7s | %15s | %15s %7s | %15s %7s | %s\n", "params", "thr", "moments",
              "limit Mp/s GB/s", "AdamW Mp/s GB/s", "/limit", "f32grad Mp/s", "GB/s",
              "bf16m/fp32m Mp/s");
  for (int64_t n : sizes) {
    for (int64_t t : threads) {
      for (int mb : {32, 16}) {
        auto lim = get("BM_Limit", n, t, mb);
        if (get("BM_LimitPf", n, t, mb).first > lim.first) lim = get("BM_LimitPf", n, t, mb);
        const auto ad = get("BM_AdamW", n, t, mb), f32 = get("BM_AdamW_f32grad", n, t, mb);
        if (ad.first == 0) continue;
        std::printf("%6lldM %3lld %7s | %7.0f %7.1f | %7.0f %7.1f %6.1f%% | ",
                    static_cast<long long>(n), static_cast<long long>(t),
                    mb == 16 ? "bf16" : "fp32", lim.first / 1e6, lim.second / 1e9, ad.first / 1e6,
                    ad.second / 1e9, lim.first ? 100.0 * ad.first / lim.first : 0.0);
        if (f32.first > 0) {
          std::printf("%7.0f %7.1f %6s | ", f32.first / 1e6, f32.second / 1e9, "");
        } else {
          std::printf("%15s %7s | ", "", "");
        }
        const double ad32 = get("BM_AdamW", n, t, 32).first;
        const double f32_32 = get("BM_AdamW_f32grad", n, t, 32).first;
        if (mb == 16 && ad32 > 0) {
          std::printf("%.2fx", ad.first / ad32);
          if (f32_32 > 0 && f32.first > 0) std::printf(" (fp32 grads %.2fx)", f32.first / f32_32);
        }
        std::printf("\n");
      }
    }
  }
}

// --pairs=N: the robust table for a shared machine. For each case, N rounds of one pass each of
// Limit, LimitPf, AdamW (bf16 grads) and AdamW (fp32 grads), interleaved so that all see the
// same background load; each kernel's time is its fastest pass (the least disturbed one).
void pairs_table(const std::vector<int64_t>& sizes, const std::vector<int64_t>& threads,
                 int rounds) {
  using Clock = std::chrono::steady_clock;
  auto time_one = [](auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  OptimizerHyper h;
  h.kind = OptimizerKind::kAdamW;
  h.weight_decay = 0.01f;
  h.step = 10;
  std::printf("ISA %s; fastest of %d interleaved passes; Mparams/s (GB/s, 1e9 B/s reads+writes)\n",
              cpu_isa_name(active_cpu_isa()), rounds);
  std::printf(
      "| params | threads | moments | limit | AdamW bf16 grads | of limit | AdamW fp32 grads |"
      " bf16/fp32 moments |\n|---|---|---|---|---|---|---|---|\n");
  for (int64_t nm : sizes) {
    const size_t n = static_cast<size_t>(nm) << 20;
    std::map<std::pair<int64_t, int>, double> adam_rate;
    for (int mb : {32, 16}) {
      const DType mt = mb == 16 ? DType::kBF16 : DType::kF32;
      State& st = state_for(n, mt);
      const ShardState s16 = st.shard(DType::kBF16), s32 = st.shard(DType::kF32);
      for (int64_t t64 : threads) {
        const int t = static_cast<int>(t64);
        double best[4] = {1e30, 1e30, 1e30, 1e30};
        optimizer_step(h, s16, t);  // warm-up
        for (int r = 0; r < rounds; ++r) {
          best[0] = std::min(best[0], time_one([&] { limit_step(s16, t, false); }));
          best[1] = std::min(best[1], time_one([&] { limit_step(s16, t, true); }));
          best[2] = std::min(best[2], time_one([&] { optimizer_step(h, s16, t); }));
          best[3] = std::min(best[3], time_one([&] { optimizer_step(h, s32, t); }));
        }
        const double lim = n / std::min(best[0], best[1]), ad = n / best[2], ad32 = n / best[3];
        adam_rate[{t64, mb}] = ad;
        std::printf("| %lldM | %d | %s | %.0f (%.1f) | %.0f (%.1f) | %.1f%% | %.0f (%.1f) |",
                    static_cast<long long>(nm), t, mb == 16 ? "bf16" : "fp32", lim / 1e6,
                    lim * bytes_per_param(DType::kBF16, mt) / 1e9, ad / 1e6,
                    ad * bytes_per_param(DType::kBF16, mt) / 1e9, 100.0 * ad / lim, ad32 / 1e6,
                    ad32 * bytes_per_param(DType::kF32, mt) / 1e9);
        if (mb == 16) {
          std::printf(" %.2fx |\n", ad / adam_rate[{t64, 32}]);
        } else {
          std::printf(" |\n");
        }
        std::fflush(stdout);
      }
    }
  }
}

// --ab=N: the bf16-moment speed-up, measured A/B. Both states (fp32 moments and bf16 moments)
// are allocated side by side and each of N rounds runs one pass of each of four kernels back to
// back: AdamW with fp32 moments, AdamW with bf16 moments, and the limit kernel for each (bf16
// grads, bf16 lp_out, weight decay, as above); the order alternates between rounds. On a shared
// machine the two AdamW passes of a round see nearly the same background, so the per-round
// ratio bf16/fp32 is the robust statistic; its median is reported with the medians (and the
// fastest passes) of each kernel. With one thread the step runs on the calling thread, so the
// thread's CPU time is reported too (time the core spent on the pass, excluding preemption).
double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t k = x.size() / 2;
  return x.size() % 2 ? x[k] : 0.5 * (x[k - 1] + x[k]);
}

void ab_table(const std::vector<int64_t>& sizes, const std::vector<int64_t>& threads, int rounds) {
  using Clock = std::chrono::steady_clock;
  OptimizerHyper h;
  h.kind = OptimizerKind::kAdamW;
  h.weight_decay = 0.01f;
  h.step = 10;
  std::printf(
      "ISA %s; %d interleaved rounds; AdamW bf16 grads, bf16 lp_out; Mparams/s from the median "
      "pass (fastest pass in brackets)\n",
      cpu_isa_name(active_cpu_isa()), rounds);
  std::printf(
      "| params | threads | limit fp32 m | AdamW fp32 m | of limit | limit bf16 m | AdamW bf16 m |"
      " of limit | bf16/fp32 (median of per-round ratios) | same, thread CPU time |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t nm : sizes) {
    const size_t n = static_cast<size_t>(nm) << 20;
    State s32(n, DType::kF32), s16(n, DType::kBF16);
    const ShardState a32 = s32.shard(DType::kBF16), a16 = s16.shard(DType::kBF16);
    for (int64_t t64 : threads) {
      const int t = static_cast<int>(t64);
      // Kernels 0..3: limit fp32 m, AdamW fp32 m, limit bf16 m, AdamW bf16 m.
      std::vector<double> wall[4], cpu[4], ratio, ratio_cpu;
      auto run = [&](int k) {
        const ShardState& s = k < 2 ? a32 : a16;
        const auto t0 = Clock::now();
        const double c0 = thread_cpu_seconds();
        if (k % 2 == 0) {
          limit_step(s, t, true);
        } else {
          optimizer_step(h, s, t);
        }
        cpu[k].push_back(thread_cpu_seconds() - c0);
        wall[k].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      };
      for (int k = 0; k < 4; ++k) run(k);  // warm-up
      for (int k = 0; k < 4; ++k) wall[k].clear(), cpu[k].clear();
      for (int r = 0; r < rounds; ++r) {
        static const int kOrder[2][4] = {{0, 1, 3, 2}, {2, 3, 1, 0}};
        for (int k : kOrder[r % 2]) run(k);
        ratio.push_back(wall[1].back() / wall[3].back());
        ratio_cpu.push_back(cpu[1].back() / cpu[3].back());
      }
      auto rate = [&](int k) { return n / median(wall[k]) / 1e6; };
      auto best = [&](int k) {
        return n / *std::min_element(wall[k].begin(), wall[k].end()) / 1e6;
      };
      std::printf(
          "| %lldM | %d | %.0f [%.0f] | %.0f [%.0f] | %.1f%% | %.0f [%.0f] | %.0f [%.0f] | "
          "%.1f%% | %.2fx |",
          static_cast<long long>(nm), t, rate(0), best(0), rate(1), best(1),
          100.0 * rate(1) / rate(0), rate(2), best(2), rate(3), best(3), 100.0 * rate(3) / rate(2),
          median(ratio));
      if (t == 1) {
        std::printf(" %.2fx (%.0f vs %.0f Mp/s) |\n", median(ratio_cpu), n / median(cpu[3]) / 1e6,
                    n / median(cpu[1]) / 1e6);
      } else {
        std::printf(" |\n");
      }
      std::fflush(stdout);
    }
  }
}

// --accuracy: the bf16-moment accuracy experiment quoted in docs/CPU_OPTIM.md. AdamW on a noisy
// quadratic 0.5 * c_i * (p_i - t_i)^2 (c_i log-normal), gradient noise decaying as
// 1 / (1 + t/300), fp32 and bf16 moments side by side from the same noise.
void accuracy_experiment() {
  const size_t n = 100000;
  std::vector<float> target(n), curv(n), g(n), noise(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (size_t i = 0; i < n; ++i) {
    target[i] = nd(rng);
    curv[i] = std::exp(2.0f * nd(rng));
  }
  std::printf("%6s %5s | %12s %12s | %14s | %s\n", "beta2", "step", "loss fp32 m", "loss bf16 m",
              "rel param diff", "mean v_bf16/v_fp32 (geometric)");
  for (float beta2 : {0.999f, 0.99f}) {
    std::vector<float> p32(n, 0.0f), p16(n, 0.0f), m32(n, 0.0f), v32(n, 0.0f);
    std::vector<uint16_t> m16(n, 0), v16(n, 0);
    OptimizerHyper h;
    h.lr = 1e-2f;
    h.beta2 = beta2;
    std::mt19937 noise_rng(2);
    for (int step = 1; step <= 3000; ++step) {
      h.step = step;
      const float sigma = 1.0f / (1.0f + static_cast<float>(step) / 300.0f);
      for (float& e : noise) e = sigma * nd(noise_rng);
      for (int bf16 = 0; bf16 < 2; ++bf16) {
        std::vector<float>& p = bf16 ? p16 : p32;
        for (size_t i = 0; i < n; ++i) g[i] = curv[i] * (p[i] - target[i]) + noise[i];
        ShardState s;
        s.n = n;
        s.grad = g.data();
        s.master = p.data();
        s.m = bf16 ? static_cast<void*>(m16.data()) : m32.data();
        s.v = bf16 ? static_cast<void*>(v16.data()) : v32.data();
        s.moment_dtype = bf16 ? DType::kBF16 : DType::kF32;
        optimizer_step(h, s);
      }
      if (step % 500 == 0) {
        double l32 = 0, l16 = 0, d = 0, nn = 0, lv = 0;
        for (size_t i = 0; i < n; ++i) {
          const double e32 = p32[i] - target[i], e16 = p16[i] - target[i];
          l32 += 0.5 * curv[i] * e32 * e32 / n;
          l16 += 0.5 * curv[i] * e16 * e16 / n;
          d += (p16[i] - p32[i]) * static_cast<double>(p16[i] - p32[i]);
          nn += static_cast<double>(p32[i]) * p32[i];
          lv += std::log(bf16_to_f32(v16[i]) / static_cast<double>(v32[i])) / n;
        }
        std::printf("%6.3f %5d | %12.4g %12.4g | %13.2f%% | %.3f\n", beta2, step, l32, l16,
                    100.0 * std::sqrt(d / nn), std::exp(lv));
      }
    }
  }
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  if (!take_flag(&argc, argv, "--accuracy").empty()) {
    accuracy_experiment();
    return 0;
  }
  // --sizes=1,16,64,256 (Mi params), --threads=1,2, --rounds=N: each (size, moments) group runs
  // its Limit/AdamW pairs N times interleaved; the summary keeps each case's best round.
  const std::vector<int64_t> sizes =
      parse_list(take_flag(&argc, argv, "--sizes"), {1, 16, 64, 256});
  const std::vector<int64_t> threads = parse_list(take_flag(&argc, argv, "--threads"), {1, 2});
  const std::string r = take_flag(&argc, argv, "--rounds");
  const int rounds = r.empty() ? 3 : std::atoi(r.c_str());
  auto reg = [](const char* name, void (*fn)(benchmark::State&), int64_t n, int64_t t, int64_t b,
                double min_time) {
    benchmark::RegisterBenchmark(name, fn)
        ->Args({n, t, b})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->MinTime(min_time);
  };
  for (int64_t n : sizes) {
    const double min_time = n >= 256 ? 0.8 : (n >= 64 ? 0.5 : 0.3);
    for (int mb : {32, 16}) {
      for (int round = 0; round < rounds; ++round) {
        for (int64_t t : threads) {
          reg("BM_Limit", BM_Limit, n, t, mb, min_time);
          reg("BM_LimitPf", BM_LimitPf, n, t, mb, min_time);
          reg("BM_AdamW", BM_AdamW, n, t, mb, min_time);
          if (n == 16 || n == 64) reg("BM_AdamW_f32grad", BM_AdamW_f32grad, n, t, mb, min_time);
        }
      }
    }
    if (n == 16 || n == 64) {
      for (int64_t t : threads) {
        for (int gb : {32, 16}) reg("BM_GradStats", BM_GradStats, n, t, gb, 0.3);
      }
    }
  }
  const std::string ab = take_flag(&argc, argv, "--ab");
  if (!ab.empty()) {
    ab_table(sizes, threads, std::atoi(ab.c_str()));
    return 0;
  }
  const std::string pairs = take_flag(&argc, argv, "--pairs");
  if (!pairs.empty()) {
    pairs_table(sizes, threads, std::atoi(pairs.c_str()));
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  Collector c;
  benchmark::RunSpecifiedBenchmarks(&c);
  print_summary(c, sizes, threads, rounds);
  benchmark::Shutdown();
  return 0;
}
