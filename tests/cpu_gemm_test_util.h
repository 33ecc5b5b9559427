// What the CPU kernel tests of the linear layer share (tests/cpu_kernels_test.cc,
// tests/cpu_gemm_paths_test.cc): the double-precision matmul and its gradients (llm.c
// train_gpt2.c math), and the GEMM paths (kernels/cpu/gemm.h) this build and CPU can run.
#pragma once

#include <vector>

#include "kernels/cpu/gemm.h"
#include "tests/kernel_test_util.h"

namespace strata::kernel_test {

// y[n][o] = b[o] + sum_c x[n][c] * w[o][c]; `b` may be null.
inline Vec ref_matmul(const Vec& x, const Vec& w, const Vec* b, int N, int C, int OC) {
  Vec y(size_t(N) * OC);
  for (int n = 0; n < N; ++n) {
    for (int o = 0; o < OC; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (int c = 0; c < C; ++c) s += x[size_t(n) * C + c] * w[size_t(o) * C + c];
      y[size_t(n) * OC + o] = s;
    }
  }
  return y;
}

struct MmGrad {
  Vec dx, dw, db;
};
inline MmGrad ref_matmul_grad(const Vec& dy, const Vec& x, const Vec& w, int N, int C, int OC) {
  MmGrad g{Vec(size_t(N) * C, 0.0), Vec(size_t(OC) * C, 0.0), Vec(OC, 0.0)};
  for (int n = 0; n < N; ++n) {
    for (int o = 0; o < OC; ++o) {
      double d = dy[size_t(n) * OC + o];
      g.db[o] += d;
      for (int c = 0; c < C; ++c) {
        g.dx[size_t(n) * C + c] += d * w[size_t(o) * C + c];
        g.dw[size_t(o) * C + c] += d * x[size_t(n) * C + c];
      }
    }
  }
  return g;
}

// Every GEMM path (gemm.h) this build and CPU can run: the ops that call the GEMM are checked
// on each (a ScopedGemmPath forces it), whatever STRATA_CPU_ISA picked for the process.
inline std::vector<cpu::GemmPath> available_gemm_paths() {
  std::vector<cpu::GemmPath> out;
  for (cpu::GemmPath p : {cpu::GemmPath::kAvx2, cpu::GemmPath::kOneDnn, cpu::GemmPath::kBaseline}) {
    if (cpu::gemm_path_available(p)) out.push_back(p);
  }
  return out;
}

}  // namespace strata::kernel_test
