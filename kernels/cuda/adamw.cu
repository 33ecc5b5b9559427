// The optimizer step for device-resident shards: optimizer_step_reference (cpu_optim/
// reference.cc) element for element. Compiled with --fmad=false (kernels/cuda/CMakeLists.txt)
// so that no multiply-add is contracted and the arithmetic is the reference's, operation for
// operation (sqrtf and division are IEEE-rounded by default in nvcc).
//
// The dtypes of grad, moments and low-precision copy are run-time values switched on inside
// the kernel (uniform branches, negligible next to the memory traffic) instead of template
// parameters: 3 x 2 x 4 instantiations would cost build time for nothing. Where the arrays are
// 16-byte aligned a thread steps four consecutive elements with one access per array.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

struct StepArgs {
  int kind;  // OptimizerKind
  float lr, b1, b2, eps, wd, step_size, inv_bc2_sqrt, grad_mult;
  DType grad_t, moment_t, lp_t;
};

// K consecutive elements of a `t` array from element i (a multiple of K), in one access where K
// is 4 (16 bytes of fp32, 8 of a 16-bit type: the launcher checks the arrays are aligned); the
// conversions are load_dt's and store_dt's, element by element.
template <int K>
__device__ __forceinline__ void load_k(const void* p, DType t, size_t i, float* out) {
  if constexpr (K == 1) {
    out[0] = load_dt(p, t, i);
  } else {
    static_assert(K == 4, "four elements an access");
    if (t == DType::kF32) {
      const uint4 bits = *reinterpret_cast<const uint4*>(static_cast<const float*>(p) + i);
      memcpy(out, &bits, 16);
    } else {
      const uint64_t bits = *reinterpret_cast<const uint64_t*>(static_cast<const uint16_t*>(p) + i);
      for (int j = 0; j < 4; ++j) out[j] = load_dt(&bits, t, size_t(j));
    }
  }
}
template <int K>
__device__ __forceinline__ void store_k(void* p, DType t, size_t i, const float* in) {
  if constexpr (K == 1) {
    store_dt(p, t, i, in[0]);
  } else if (t == DType::kF32) {
    uint4 bits;
    memcpy(&bits, in, 16);
    *reinterpret_cast<uint4*>(static_cast<float*>(p) + i) = bits;
  } else {
    uint64_t bits;
    for (int j = 0; j < 4; ++j) store_dt(&bits, t, size_t(j), in[j]);
    *reinterpret_cast<uint64_t*>(static_cast<uint16_t*>(p) + i) = bits;
  }
}

// One element's step: the reference's arithmetic, operation for operation. g is the gradient
// times grad_mult; m and v are read only by the kinds that keep them.
__device__ __forceinline__ void step_element(const StepArgs& a, float g, float& p, float& m,
                                             float& v) {
  switch (static_cast<OptimizerKind>(a.kind)) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      const bool adamw = a.kind == int(OptimizerKind::kAdamW);
      if (!adamw && a.wd != 0.0f) g += a.wd * p;
      m = a.b1 * m + (1.0f - a.b1) * g;
      v = a.b2 * v + (1.0f - a.b2) * g * g;
      const float denom = sqrtf(v) * a.inv_bc2_sqrt + a.eps;
      if (adamw && a.wd != 0.0f) p -= a.lr * a.wd * p;
      p -= a.step_size * (m / denom);
      break;
    }
    case OptimizerKind::kAdagrad: {
      if (a.wd != 0.0f) g += a.wd * p;
      v = v + g * g;
      p -= a.lr * g / (sqrtf(v) + a.eps);
      break;
    }
    case OptimizerKind::kLion: {
      const float c = a.b1 * m + (1.0f - a.b1) * g;
      const float sgn = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
      p -= a.lr * (sgn + a.wd * p);
      m = a.b2 * m + (1.0f - a.b2) * g;
      break;
    }
  }
}

// Elements i .. i+K-1 (i a multiple of K).
template <int K>
__device__ __forceinline__ void step_elements(const StepArgs& a, size_t i, const void* grad,
                                              float* master, void* m_, void* v_, void* lp) {
  const bool has_m = a.kind != int(OptimizerKind::kAdagrad);
  const bool has_v = a.kind != int(OptimizerKind::kLion);
  float g[K], p[K], m[K] = {}, v[K] = {};
  load_k<K>(grad, a.grad_t, i, g);
  load_k<K>(master, DType::kF32, i, p);
  if (has_m) load_k<K>(m_, a.moment_t, i, m);
  if (has_v) load_k<K>(v_, a.moment_t, i, v);
  for (int j = 0; j < K; ++j) step_element(a, g[j] * a.grad_mult, p[j], m[j], v[j]);
  if (has_m) store_k<K>(m_, a.moment_t, i, m);
  if (has_v) store_k<K>(v_, a.moment_t, i, v);
  store_k<K>(master, DType::kF32, i, p);
  if (lp) store_k<K>(lp, a.lp_t, i, p);
}

// A grid-stride loop over n elements: in fours where `packed` (every array 16-byte aligned),
// then the rest one at a time. Each access of four moves 8-16 bytes a thread where one element
// a thread moved 2-4, so that enough bytes are in flight to stream at the memory's bandwidth.
__global__ void optimizer_kernel(StepArgs a, size_t n, const void* grad, float* master, void* m_,
                                 void* v_, void* lp, bool packed) {
  const size_t t = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t fours = packed ? n / 4 : 0;
  for (size_t q = t; q < fours; q += stride) step_elements<4>(a, q * 4, grad, master, m_, v_, lp);
  for (size_t i = fours * 4 + t; i < n; i += stride) {
    step_elements<1>(a, i, grad, master, m_, v_, lp);
  }
}

}  // namespace

Status cuda_optimizer_step(cudaStream_t s, const OptimizerHyper& h, const ShardState& st) {
  if (st.n == 0) return Status::ok();
  if (st.moment_dtype == DType::kF16) {
    return invalid_argument("optimizer: moments must be fp32 or bf16, got fp16");
  }
  if (st.master_src || st.m_src || st.v_src) {
    // Device-resident state is stepped after backward, never speculated (speculation.cc).
    return invalid_argument("optimizer: an out-of-place step (ShardState::*_src) is host-only");
  }
  // Bias correction on the host, exactly as the reference computes it: 1 - beta^t in fp64,
  // rounded once (in fp32 the cancellation amplifies pow's rounding error).
  float bc1 = 1.0f, bc2 = 1.0f;
  if (h.bias_correction) {
    bc1 = static_cast<float>(1.0 - std::pow(double(h.beta1), double(h.step)));
    bc2 = static_cast<float>(1.0 - std::pow(double(h.beta2), double(h.step)));
  }
  StepArgs a{int(h.kind),  h.lr,           h.beta1,         h.beta2,
             h.eps,        h.weight_decay, h.lr / bc1,      1.0f / std::sqrt(bc2),
             st.grad_mult, st.grad_dtype,  st.moment_dtype, st.lp_dtype};
  const bool packed = packs_aligned({st.grad, st.master, st.m, st.v, st.lp_out});
  optimizer_kernel<<<grid_for(packed ? (st.n + 3) / 4 : st.n, 256), 256, 0, s>>>(
      a, st.n, st.grad, st.master, st.m, st.v, st.lp_out, packed);
  STRATA_CUDA_LAUNCH_CHECK("launching the optimizer step");
  return Status::ok();
}

}  // namespace strata
