// The optimizer step for device-resident shards: optimizer_step_reference (cpu_optim/
// reference.cc) element for element. Compiled with --fmad=false (kernels/cuda/CMakeLists.txt)
// so that no multiply-add is contracted and the arithmetic is the reference's, operation for
// operation (sqrtf and division are IEEE-rounded by default in nvcc).
//
// The dtypes of grad, moments and low-precision copy are run-time values switched on inside
// the kernel (uniform branches, negligible next to the memory traffic) instead of template
// parameters: 3 x 2 x 4 instantiations would cost build time for nothing.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

struct StepArgs {
  int kind;  // OptimizerKind
  float lr, b1, b2, eps, wd, step_size, inv_bc2_sqrt, grad_mult;
  DType grad_t, moment_t, lp_t;
};

__global__ void optimizer_kernel(StepArgs a, size_t n, const void* grad, float* master, void* m_,
                                 void* v_, void* lp) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    float g = load_dt(grad, a.grad_t, i) * a.grad_mult;
    float p = master[i];
    switch (static_cast<OptimizerKind>(a.kind)) {
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW: {
        const bool adamw = a.kind == int(OptimizerKind::kAdamW);
        if (!adamw && a.wd != 0.0f) g += a.wd * p;
        float m = load_dt(m_, a.moment_t, i);
        float v = load_dt(v_, a.moment_t, i);
        m = a.b1 * m + (1.0f - a.b1) * g;
        v = a.b2 * v + (1.0f - a.b2) * g * g;
        const float denom = sqrtf(v) * a.inv_bc2_sqrt + a.eps;
        if (adamw && a.wd != 0.0f) p -= a.lr * a.wd * p;
        p -= a.step_size * (m / denom);
        store_dt(m_, a.moment_t, i, m);
        store_dt(v_, a.moment_t, i, v);
        break;
      }
      case OptimizerKind::kAdagrad: {
        if (a.wd != 0.0f) g += a.wd * p;
        const float v = load_dt(v_, a.moment_t, i) + g * g;
        p -= a.lr * g / (sqrtf(v) + a.eps);
        store_dt(v_, a.moment_t, i, v);
        break;
      }
      case OptimizerKind::kLion: {
        const float m = load_dt(m_, a.moment_t, i);
        const float c = a.b1 * m + (1.0f - a.b1) * g;
        const float sgn = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
        p -= a.lr * (sgn + a.wd * p);
        store_dt(m_, a.moment_t, i, a.b2 * m + (1.0f - a.b2) * g);
        break;
      }
    }
    master[i] = p;
    if (lp) store_dt(lp, a.lp_t, i, p);
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
  optimizer_kernel<<<grid_for(st.n, 256), 256, 0, s>>>(a, st.n, st.grad, st.master, st.m, st.v,
                                                       st.lp_out);
  STRATA_CUDA_LAUNCH_CHECK("launching the optimizer step");
  return Status::ok();
}

}  // namespace strata
