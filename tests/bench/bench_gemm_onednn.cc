// oneDNN's fp32 matmul against strata's hand AVX2 GEMM (kernels/cpu/gemm_avx2.cc) at the
// linear-layer shapes of configs/bench-25m.json (N = 2 x 128 rows, width 512), one thread.
// A measurement for the choice of GEMM library, not a test and not a dependency: it is
// built by hand where oneDNN is installed (Debian: libdnnl-dev), against an existing build:
//
//   g++ -O3 -std=c++20 -I. -Iinclude tests/bench/bench_gemm_onednn.cc \
//       -o /tmp/bench_gemm_onednn build/libstrata.a -ldnnl -lgomp -lfmt -ltbb -lpthread
//   OMP_NUM_THREADS=1 DNNL_VERBOSE=0 /tmp/bench_gemm_onednn [seconds per case, default 1]
//
// Each case: C = op(A) @ op(B) with the layouts matmul_forward/backward use (forward: x[N,C] @
// W[OC,C]^T; dinp: dout[N,OC] @ W[OC,C]; dweight: dout^T[OC,N] @ x[N,C]); fp32 operands for
// both, plus the hand kernel on bf16 operands (what training runs: widened while packing).
// Reports GFLOP per CPU-second of the process (fair on a loaded machine) and wall GFLOP/s, the
// largest relative difference between the two results, whether oneDNN gave the same bits
// on two calls, and whether its bits at 2 OpenMP threads equal those at 1 (strata's
// onednn GEMM path runs oneDNN at 1 OpenMP thread per TBB worker; see gemm_onednn.cc).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "strata/dtype.h"

namespace {

double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

struct Timing {
  double cpu_gflops, wall_gflops;
};

// Runs f repeatedly for about `seconds` (after one warm-up call).
Timing time_it(const std::function<void()>& f, double flops, double seconds) {
  f();
  int n = 0;
  auto w0 = std::chrono::steady_clock::now();
  double c0 = cpu_seconds(), wall = 0;
  do {
    f();
    ++n;
    wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  } while (wall < seconds);
  double cpu = cpu_seconds() - c0;
  return {flops * n / cpu * 1e-9, flops * n / wall * 1e-9};
}

struct Case {
  const char* name;
  int m, n, k;
  bool trans_a, trans_b;  // A stored [k, m] / B stored [n, k]
};

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 1.0;
  const int N = 256, C = 512;
  const Case cases[] = {
      {"fwd qkv   x[256,512] W[1536,512]^T", N, 3 * C, C, false, true},
      {"fwd fc    x[256,512] W[2048,512]^T", N, 4 * C, C, false, true},
      {"fwd proj  x[256,2048] W[512,2048]^T", N, C, 4 * C, false, true},
      {"dinp qkv  dout[256,1536] W[1536,512]", N, C, 3 * C, false, false},
      {"dinp proj dout[256,512] W[512,2048]", N, 4 * C, C, false, false},
      {"dW qkv    dout^T[1536,256] x[256,512]", 3 * C, C, N, true, false},
      {"dW proj   dout^T[512,256] x[256,2048]", C, 4 * C, N, true, false},
  };
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream strm(eng);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::printf("strata gemm isa: %s; GFLOP per CPU-second (wall GFLOP/s)\n",
              strata::cpu::gemm_isa());
  std::printf(
      "| case | oneDNN fp32 | strata fp32 | strata bf16 | max rel diff | oneDNN "
      "repeatable | oneDNN 2 threads = 1 |\n|---|---|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    std::vector<float> a(size_t(c.m) * c.k), b(size_t(c.k) * c.n);
    for (auto& x : a) x = u(rng);
    for (auto& x : b) x = u(rng);
    std::vector<uint16_t> a16(a.size()), b16(b.size());
    for (size_t i = 0; i < a.size(); ++i) a16[i] = strata::f32_to_bf16(a[i]);
    for (size_t i = 0; i < b.size(); ++i) b16[i] = strata::f32_to_bf16(b[i]);
    std::vector<float> c_dnnl(size_t(c.m) * c.n), c_dnnl2(c_dnnl.size()), c_hand(c_dnnl.size());
    using dt = dnnl::memory::data_type;
    using dims = dnnl::memory::dims;
    // Strides express the transposes: op(A)[i, p] at a[i * k + p], or a[p * m + i].
    dnnl::memory::desc ad({c.m, c.k}, dt::f32, c.trans_a ? dims{1, c.m} : dims{c.k, 1});
    dnnl::memory::desc bd({c.k, c.n}, dt::f32, c.trans_b ? dims{1, c.k} : dims{c.n, 1});
    dnnl::memory::desc cd({c.m, c.n}, dt::f32, dims{c.n, 1});
    // oneDNN 2.x: an op descriptor, then the primitive descriptor for the engine.
    dnnl::matmul prim(dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), eng));
    dnnl::memory am(ad, eng, a.data()), bm(bd, eng, b.data()), cm(cd, eng, c_dnnl.data());
    auto run_dnnl = [&] {
      prim.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
      strm.wait();
    };
    strata::cpu::GemmArgs g{.m = c.m,
                            .n = c.n,
                            .k = c.k,
                            .a = a.data(),
                            .lda = c.trans_a ? c.m : c.k,
                            .trans_a = c.trans_a,
                            .b = b.data(),
                            .ldb = c.trans_b ? c.k : c.n,
                            .trans_b = c.trans_b,
                            .c = c_hand.data(),
                            .ldc = c.n};
    strata::cpu::GemmArgs g16 = g;
    g16.a = a16.data();
    g16.a_type = strata::DType::kBF16;
    g16.b = b16.data();
    g16.b_type = strata::DType::kBF16;
    std::vector<float> c16(c_hand.size());
    g16.c = c16.data();
    const double flops = 2.0 * c.m * c.n * c.k;
    Timing td = time_it(run_dnnl, flops, seconds);
    Timing th = time_it([&] { strata::cpu::gemm(g); }, flops, seconds);
    Timing t16 = time_it([&] { strata::cpu::gemm(g16); }, flops, seconds);
    run_dnnl();
    std::memcpy(c_dnnl2.data(), c_dnnl.data(), c_dnnl.size() * 4);
    run_dnnl();
    const int omp_threads = omp_get_max_threads();
    std::vector<float> c_one(c_dnnl.size());
    omp_set_num_threads(1);
    run_dnnl();
    std::memcpy(c_one.data(), c_dnnl.data(), c_one.size() * 4);
    omp_set_num_threads(2);
    run_dnnl();
    const bool same_threads = std::memcmp(c_one.data(), c_dnnl.data(), c_one.size() * 4) == 0;
    omp_set_num_threads(omp_threads);
    strata::cpu::gemm(g);
    double maxrel = 0;
    for (size_t i = 0; i < c_hand.size(); ++i) {
      maxrel = std::max(
          maxrel, std::fabs(double(c_dnnl[i]) - c_hand[i]) / (std::fabs(double(c_hand[i])) + 1e-3));
    }
    bool same = std::memcmp(c_dnnl.data(), c_dnnl2.data(), c_dnnl.size() * 4) == 0;
    std::printf("| %s | %.1f (%.1f) | %.1f (%.1f) | %.1f (%.1f) | %.1e | %s | %s |\n", c.name,
                td.cpu_gflops, td.wall_gflops, th.cpu_gflops, th.wall_gflops, t16.cpu_gflops,
                t16.wall_gflops, maxrel, same ? "yes" : "no", same_threads ? "yes" : "no");
  }
  return 0;
}
