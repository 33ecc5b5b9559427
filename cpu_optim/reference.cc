// Scalar reference optimizers: the definition of the numbers the fast paths must match.
#include <cmath>

#include "strata/optimizer.h"

namespace strata {

const char* optimizer_kind_name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdamW:
      return "AdamW";
    case OptimizerKind::kAdagrad:
      return "Adagrad";
    case OptimizerKind::kLion:
      return "Lion";
  }
  return "?";
}

void optimizer_step_reference(const OptimizerHyper& h, const ShardState& s) {
  const float b1 = h.beta1, b2 = h.beta2;
  float bc1 = 1.0f, bc2 = 1.0f;
  if (h.bias_correction) {
    // 1 - beta^t in fp64, rounded once: in fp32, pow's rounding error is amplified by the
    // cancellation (at t = 2, beta2 = 0.999, by 500x, a 1.5e-5 relative error in the step).
    bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), static_cast<double>(h.step)));
    bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), static_cast<double>(h.step)));
  }
  const float step_size = h.lr / bc1;
  // 1/sqrt(bc2) once per step: the per-element denominator is then a multiply, not a divide.
  const float inv_bc2_sqrt = 1.0f / std::sqrt(bc2);
  const float* master_src = s.master_src ? s.master_src : s.master;
  const void* m_src = s.m_src ? s.m_src : s.m;
  const void* v_src = s.v_src ? s.v_src : s.v;
  for (size_t i = 0; i < s.n; ++i) {
    float g = load_f32(s.grad, s.grad_dtype, i) * s.grad_mult;
    float p = master_src[i];
    switch (h.kind) {
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW: {
        if (h.kind == OptimizerKind::kAdam && h.weight_decay != 0.0f) g += h.weight_decay * p;
        float m = load_f32(m_src, s.moment_dtype, i);
        float v = load_f32(v_src, s.moment_dtype, i);
        m = b1 * m + (1.0f - b1) * g;
        v = b2 * v + (1.0f - b2) * g * g;
        float denom = std::sqrt(v) * inv_bc2_sqrt + h.eps;
        if (h.kind == OptimizerKind::kAdamW && h.weight_decay != 0.0f) {
          p -= h.lr * h.weight_decay * p;
        }
        p -= step_size * (m / denom);
        store_f32(s.m, s.moment_dtype, i, m);
        store_f32(s.v, s.moment_dtype, i, v);
        break;
      }
      case OptimizerKind::kAdagrad: {
        if (h.weight_decay != 0.0f) g += h.weight_decay * p;
        float v = load_f32(v_src, s.moment_dtype, i) + g * g;
        p -= h.lr * g / (std::sqrt(v) + h.eps);
        store_f32(s.v, s.moment_dtype, i, v);
        break;
      }
      case OptimizerKind::kLion: {
        float m = load_f32(m_src, s.moment_dtype, i);
        float c = b1 * m + (1.0f - b1) * g;
        float sgn = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
        p -= h.lr * (sgn + h.weight_decay * p);
        store_f32(s.m, s.moment_dtype, i, b2 * m + (1.0f - b2) * g);
        break;
      }
    }
    s.master[i] = p;
    if (s.lp_out) store_f32(s.lp_out, s.lp_dtype, i, p);
  }
}

GradStats grad_stats_reference(const void* grad, DType dtype, size_t n) {
  GradStats st;
  for (size_t i = 0; i < n; ++i) {
    double g = load_f32(grad, dtype, i);
    if (!std::isfinite(g)) st.nonfinite = true;
    st.norm_sq += g * g;
  }
  return st;
}

}  // namespace strata
