// The optimizer step on one contiguous shard of parameters, and the gradient statistics
// (global norm, inf/nan) that decide clipping and overflow skipping.
//
// One call steps one shard in place: fp32 master weights and the moments are read and written
// back (or, with ShardState's *_src set, read from there and written to master/m/v); the gradient
// is read (fp32, bf16 or fp16) and multiplied by `grad_mult` first (the loss-scale unscale times
// the clip coefficient); the new low-precision parameters, if `lp_out` is set, are written there
// (round to nearest even). Decoupled weight decay for AdamW, L2 added to the gradient for Adam.
//
// optimizer_step_reference() is the plain scalar loop: the definition of the numbers. The fast
// path (cpu_optim/, run-time ISA dispatch) must match it within the tolerances in its tests.
// Thread safety: calls on disjoint shards may run concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/dtype.h"

namespace strata {

enum class OptimizerKind { kAdam, kAdamW, kAdagrad, kLion };
const char* optimizer_kind_name(OptimizerKind k);

// What an optimizer keeps between steps in ShardState's m and v, as a checkpoint records it
// (CheckpointMeta::optimizer_state). Adam and AdamW keep the same state (first and second
// moments), so either takes over the other's, as in PyTorch and DeepSpeed; Adagrad keeps sums
// of squared gradients in v and Lion a momentum in m, which no other optimizer can step from.
struct OptimizerState {
  const char* name;        // as recorded: "adam", "adagrad" or "lion"
  const char* optimizers;  // the optimizer.type values that keep it
  const char* holds;       // what m and v hold
};
inline constexpr OptimizerState kOptimizerStates[] = {
    {"adam", "AdamW or Adam", "first and second moments"},
    {"adagrad", "Adagrad", "sums of squared gradients"},
    {"lion", "Lion", "a momentum"},
};
// The state `k` keeps.
constexpr const OptimizerState& optimizer_state(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::kAdagrad:
      return kOptimizerStates[1];
    case OptimizerKind::kLion:
      return kOptimizerStates[2];
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      break;
  }
  return kOptimizerStates[0];
}
// The state recorded as `name`, or null when no optimizer keeps one by that name.
constexpr const OptimizerState* find_optimizer_state(std::string_view name) {
  for (const OptimizerState& s : kOptimizerStates) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

struct OptimizerHyper {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  int64_t step = 1;  // 1-based step count, for Adam's bias correction
  bool bias_correction = true;
};

struct ShardState {
  size_t n = 0;                // elements in the shard
  const void* grad = nullptr;  // [n] gradient
  DType grad_dtype = DType::kF32;
  float grad_mult = 1.0f;            // grad := grad * grad_mult before use
  float* master = nullptr;           // [n] fp32 master weights, updated in place
  void* m = nullptr;                 // [n] first moment (Adam/AdamW/Lion), in place
  void* v = nullptr;                 // [n] second moment (Adam/AdamW/Adagrad), in place
  DType moment_dtype = DType::kF32;  // fp32 or bf16
  void* lp_out = nullptr;            // [n] new low-precision params, or null
  DType lp_dtype = DType::kBF16;
  // Out of place: when set, the pre-step state is read from these ([n] each, same dtypes) and
  // the new state written to master/m/v, which must not overlap them; the sources are left as
  // they were (a speculative step keeps its undo state this way, with no copy). Null: in place.
  const float* master_src = nullptr;
  const void* m_src = nullptr;
  const void* v_src = nullptr;
};

// Scalar reference step. Never fails: inputs are checked by the caller.
void optimizer_step_reference(const OptimizerHyper& h, const ShardState& s);

// Sum of squares (fp64) and an inf/nan flag over n gradient elements.
struct GradStats {
  double norm_sq = 0.0;
  bool nonfinite = false;
  void merge(const GradStats& o) {
    norm_sq += o.norm_sq;
    nonfinite = nonfinite || o.nonfinite;
  }
};
GradStats grad_stats_reference(const void* grad, DType dtype, size_t n);

}  // namespace strata
