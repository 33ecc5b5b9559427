// The step (Run::run_step): the program's passes over the micro-batches (forward groups and
// backward groups), the optimizer step after backward (exact, deferred, speculated or
// delayed), and the schedule's choices settled on every rank alike.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "src/tiers/tier_manager.h"
#include "src/train/data.h"
#include "src/train/run.h"
#include "src/train/schedule.h"
#include "strata/log.h"

namespace strata::run_detail {

Status Run::run_program(Pass pass, int micro, bool last, bool speculate, const MicroBatch* mbs,
                        int n, size_t begin, size_t end) {
  const Program& program = arch_->program(pass);
  const std::vector<ProgramOp>& ops = program.ops;
  end = std::min(end, ops.size());
  if (n > 1 && parts_.size() < size_t(n))
    parts_.resize(size_t(n), std::vector<float*>(grads_.size()));
  const char* what = pass == Pass::kTrain ? "forward/backward" : "eval forward";
  // Segment by segment (segment_starts), each run once per micro-batch of the group.
  for (size_t s = begin; s < end;) {
    size_t e = s + 1;
    while (e < end && !segment_starts(program, e, begin)) ++e;
    for (int k = 0; k < n; ++k) {
      const bool first = k == 0, final = k == n - 1;
      if (n > 1) model_->select(k);
      std::vector<float*>& grads = first ? grads_ : parts_[size_t(k)];
      const ModuleBindings bound{params_, grads};
      for (size_t i = s; i < e; ++i) {
        const ProgramOp& op = ops[i];
        const int m = op.module;
        switch (op.kind) {
          case ProgramOp::kAcquireParams:
            if (first) {
              STRATA_ASSIGN_OR_RETURN(params_[size_t(m)], tm_->acquire_params(m), what);
            }
            break;
          case ProgramOp::kReleaseParams:
            if (final) {
              tm_->release_params(m);
              params_[size_t(m)] = nullptr;
            }
            break;
          case ProgramOp::kAcquireGrads:
            if (first) {
              STRATA_ASSIGN_OR_RETURN(grads_[size_t(m)], tm_->acquire_grads(m, micro), "backward");
            } else if (grads[size_t(m)] == nullptr) {
              STRATA_ASSIGN_OR_RETURN(grads[size_t(m)], tm_->acquire_grad_part(m), "backward");
            }
            break;
          case ProgramOp::kDrainGrads:
            if (!first) {  // a backward group's further micro-batch: into the first's buffer
              tm_->add_grad_part(m, grads[size_t(m)]);
              grads[size_t(m)] = nullptr;
            }
            if (!final) break;
            tm_->drain_grads(m, micro, last);
            grads_[size_t(m)] = nullptr;
            // Under the last micro-batch's backward, step the modules whose gradients are final.
            if (speculate && last &&
                (i + 1 == ops.size() || ops[i + 1].kind != ProgramOp::kDrainGrads)) {
              STRATA_RETURN_IF_ERROR(tm_->step_ready(/*wait_all=*/false), what);
            }
            break;
          case ProgramOp::kCompute:
            model_->compute(op, bound, mbs[k]);
            break;
        }
      }
    }
    s = e;
  }
  return Status::ok();
}

const int32_t* Run::batch_positions() {
  if (!data_->train_positions()) return nullptr;
  ++positioned_batches_;
  if (positions_are_plain(pos_.data(), B_, T_)) return nullptr;
  ++per_sequence_batches_;
  return pos_.data();
}

Status Run::forward_backward(float dloss, bool speculate, float* aux) {
  std::vector<MicroBatch> mbs;
  for (int micro = 0; micro < accum_; ++micro) {
    const bool dropout = !(preference() && cfg_.dpo.disable_dropout);
    mbs.push_back({dloss, losses_.data() + size_t(micro) * B_ * T_, nullptr, aux + micro,
                   dropout ? training_dropout_key(cfg_.train.seed, step_, micro, rank_) : 0,
                   /*losses_out_pinned=*/true});
  }
  if (preference()) weigh_preference_rows(scaler_.scale, &mbs);
  // Forward groups (strata.grouped_forwards): the micro-batches of a group run their forwards
  // together, module by module, each on its own activation slot; then each its head and
  // backward, in order, as an ungrouped step would (the same bits) — or, with backward groups,
  // its heads and then their backwards together, module by module.
  const size_t forward_end = arch_->program(Pass::kTrain).forward_end;
  const int group = forward_end > 0 ? std::max(1, tm_->forward_group()) : 1;
  for (int first = 0; first < accum_; first += group) {
    const int n = std::min(group, accum_ - first);
    for (int k = 0; k < n; ++k) {
      data_->train_batch(cfg_.train.seed, step_, first + k, rank_, B_, T_, tok_.data(), tgt_.data(),
                         pos_.data());
      model_->select(k);
      model_->begin_batch(tok_.data(), tgt_.data(), batch_positions());
    }
    tm_->begin_micro(first);
    const std::string group_name =
        fmt::format("micro-batches {}-{} of {}", first + 1, first + n, accum_);
    if (n > 1 && first == 0 && tm_->backward_grouped()) {
      // A backward group (strata.grouped_backwards): the whole program, segment by segment,
      // each segment run for every micro-batch of the group in turn; the further micro-batches'
      // gradients in parts added to the first's on the device, drained once. Only the first
      // group's: a later group's sums must be added to the accumulator one micro-batch at a
      // time (((g0 + g1) + g2) + g3, not (g0 + g1) + (g2 + g3)), so its backwards run one by one.
      STRATA_RETURN_IF_ERROR(
          run_program(Pass::kTrain, first, first + n == accum_, speculate, &mbs[size_t(first)], n),
          group_name);
      for (int k = 0; k < n; ++k) {
        if (opts_.mid_step) opts_.mid_step(step_, first + k);
      }
      continue;
    }
    if (n > 1) {
      STRATA_RETURN_IF_ERROR(run_program(Pass::kTrain, first, false, speculate, &mbs[size_t(first)],
                                         n, 0, forward_end),
                             group_name);
    }
    for (int k = 0; k < n; ++k) {
      const int micro = first + k;
      const bool last = micro == accum_ - 1;
      model_->select(k);
      if (k > 0) tm_->begin_micro(micro);
      STRATA_RETURN_IF_ERROR(run_program(Pass::kTrain, micro, last, speculate, &mbs[size_t(micro)],
                                         1, n > 1 ? forward_end : 0),
                             fmt::format("micro-batch {} of {}", micro + 1, accum_));
      if (opts_.mid_step) opts_.mid_step(step_, micro);
    }
  }
  return Status::ok();
}

Status Run::step_optimizer(const GradStats& stats, double scale, bool delayed, bool speculate,
                           bool not_under_backward) {
  last_skipped_ = scaler_.update(cfg_, stats.nonfinite);
  last_grad_norm_ = std::sqrt(stats.norm_sq) / scale;
  if (!last_skipped_) {
    double coef = 1.0;
    if (cfg_.gradient_clipping > 0) {
      double c = cfg_.gradient_clipping / (last_grad_norm_ + 1e-6);
      if (c < 1.0) coef = c;
    }
    hyper_.lr = static_cast<float>(learning_rate(cfg_, opt_steps_));
    hyper_.step = opt_steps_ + 1;
    const float mult = static_cast<float>(coef / scale);
    last_clipped_ = coef < 1.0;
    if (delayed) {
      STRATA_RETURN_IF_ERROR(tm_->start_delayed_update(hyper_, mult),
                             "starting the delayed update");
    } else {
      // Keeps what was stepped under backward when (lr, step, mult) match, else redoes it;
      // with the overlap, the modules not stepped yet are stepped as the next forward needs
      // them (deferred: exact whatever the clipping).
      const bool defer = speculate && (!not_under_backward || defer_choice_.defer());
      STRATA_RETURN_IF_ERROR(tm_->optimizer_step(hyper_, mult, defer),
                             "");  // says "optimizer step" itself
    }
    ++opt_steps_;
  } else {
    STRATA_RETURN_IF_ERROR(tm_->skip_step(), "skipping the step (non-finite gradients)");
  }
  // An overflow the scale can no longer answer stops the run, the step skipped like any other.
  return scaler_.check(cfg_);
}

Result<double> Run::run_step() {
  const auto t0 = Clock::now();
  const double scale = scaler_.scale;
  // The loss is the mean over the GLOBAL batch: each rank's gradients are 1/world of the
  // average, and the reduce-scatter sums them. With a loss mask, the mean over the targets that
  // count in the whole global batch (every micro-batch of every rank: transformers' Trainer's
  // num_items_in_batch with average_tokens_across_devices); every rank counts them itself (the
  // batches are a function of the step).
  const int64_t targets = global_train_targets();
  const float dloss = static_cast<float>(scale / double(targets));
  // The optimizer's schedule for this step (docs/ARCHITECTURE.md, "The optimizer under
  // backward"): delayed (one step stale) after the warm-up, else exact — stepped module by
  // module under the last micro-batch's backward as if no clipping applies and no overflow
  // occurred (validated below), or after backward when strata.optimizer.overlap is false.
  const bool delayed = cfg_.strata.delayed_update && step_ >= cfg_.strata.delayed_update_warmup;
  const bool speculate = cfg_.strata.optimizer_overlap && !delayed;
  const float unclipped_mult = static_cast<float>(1.0 / scale);
  // A step after one that clipped or overflowed likely does too: then the state is only read
  // ahead under backward and stepped after validation, instead of stepped twice.
  // A step after one that did not clip is stepped under backward unless speculate_choice_ says
  // otherwise; then, as after one that clipped, nothing is stepped under backward and where its
  // optimizer runs is defer_choice_'s.
  const bool may_speculate = speculate && !last_clipped_ && !last_skipped_;
  const bool under_backward = may_speculate && speculate_choice_.defer();
  if (speculate) {
    OptimizerHyper h = hyper_;
    h.lr = static_cast<float>(learning_rate(cfg_, opt_steps_));
    h.step = opt_steps_ + 1;
    tm_->begin_speculation(h, unclipped_mult, cfg_.gradient_clipping > 0 || cfg_.fp16.enabled,
                           /*step_modules=*/under_backward);
  }
  const bool not_under_backward = speculate && !under_backward;
  tm_->begin_phase("train");
  std::vector<float> aux(size_t(accum_), -1.0f);
  STRATA_RETURN_IF_ERROR(forward_backward(dloss, speculate, aux.data()), "");
  model_->select(0);
  if (speculate) STRATA_RETURN_IF_ERROR(tm_->step_ready(/*wait_all=*/true), "forward/backward");
  STRATA_RETURN_IF_ERROR(tm_->end_backward(), "forward/backward");
  // The last step's delayed update lands before the next forward.
  STRATA_RETURN_IF_ERROR(tm_->finish_delayed_update(), "the last step's delayed update");
  last_fwd_bwd_s_ = seconds_since(t0);
  double loss_sum = 0;
  for (float l : losses_) loss_sum += l;  // masked-out targets' losses are 0
  const bool masked = data_->train_packed();
  double loss = masked ? loss_sum / double(targets) : loss_sum / (double(B_) * T_ * accum_);
  if (preference()) {
    STRATA_ASSIGN_OR_RETURN(loss, preference_step_loss(), "");
  }
  double aux_sum = 0;
  for (float a : aux) aux_sum += a;
  last_aux_loss_ = aux[0] < 0 ? -1.0 : aux_sum / accum_;

  // A step under backward that stepped part of its modules after backward while their undo
  // room was made ready is not timed by speculate_choice_ (any rank's, so that all agree).
  bool undo_not_ready = under_backward && tm_->undo_not_ready();
  GradStats stats = tm_->grad_stats();
  if (!cfg_.device.simulate.empty()) {
    // The simulated device computes nothing: its norm is the configured one, on every rank.
    const double g = cfg_.device.simulate_grad_norm * scale;
    stats.norm_sq = g * g / world_;
    stats.nonfinite = false;
  }
  if (world_ > 1) {
    // Each rank's norm² covers its own shards; the loss its own rows.
    float sums[3] = {static_cast<float>(loss), static_cast<float>(stats.norm_sq),
                     static_cast<float>(last_aux_loss_)};
    float flags[2] = {stats.nonfinite ? 1.0f : 0.0f, undo_not_ready ? 1.0f : 0.0f};
    STRATA_RETURN_IF_ERROR(reduce(sums, 3, ReduceOp::kSum), "reducing the loss and grad norm");
    if (last_aux_loss_ >= 0) last_aux_loss_ = double(sums[2]) / world_;
    STRATA_RETURN_IF_ERROR(reduce(flags, 2, ReduceOp::kMax), "reducing the overflow flag");
    loss = preference() ? loss : masked ? double(sums[0]) : double(sums[0]) / world_;
    stats.norm_sq = sums[1];
    stats.nonfinite = flags[0] != 0.0f || !std::isfinite(sums[1]);
    undo_not_ready = flags[1] != 0.0f;
  }
  STRATA_RETURN_IF_ERROR(step_optimizer(stats, scale, delayed, speculate, not_under_backward), "");
  STRATA_RETURN_IF_ERROR(tm_->end_phase(), "end of the step");
  const double step_s = opts_.trial_time
                            ? opts_.trial_time(step_, under_backward, seconds_since(t0))
                            : seconds_since(t0);
  if (not_under_backward && defer_choice_.record(step_s)) {
    STRATA_RETURN_IF_ERROR(settle_defer_choice(), "choosing where the optimizer runs");
  }
  if (may_speculate && speculate_choice_.record(step_s, /*settled=*/!undo_not_ready)) {
    STRATA_RETURN_IF_ERROR(settle_speculate_choice(), "choosing whether to step under backward");
  }
  if (step_ == 0 && rank_ == 0 && !cfg_.strata.trace_file.empty() && tm_->trace("train")) {
    std::vector<std::string> names;
    for (size_t m = 0; m < arch_->layout().modules.size(); ++m) {
      names.push_back(tm_->object_name(int(m)));
    }
    std::ofstream(cfg_.strata.trace_file) << tm_->trace("train")->to_jsonl(names);
    log_info("wrote the access trace to {} (strata trace replay --trace {})",
             cfg_.strata.trace_file, cfg_.strata.trace_file);
  }
  ++step_;
  return loss;
}

// The same choice on every rank: the slowest rank's medians decide; m gets them.
Status Run::settle(DeferChoice& choice, float m[2]) {
  m[0] = static_cast<float>(choice.deferred_median());
  m[1] = static_cast<float>(choice.plain_median());
  if (world_ > 1) STRATA_RETURN_IF_ERROR(reduce(m, 2, ReduceOp::kMax), "");
  choice.decide(m[0], m[1]);
  return Status::ok();
}

Status Run::settle_defer_choice() {
  float m[2];
  STRATA_RETURN_IF_ERROR(settle(defer_choice_, m), "");
  if (rank_ == 0) {
    log_info(
        "optimizer: steps that clip ran in {:.2f} s deferred into the next forward and {:.2f} s "
        "stepped after backward: {} from now on (strata.optimizer.defer = \"auto\"; the same "
        "bits either way)",
        m[0], m[1], defer_choice_.defer() ? "deferring" : "stepping after backward");
  }
  return Status::ok();
}

Status Run::settle_speculate_choice() {
  float m[2];
  STRATA_RETURN_IF_ERROR(settle(speculate_choice_, m), "");
  if (rank_ == 0) {
    const int unsettled = speculate_choice_.unsettled();
    log_info(
        "optimizer: steps that did not clip ran in {:.2f} s stepped under backward{} and {:.2f} s "
        "not: {} from now on (strata.optimizer.speculate = \"auto\"; the same bits either way)",
        m[0],
        unsettled > 0
            ? fmt::format(" (timed after {} step(s) that made its undo room ready)", unsettled)
            : std::string(),
        m[1],
        speculate_choice_.defer() ? "stepping under backward" : "stepping as clipped steps do");
  }
  if (!speculate_choice_.defer()) {
    // No step takes undo state from now on: the room the trial's steps took is given back.
    const size_t freed = tm_->release_undo_room();
    if (rank_ == 0 && freed > 0) {
      log_info("host tier: the undo room ({}) given back: nothing is stepped under backward",
               format_bytes(double(freed)));
    }
  }
  return Status::ok();
}

}  // namespace strata::run_detail
