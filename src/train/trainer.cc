#include "src/train/trainer.h"

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
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

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
#include "src/train/metrics_log.h"
#include "src/train/monitors.h"
#include "src/train/process_memory.h"
#include "src/train/resume_check.h"
#include "src/train/run.h"
#include "src/train/schedule.h"
#include "src/train/step_report.h"
#include "strata/checksum.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/log.h"
#include "strata/optimizer.h"

namespace strata::run_detail {

Status Run::reduce(float* v, size_t n, ReduceOp op) {
  if (world_ == 1) return Status::ok();
  return comm_->all_reduce_blocking(v, v, n, DType::kF32, op);
}

Status Run::setup() {
  STRATA_ASSIGN_OR_RETURN(arch_, create_architecture(cfg_.model), "");
  const ModelLayout& layout = arch_->layout();
  params_.assign(layout.modules.size(), nullptr);
  grads_.assign(layout.modules.size(), nullptr);
  dt_ = cfg_.model.dtype;
  B_ = static_cast<int>(cfg_.train_micro_batch_size_per_gpu);
  accum_ = static_cast<int>(cfg_.gradient_accumulation_steps);
  T_ = cfg_.data.seq_len > 0 ? cfg_.data.seq_len : cfg_.model.context;
  if (B_ < 1 || accum_ < 1) {
    return invalid_argument(
        "train_micro_batch_size_per_gpu and gradient_accumulation_steps "
        "must be >= 1");
  }
  for (const auto& line : cfg_.resolved_auto) log_info("config: {}", line);
  for (const auto& line : cfg_.not_acted_on) log_info("config: {}", line);

  STRATA_RETURN_IF_ERROR(load_data(), "");

  STRATA_RETURN_IF_ERROR(create_device(), "");
  // strata.optimizer.speculate "auto" times both schedules where the device is not the host
  // (a GPU, or the simulated one): there the optimizer under backward competes with nothing on
  // the device, but the host's copies and memory bandwidth decide whether it hides. On the CPU
  // backend the device's work and the optimizer share the cores, and stepping under backward
  // is what the measurements favour: "auto" is "always" there.
  const std::string& spec = cfg_.strata.optimizer_speculate;
  speculate_choice_ =
      DeferChoice(DeferChoice::parse(spec == "auto" && dev_->host_addressable() ? "always" : spec));
  STRATA_RETURN_IF_ERROR(create_comms(), "");
  // train.checkpoint_dir and train.export_dir are checked before anything is trained; a
  // failure is reported together with the tiers' preflight (create_tiers).
  const Status dirs = check_output_dirs();
  if (!eval_only_ && cfg_.train_batch_size != int64_t(B_) * accum_ * world_) {
    return invalid_argument(fmt::format(
        "train_batch_size ({}) must equal train_micro_batch_size_per_gpu ({}) * "
        "gradient_accumulation_steps ({}) * world size ({} ranks) = {}; the config was resolved "
        "for another world size: set train_batch_size (or the micro batch) for {} ranks",
        cfg_.train_batch_size, B_, accum_, world_, int64_t(B_) * accum_ * world_, world_));
  }
  log_info("model: {}, {}", arch_->describe(), dtype_name(dt_));
  log_info("batch: {} micro x {} accumulation x {} rank(s) x {} tokens = {} tokens per step", B_,
           accum_, world_, T_, int64_t(B_) * accum_ * world_ * T_);
  STRATA_RETURN_IF_ERROR(create_tiers(dirs), "");

  hyper_.kind = optimizer_kind(cfg_.optimizer);
  hyper_.beta1 = static_cast<float>(cfg_.optimizer.beta1);
  hyper_.beta2 = static_cast<float>(cfg_.optimizer.beta2);
  hyper_.eps = static_cast<float>(cfg_.optimizer.eps);
  hyper_.weight_decay = static_cast<float>(cfg_.optimizer.weight_decay);
  hyper_.bias_correction = cfg_.optimizer.bias_correction;
  scaler_ = LossScaler::from_config(cfg_);
  tok_.resize(size_t(B_) * T_);
  tgt_.resize(size_t(B_) * T_);
  pos_.resize(size_t(B_) * T_);
  {
    const size_t n = size_t(accum_) * B_ * T_;
    STRATA_ASSIGN_OR_RETURN(void* mem, dev_->allocate_host(n * sizeof(float)),
                            "the per-token losses' host buffer");
    Device* dev = dev_.get();
    losses_mem_ = {static_cast<float*>(mem), [dev](float* p) { dev->release_host(p); }};
    losses_ = {losses_mem_.get(), n};
    std::fill(losses_.begin(), losses_.end(), 0.0f);
  }
  if (eval_only_) {
    // DPO's reference is the initial model: its log-probabilities before the checkpoint loads.
    if (preference()) {
      STRATA_RETURN_IF_ERROR(init_weights(), "");
      STRATA_RETURN_IF_ERROR(reference_logps(), "DPO's reference log-probabilities");
      if (opts_.resume.empty()) return Status::ok();
    }
    if (!opts_.resume.empty()) return load_for_eval(opts_.resume);
    return init_or_resume();
  }
  STRATA_RETURN_IF_ERROR(init_or_resume(), "initial state");
  STRATA_RETURN_IF_ERROR(check_no_foreign_overwrite(cfg_.train.checkpoint_dir, run_id_, step_,
                                                    cfg_.train.steps, passed_over_),
                         "");
  if (cfg_.train.export_dir.empty()) return Status::ok();
  return check_export_owner(export_target(step_));
}

Status Run::load_data() {
  DataConfig data_cfg = cfg_.data;
  data_cfg.seq_len = T_;
  if (eval_only_) {
    data_cfg.eval_fraction = 1.0;  // all of it is held out: eval_batch's windows
    // strata eval evaluates the held-out file when there is one.
    if (!data_cfg.eval_source.empty()) data_cfg.source = std::exchange(data_cfg.eval_source, "");
  }
  STRATA_ASSIGN_OR_RETURN(Dataset d, Dataset::load(data_cfg, arch_->vocab_size(), cfg_.train.seed),
                          "data");
  // (A packed split has a window with a loss target: Dataset::load checks it.)
  if (eval_only_ && !d.eval_packed() && d.eval_tokens() < size_t(T_) + 1) {
    return invalid_argument(fmt::format(
        "{}: {} holds {} tokens; eval needs at least T + 1 = {} (T = {} = {}): give a "
        "longer token file, or a shorter data.seq_len",
        cfg_.data.eval_source.empty() ? "data.source" : "data.eval_source", data_cfg.source,
        d.eval_tokens(), T_ + 1, cfg_.data.seq_len > 0 ? "data.seq_len" : "model.context", T_));
  }
  const bool evals = cfg_.train.eval_interval > 0;
  if (!eval_only_ && evals && d.eval_tokens() == 0) {
    return invalid_argument(fmt::format(
        "no token is held out for eval (data.eval_fraction {} of {} tokens) but "
        "train.eval_interval is {}: raise data.eval_fraction, give data.eval_source, or set "
        "train.eval_interval to 0",
        cfg_.data.eval_fraction, d.train_tokens(), cfg_.train.eval_interval));
  }
  if (!eval_only_ && ((!d.train_packed() && d.train_tokens() < size_t(T_) + 2) ||
                      (evals && !d.eval_packed() && d.eval_tokens() < size_t(T_) + 2))) {
    return invalid_argument(fmt::format(
        "data: {} train and {} eval tokens; each split needs at least seq_len+2 = {} (use a "
        "larger corpus or change data.eval_fraction)",
        d.train_tokens(), d.eval_tokens(), T_ + 2));
  }
  data_.emplace(std::move(d));
  log_info("data: {}", data_->description());
  return check_preference_data();
}

Status Run::check_output_dirs() {
  // The checkpoint directory needs room for the checkpoints the run will hold at its peak (no
  // more than it saves: one per train.checkpoint_interval, the final one, or the one a stop
  // writes).
  const int64_t interval = cfg_.train.checkpoint_interval;
  const int64_t saves = std::max<int64_t>(
      1, (interval > 0 ? cfg_.train.steps / interval : 0) + (cfg_.train.final_checkpoint ? 1 : 0));
  const int to_come =
      int(std::min<int64_t>(saves, checkpoints_to_come(cfg_.train.checkpoint_dir, opts_.resume)));
  Status ckpt_dir = eval_only_
                        ? Status::ok()
                        : prepare_checkpoint_dir(cfg_.train.checkpoint_dir,
                                                 checkpoint_file_bytes(checkpoint_meta(0)), to_come,
                                                 /*remove_temporaries=*/rank_ == 0);
  if (ckpt_dir.is_ok() && !eval_only_ && !cfg_.train.export_dir.empty()) {
    ckpt_dir = check_export_dir(export_target(0));
  }
  return ckpt_dir;
}

Status Run::create_tiers(const Status& dirs) {
  TierOptions to = TierOptions::from_config(cfg_, dt_);
  STRATA_ASSIGN_OR_RETURN(to.placement, placement_from_config(cfg_, *dev_), "placement");
  to.storage.faults = opts_.storage_faults;
  to.rank = rank_;
  to.param_comm = param_comm_.get();
  to.grad_comm = grad_comm_.get();
  to.zeropp = zeropp_.get();
  STRATA_ASSIGN_OR_RETURN(const ActivationMode act_mode,
                          parse_activation_mode(cfg_.strata.activations), "");
  // The runner's own choice of attention (create_runner asks the same question).
  const bool fused = arch_->fused_attention(dev_->kernels(), dt_);
  const ActivationSizes acts = arch_->activation_plan(B_, T_, dt_, act_mode, fused);
  to.stash_layers = acts.stash_layers;
  to.stash_bytes = acts.stash_bytes;
  to.activation_slot_bytes = acts.slot_bytes;
  if (eval_only_) to.forward_group = 1;  // eval runs one forward at a time
  TierShortfall short_of;
  auto tm =
      TierManager::create(*dev_, *arch_, dt_, cfg_.strata.moment_dtype, to, acts.bytes, &short_of);
  if (!dirs.is_ok()) {
    if (tm.is_ok()) return dirs.with_context("preflight");
    return Status(tm.status().code(), tm.status().message() + "\n  - " + dirs.message());
  }
  if (!tm.is_ok() && act_mode != ActivationMode::kOffload && short_of.device) {
    // Name the activation modes that need less device memory, with their bytes.
    const size_t rec = arch_->activation_plan(B_, T_, dt_, ActivationMode::kRecompute, fused).bytes;
    const size_t off = arch_->activation_plan(B_, T_, dt_, ActivationMode::kOffload, fused).bytes;
    const int sets = std::max(1, to.forward_group);
    // Only the modes that hold less than the one the run has (recompute: offload alone).
    const std::string modes =
        act_mode == ActivationMode::kRecompute
            ? fmt::format("strata.activations = offload needs {} (block inputs in host memory)",
                          format_bytes(double(off)))
            : fmt::format(
                  "strata.activations = recompute needs {} (one extra block forward in "
                  "backward), offload {} (block inputs in host memory)",
                  format_bytes(double(rec)), format_bytes(double(off)));
    return out_of_memory(fmt::format(
        "{}\n  - activations ({}) take {} of the device{}: {}", tm.status().message(),
        cfg_.strata.activations,
        format_bytes(double(acts.bytes + acts.slot_bytes * size_t(sets - 1))),
        sets > 1 ? fmt::format(" ({} micro-batches' forwards grouped, {} and {} for each further "
                               "one: strata.grouped_forwards = {}; 1 holds {})",
                               sets, format_bytes(double(acts.bytes)),
                               format_bytes(double(acts.slot_bytes)), sets,
                               format_bytes(double(acts.bytes)))
                 : std::string(),
        modes));
  }
  STRATA_ASSIGN_OR_RETURN(tm_, std::move(tm), "");
  log_info("tiers: {}", tm_->describe());
  const int sets = tm_->forward_group();
  log_info(
      "activations: {}, {} on the device{}{}", cfg_.strata.activations,
      format_bytes(double(acts.bytes + acts.slot_bytes * size_t(sets - 1))),
      sets > 1
          ? fmt::format(" ({} micro-batches' forwards grouped: {} for one, {} for "
                        "each further one; strata.grouped_forwards{}{})",
                        sets, format_bytes(double(acts.bytes)),
                        format_bytes(double(acts.slot_bytes)), to.forward_group == 0 ? " auto" : "",
                        tm_->backward_grouped()
                            ? "; the first group's backwards too, strata.grouped_backwards"
                            : "")
          : std::string(),
      acts.host_bytes ? fmt::format(", {} in the host tier", format_bytes(double(acts.host_bytes)))
                      : "");
  STRATA_ASSIGN_OR_RETURN(
      model_, arch_->create_runner(*dev_, B_, T_, dt_, act_mode, tm_.get(), tm_->forward_group()),
      "model");
  return Status::ok();
}

CheckpointMeta Run::checkpoint_meta(int64_t step) const {
  CheckpointMeta meta;
  meta.step = step;
  meta.opt_steps = opt_steps_;
  meta.loss_scale = scaler_.scale;
  meta.scaler_cur_iter = scaler_.cur_iter;
  meta.scaler_last_overflow_iter = scaler_.last_overflow_iter;
  meta.scaler_cur_hysteresis = scaler_.cur_hysteresis;
  meta.model_shape = arch_->shape_string();
  meta.moment_dtype = dtype_name(cfg_.strata.moment_dtype);
  meta.optimizer_state = optimizer_state(optimizer_kind(cfg_.optimizer)).name;
  meta.seed = cfg_.train.seed;
  meta.micro_batch = B_;
  meta.accumulation = accum_;
  const SchedulerConfig& sc = cfg_.scheduler;
  if (sc.type == "WarmupDecayLR" || sc.type == "WarmupCosineLR") {
    meta.schedule_steps = sc.total_num_steps;
  }
  meta.pad_token_id = cfg_.model.pad_token_id;
  meta.run_id = run_id_;
  // A frozen module (LoRA's base) has no state of its own to save: 0 elements.
  for (const ModuleSpec& m : arch_->layout().modules) {
    meta.modules.push_back({m.name, m.trainable ? m.numel : 0});
  }
  return meta;
}

Status Run::init_or_resume() {
  // A frozen base (LoRA) is not in the checkpoints: it is initialized (read) before one loads.
  // DPO's reference is the initial model: its log-probabilities come first, on a resume too.
  const bool reference = preference();
  if ((!opts_.resume.empty() && arch_->lora()) || reference) {
    STRATA_RETURN_IF_ERROR(init_weights(), "");
  }
  if (reference) STRATA_RETURN_IF_ERROR(reference_logps(), "DPO's reference log-probabilities");
  if (opts_.resume.empty()) {
    run_id_ = new_run_id();
  } else {
    std::vector<std::string> candidates = {opts_.resume};
    if (opts_.resume == "latest") {
      STRATA_ASSIGN_OR_RETURN(candidates, resume_candidates(cfg_.train.checkpoint_dir), "--resume");
    }
    // Every value of the checkpoint is checked against this run before it is used; a damaged
    // newest checkpoint falls back to the older intact one (the same on every rank).
    ResumePlan plan;
    auto load = [&](const std::string& path) -> Status {
      STRATA_ASSIGN_OR_RETURN(plan, check_resume(path, checkpoint_meta(0), cfg_.train.steps), "");
      if (plan.whole && world_ == 1) return tm_->load(path);
      return tm_->load_shards(plan.files);  // re-sharding: this rank's part of the old shards
    };
    std::function<Result<ResumeOutcome>(ResumeOutcome)> agree;
    if (world_ > 1) {
      agree = [&](ResumeOutcome mine) -> Result<ResumeOutcome> {
        float worst = float(mine);
        STRATA_RETURN_IF_ERROR(reduce(&worst, 1, ReduceOp::kMax), "ranks agreeing on the resume");
        return ResumeOutcome(int(worst));
      };
    }
    STRATA_ASSIGN_OR_RETURN(std::string path, resume_first_intact(candidates, load, agree),
                            "--resume");
    passed_over_.assign(candidates.begin(), std::find(candidates.begin(), candidates.end(), path));
    const CheckpointMeta& meta = plan.meta;
    if (meta.world_size != world_) {
      log_info("resharded the checkpoint of {} rank(s) onto {} rank(s)", meta.world_size, world_);
    }
    step_ = meta.step;
    opt_steps_ = meta.opt_steps;
    scaler_.scale = meta.loss_scale;
    scaler_.cur_iter = meta.scaler_cur_iter;
    scaler_.last_overflow_iter = meta.scaler_last_overflow_iter;
    scaler_.cur_hysteresis = meta.scaler_cur_hysteresis;
    run_id_ = meta.run_id.empty() ? new_run_id() : meta.run_id;
    log_info("resumed from {} at step {}", path, step_);
    CheckpointMeta now = checkpoint_meta(step_);
    now.world_size = world_;
    for (const std::string& note : resume_notes(meta, now)) {
      if (rank_ == 0) log_warn("--resume: {}", note);
    }
  }
  if (world_ > 1) {
    // One lineage on every rank: rank 0's (three 24-bit pieces travel exactly as floats).
    const uint64_t id = std::strtoull(run_id_.c_str(), nullptr, 16);
    float parts[3] = {float(id & 0xffffff), float((id >> 24) & 0xffffff), float(id >> 48)};
    STRATA_RETURN_IF_ERROR(comm_->broadcast_blocking(parts, 3, DType::kF32, 0), "run id");
    run_id_ = fmt::format("{:016x}",
                          uint64_t(parts[0]) | uint64_t(parts[1]) << 24 | uint64_t(parts[2]) << 48);
  }
  if (!opts_.resume.empty() || reference) return Status::ok();
  return init_weights();
}

Status Run::init_weights() {
  // Random weights (Architecture::init_range), or Hugging Face weights validated first, then
  // streamed range by range into their homes (a LoRA adapter is not in the base's checkpoint:
  // random). Ranges are filled from several threads; a progress line every 10 s on rank 0.
  const auto t0 = Clock::now();
  const bool pretrained = !cfg_.model.from_pretrained.empty();
  std::unique_ptr<HfCheckpointReader> hf;
  if (pretrained) {
    STRATA_ASSIGN_OR_RETURN(hf, HfCheckpointReader::open(cfg_.model.from_pretrained, *arch_), "");
  }
  size_t total = 0;  // this rank's elements
  for (size_t m = 0; m < arch_->layout().modules.size(); ++m) total += tm_->shard_count(int(m));
  std::atomic<size_t> done{0};
  std::atomic<double> last{0.0};
  STRATA_RETURN_IF_ERROR(tm_->init_state([&](int m, size_t begin, size_t count, float* out) {
    if (hf == nullptr || arch_->hf_tensors(m).empty()) {
      arch_->init_range(m, cfg_.train.seed, begin, count, out);
    } else {
      STRATA_RETURN_IF_ERROR(hf->read_range(m, begin, count, out),
                             fmt::format("module {}", arch_->layout().modules[size_t(m)].name));
    }
    const size_t now = done += count;
    double seen = last.load();
    const double t = seconds_since(t0);
    if (rank_ == 0 && t - seen >= 10.0 && last.compare_exchange_strong(seen, t)) {
      log_info("{}: {:.0f}% of {:.2f} G parameters ({:.0f} s)",
               pretrained ? "model.from_pretrained" : "initializing the weights",
               std::min(100.0, 100.0 * double(now) / double(std::max<size_t>(total, 1))),
               double(total) / 1e9, t);
    }
    return Status::ok();
  }),
                         pretrained ? "model.from_pretrained" : "initializing the weights");
  if (pretrained) {
    log_info("loaded {} ({:.1f} MB of weights) in {:.2f} s", cfg_.model.from_pretrained,
             double(hf->bytes()) / 1e6, seconds_since(t0));
  } else {
    log_info("initialized {:.2f} M parameters (seed {}) and their optimizer state in {:.2f} s",
             double(arch_->layout().num_params()) / 1e6, cfg_.train.seed, seconds_since(t0));
  }
  return Status::ok();
}

Status Run::load_for_eval(const std::string& path) {
  // The model, the module layout and the moment dtype must match; train.seed and train.steps
  // only steer training, so the checkpoint's own are taken, and evaluation steps no optimizer,
  // so whichever state the moments are is not checked (optimizer_state "").
  STRATA_ASSIGN_OR_RETURN(ShardManifest man, read_shard_manifest(path), "--checkpoint");
  STRATA_ASSIGN_OR_RETURN(CheckpointMeta first, read_checkpoint_meta(man.files.at(0)),
                          "--checkpoint");
  CheckpointMeta mine = checkpoint_meta(0);
  mine.seed = first.seed;
  mine.optimizer_state.clear();
  STRATA_ASSIGN_OR_RETURN(ResumePlan plan,
                          check_resume(path, mine, std::numeric_limits<int64_t>::max()),
                          "--checkpoint");
  const auto t0 = Clock::now();
  if (arch_->lora()) STRATA_RETURN_IF_ERROR(init_weights(), "the frozen base");
  if (plan.whole && world_ == 1) {
    STRATA_RETURN_IF_ERROR(tm_->load(path), "--checkpoint");
  } else {
    STRATA_RETURN_IF_ERROR(tm_->load_shards(plan.files), "--checkpoint");
  }
  log_info("loaded {} (step {}) in {:.2f} s", path, plan.meta.step, seconds_since(t0));
  return Status::ok();
}

Status Run::save_checkpoint(int64_t step, std::string* path_out) {
  const std::string& dir = cfg_.train.checkpoint_dir;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return io_error(fmt::format("train.checkpoint_dir: cannot create '{}': {}", dir, ec.message()));
  }
  const std::string name = fmt::format("ckpt-{:08}.bin", step);
  const std::string path = dir + "/" + name;
  const std::string what = "saving step " + std::to_string(step);
  if (world_ > 1) {
    // Every rank writes its shard file; once all have (barrier), rank 0 writes the manifest
    // and moves `latest`, so `latest` never names a checkpoint with a missing shard.
    STRATA_RETURN_IF_ERROR(tm_->save(shard_file_path(path, rank_, world_), checkpoint_meta(step)),
                           what);
    STRATA_RETURN_IF_ERROR(comm_->barrier_blocking(), what + ": waiting for every rank's shard");
    if (rank_ == 0) {
      STRATA_RETURN_IF_ERROR(write_shard_manifest(path, step, world_, run_id_), what);
      STRATA_RETURN_IF_ERROR(set_latest_checkpoint(dir, name), what);
    }
  } else {
    STRATA_RETURN_IF_ERROR(tm_->save(path, checkpoint_meta(step)), what);
    STRATA_RETURN_IF_ERROR(set_latest_checkpoint(dir, name), what);
  }
  *path_out = path;
  if (rank_ != 0) return Status::ok();
  // Keep this lineage's two newest (never the one just written, never another run's).
  prune_checkpoints(dir, run_id_, name);
  return Status::ok();
}

}  // namespace strata::run_detail

