#include "src/train/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace strata {

double learning_rate(const Config& cfg, int64_t step) {
  const SchedulerConfig& s = cfg.scheduler;
  if (s.type.empty()) return cfg.optimizer.lr;
  const double warm = static_cast<double>(std::max<int64_t>(s.warmup_num_steps, 1));
  const double t = static_cast<double>(step);
  auto warm_gamma = [&]() {
    if (s.warmup_type == "linear") return t / warm;
    return std::log(t + 1.0) / std::log(std::max(warm, 2.0));
  };
  if (s.type == "WarmupLR" || s.type == "WarmupDecayLR") {
    // DeepSpeed's WarmupLR warms up over at least 2 steps (warmup_num_steps = max(2, given)):
    // with 0 or 1 the decay would otherwise start above warmup_max_lr.
    const int64_t warm_steps = std::max<int64_t>(s.warmup_num_steps, 2);
    const double w = static_cast<double>(warm_steps);
    double gamma;
    if (step < warm_steps) {
      gamma = s.warmup_type == "linear" ? t / w : std::log(t + 1.0) / std::log(w);
    } else if (s.type == "WarmupLR") {
      gamma = 1.0;
    } else {
      double total = static_cast<double>(s.total_num_steps);
      gamma = std::max(0.0, (total - t) / std::max(1.0, total - w));
    }
    return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
  }
  // WarmupCosineLR
  double ratio;
  if (step < s.warmup_num_steps) {
    ratio = s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * warm_gamma();
  } else {
    double total = static_cast<double>(std::max(s.total_num_steps, s.warmup_num_steps + 1));
    // No warm-up and one step in all: no span to decay over (0 / 0 made the rate NaN).
    double progress = total > warm ? std::min(1.0, (t - warm) / (total - warm)) : t < warm ? 0 : 1;
    ratio = s.cos_min_ratio + (1.0 - s.cos_min_ratio) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  return cfg.optimizer.lr * ratio;
}

LossScaler LossScaler::from_config(const Config& cfg) {
  LossScaler ls;
  if (cfg.fp16.enabled) {
    ls.scale = cfg.fp16.loss_scale > 0 ? cfg.fp16.loss_scale
                                       : std::ldexp(1.0, cfg.fp16.initial_scale_power);
    ls.cur_hysteresis = cfg.fp16.hysteresis;
  }
  return ls;
}

bool LossScaler::update(const Config& cfg, bool overflow) {
  const bool dynamic = cfg.fp16.enabled && cfg.fp16.loss_scale <= 0;
  if (dynamic) {
    if (overflow) {
      if (cfg.fp16.hysteresis == 1 || cur_hysteresis == 1) {
        if (scale <= cfg.fp16.min_loss_scale) {
          ++floor_overflows;  // nothing left to halve: check() stops the run
        } else {
          scale = std::max(scale / 2.0, cfg.fp16.min_loss_scale);
        }
      } else {
        --cur_hysteresis;
      }
      last_overflow_iter = cur_iter;
    } else {
      floor_overflows = 0;
      if (cfg.fp16.consecutive_hysteresis) cur_hysteresis = cfg.fp16.hysteresis;
      if ((cur_iter - last_overflow_iter) % cfg.fp16.loss_scale_window == 0) {
        if (!cfg.fp16.consecutive_hysteresis) cur_hysteresis = cfg.fp16.hysteresis;
        scale *= 2.0;
      }
    }
  }
  if (cfg.fp16.enabled && !dynamic) floor_overflows = overflow ? floor_overflows + 1 : 0;
  ++cur_iter;
  return overflow;
}

Status LossScaler::check(const Config& cfg) const {
  if (!cfg.fp16.enabled || floor_overflows == 0) return Status::ok();
  if (cfg.fp16.loss_scale <= 0) {
    return internal_error(fmt::format(
        "the loss overflowed at the minimum loss scale {:g} (fp16.min_loss_scale), its "
        "hysteresis used up: training diverged, or fp16 cannot hold its gradients; lower "
        "optimizer.params.lr, enable gradient_clipping, lower fp16.min_loss_scale, or train in "
        "bf16 (bf16.enabled true, fp16.enabled false)",
        cfg.fp16.min_loss_scale));
  }
  if (floor_overflows < kStaticScaleOverflowLimit) return Status::ok();
  return internal_error(fmt::format(
      "the loss overflowed at the static loss scale {:g} (fp16.loss_scale) on {} steps in a row, "
      "each skipped: lower fp16.loss_scale, or set it to 0 for the dynamic scaler; if a lower "
      "scale overflows too, training diverged: lower optimizer.params.lr or enable "
      "gradient_clipping",
      scale, floor_overflows));
}

}  // namespace strata
