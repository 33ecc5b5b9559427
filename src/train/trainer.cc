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
    mbs.push_back({dloss, losses_.data() + size_t(micro) * B_ * T_, nullptr, aux + micro,
                   training_dropout_key(cfg_.train.seed, step_, micro, rank_),
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
