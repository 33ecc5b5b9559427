// The run loop (Run::loop, run.h): the steps, with the progress line, the metrics log, the
// monitors, evals, stops and checkpoints between them, then the final checkpoint and export.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "src/base/safe_file.h"
#include "src/hf/export_dir.h"
#include "src/hf/hf_export.h"
#include "src/train/metrics_log.h"
#include "src/train/monitors.h"
#include "src/train/process_memory.h"
#include "src/train/run.h"
#include "src/train/schedule.h"
#include "src/train/step_report.h"
#include "strata/log.h"

namespace strata::run_detail {

double Run::comm_seconds() const {
  double t = 0;
  for (Communicator* c : {comm_.get(), param_comm_.get(), grad_comm_.get()}) {
    if (c) t += c->busy_seconds();
  }
  if (zeropp_) t += zeropp_->busy_seconds();
  return t;
}

std::array<uint64_t, 3> Run::comm_bytes_sent() const {
  std::array<uint64_t, 3> b{0, 0, 0};
  if (param_comm_) b[0] = param_comm_->bytes_sent() + (zeropp_ ? zeropp_->bytes_sent(true) : 0);
  if (grad_comm_) b[1] = grad_comm_->bytes_sent() + (zeropp_ ? zeropp_->bytes_sent(false) : 0);
  b[2] = comm_->bytes_sent();
  return b;
}

std::array<uint64_t, 2> Run::tier_bytes() const {
  return {tm_->stats(Tier::kDevice).bytes_in + tm_->stats(Tier::kDevice).bytes_out,
          tm_->stats(Tier::kNvme).bytes_queued};
}

StepWindow Run::step_window(const TierTimes& tt, Meters* mark) const {
  const Meters now = meters();
  StepWindow s;
  s.steps = 1;
  s.comm_s = now.comm_s - mark->comm_s;
  for (size_t i = 0; i < s.sent.size(); ++i) s.sent[i] = now.sent[i] - mark->sent[i];
  s.fwd_bwd_s = last_fwd_bwd_s_;
  s.optimizer_s = tt.schedule.optimizer_s;
  s.io_wait_s = tt.io_wait_s;
  s.fetch_wait_s = tt.schedule.compute_wait_s;
  s.optimizer_hidden_s = tt.schedule.optimizer_hidden_s;
  s.cpu_optimizer_s = tt.schedule.cpu_optimizer_s;
  s.cpu_optimizer_params = tt.schedule.cpu_optimizer_params;
  s.device_bytes = now.bytes[0] - mark->bytes[0];
  s.nvme_bytes = now.bytes[1] - mark->bytes[1];
  *mark = now;
  return s;
}

void Run::add_step(const TierTimes& tt, double loss, TrainResult* out) const {
  TrainResult& r = *out;
  r.schedule += tt.schedule;
  if (cfg_.strata.delayed_update && step_ > cfg_.strata.delayed_update_warmup) {
    r.approximate = true;
  }
  r.fwd_bwd_s += last_fwd_bwd_s_;
  r.io_wait_s += tt.io_wait_s;
  r.losses.push_back(loss);
  if (preference()) r.accuracies.push_back(last_dpo_.accuracy);
  const ScheduleCounts& c = tt.schedule;
  r.optimizer_schedule.push_back(c.rollbacks > 0                        ? 2
                                 : c.modules_stepped_under_backward > 0 ? 1
                                 : c.modules_deferred > 0               ? 3
                                                                        : 0);
  if (last_skipped_) ++r.skipped_steps;
  r.step_skipped.push_back(last_skipped_ ? 1 : 0);
}

Status Run::finish_run(Clock::time_point t0, int64_t tokens_per_step, TrainResult* out) {
  TrainResult& r = *out;
  if (profiler_ && !r.op_profile && rank_ == 0) {
    log_warn(
        "flops_profiler: nothing profiled: its step {} (profile_step {}) was not run here (steps "
        "{} to {}); set flops_profiler.profile_step to one of this run's steps minus one",
        cfg_.flops_profiler.profile_step + 1, cfg_.flops_profiler.profile_step, r.start_step + 1,
        step_);
  }
  // The last step's deferred optimizer pass (if any) runs now, before anything reads the state.
  STRATA_RETURN_IF_ERROR(tm_->finish_pending_step(), "the last optimizer step");
  if (!r.stopped_early && cfg_.train.final_checkpoint) {
    STRATA_RETURN_IF_ERROR(save_checkpoint(step_, &r.last_checkpoint), "final checkpoint");
    if (!cfg_.train.export_dir.empty() && rank_ == 0) {
      const auto te = Clock::now();
      HfExportOptions options;
      options.progress = true;
      Status st = export_as_owner(export_target(step_), [&] {
        return export_checkpoint(r.last_checkpoint, cfg_.model, cfg_.train.export_dir, options);
      });
      if (!st.is_ok()) {
        return Status(
            st.code(),
            fmt::format("exporting to train.export_dir failed: {}\n  the training is done and its "
                        "checkpoint {} is saved; once the cause is fixed, finish the export "
                        "with: strata export --config <this run's config> --checkpoint {} --out {}",
                        st.message(), r.last_checkpoint, r.last_checkpoint, cfg_.train.export_dir));
      }
      log_info("exported {} to {} (Hugging Face format) in {:.2f} s", r.last_checkpoint,
               cfg_.train.export_dir, seconds_since(te));
    }
  }
  r.end_step = step_;
  r.loss_scale = scaler_.scale;
  r.weights_crc = tm_->weights_crc();
  r.param_fetches = tm_->stats(Tier::kDevice).fetches;
  r.param_prefetches = tm_->stats(Tier::kDevice).prefetches;
  r.grad_reductions = tm_->stats(Tier::kDevice).grad_reductions;
  r.grad_shared_reductions = tm_->stats(Tier::kDevice).grad_shared_reductions;
  for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    const TierStats ts = tm_->stats(t);
    r.tiers.push_back({tier_name(t), ts.capacity, ts.peak, ts.bytes_in, ts.bytes_out, ts.current,
                       ts.undo_room, ts.undo_given_back});
  }
  r.peak_rss = peak_rss_bytes();
  r.end_rss = proc_status_bytes("VmRSS:");
  r.base_rss = base_rss_;
  r.device_in_rss = dev_->host_addressable();
  r.micro_batches_with_positions = positioned_batches_;
  r.micro_batches_per_sequence = per_sequence_batches_;
  const double secs = seconds_since(t0);
  r.tokens_per_s = double(tokens_per_step * (step_ - r.start_step)) / std::max(secs, 1e-9);
  return Status::ok();
}

