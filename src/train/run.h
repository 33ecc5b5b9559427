// The trainer's run: setup, the step, evaluation and checkpoints (trainer.cc) and the run loop
// with its progress, metrics and monitors (run_loop.cc). Internal to src/train/: the public
// entry points are train() and evaluate() (trainer.h).
#pragma once

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>

#include "src/checkpoint/checkpoint.h"
#include "src/comm/zeropp.h"
#include "src/hf/export_dir.h"
#include "src/hf/hf_checkpoint.h"
#include "src/hf/hf_export.h"
#include "src/model/architecture.h"
#include "src/tiers/memory_model.h"
#include "src/tiers/tier_manager.h"
#include "src/train/checkpoint_dir.h"
#include "src/train/data.h"
#include "src/train/defer_choice.h"
#include "src/train/metrics_log.h"
#include "src/train/monitors.h"
#include "src/train/op_profile.h"
#include "src/train/preference.h"
#include "src/train/process_memory.h"
#include "src/train/resume_check.h"
#include "src/train/schedule.h"
#include "src/train/step_report.h"
#include "src/train/trainer.h"
#include "strata/checksum.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/log.h"
#include "strata/optimizer.h"

namespace strata::run_detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline OptimizerKind optimizer_kind(const OptimizerConfig& o) {
  std::string t = o.type;
  for (auto& c : t) c = static_cast<char>(std::tolower(c));
  if (t == "adagrad") return OptimizerKind::kAdagrad;
  if (t == "lion") return OptimizerKind::kLion;
  if (t == "adam" && !o.adam_w_mode) return OptimizerKind::kAdam;
  return OptimizerKind::kAdamW;
}

class Run {
 public:
  // eval_only: set up for evaluate() (strata eval): the whole of data.source is the eval
  // corpus, train.checkpoint_dir is left alone, opts.resume names the checkpoint to evaluate.
  // base_rss: VmRSS when train() was called (the summary's "rest").
  Run(const Config& cfg, const TrainOptions& opts, size_t base_rss, bool eval_only = false)
      : cfg_(cfg), opts_(opts), eval_only_(eval_only), base_rss_(base_rss) {}
  ~Run() {
    if (dev_) {
      // Stream-ordered collectives refer to the communicators: join every stream first.
      dev_->synchronize(dev_->compute_stream()).ignore();
      dev_->synchronize(dev_->h2d_stream()).ignore();
      dev_->synchronize(dev_->d2h_stream()).ignore();
    }
    model_.reset();
    tm_.reset();
  }

  Status setup();
  Result<TrainResult> loop();
  Result<EvalResult> evaluate();
  const TierManager& tiers() const { return *tm_; }

 private:
  // setup()'s steps, in its order. The token file(s) of data.source (eval_only: the held-out
  // file, or all of data.source), checked to hold a window of T_.
  Status load_data();
  Status create_device();
  // flops_profiler.enabled: wraps dev_ in the op profile's device (profiler_).
  // An error when flops_profiler.output_file names something that is not an earlier profile.
  Status wrap_profiler(std::optional<SimulatedDeviceOptions> model);
  // run_step(), with the op profile around it when it is flops_profiler.profile_step's step:
  // then logged by rank 0 (and written to flops_profiler.output_file) and kept in `r`.
  Result<double> profiled_step(TrainResult* r);
  Status report_profile(TrainResult* r);
  Status create_comms();
  // train.checkpoint_dir prepared for the checkpoints the run will hold at its peak (room,
  // temporaries removed on rank 0) and train.export_dir checked; OK for eval_only. Its failure
  // is not returned at once: create_tiers reports it with the tiers' preflight.
  Status check_output_dirs();
  // The tier manager (its preflight: every tier's need against its capacity, with the
  // activations of strata.activations) and the model's runner over it. `dirs`, the result of
  // check_output_dirs, fails here after the preflight, listed with its shortfalls; a device
  // short of memory for the activations names the modes that need less.
  Status create_tiers(const Status& dirs);
  // Sums `v` over ranks (max with kMax); a no-op on one rank, so one rank stays bit-identical.
  Status reduce(float* v, size_t n, ReduceOp op);
  Status init_or_resume();
  Status init_weights();  // the initial weights: from_pretrained's, else drawn from train.seed
  Status load_for_eval(const std::string& path);
  Result<double> run_step();
  // The step's forwards and backwards: every micro-batch of this rank (its batch drawn, its
  // losses into losses_[micro], its load-balancing loss into aux[micro]), in forward groups
  // and the first backward group as the tier manager decided; `speculate`: the optimizer steps
  // or reads ahead under the last backward. mid_step runs after each micro-batch.
  Status forward_backward(float dloss, bool speculate, float* aux);
  // After backward, with the step's global gradient statistics (norm² and overflow, of the
  // loss scaled by `scale`): updates the loss scaler and the grad norm, then the optimizer
  // step — delayed, or exact (keeping or redoing what ran under backward; deferring the rest
  // into the next forward where `speculate` and the schedule say so) — or, after an fp16
  // overflow, its skip.
  Status step_optimizer(const GradStats& stats, double scale, bool delayed, bool speculate,
                        bool not_under_backward);
  // The eval loss over data.eval_batches batches, at most those that hold the held-out windows
  // once (more would count windows again); where those batches take every window, the loss
  // strata eval gives (whole_eval_loss). nullopt: cut short by a stop signal (one rank: the
  // ranks run an eval's collectives together, so with several it runs to its end).
  Result<std::optional<double>> eval_loss();
  // The mean loss over every held-out window once, in `batches` eval batches whose last rows
  // past the end wrap to the start and are computed but not counted; `tokens`: the targets
  // counted. With `stoppable` (one rank) a stop signal cuts it short: nullopt.
  Result<std::optional<double>> whole_eval_loss(size_t batches, bool stoppable, int64_t* tokens);
  // Runs eval batch i (the forward alone); its per-token losses land in losses_ (run_eval.cc).
  Status eval_batch(int i);

