// Resolution of a parsed config (config_ctx.h): what it leaves to "auto" and the defaults that
// depend on other keys, then the rules across keys, one section at a time.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "src/base/json_depth.h"
#include "src/base/json_text.h"
#include "src/config/config_ctx.h"
#include "src/config/key_table.h"
#include "src/config/leaf.h"
#include "src/config/model_shape.h"
#include "src/hf/hf_config.h"
#include "strata/log.h"

namespace strata::config_internal {
namespace {

using json = nlohmann::json;

Status resolve_batch(Ctx* ctx, int world_size) {
  Config& c = ctx->cfg;
  bool has_t = is_given(*ctx, "train_batch_size");
  bool has_m = is_given(*ctx, "train_micro_batch_size_per_gpu");
  bool has_g = is_given(*ctx, "gradient_accumulation_steps");
  bool any_auto = is_auto(*ctx, "train_batch_size") ||
                  is_auto(*ctx, "train_micro_batch_size_per_gpu") ||
                  is_auto(*ctx, "gradient_accumulation_steps");
  const int64_t ws = world_size;
  int64_t& t = c.train_batch_size;
  int64_t& m = c.train_micro_batch_size_per_gpu;
  int64_t& g = c.gradient_accumulation_steps;
  // m * g * ws, or why it cannot be a batch (the keys' ranges let the product overflow).
  int64_t mgw = 0;
  const bool fits = !__builtin_mul_overflow(m, g, &mgw) && !__builtin_mul_overflow(mgw, ws, &mgw);
  if ((has_m && has_g) && !fits) {
    return invalid_argument(fmt::format(
        "train_micro_batch_size_per_gpu ({}) * gradient_accumulation_steps ({}) * world_size "
        "({}) is too large a batch; lower one of them",
        m, g, ws));
  }
  if (has_t && has_m && has_g) {
    // checked below
  } else if (has_t && has_m) {
    g = t / (m * ws);
  } else if (has_t && has_g) {
    m = t / (g * ws);
  } else if (has_m && has_g) {
    t = mgw;
  } else if (has_t) {
    g = 1;
    m = t / ws;
  } else if (has_m) {
    g = 1;
    t = m * ws;
  } else if (has_g && !any_auto) {
    return invalid_argument(
        fmt::format("gradient_accumulation_steps ({}) alone does not fix the batch; also give "
                    "train_batch_size or train_micro_batch_size_per_gpu",
                    g));
  } else if (any_auto) {
    m = 1;
    if (!has_g) g = 1;
    t = m * g * ws;
  } else {
    return invalid_argument(
        "no batch size: give train_batch_size or train_micro_batch_size_per_gpu "
        "(and optionally gradient_accumulation_steps); train_batch_size = "
        "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size");
  }
  if (m < 1 || g < 1 || __builtin_mul_overflow(m, g, &mgw) ||
      __builtin_mul_overflow(mgw, ws, &mgw) || t != mgw) {
    return invalid_argument(fmt::format(
        "train_batch_size ({}) must equal train_micro_batch_size_per_gpu ({}) * "
        "gradient_accumulation_steps ({}) * world_size ({}) = {}; fix one of them or leave one "
        "out to have it derived",
        t, m, g, ws, mgw));
  }
  if (is_auto(*ctx, "train_batch_size")) note_auto(ctx, "train_batch_size", std::to_string(t));
  if (is_auto(*ctx, "train_micro_batch_size_per_gpu")) {
    note_auto(ctx, "train_micro_batch_size_per_gpu", std::to_string(m));
  }
  if (is_auto(*ctx, "gradient_accumulation_steps")) {
    note_auto(ctx, "gradient_accumulation_steps", std::to_string(g));
  }
  return Status::ok();
}

// A config.json's shape against the same ranges a native model section has (the key table's),
// before anything is sized from it: a billion layers must be an error, not an OOM kill.
// The first model.* key of `c` outside the key table's range, and why (null: none).
std::pair<const Key*, Status> first_model_range_error(const Config& c) {
  for (const Key& k : schema().keys) {
    if (k.path.rfind("model.", 0) != 0 || !k.alias_of.empty() || !k.get) continue;
    if (k.type.kind != Kind::kInt && k.type.kind != Kind::kReal) continue;
    Result<json> v = check_value(k.type, k.get(c), k.path);
    if (!v.is_ok()) return {&k, v.status()};
  }
  return {nullptr, Status::ok()};
}

Status check_pretrained_ranges(const Config& c, const std::string& dir) {
  if (const auto [key, why] = first_model_range_error(c); key != nullptr) {
    const std::string hf_key = hf_config_key(c.model.type, key->path);
    return invalid_argument(fmt::format("{}/config.json: {}is beyond what strata trains ({}){}",
                                        dir, hf_key.empty() ? "" : hf_key + " ", why.message(),
                                        key->path == "model.context"
                                            ? "; give a shorter model.context beside "
                                              "from_pretrained"
                                            : ""));
  }
  return Status::ok();
}

// The model section: from model.from_pretrained's config.json or as given, checked; the
// padded vocabulary.
Status resolve_model(Ctx* ctx) {
  Config& c = ctx->cfg;
  c.model.given = false;
  for (const auto& [path, v] : ctx->given) c.model.given |= path.rfind("model.", 0) == 0;
  if (is_given(*ctx, "model.from_pretrained")) {
    const std::string dir = c.model.from_pretrained;
    for (const auto& [path, v] : ctx->given) {
      if (path.rfind("model.", 0) == 0 && path != "model.from_pretrained" &&
          path != "model.context") {
        return invalid_argument(fmt::format(
            "{}: the model's shape comes from model.from_pretrained ({}/config.json); remove "
            "this key (only model.context may be given beside from_pretrained)",
            path, dir));
      }
    }
    STRATA_ASSIGN_OR_RETURN(
        ModelConfig m,
        model_config_from_hf(dir, is_given(*ctx, "model.context") ? c.model.context : 0),
        "model.from_pretrained");
    m.from_pretrained = dir;
    m.lora = c.model.lora;
    c.model = m;
    STRATA_RETURN_IF_ERROR(check_pretrained_ranges(c, dir), "model.from_pretrained");
  }
  STRATA_RETURN_IF_ERROR(check_model_shape(c.model), "");
  if (c.model.padded_vocab_size == 0) {
    c.model.padded_vocab_size = (c.model.vocab_size + 63) / 64 * 64;
    if (is_auto(*ctx, "model.padded_vocab_size")) {
      note_auto(ctx, "model.padded_vocab_size", std::to_string(c.model.padded_vocab_size));
    }
  }
  return Status::ok();
}

// The lora section: on when any adapter key is given; the combinations strata refuses.
Status resolve_lora(Ctx* ctx) {
  Config& c = ctx->cfg;
  // Any lora.* key turns adapters on, except how the base is stored: that alone would train
  // adapters nobody asked for.
  for (const auto& [path, v] : ctx->given) {
    c.model.lora.enabled |= path.rfind("lora.", 0) == 0 && path != "lora.base_quantization" &&
                            path != "lora.double_quant";
  }
  const LoraConfig& lq = c.model.lora;
  if (lq.base_quantization != "none" && !lq.enabled) {
    return invalid_argument(fmt::format(
        "lora.base_quantization: {} quantizes a frozen LoRA base, but no adapters are configured; "
        "give the lora section its adapters (e.g. lora.r and lora.target_modules) or set "
        "lora.base_quantization to none",
        lq.base_quantization));
  }
  if (lq.double_quant && lq.base_quantization != "nf4") {
    return invalid_argument(
        "lora.double_quant: true applies to lora.base_quantization nf4 only; remove it");
  }
  if (lq.double_quant) {
    return invalid_argument(
        "lora.double_quant: true (bitsandbytes' double quantization of nf4's absmax) is not "
        "implemented; set it to false (nf4 keeps one fp32 absmax per 64 weights: 0.0625 B/param)");
  }
  if (lq.base_quantization != "none" && c.zero.zero_quantized_weights) {
    return invalid_argument(fmt::format(
        "lora.base_quantization: {} stores the frozen base quantized already; "
        "zero_optimization.zero_quantized_weights would quantize those bytes again; set it to "
        "false",
        lq.base_quantization));
  }
  if (lq.enabled && lq.bias != "none") {
    return invalid_argument(fmt::format(
        "lora.bias: \"{}\" (training the base's {}biases beside the adapters) is not "
        "implemented: a LoRA run's base is frozen whole (parameters only, no gradients or "
        "optimizer state); set it to \"none\", or train without the lora section to train every "
        "parameter",
        lq.bias, lq.bias == "lora_only" ? "targeted layers' " : ""));
  }
  if (lq.enabled && !lq.modules_to_save.empty()) {
    return invalid_argument(fmt::format(
        "lora.modules_to_save: [{}] (whole modules trained beside the adapters) is not "
        "implemented: a LoRA run's base is frozen whole; remove it, or train without the lora "
        "section to train every parameter",
        fmt::join(lq.modules_to_save, ", ")));
  }
  return Status::ok();
}

// The training window (data.seq_len, at most the context) and the monitors strata refuses.
Status resolve_data(Ctx* ctx) {
  Config& c = ctx->cfg;
  if (c.data.seq_len == 0) {
    c.data.seq_len = c.model.context;
    if (is_auto(*ctx, "data.seq_len"))
      note_auto(ctx, "data.seq_len", std::to_string(c.data.seq_len));
  } else if (c.data.seq_len > c.model.context) {
    return invalid_argument(fmt::format("data.seq_len: {} is longer than model.context ({})",
                                        c.data.seq_len, c.model.context));
  }

  if (auto it = ctx->given.find("wandb.enabled"); it != ctx->given.end() && it->second == true) {
    return invalid_argument(
        "wandb.enabled: true is not supported: strata does not talk to Weights & Biases (no "
        "network access from the trainer); set tensorboard.enabled true and upload its event "
        "files with `wandb sync <tensorboard.output_path>/<tensorboard.job_name>`");
  }
  return Status::ok();
}

// The dpo section's rules across its keys (TRL's DPOTrainer's checks).
Status resolve_dpo(Ctx* ctx) {
  const DpoConfig& d = ctx->cfg.dpo;
  if (d.loss_type.empty()) {
    return invalid_argument(fmt::format("dpo.loss_type is an empty list: name one or more of {}",
                                        fmt::join(split(kDpoLossTypes, '|'), ", ")));
  }
  if (!d.loss_weights.empty() && d.loss_weights.size() != d.loss_type.size()) {
    return invalid_argument(fmt::format(
        "dpo.loss_weights has {} weights for {} loss types: give one weight per dpo.loss_type "
        "entry, or leave it out (each weighs 1)",
        d.loss_weights.size(), d.loss_type.size()));
  }
  // f-DPO's reparameterization cancels only in the chosen-rejected difference of scores.
  static const std::set<std::string> kTakeF = {"sigmoid",  "sigmoid_norm", "hinge",    "ipo",
                                               "exo_pair", "robust",       "discopop", "sft"};
  std::vector<std::string> no_f;
  for (const std::string& t : d.loss_type) {
    if (!kTakeF.count(t)) no_f.push_back(t);
  }
  if (d.f_divergence_type != "reverse_kl" && !no_f.empty()) {
    return invalid_argument(fmt::format(
        "dpo.f_divergence_type \"{}\" does not apply to dpo.loss_type {}: only {} are built on "
        "the difference of the chosen and rejected scores; use \"reverse_kl\" with them",
        d.f_divergence_type, fmt::join(no_f, ", "), fmt::join(kTakeF, ", ")));
  }
  const bool exo =
      std::find(d.loss_type.begin(), d.loss_type.end(), "exo_pair") != d.loss_type.end();
  if (exo && d.label_smoothing <= 0.0) {
    return invalid_argument(
        "dpo.loss_type exo_pair needs dpo.label_smoothing above 0 (its epsilon; the EXO paper "
        "recommends 1e-3)");
  }
  return Status::ok();
}

// bf16 / fp16 (auto: the checkpoint's dtype) and the clipping default.
Status resolve_precision(Ctx* ctx) {
  Config& c = ctx->cfg;
  // precision: "auto" is the checkpoint's dtype (config.json's dtype / torch_dtype) where
  // model.from_pretrained names one, as the Hugging Face Trainer's --bf16 / --fp16 would be set
  // for it; false without one.
  const bool pretrained = is_given(*ctx, "model.from_pretrained");
  auto precision_auto = [&](const char* path, DType dt, bool* enabled, bool other) {
    if (!is_auto(*ctx, path)) return;
    *enabled = pretrained && c.model.dtype == dt && !other;
    note_auto(ctx, path,
              pretrained ? fmt::format("{} (model.from_pretrained's dtype is {})", *enabled,
                                       dtype_name(c.model.dtype))
                         : "false");
  };
  precision_auto("fp16.enabled", DType::kF16, &c.fp16.enabled, c.bf16.enabled);
  precision_auto("bf16.enabled", DType::kBF16, &c.bf16.enabled, c.fp16.enabled);
  if (c.fp16.enabled && c.bf16.enabled) {
    return invalid_argument(
        "fp16.enabled and bf16.enabled are both true; enable one of them (bf16 needs no loss "
        "scaling)");
  }
  c.model.dtype = c.bf16.enabled ? DType::kBF16 : c.fp16.enabled ? DType::kF16 : DType::kF32;
  if (is_auto(*ctx, "gradient_clipping")) {
    c.gradient_clipping = 1.0;
    note_auto(ctx, "gradient_clipping", "1");
  }
  return Status::ok();
}

// The optimizer's parameters and the defaults "auto" takes.
Status resolve_optimizer(Ctx* ctx) {
  Config& c = ctx->cfg;
  auto num = [](double x) { return fmt::format("{}", x); };
  bool opt_section = ctx->given.count("optimizer.type") != 0;
  for (const auto& [path, v] : ctx->given) {
    if (path.rfind("optimizer.params.", 0) == 0 && !opt_section) {
      return invalid_argument(
          "optimizer.type: required when optimizer.params is given; one of "
          "Adam, AdamW, Adagrad, Lion");
    }
  }
  if (is_auto(*ctx, "optimizer.params.lr")) {
    if (is_given(*ctx, "scheduler.params.warmup_max_lr"))
      c.optimizer.lr = c.scheduler.warmup_max_lr;
    note_auto(ctx, "optimizer.params.lr", num(c.optimizer.lr));
  }
  if (is_auto(*ctx, "optimizer.params.betas")) {
    note_auto(ctx, "optimizer.params.betas",
              fmt::format("[{}, {}]", c.optimizer.beta1, c.optimizer.beta2));
  }
  if (is_auto(*ctx, "optimizer.params.eps"))
    note_auto(ctx, "optimizer.params.eps", num(c.optimizer.eps));
  if (is_auto(*ctx, "optimizer.params.weight_decay")) {
    note_auto(ctx, "optimizer.params.weight_decay", num(c.optimizer.weight_decay));
  }
  return Status::ok();
}

// The scheduler: its parameters for its type, warm-up and length defaults.
Status resolve_scheduler(Ctx* ctx) {
  Config& c = ctx->cfg;
  auto num = [](double x) { return fmt::format("{}", x); };
  SchedulerConfig& sc = c.scheduler;
  bool sched_params = false;
  for (const auto& [path, v] : ctx->given) sched_params |= path.rfind("scheduler.params.", 0) == 0;
  for (const std::string& path : ctx->autos)
    sched_params |= path.rfind("scheduler.params.", 0) == 0;
  if (sc.type.empty() && sched_params) {
    return invalid_argument(
        "scheduler.type: required when scheduler.params is given; one of "
        "WarmupLR, WarmupDecayLR, WarmupCosineLR");
  }
  if (!sc.type.empty()) {
    std::vector<std::string> takes = {"warmup_num_steps", "warmup_type", "last_batch_iteration"};
    if (sc.type == "WarmupCosineLR") {
      takes.insert(takes.end(), {"total_num_steps", "warmup_min_ratio", "cos_min_ratio"});
    } else {
      takes.insert(takes.end(), {"warmup_min_lr", "warmup_max_lr"});
      if (sc.type == "WarmupDecayLR") takes.push_back("total_num_steps");
    }
    std::vector<std::string> set_params;
    for (const auto& [path, v] : ctx->given) set_params.push_back(path);
    set_params.insert(set_params.end(), ctx->autos.begin(), ctx->autos.end());
    for (const std::string& path : set_params) {
      if (path.rfind("scheduler.params.", 0) != 0) continue;
      std::string name = path.substr(std::strlen("scheduler.params."));
      if (std::find(takes.begin(), takes.end(), name) == takes.end()) {
        return invalid_argument(fmt::format("{}: not a parameter of {} (it takes {})", path,
                                            sc.type, fmt::join(takes, ", ")));
      }
    }
  }
  if (!is_given(*ctx, "scheduler.params.warmup_max_lr")) {
    sc.warmup_max_lr = c.optimizer.lr;
    if (is_auto(*ctx, "scheduler.params.warmup_max_lr")) {
      note_auto(ctx, "scheduler.params.warmup_max_lr", num(sc.warmup_max_lr));
    }
  }
  if (is_auto(*ctx, "scheduler.params.warmup_min_lr")) {
    sc.warmup_min_lr = 0;
    note_auto(ctx, "scheduler.params.warmup_min_lr", "0");
  }
  if (is_auto(*ctx, "scheduler.params.warmup_num_steps")) {
    // The Hugging Face integration's get_warmup_steps: ceil(steps * warmup_ratio), with a
    // warmup ratio of 0.1 (the Trainer's is an argument strata does not have). At least one
    // step: a run of fewer than 10 steps still warms up, and never past its length.
    sc.warmup_num_steps = std::max<int64_t>(1, (c.train.steps + 9) / 10);
    note_auto(
        ctx, "scheduler.params.warmup_num_steps",
        fmt::format("{} (10% of train.steps {}, rounded up)", sc.warmup_num_steps, c.train.steps));
  }
  if (!is_given(*ctx, "scheduler.params.total_num_steps")) {
    sc.total_num_steps = c.train.steps;
    if (is_auto(*ctx, "scheduler.params.total_num_steps")) {
      note_auto(ctx, "scheduler.params.total_num_steps", std::to_string(sc.total_num_steps));
    }
  }
  if ((sc.type == "WarmupDecayLR" || sc.type == "WarmupCosineLR") &&
      sc.warmup_num_steps > sc.total_num_steps) {
    return invalid_argument(
        fmt::format("scheduler.params.warmup_num_steps: {} is longer than total_num_steps ({})",
                    sc.warmup_num_steps, sc.total_num_steps));
  }
  if (sc.warmup_min_lr > sc.warmup_max_lr) {
    return invalid_argument(
        fmt::format("scheduler.params.warmup_min_lr: {} is above warmup_max_lr ({})",
                    sc.warmup_min_lr, sc.warmup_max_lr));
  }
  return Status::ok();
}

// strata.activations from DeepSpeed's activation_checkpointing, and forward groups.
Status resolve_activations(Ctx* ctx) {
  Config& c = ctx->cfg;
  // activations: DeepSpeed's activation_checkpointing maps onto strata.activations unless that
  // is given (strata checkpoints at every block boundary).
  if (!is_given(*ctx, "strata.activations")) {
    auto flag = [&](const char* path) {
      auto it = ctx->given.find(path);
      return it != ctx->given.end() && it->second.is_boolean() && it->second.get<bool>();
    };
    auto count = ctx->given.find("activation_checkpointing.number_checkpoints");
    const bool counted = count != ctx->given.end() && count->second.is_number_integer() &&
                         count->second.get<int64_t>() > 0;
    const char* from = nullptr;
    if (flag("activation_checkpointing.cpu_checkpointing")) {
      c.strata.activations = "offload";
      from = "activation_checkpointing.cpu_checkpointing";
    } else if (flag("activation_checkpointing.partition_activations")) {
      c.strata.activations = "recompute";
      from = "activation_checkpointing.partition_activations";
    } else if (counted) {
      c.strata.activations = "recompute";
      from = "activation_checkpointing.number_checkpoints";
    }
    if (from) {
      c.resolved_auto.push_back(
          fmt::format("strata.activations = {} (from {})", c.strata.activations, from));
    }
  }

  if (c.strata.grouped_forwards > c.gradient_accumulation_steps) {
    return invalid_argument(fmt::format(
        "strata.grouped_forwards: {} is more than gradient_accumulation_steps ({}); a forward "
        "group holds at most one step's micro-batches (set it to {} or less, or \"auto\")",
        c.strata.grouped_forwards, c.gradient_accumulation_steps, c.gradient_accumulation_steps));
  }
  if (c.strata.grouped_forwards > 1 && c.strata.activations == "offload") {
    return invalid_argument(fmt::format(
        "strata.grouped_forwards: {} under strata.activations = offload, which keeps one set of "
        "block inputs; set strata.grouped_forwards to 1 (or \"auto\"), or activations to keep "
        "or recompute",
        c.strata.grouped_forwards));
  }
  return Status::ok();
}

// The ZeRO section's size defaults (from the model's width) and offload combinations.
Status resolve_zero(Ctx* ctx) {
  Config& c = ctx->cfg;
  ZeroConfig& z = c.zero;
  const size_t h = static_cast<size_t>(c.model.n_embd);
  auto size_auto = [&](const char* path, size_t* field, size_t value) {
    if (!is_auto(*ctx, path)) return;
    *field = value;
    note_auto(ctx, path, std::to_string(value));
  };
  size_auto("zero_optimization.reduce_bucket_size", &z.reduce_bucket_size, h * h);
  size_auto("zero_optimization.stage3_prefetch_bucket_size", &z.stage3_prefetch_bucket_size,
            h * h * 9 / 10);
  size_auto("zero_optimization.stage3_param_persistence_threshold",
            &z.stage3_param_persistence_threshold, 10 * h);
  size_auto("zero_optimization.stage3_max_live_parameters", &z.stage3_max_live_parameters,
            1'000'000'000);
  size_auto("zero_optimization.stage3_max_reuse_distance", &z.stage3_max_reuse_distance,
            1'000'000'000);
  if (!is_given(*ctx, "zero_optimization.overlap_comm")) z.overlap_comm = z.stage == 3;
  if (z.offload_param.device != "none" && z.stage != 3) {
    return invalid_argument(fmt::format(
        "zero_optimization.offload_param.device: {} needs zero_optimization.stage 3 (got {})",
        z.offload_param.device, z.stage));
  }
  if (z.offload_optimizer.ratio < 1.0 && z.stage != 3) {
    return invalid_argument(
        fmt::format("zero_optimization.offload_optimizer.ratio: {} (partial offload) needs "
                    "zero_optimization.stage 3 (got {})",
                    z.offload_optimizer.ratio, z.stage));
  }
  for (auto [name, off] : {std::pair{"offload_param", &z.offload_param},
                           std::pair{"offload_optimizer", &z.offload_optimizer}}) {
    if (off->device == "nvme" && off->nvme_path.empty()) {
      return invalid_argument(fmt::format(
          "zero_optimization.{}.nvme_path: required when device is nvme; give a directory on "
          "an NVMe file system",
          name));
    }
  }
  return Status::ok();
}

}  // namespace

// Resolves what the parsed config leaves to "auto" and checks the combinations no one key
// can, a section at a time in the order each depends on the last (the model first: the
// precision, the batch and the ZeRO sizes read it).
Status resolve(Ctx* ctx, int world_size) {
  if (world_size > 1 && ctx->cfg.strata.comm_backend == "single") {
    // Each process would train alone, over the same checkpoint directory and swap files.
    return invalid_argument(fmt::format(
        "strata.comm.backend is single, which trains one rank, but the launcher started {} "
        "processes: use mpi (or auto) to train them as {} ranks, or run one process",
        world_size, world_size));
  }
  STRATA_RETURN_IF_ERROR(resolve_model(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_lora(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_data(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_dpo(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_precision(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_batch(ctx, world_size), "");
  STRATA_RETURN_IF_ERROR(resolve_optimizer(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_scheduler(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_activations(ctx), "");
  return resolve_zero(ctx);
}

}  // namespace strata::config_internal

namespace strata {

Status check_model_ranges(const ModelConfig& model, const std::string& origin) {
  Config c;
  c.model = model;
  const auto [key, why] = config_internal::first_model_range_error(c);
  if (key == nullptr) return Status::ok();
  return invalid_argument(fmt::format("{}: {}", origin, why.message()));
}

}  // namespace strata