Result<double> Run::profiled_step(TrainResult* r) {
  const bool profiling = profiler_ && step_ == cfg_.flops_profiler.profile_step;
  if (profiling) profiler_->start(step_ + 1);
  STRATA_ASSIGN_OR_RETURN(double loss, run_step(), "");
  if (profiling) STRATA_RETURN_IF_ERROR(report_profile(r), "flops_profiler");
  return loss;
}

Status Run::report_profile(TrainResult* r) {
  STRATA_ASSIGN_OR_RETURN(OpProfile p, profiler_->stop(), fmt::format("step {}", step_));
  if (rank_ == 0) {
    const std::string table = format_op_profile(p);
    log_info("{}", table);
    const std::string& path = cfg_.flops_profiler.output_file;
    if (!path.empty()) {
      // The run goes on: a lost profile costs no training.
      Status st = write_file_atomically(path, table, 0644);
      if (!st.is_ok()) {
        log_warn("flops_profiler.output_file {} not written ({}); the table is in the log", path,
                 st.message());
      }
    }
  }
  r->op_profile = std::move(p);
  return Status::ok();
}

Result<TrainResult> Run::loop() {
  TrainResult r;
  r.rank = rank_;
  r.world_size = world_;
  r.forward_group = tm_->forward_group();
  r.start_step = step_;
  const int64_t total = cfg_.train.steps;
  const int64_t print_every = std::max<int64_t>(1, cfg_.steps_per_print);
  std::string log_path = cfg_.train.log_file.empty() ? cfg_.train.checkpoint_dir + "/metrics.jsonl"
                                                     : cfg_.train.log_file;
  // Only rank 0 reports: progress lines and the JSONL log (every rank's numbers are global).
  // A failed metrics write is a loud warning and r.metrics_error (the CLI exits 1), never a
  // lost checkpoint.
  const bool report = rank_ == 0;
  MetricsLog jsonl;
  Monitors monitors;
  if (report) {
    // Appended to, never truncated: each run's lines follow one naming its lineage.
    STRATA_RETURN_IF_ERROR(jsonl.open(log_path, /*append=*/true), "");
    jsonl.write_line(nlohmann::json{{"run_id", run_id_}, {"start_step", step_}}.dump()).ignore();
    STRATA_ASSIGN_OR_RETURN(monitors, Monitors::open(cfg_), "");
  }
  const int64_t log_every = std::max<int64_t>(1, cfg_.train.log_interval);

  bool eval_cut = false;  // a stop signal left the last eval off (one rank: run_eval.cc)
  auto do_eval = [&](int64_t step) -> Status {
    STRATA_ASSIGN_OR_RETURN(std::optional<double> cut_or_loss, eval_loss(), "eval");
    eval_cut = !cut_or_loss;
    if (!cut_or_loss) {
      log_info("eval at step {} left off: stopping", step);
      return Status::ok();
    }
    const double el = *cut_or_loss;
    r.eval_losses.emplace_back(step, el);
    if (preference()) r.eval_accuracies.emplace_back(step, last_eval_dpo_.accuracy);
    if (!report) return Status::ok();
    nlohmann::json rec{{"step", step}, {"eval_loss", el}};
    std::string rewards;
    if (preference()) {
      const DpoMetrics& m = last_eval_dpo_;
      rec["eval_rewards/chosen"] = m.reward_chosen;
      rec["eval_rewards/rejected"] = m.reward_rejected;
      rec["eval_rewards/accuracies"] = m.accuracy;
      rec["eval_rewards/margins"] = m.margin();
      rec["eval_logps/chosen"] = m.logp_chosen;
      rec["eval_logps/rejected"] = m.logp_rejected;
      rewards = fmt::format(" | acc {:.2f} margin {:.3f}", m.accuracy, m.margin());
    }
    if (opts_.progress) {
      std::printf("step %5lld/%lld | eval loss %.4f%s\n", (long long)step, (long long)total, el,
                  rewards.c_str());
    }
    jsonl.write_line(rec.dump()).ignore();
    Scalars scalars{{"eval_loss", el}};
    if (preference()) scalars.push_back({"eval_rewards/accuracies", last_eval_dpo_.accuracy});
    monitors.add(step, scalars);
    return Status::ok();
  };
  if (step_ == 0 && cfg_.train.eval_interval > 0) {
    STRATA_RETURN_IF_ERROR(do_eval(0), "eval before step 1");
    if (eval_cut) {
      // The stop came before step 1: no step begins after it (a step began and a checkpoint
      // came after it). The checkpoint holds the initial state; --resume starts at step 1.
      r.stopped_early = true;
      STRATA_RETURN_IF_ERROR(save_checkpoint(step_, &r.last_checkpoint), "stopping");
      log_info("stopped before step 1: checkpoint {} written; continue with --resume",
               r.last_checkpoint);
    }
  }

  const auto t0 = Clock::now();
  const int64_t tokens_per_step = int64_t(B_) * T_ * accum_ * world_;
  // Two windows of steps: the progress line's (steps_per_print) and the metrics record's
  // (train.log_interval), each with the time it started.
  StepWindow w, wl;
  auto window_t = Clock::now(), log_window_t = window_t;
  // The meters' mark (a write behind a step's end counts in the step that queued it).
  Meters mark = meters();
  tm_->take_times();
  while (step_ < total && !r.stopped_early) {
    const auto before = tier_bytes();
    const uint64_t in_before = tm_->stats(Tier::kDevice).bytes_in;
    STRATA_ASSIGN_OR_RETURN(double loss, profiled_step(&r), fmt::format("step {}", step_ + 1));
    r.step_nvme_bytes.push_back(tier_bytes()[1] - before[1]);
    r.step_device_bytes.push_back(tier_bytes()[0] - before[0]);
    r.step_device_in.push_back(tm_->stats(Tier::kDevice).bytes_in - in_before);
    const TierTimes tt = tm_->take_times();
    const StepWindow s = step_window(tt, &mark);  // this step
    r.comm_s += s.comm_s;
    for (uint64_t sent : s.sent) r.comm_bytes += sent;
    w += s;
    wl += s;
    add_step(tt, loss, &r);
    if (opts_.on_step_end) opts_.on_step_end(step_);
    // A non-finite loss stops the run; in fp16 once kFp16NonfiniteLossLimit steps in a row had
    // one (each skipped as an overflow; schedule.h).
    nonfinite_losses_ = std::isfinite(loss) ? 0 : nonfinite_losses_ + 1;
    if (nonfinite_losses_ >= (cfg_.fp16.enabled ? kFp16NonfiniteLossLimit : 1)) {
      if (!cfg_.fp16.enabled) {
        return internal_error(fmt::format(
            "step {}: loss is {} — training diverged; lower optimizer.params.lr or enable "
            "gradient_clipping",
            step_, loss));
      }
      return internal_error(fmt::format(
          "steps {} to {}: loss is {} — training diverged (each of those fp16 steps was skipped "
          "as an overflow, and no loss scale changes a forward's loss); lower "
          "optimizer.params.lr, enable gradient_clipping, or train in bf16 (bf16.enabled true, "
          "fp16.enabled false)",
          step_ - nonfinite_losses_ + 1, step_, loss));
    }
    const bool last = step_ == total;
    // The state at this step, over the window `win` that started at `since`.
    auto report_of = [&](const StepWindow& win, Clock::time_point since) {
      StepReport rep;
      rep.step = step_;
      rep.total = total;
      rep.loss = loss;
      rep.lr = learning_rate(cfg_, std::max<int64_t>(opt_steps_ - 1, 0));
      rep.grad_norm = last_grad_norm_;
      rep.aux_loss = last_aux_loss_;
      rep.preference = preference();
      rep.reward_chosen = last_dpo_.reward_chosen;
      rep.reward_rejected = last_dpo_.reward_rejected;
      rep.reward_accuracy = last_dpo_.accuracy;
      rep.logp_chosen = last_dpo_.logp_chosen;
      rep.logp_rejected = last_dpo_.logp_rejected;
      rep.fp16 = cfg_.fp16.enabled;
      rep.loss_scale = scaler_.scale;
      rep.skipped = last_skipped_;
      rep.rollbacks = int64_t(r.schedule.rollbacks);
      rep.approximate = r.approximate;
      rep.world_size = world_;
      rep.window_s = seconds_since(since);
      rep.tokens_per_s = double(tokens_per_step * win.steps) / std::max(rep.window_s, 1e-9);
      rep.elapsed_s = seconds_since(t0);
      rep.eta_s = rep.elapsed_s / double(step_ - r.start_step) * double(total - step_);
      rep.peak_rss = peak_rss_bytes();
      rep.rss = proc_status_bytes("VmRSS:");
      return rep;
    };
    if (report && (step_ % print_every == 0 || last || step_ == r.start_step + 1)) {
      if (opts_.progress) {
        std::fputs(progress_line(report_of(w, window_t), w).c_str(), stdout);
        std::fflush(stdout);
      }
    }
    if (step_ % print_every == 0 || last || step_ == r.start_step + 1) {
      window_t = Clock::now();
      w = StepWindow{};
    }
    if (step_ % log_every == 0 || last || step_ == r.start_step + 1) {
      if (report) {
        const std::string line = metrics_record(report_of(wl, log_window_t), wl);
        jsonl.write_line(line).ignore();
        const nlohmann::json rec = nlohmann::json::parse(line);
        Scalars scalars;
        for (const auto& [key, value] : rec.items()) {
          if (value.is_number() && key != "step") scalars.emplace_back(key, value.get<double>());
        }
        monitors.add(step_, scalars);
      }
      log_window_t = Clock::now();
      wl = StepWindow{};
    }
    if (cfg_.train.eval_interval > 0 && (step_ % cfg_.train.eval_interval == 0 || last)) {
      STRATA_RETURN_IF_ERROR(do_eval(step_), fmt::format("eval at step {}", step_));
      // The eval's fetch waits, collectives and bytes moved are not the next step's.
      tm_->take_times();
      mark = meters();
      window_t = log_window_t = Clock::now();
    }
    bool stop = (opts_.stop_signal && opts_.stop_signal->load() != 0) ||
                (opts_.stop_at_step >= 0 && step_ >= opts_.stop_at_step);
    if (world_ > 1) {
      // A stop reaches the ranks (src/train/stop_signals.h), but not at the same step: all
      // ranks stop after the step in which any of them saw it, so the checkpoint's collectives
      // line up.
      float any = stop ? 1.0f : 0.0f;
      STRATA_RETURN_IF_ERROR(reduce(&any, 1, ReduceOp::kMax), "agreeing on a stop");
      stop = any != 0.0f;
    }
    if (stop && !last) {
      r.stopped_early = true;
      STRATA_RETURN_IF_ERROR(save_checkpoint(step_, &r.last_checkpoint), "stopping");
      log_info("stopped at step {}: checkpoint {} written; continue with --resume", step_,
               r.last_checkpoint);
      break;
    }
    if (cfg_.train.checkpoint_interval > 0 && step_ % cfg_.train.checkpoint_interval == 0 &&
        !last) {
      STRATA_RETURN_IF_ERROR(save_checkpoint(step_, &r.last_checkpoint),
                             fmt::format("checkpoint at step {}", step_));
      mark.comm_s = comm_seconds();  // the checkpoint's barrier is not the next step's
    }
  }
  STRATA_RETURN_IF_ERROR(finish_run(t0, tokens_per_step, &r), "");
  r.metrics_error = !jsonl.error().is_ok()      ? jsonl.error().message()
                    : !monitors.error().is_ok() ? monitors.error().message()
                                                : "";
  return r;
}

}  // namespace strata::run_detail
