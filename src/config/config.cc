// The config parser: one table of every accepted key drives parsing, unknown-key suggestions,
// overrides, the not-acted-on report and the reference docs.
//
// Flow: parse JSON -> apply overrides (paths checked against the table) -> walk the document,
// checking each leaf's type and range and writing it into the Config -> resolve "auto" and
// defaults that depend on other keys -> cross-key rules (batch triple, fp16/bf16, ...) -> list
// settings the engine does not act on yet.
#include "strata/config.h"

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
#include "src/config/key_table.h"
#include "src/config/leaf.h"
#include "src/config/model_shape.h"
#include "src/hf/hf_config.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;
using namespace config_internal;

// Parser state.
struct Ctx {
  Config cfg;
  std::map<std::string, json> given;  // canonical path -> normalized value (absent: not set)
  std::set<std::string> autos;        // canonical paths set to "auto"
};

Status walk(const json& obj, const std::string& section, Ctx* ctx) {
  const Schema& s = schema();
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string path = join(section, it.key());
    const json& v = it.value();
    auto leaf = s.leaf.find(path);
    if (leaf != s.leaf.end()) {
      const Key& key = s.keys[leaf->second];
      if (v.is_null()) continue;  // DeepSpeed's None: the default
      const std::string& canon = canonical(key);
      if (ctx->given.count(canon) || ctx->autos.count(canon)) {
        return invalid_argument(
            fmt::format("{}: given twice (as {}); these keys are aliases, keep one", path,
                        fmt::join(s.alias_group.at(canon), " and ")));
      }
      if ((key.flags & kAuto) && v.is_string() && v.get<std::string>() == "auto") {
        ctx->autos.insert(canon);
        continue;
      }
      STRATA_ASSIGN_OR_RETURN(json norm, check_value(key.type, v, path), "");
      if (key.set) key.set(ctx->cfg, norm);
      ctx->given[canon] = std::move(norm);
      continue;
    }
    if (s.children.count(path)) {
      if (v.is_null()) continue;
      if (!v.is_object()) return type_error(path, "object", v);
      STRATA_RETURN_IF_ERROR(walk(v, path, ctx), "");
      continue;
    }
    return unknown_key(section, it.key());
  }
  return Status::ok();
}

Status apply_override(json* doc, const std::string& text) {
  size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    return invalid_argument(
        fmt::format("override \"{}\": expected path=value, e.g. zero_optimization.stage=3", text));
  }
  std::string path = text.substr(0, eq);
  std::string value_text = text.substr(eq + 1);
  std::vector<std::string> segs = split(path, '.');
  const Schema& s = schema();
  std::string section;
  const Key* leaf = nullptr;
  for (size_t i = 0; i < segs.size(); ++i) {
    if (segs[i].empty()) {
      return invalid_argument(fmt::format("override \"{}\": empty name in path", text));
    }
    std::string full = join(section, segs[i]);
    auto it = s.leaf.find(full);
    if (it != s.leaf.end()) {
      leaf = &s.keys[it->second];
      if (leaf->type.kind == Kind::kAny) break;  // free-form below this key
      if (i + 1 != segs.size()) {
        return invalid_argument(
            fmt::format("override \"{}\": {} is a value, not a section", text, full));
      }
      break;
    }
    if (!s.children.count(full)) {
      return unknown_key(section, segs[i]).with_context(fmt::format("override \"{}\"", text));
    }
    section = full;
  }
  Status depth = check_json_depth(value_text);
  if (!depth.is_ok()) return depth.with_context(fmt::format("override \"{}\"", path));
  json value = json::parse(value_text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = value_text;  // not JSON (or 1e400): a string

  json* cur = doc;
  for (size_t i = 0; i + 1 < segs.size(); ++i) {
    json& next = (*cur)[segs[i]];
    if (!next.is_object()) next = json::object();
    cur = &next;
  }
  // An override of one spelling of an aliased key replaces every spelling in the file.
  if (leaf && leaf->type.kind != Kind::kAny) {
    for (const std::string& spelling : s.alias_group.at(canonical(*leaf))) {
      cur->erase(split(spelling, '.').back());
    }
  }
  (*cur)[segs.back()] = std::move(value);
  return Status::ok();
}

