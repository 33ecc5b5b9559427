// Run-time choice of the GEMM implementation (see gemm.h).
#include "kernels/cpu/gemm.h"

namespace strata::cpu {
namespace {

using GemmFn = void (*)(const GemmArgs&);

struct Choice {
  GemmFn fn;
  const char* name;
};

Choice choose() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return {&avx2::gemm, "avx2"};
  }
  return {&baseline::gemm, "baseline"};
}

const Choice& choice() {
  static const Choice c = choose();
  return c;
}

}  // namespace

void gemm(const GemmArgs& g) { choice().fn(g); }
const char* gemm_isa() { return choice().name; }

}  // namespace strata::cpu