  // Preference data (DPO, run_preference.cc). The check of load_data: the micro-batch holds
  // whole pairs.
  bool preference() const { return data_ && data_->preference(); }
  Status check_preference_data();
  // The forward alone over B/2 pairs from `first_pair` (wrapping) of a split; losses_ gets
  // their rows' per-token losses.
  Status pair_forward(bool eval_split, size_t first_pair);
  // ref_train_ and ref_eval_ from the weights now held (the initial ones: the reference), with
  // each row's completion targets (count_train_, count_eval_).
  Status reference_logps();
  Status reference_logps_of(bool eval_split, std::vector<float>* out, std::vector<float>* counts);
  // The step's micro-batches' row weights (MicroBatch::row_weights), `scale` the loss scale.
  void weigh_preference_rows(double scale, std::vector<MicroBatch>* mbs);
  // After the step's backward: its DPO loss over the global batch's pairs (last_dpo_).
  Result<double> preference_step_loss();
  Status reduce_dpo_sums(DpoSums* s);
  // The held-out DPO loss over data.eval_batches batches of pairs (at most every pair once;
  // every_pair: all of them); last_eval_dpo_ gets its metrics. preference_evaluate: strata
  // eval's, over every pair.
  Result<std::optional<double>> preference_eval_loss(bool every_pair = false);
  Result<EvalResult> preference_evaluate();
  // The loss targets of this step's global batch (B*T*accum*world without a loss mask).
  int64_t global_train_targets() const {
    int64_t n = 0;
    for (int micro = 0; micro < accum_; ++micro) {
      for (int r = 0; r < world_; ++r) {
        n += data_->train_batch_targets(cfg_.train.seed, step_, micro, r, B_, T_);
      }
    }
    return n;
  }
  // Runs ops [begin, end) of the program for micro-batches mbs[0..n) (n > 1: a group, each on
  // its activation slot k; `micro` is the first's index): its state steps through the tier
  // manager, its compute steps on the runner, segment by segment (segment_starts), each run for
  // every micro-batch in turn — parameters acquired on the first run and released on the last,
  // the further micro-batches' gradients in parts (parts_) added to the first's at each drain,
  // drained on the last. Training under the last micro-batch (`speculate`) steps the modules
  // whose gradients are final after each run of drains. A forward group's prefix is
  // [0, Program::forward_end); a backward group runs the whole program.
  Status run_program(Pass pass, int micro, bool last, bool speculate, const MicroBatch* mbs,
                     int n = 1, size_t begin = 0, size_t end = SIZE_MAX);
  // Settles strata.optimizer.defer = "auto" once its trial steps are timed (every rank alike).
  Status settle(DeferChoice& choice, float m[2]);
  Status settle_defer_choice();
  Status settle_speculate_choice();
  Status save_checkpoint(int64_t step, std::string* path_out);
  CheckpointMeta checkpoint_meta(int64_t step) const;
  // The loop's meters (run_loop.cc), read before and after a step: seconds in collectives
  // (parameter gathers and gradient reduce-scatters overlap compute; the main thread's
  // reductions block it); bytes sent by the parameter, gradient and main communicators; bytes
  // moved to and from the device and asked of NVMe (counted when queued).
  double comm_seconds() const;
  std::array<uint64_t, 3> comm_bytes_sent() const;
  std::array<uint64_t, 2> tier_bytes() const;
  struct Meters {  // the three, read at one point of the loop
    double comm_s = 0;
    std::array<uint64_t, 3> sent{0, 0, 0};
    std::array<uint64_t, 2> bytes{0, 0};
  };
  Meters meters() const { return {comm_seconds(), comm_bytes_sent(), tier_bytes()}; }
  // The step just run as a window of the meters since `mark` (moved to now), with its optimizer
  // times (tt) and its forward and backward.
  StepWindow step_window(const TierTimes& tt, Meters* mark) const;
  // Adds a step's optimizer counts and times (tt), its loss and its skip to the run's result.
  void add_step(const TierTimes& tt, double loss, TrainResult* r) const;
  // After the last step: its deferred optimizer pass, the final checkpoint and export, the
  // run's totals.
  Status finish_run(Clock::time_point t0, int64_t tokens_per_step, TrainResult* r);
  // train.export_dir, written by this run's lineage with the checkpoint of `step`.
  ExportTarget export_target(int64_t step) const {
    return {cfg_.train.export_dir,
            "train.export_dir",
            run_id_,
            step,
            cfg_.model.from_pretrained,
            /*force=*/false,
            ""};
  }