void note_auto(Ctx* ctx, const std::string& path, const std::string& value) {
  ctx->cfg.resolved_auto.push_back(fmt::format("{} = {} (auto)", path, value));
}
bool is_auto(const Ctx& ctx, const char* path) { return ctx.autos.count(path) != 0; }
bool is_given(const Ctx& ctx, const char* path) { return ctx.given.count(path) != 0; }

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
  if (has_t && has_m && has_g) {
    // checked below
  } else if (has_t && has_m) {
    g = t / (m * ws);
  } else if (has_t && has_g) {
    m = t / (g * ws);
  } else if (has_m && has_g) {
    t = m * g * ws;
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
  if (m < 1 || g < 1 || t != m * g * ws) {
    return invalid_argument(fmt::format(
        "train_batch_size ({}) must equal train_micro_batch_size_per_gpu ({}) * "
        "gradient_accumulation_steps ({}) * world_size ({}) = {}; fix one of them or leave one "
        "out to have it derived",
        t, m, g, ws, m * g * ws));
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
Status check_pretrained_ranges(const Config& c, const std::string& dir) {
  for (const Key& k : schema().keys) {
    if (k.path.rfind("model.", 0) != 0 || !k.alias_of.empty() || !k.get) continue;
    if (k.type.kind != Kind::kInt && k.type.kind != Kind::kReal) continue;
    Result<json> v = check_value(k.type, k.get(c), k.path);
    if (v.is_ok()) continue;
    const std::string hf_key = hf_config_key(c.model.type, k.path);
    return invalid_argument(
        fmt::format("{}/config.json: {}is beyond what strata trains ({}){}", dir,
                    hf_key.empty() ? "" : hf_key + " ", v.status().message(),
                    k.path == "model.context" ? "; give a shorter model.context beside "
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

// Resolves what the parsed config leaves to "auto" and checks the combinations no one key
// can, a section at a time in the order each depends on the last (the model first: the
// precision, the batch and the ZeRO sizes read it).
Status resolve(Ctx* ctx, int world_size) {
  STRATA_RETURN_IF_ERROR(resolve_model(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_lora(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_data(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_precision(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_batch(ctx, world_size), "");
  STRATA_RETURN_IF_ERROR(resolve_optimizer(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_scheduler(ctx), "");
  STRATA_RETURN_IF_ERROR(resolve_activations(ctx), "");
  return resolve_zero(ctx);
}

std::string value_text(const json& v) {
  return v.is_string() ? v.get<std::string>()
                       : v.dump(-1, ' ', false, json::error_handler_t::replace);
}

void list_not_acted_on(Ctx* ctx) {
  static const Config defaults;
  const Schema& s = schema();
  for (const Key& k : s.keys) {
    if (!k.not_acted || !k.alias_of.empty()) continue;
    auto it = ctx->given.find(k.path);
    if (it == ctx->given.end()) continue;
    json value = k.get ? k.get(ctx->cfg) : it->second;
    json dflt = k.get ? k.get(defaults) : json::parse(k.dflt);
    if (k.type.kind == Kind::kAny) {
      if (value.is_object() && value.value("enabled", true) == false) continue;
    } else if (value == dflt) {
      continue;
    }
    ctx->cfg.not_acted_on.push_back(
        fmt::format("{} = {}: accepted; {}", k.path, value_text(value), k.not_acted));
  }
}

// DeepSpeed refuses a key given twice in one object (its JSON loader raises); so does strata.
// nlohmann::json keeps the last silently, so a SAX pass looks for duplicates first.
class DuplicateKeyFinder : public json::json_sax_t {
 public:
  std::string duplicate;  // path of the first duplicate, "" if none

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override {
    frames_.push_back({true, {}, "", 0});
    return true;
  }
  bool key(string_t& k) override {
    Frame& f = frames_.back();
    f.key = k;
    if (!f.keys.insert(k).second) {
      duplicate = path();
      return false;  // stop: report the first one
    }
    return true;
  }
  bool end_object() override { return end(); }
  bool start_array(std::size_t) override {
    frames_.push_back({false, {}, "", 0});
    return true;
  }
  bool end_array() override { return end(); }
  bool parse_error(std::size_t, const std::string&, const json::exception&) override {
    return false;
  }

 private:
  struct Frame {
    bool object;
    std::set<std::string> keys;
    std::string key;
    size_t index;
  };
  bool value() {
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().index;
    return true;
  }
  bool end() {
    frames_.pop_back();
    return value();
  }
  std::string path() const {
    std::string p;
    for (const Frame& f : frames_) {
      p = f.object ? join(p, f.key) : fmt::format("{}[{}]", p, f.index);
    }
    return p;
  }
  std::vector<Frame> frames_;
};

}  // namespace

Result<size_t> parse_size(const std::string& text) {
  auto bad = [&](std::string_view why) -> Status {
    return invalid_argument(fmt::format(
        "\"{}\": {}; use a byte count or a number with a unit: k, M, G, T (x1000) or KiB, MiB, "
        "GiB, TiB (x1024), e.g. \"16GiB\"",
        text, why));
  };
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i < text.size() && text[i] == '-') return bad("negative size");
  if (i == text.size() || !(std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    return bad("not a size");
  }
  const char* begin = text.c_str() + i;
  char* end = nullptr;
  errno = 0;
  double mant = std::strtod(begin, &end);
  if (end == begin || errno == ERANGE) return bad("not a size");
  std::string unit(end);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();
  std::string u;
  for (char ch : unit) u.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
  static const std::pair<const char*, double> kUnits[] = {{"", 1},
                                                          {"b", 1},
                                                          {"k", 1e3},
                                                          {"kb", 1e3},
                                                          {"m", 1e6},
                                                          {"mb", 1e6},
                                                          {"g", 1e9},
                                                          {"gb", 1e9},
                                                          {"t", 1e12},
                                                          {"tb", 1e12},
                                                          {"p", 1e15},
                                                          {"pb", 1e15},
                                                          {"ki", 1024.0},
                                                          {"kib", 1024.0},
                                                          {"mi", 1048576.0},
                                                          {"mib", 1048576.0},
                                                          {"gi", 1073741824.0},
                                                          {"gib", 1073741824.0},
                                                          {"ti", 1099511627776.0},
                                                          {"tib", 1099511627776.0},
                                                          {"pi", 1125899906842624.0},
                                                          {"pib", 1125899906842624.0}};
  double scale = 0;
  for (const auto& [name, mult] : kUnits) {
    if (u == name) scale = mult;
  }
  if (scale == 0) return bad(fmt::format("unknown unit \"{}\"", unit));
  double bytes = mant * scale;
  if (!std::isfinite(bytes) || bytes >= 1.8446744073709552e19) return bad("too large");
  double whole = std::round(bytes);
  if (std::fabs(bytes - whole) > 1e-6 * std::max(1.0, whole)) {
    return bad("not a whole number of bytes");
  }
  return static_cast<size_t>(whole);
}

Result<Config> parse_config(const std::string& json_text, const std::string& origin,
                            const std::vector<std::string>& overrides, int world_size) {
  STRATA_ASSIGN_OR_RETURN(json doc, parse_json_text(json_text, origin, /*comments=*/true), "");
  DuplicateKeyFinder dups;
  (void)json::sax_parse(json_text, &dups, json::input_format_t::json, /*strict=*/true,
                        /*ignore_comments=*/true);
  if (!dups.duplicate.empty()) {
    return invalid_argument(
        fmt::format("{}: {}: key given twice in one object; keep one (DeepSpeed refuses this too)",
                    origin, dups.duplicate));
  }
  if (!doc.is_object()) {
    return invalid_argument(fmt::format("{}: expected a JSON object at the top level, got {}",
                                        origin, short_dump(doc)));
  }
  if (world_size < 1) {
    return invalid_argument(
        fmt::format("{}: world_size {} must be at least 1", origin, world_size));
  }
  for (const std::string& ov : overrides) {
    Status st = apply_override(&doc, ov);
    if (!st.is_ok()) return st.with_context(origin);
  }
  Ctx ctx;
  Status st = walk(doc, "", &ctx);
  if (st.is_ok()) st = resolve(&ctx, world_size);
  if (!st.is_ok()) return st.with_context(origin);
  list_not_acted_on(&ctx);
  // strata.optimizer.defer says where an overlapped step that clipping holds back runs: without
  // the overlap there is no such step, and the key does nothing.
  if (ctx.given.count("strata.optimizer.defer") && !ctx.cfg.strata.optimizer_overlap &&
      ctx.cfg.strata.optimizer_defer != "auto") {
    log_warn(
        "{}: strata.optimizer.defer = {} has no effect with strata.optimizer.overlap = false "
        "(every step runs after backward); set strata.optimizer.overlap = true to use it, or "
        "remove it",
        origin, ctx.cfg.strata.optimizer_defer);
  }
  return std::move(ctx.cfg);
}

Status check_model_given(const Config& config) {
  if (config.model.given) return Status::ok();
  return invalid_argument(
      "the config has no model: add a \"model\" section, either {\"from_pretrained\": "
      "\"<Hugging Face model directory>\", \"context\": <tokens>} to fine-tune a checkpoint, "
      "or model.type and its shape keys (n_layer, n_head, n_embd, vocab_size, context; see "
      "docs/CONFIG.md) for a fresh one, or --set model.from_pretrained=DIR. A DeepSpeed config "
      "(e.g. the Hugging Face Trainer's ZeRO-3 one) describes the engine, not the model");
}

Status check_model_shape(const ModelConfig& m) {
  if (m.n_layer < 1 || m.n_head < 1 || m.n_embd < 1 || m.vocab_size < 2 || m.context < 1) {
    return invalid_argument("model: n_layer, n_head, n_embd, context must be >= 1, vocab >= 2");
  }
  if (m.n_embd % m.n_head != 0) {
    return invalid_argument(
        fmt::format("model.n_embd: {} is not divisible by model.n_head ({})", m.n_embd, m.n_head));
  }
  if (m.padded_vocab_size != 0 && m.padded_vocab_size < m.vocab_size) {
    return invalid_argument(
        fmt::format("model.padded_vocab_size: {} is smaller than model.vocab_size ({})",
                    m.padded_vocab_size, m.vocab_size));
  }
  return Status::ok();
}

std::string model_section_json(const ModelConfig& model) {
  static const std::set<std::string> kAlways = {"model.type",       "model.n_layer",
                                                "model.n_head",     "model.n_embd",
                                                "model.vocab_size", "model.context"};
  Config given, defaults;
  given.model = model;
  json section = json::object();
  for (const Key& k : schema().keys) {
    if (k.path.rfind("model.", 0) != 0 || k.get == nullptr || !k.alias_of.empty()) continue;
    const json v = k.get(given);
    if (kAlways.count(k.path) == 0 && v == k.get(defaults)) continue;
    std::string pointer = "/" + k.path.substr(6);
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    section[json::json_pointer(pointer)] = v;
  }
  return section.dump();
}

Result<Config> load_config(const std::string& path, const std::vector<std::string>& overrides,
                           int world_size) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return invalid_argument(fmt::format("{}: is a directory; give the config file's path", path));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return errno_status(errno ? errno : ENOENT,
                        fmt::format("{}: cannot open config file (check the path)", path));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return errno_status(errno ? errno : EIO, fmt::format("{}: reading", path));
  return parse_config(ss.str(), path, overrides, world_size);
}

void log_config_notes(const Config& config) {
  for (const std::string& line : config.resolved_auto) log_info("config: {}", line);
  for (const std::string& line : config.not_acted_on) log_info("config: {}", line);
}

}  // namespace strata
