// Portable scalar path: the fused pass with one lane, for any CPU. Compiled with no ISA flags.
#include <cmath>

#include "cpu_optim/step_impl.h"
#include "strata/dtype.h"

namespace strata::cpu_optim_internal {
namespace {

struct ScalarOps {
  static constexpr size_t W = 1;
  static constexpr int kUnroll = 1;
  using F = float;
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F sign(F c) { return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f); }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static void stream(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  using H = uint16_t;
  static H to_bf16(F x) { return f32_to_bf16(x); }
  static void store_h(uint16_t* p, H h) { *p = h; }
  static void stream_h(uint16_t* p, H h) { *p = h; }
  static constexpr bool kBf16Fast = false;
  static constexpr bool kBf16Pairs = false;
  static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static void store_f16(uint16_t* p, F x) { *p = f32_to_f16(x); }
  static void stream_f16(uint16_t* p, F x) { *p = f32_to_f16(x); }
  static constexpr size_t kPrefetchElems = 0;  // hardware prefetch only
  static void prefetch(const void*) {}
  static void fence() {}

  struct Acc {
    double d[kStatsLanes];
  };
  static void acc_load(Acc& a, const double* lanes) {
    for (int k = 0; k < kStatsLanes; ++k) a.d[k] = lanes[k];
  }
  static void acc_add(Acc& a, size_t j, F x) {
    const double d = x;
    a.d[j] += d * d;
  }
  static void acc_store(const Acc& a, double* lanes) {
    for (int k = 0; k < kStatsLanes; ++k) lanes[k] = a.d[k];
  }
};

}  // namespace

const IsaKernels& scalar_kernels() {
  static const IsaKernels t = make_table<ScalarOps>();
  return t;
}

}  // namespace strata::cpu_optim_internal
