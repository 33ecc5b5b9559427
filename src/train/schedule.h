// Learning-rate schedules and the fp16 dynamic loss scaler, with DeepSpeed's semantics.
#pragma once

#include <cstdint>

#include "strata/config.h"

namespace strata {

// Learning rate for optimizer step `step` (0-based count of steps taken before this one).
//   none           : optimizer.lr
//   WarmupLR       : min + (max-min)*gamma, gamma = log(step+1)/log(warmup) ("log") or
//                    step/warmup ("linear") during warmup, then 1.
//   WarmupDecayLR  : as WarmupLR, then linear decay to 0 at total_num_steps.
//   WarmupCosineLR : lr * ratio; ratio warms from warmup_min_ratio to 1, then follows a cosine
//                    from 1 down to cos_min_ratio at total_num_steps.
double learning_rate(const Config& cfg, int64_t step);

// DeepSpeed's DynamicLossScaler (fp16): initial 2^initial_scale_power; an overflow skips the
// step and, once `hysteresis` overflows have been absorbed, halves the scale (not below
// min_loss_scale); `loss_scale_window` clean steps since the last overflow double it. A static
// scale (fp16.loss_scale > 0) never changes; bf16/fp32 use scale 1.
struct LossScaler {
  double scale = 1.0;
  int64_t cur_iter = 0;
  int64_t last_overflow_iter = -1;
  int cur_hysteresis = 1;

  static LossScaler from_config(const Config& cfg);
  // Records the outcome of a step. Returns true if the step must be skipped.
  bool update(const Config& cfg, bool overflow);
};

}  // namespace strata