  const Config& cfg_;
  const TrainOptions& opts_;
  const bool eval_only_;
  size_t base_rss_ = 0;  // VmRSS when train() was called
  std::unique_ptr<Architecture> arch_;
  DType dt_ = DType::kBF16;
  int B_ = 0, T_ = 0, accum_ = 1;
  std::unique_ptr<Device> dev_;
  ProfiledDevice* profiler_ = nullptr;  // dev_ itself, when flops_profiler.enabled
  // comm_: blocking collectives of the main thread (loss, grad norm, overflow, barriers);
  // param_comm_ / grad_comm_: the tier manager's gathers (h2d stream) and reduce-scatters (d2h
  // stream), only when world_ > 1. Declared before tm_ so they outlive it.
  std::unique_ptr<Communicator> comm_, param_comm_, grad_comm_;
  // ZeRO++ (zero_quantized_weights, zero_hpz_partition_size, zero_quantized_gradients): its
  // sub-groups of param_comm_ / grad_comm_; null when none of the keys is on.
  std::unique_ptr<ZeroPP> zeropp_;
  int world_ = 1, rank_ = 0;
  std::unique_ptr<TierManager> tm_;
  std::unique_ptr<ModelRunner> model_;
  std::optional<Dataset> data_;
  LossScaler scaler_;
  int64_t step_ = 0, opt_steps_ = 0;
  std::string run_id_;  // the checkpoints' lineage (src/train/checkpoint_dir.h)
  // The damaged checkpoints --resume passed over (paths): this run may replace them.
  std::vector<std::string> passed_over_;
  OptimizerHyper hyper_;
  std::vector<int32_t> tok_, tgt_, pos_;  // pos_: the positions of a batch packed per sequence
  bool eval_cap_logged_ = false;          // eval_loss said once that data.eval_batches was capped
  // The training micro-batches that came with positions (packed per sequence), and those of
  // them with a conversation boundary in a row, which attention masks per conversation
  // (TrainResult::micro_batches_*).
  int64_t positioned_batches_ = 0, per_sequence_batches_ = 0;
  // The positions of the training micro-batch just drawn into pos_ for begin_batch: none where
  // the split carries none or every row's are plain (positions_are_plain); counted.
  const int32_t* batch_positions();
  // [accum][B*T], the device's host memory (allocate_host): the losses are copied straight
  // into it (MicroBatch::losses_out_pinned). Declared after dev_, which releases it.
  std::unique_ptr<float, std::function<void(float*)>> losses_mem_;
  std::span<float> losses_;
  // The device pointers of the modules the program holds at this point, by module.
  std::vector<const void*> params_;
  std::vector<float*> grads_;
  // A backward group's further micro-batches' gradient parts: parts_[k][m] (k >= 1).
  std::vector<std::vector<float*>> parts_;
  double last_grad_norm_ = 0;
  // The last step's mean load-balancing loss over its micro-batches and ranks (a mixture of
  // experts; -1 for other models), reported apart from the loss.
  double last_aux_loss_ = -1;
  bool last_skipped_ = false;
  int64_t nonfinite_losses_ = 0;  // steps in a row, up to this one, whose loss was inf or nan
  // The last step's clip coefficient was < 1. Before the first step: whether clipping is on
  // (early gradients are the largest, so the first step is expected to clip: it is deferred,
  // not speculated and rolled back).
  bool last_clipped_ = cfg_.gradient_clipping > 0;
  // Whether such a step (not stepped under backward) defers into the next forward.
  DeferChoice defer_choice_{DeferChoice::parse(cfg_.strata.optimizer_defer)};
  // The same trial for stepping under backward (strata.optimizer.speculate): its first option
  // ("defer" in DeferChoice's terms) is to speculate.
  // Set once the device exists (setup: "auto" is "always" on the CPU backend).
  DeferChoice speculate_choice_{DeferChoice::Mode::kAlways};
  double last_fwd_bwd_s_ = 0;
  // Preference data: the loss (the dpo section), the reference's log-probabilities and the
  // completion targets of every pair's two sequences (chosen first), the step's rows' share of
  // them and their weights ([accum]), the last step's and eval's metrics.
  DpoLoss dpo_loss_;
  std::vector<float> ref_train_, ref_eval_, count_train_, count_eval_;
  std::vector<std::vector<float>> ref_rows_, count_rows_;
  std::vector<DpoRowWeights> row_weights_;
  DpoMetrics last_dpo_, last_eval_dpo_;
};

}  // namespace strata::run_detail