namespace strata {

using run_detail::Run;

Result<EvalResult> evaluate(const Config& cfg, const EvalOptions& opts) {
  STRATA_RETURN_IF_ERROR(check_model_given(cfg), "");
  if (!cfg.device.simulate.empty()) {
    // Its kernels only cost time: the loss it would print is no model's (ln of the vocabulary).
    return invalid_argument(
        "device.simulate computes no real numbers: strata eval runs on device.backend cpu or "
        "cuda (set device.simulate to \"\")");
  }
  TrainOptions to;
  to.resume = opts.checkpoint;
  to.progress = false;
  bound_malloc_heap();
  Run run(cfg, to, proc_status_bytes("VmRSS:"), /*eval_only=*/true);
  STRATA_RETURN_IF_ERROR(run.setup(), "");
  return run.evaluate();
}

int launcher_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS",
                          "SLURM_NTASKS", "MV2_COMM_WORLD_SIZE"}) {
    if (const char* v = std::getenv(var)) {
      if (std::atoi(v) > 1) return std::atoi(v);
    }
  }
  return 1;
}

Result<TrainResult> train(const Config& cfg, const TrainOptions& opts) {
  STRATA_RETURN_IF_ERROR(check_model_given(cfg), "");
  if (!cfg.train.final_checkpoint && !cfg.train.export_dir.empty()) {
    return invalid_argument(
        "train.export_dir exports the final checkpoint, but train.final_checkpoint is false: "
        "set train.final_checkpoint true or train.export_dir \"\"");
  }
  bound_malloc_heap();
  const size_t base_rss = proc_status_bytes("VmRSS:");
  Run run(cfg, opts, base_rss);
  STRATA_RETURN_IF_ERROR(run.setup(), "");
  return run.loop();
}

}  // namespace strata
