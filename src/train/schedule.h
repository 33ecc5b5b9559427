// Learning-rate schedules and the fp16 dynamic loss scaler, with DeepSpeed's semantics.
#pragma once

#include <cstdint>

#include "strata/config.h"
#include "strata/status.h"

namespace strata {

// Learning rate for optimizer step `step` (0-based count of steps taken before this one).
//   none           : optimizer.params.lr
//   WarmupLR       : min + (max-min)*gamma, gamma = log(step+1)/log(warmup) ("log") or
//                    step/warmup ("linear") during warmup, then 1.
//   WarmupDecayLR  : as WarmupLR, then linear decay to 0 at total_num_steps.
//   WarmupCosineLR : lr * ratio; ratio warms from warmup_min_ratio to 1, then follows a cosine
//                    from 1 down to cos_min_ratio at total_num_steps.
double learning_rate(const Config& cfg, int64_t step);

// Overflows in a row at a static loss scale (fp16.loss_scale > 0) after which the run stops.
// DeepSpeed skips such steps forever; a scale that overflowed this many batches in a row will
// not stop overflowing, and each skip costs a whole forward and backward for nothing.
inline constexpr int64_t kStaticScaleOverflowLimit = 20;

// Steps in a row whose loss is inf or nan after which an fp16 run stops as diverged. The loss
// scale multiplies only the backward's seed, so it cannot bring a forward's loss back: one batch
// may overflow fp16 activations (the step is skipped, as DeepSpeed does), but losses that stay
// non-finite over batches the skipped steps left the weights unchanged for come from the
// weights. bf16 and fp32 runs stop at the first.
inline constexpr int64_t kFp16NonfiniteLossLimit = 3;

// DeepSpeed's DynamicLossScaler (fp16): initial 2^initial_scale_power; an overflow skips the
// step and, once `hysteresis` overflows have been absorbed, halves the scale (not below
// min_loss_scale); `loss_scale_window` clean steps since the last overflow double it. A static
// scale (fp16.loss_scale > 0) never changes; bf16/fp32 use scale 1.
//
// When the scale can go no lower, overflows stop the run (check()): the dynamic scale that
// overflows at min_loss_scale where it would halve (DeepSpeed's raise_error_at_min_scale, its
// default; a scale already below the floor, from an initial_scale_power under it, counts as at
// the floor), or kStaticScaleOverflowLimit overflows in a row at a static scale.
struct LossScaler {
  double scale = 1.0;
  int64_t cur_iter = 0;
  int64_t last_overflow_iter = -1;
  int cur_hysteresis = 1;
  // Overflows in a row at a scale that does not go lower: the dynamic one at min_loss_scale with
  // its hysteresis used up, or a static one. Not kept in checkpoints: a resumed run counts
  // afresh.
  int64_t floor_overflows = 0;

  static LossScaler from_config(const Config& cfg);
  // Records the outcome of a step. Returns true if the step must be skipped.
  bool update(const Config& cfg, bool overflow);
  // OK while the scaler can go on; after the update that left no scale to try, the error the
  // run stops with, naming the scale, its key and the ways out.
  [[nodiscard]] Status check(const Config& cfg) const;
};

}  // namespace strata
