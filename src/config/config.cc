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

#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Why a setting is accepted but not acted on. When a feature lands, set its keys' reason to
// nullptr in the table below (or retire the constant): this is the one list to shrink.
constexpr const char* kAlwaysStage3 =
    "across ranks strata always partitions parameters, gradients and optimizer state (stage 3)";
constexpr const char* kFastInit = "swap files are always preallocated with fallocate";
constexpr const char* kFlatModules =
    "each module's parameters and gradients are always one flat buffer, gathered and "
    "reduce-scattered whole (stage 3)";
constexpr const char* kGatherWindow =
    "stage 3 gathers whole modules with all-gather, ahead by stage3_prefetch_bucket_size";
constexpr const char* kPersistence =
    "persistence is decided per module by stage3_param_persistence_threshold";
constexpr const char* kNo16bitSave =
    "checkpoints hold each rank's fp32 master weights and moments, not gathered 16-bit weights";
constexpr const char* kWholeModuleOptimizer =
    "the optimizer pipeline steps whole modules (no sub-groups yet)";
constexpr const char* kIoWorker =
    "the I/O worker batches submissions and reaps completions on its own thread";
constexpr const char* kNoGds = "NVMe data moves through pinned host buffers (no GPUDirect Storage)";
constexpr const char* kFp32Grads =
    "gradients are reduced in fp32 and scaled once by 1/(tokens of the global batch)";
constexpr const char* kTimers = "the trainer prints its own time split with each log line";
constexpr const char* kNoCast = "inputs are token ids; there is nothing to cast";
constexpr const char* kOneAdam = "strata has one Adam implementation per backend";
constexpr const char* kMonitor = "strata writes JSONL metrics (train.log_file)";
constexpr const char* kActCkptCount =
    "strata saves every block's input whatever the count (any value > 0 turns on "
    "strata.activations = recompute)";
constexpr const char* kActCkptContiguous =
    "strata's saved block inputs already live in one device arena";
constexpr const char* kActCkptSync =
    "strata orders block-input copies with stream events, never a device-wide synchronize";
constexpr const char* kActCkptProfile =
    "strata times the whole step; recompute is not timed separately";
constexpr const char* kDsOnly = "a DeepSpeed feature strata does not implement";
constexpr const char* kResume = "resume restores the step from the checkpoint";
constexpr const char* kAlwaysPipelined =
    "strata always pipelines optimizer-state reads and writes (depth: buffer_count)";
constexpr const char* kOwnStaging =
    "strata sizes parameter staging from stage3_prefetch_bucket_size and the host tier budget";

// ---------------------------------------------------------------------------------------------
// Value types.
enum class Kind { kBool, kInt, kReal, kSize, kString, kEnum, kStringList, kBetas, kDType, kAny };

struct Type {
  Kind kind;
  double lo = 0, hi = 0;
  bool lo_open = false, hi_open = false;
  const char* values = nullptr;  // kEnum: "a|b|c"
  uint64_t multiple = 0;         // kSize: must be a multiple of this
};

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kMaxInt = kInf;          // no upper bound (values beyond 2^62 are refused)
constexpr double kMaxI32 = 2147483647.0;  // keys stored in an int
constexpr double kIntLimit = 4.611686018427387904e18;  // 2^62

Type Bool() { return {Kind::kBool}; }
Type Int(double lo, double hi) { return {Kind::kInt, lo, hi}; }
Type Real(double lo, double hi, bool lo_open = false, bool hi_open = false) {
  return {Kind::kReal, lo, hi, lo_open, hi_open};
}
Type Size(double lo = 0, double hi = kInf, uint64_t multiple = 0) {
  return {Kind::kSize, lo, hi, false, hi == kInf, nullptr, multiple};
}
Type Str() { return {Kind::kString}; }
Type Enum(const char* values) { return {Kind::kEnum, 0, 0, false, false, values}; }
Type StrList() { return {Kind::kStringList}; }
Type Betas() { return {Kind::kBetas, 0, 1, false, true}; }
Type DTypeT() { return {Kind::kDType, 0, 0, false, false, "fp32|bf16|fp16"}; }
Type Any() { return {Kind::kAny}; }

using Setter = void (*)(Config&, const json&);
using Getter = json (*)(const Config&);

template <typename T>
void set_from(const json& v, T& out) {
  if constexpr (std::is_same_v<T, DType>) {
    parse_dtype(v.get<std::string>(), &out);
  } else {
    out = v.get<T>();
  }
}
template <typename T>
json get_of(const T& x) {
  if constexpr (std::is_same_v<T, DType>) {
    return dtype_name(x);
  } else {
    return json(x);
  }
}

// Binds a key to a Config member.
#define STRATA_M(member)                                   \
  [](Config& c, const json& v) { set_from(v, c.member); }, \
      [](const Config& c) -> json { return get_of(c.member); }

constexpr unsigned kAuto = 1;  // "auto" accepted, resolved after the walk

// One accepted key. Bound keys write a Config member; unbound keys (DeepSpeed features strata
// does not have) are validated, compared with `dflt` (JSON text) and reported.
struct Key {
  std::string path;
  Type type;
  Setter set = nullptr;
  Getter get = nullptr;
  const char* doc = "";
  const char* not_acted = nullptr;  // nullptr: the engine acts on it
  unsigned flags = 0;
  const char* dflt = nullptr;  // unbound: default as JSON; bound: default's description if dynamic
  std::string alias_of;        // "" or the canonical key's path
  const char* group = "";      // heading in the reference docs
};

Key F(const char* path, Type t, Setter s, Getter g, const char* doc,
      const char* not_acted = nullptr, unsigned flags = 0, const char* dflt_note = nullptr) {
  return Key{path, t, s, g, doc, not_acted, flags, dflt_note, "", ""};
}
// Unbound: accepted, checked, never acted on.
Key U(const char* path, Type t, const char* dflt_json, const char* doc, const char* not_acted) {
  return Key{path, t, nullptr, nullptr, doc, not_acted, 0, dflt_json, "", ""};
}

std::vector<Key> build_table() {
  std::vector<Key> k;
  const char* heading = "";
  auto group = [&](const char* h) { heading = h; };
  auto add = [&](Key key) {
    key.group = heading;
    k.push_back(std::move(key));
  };
  auto alias = [&](const char* path, const char* canonical) {
    for (const Key& c : k) {
      if (c.path == canonical) {
        Key a = c;
        a.path = path;
        a.alias_of = canonical;
        a.doc = "alias";
        k.push_back(std::move(a));
        return;
      }
    }
    STRATA_CHECK(false, "alias of an unknown key");
  };

  // --- batch, clipping, printing ------------------------------------------------------------
  group("DeepSpeed: batch, clipping, printing");
  add(F("train_batch_size", Int(1, kMaxInt), STRATA_M(train_batch_size),
        "global batch: micro x accumulation x world size", nullptr, kAuto, "derived"));
  add(F("train_micro_batch_size_per_gpu", Int(1, kMaxInt), STRATA_M(train_micro_batch_size_per_gpu),
        "sequences per rank per forward/backward", nullptr, kAuto,
        "derived (1 if only this is missing)"));
  add(F("gradient_accumulation_steps", Int(1, kMaxInt), STRATA_M(gradient_accumulation_steps),
        "micro-batches per optimizer step", nullptr, kAuto, "derived (1 if only this is missing)"));
  add(F("gradient_clipping", Real(0, kInf, false, true), STRATA_M(gradient_clipping),
        "max global gradient L2 norm; 0 = off (auto: 1.0)", nullptr, kAuto));
  add(F("steps_per_print", Int(1, kMaxInt), STRATA_M(steps_per_print), "steps between log lines"));
  add(F("wall_clock_breakdown", Bool(), STRATA_M(wall_clock_breakdown),
        "DeepSpeed's per-phase timers", kTimers));

  // --- fp16 / bf16 ----------------------------------------------------------------------------
  group("DeepSpeed: fp16 / bf16");
  add(F("fp16.enabled", Bool(), STRATA_M(fp16.enabled), "fp16 params/activations (auto: false)",
        nullptr, kAuto));
  add(F("fp16.loss_scale", Real(0, kInf, false, true), STRATA_M(fp16.loss_scale),
        "static loss scale; 0 = dynamic"));
  add(F("fp16.initial_scale_power", Int(0, 62), STRATA_M(fp16.initial_scale_power),
        "dynamic: initial scale 2^power"));
  add(F("fp16.loss_scale_window", Int(1, kMaxI32), STRATA_M(fp16.loss_scale_window),
        "dynamic: overflow-free steps before the scale doubles"));
  add(F("fp16.hysteresis", Int(1, kMaxI32), STRATA_M(fp16.hysteresis),
        "dynamic: overflows tolerated before the scale halves"));
  add(F(
      "fp16.consecutive_hysteresis", Bool(),
      [](Config& c, const json& v) { c.fp16.consecutive_hysteresis = v.get<bool>() ? 1 : 0; },
      [](const Config& c) -> json { return c.fp16.consecutive_hysteresis != 0; },
      "dynamic: refill hysteresis after an overflow-free step"));
  add(F("fp16.min_loss_scale", Real(0, kInf, true, true), STRATA_M(fp16.min_loss_scale),
        "dynamic: floor of the scale"));
  add(F("fp16.auto_cast", Bool(), STRATA_M(fp16.auto_cast), "cast module inputs to fp16", kNoCast));
  add(F("bf16.enabled", Bool(), STRATA_M(bf16.enabled), "bf16 params/activations (auto: false)",
        nullptr, kAuto));

  // --- optimizer --------------------------------------------------------------------------------
  group("DeepSpeed: optimizer");
  add(F("optimizer.type", Enum("Adam|AdamW|Adagrad|Lion"), STRATA_M(optimizer.type),
        "optimizer (case-insensitive); required when the section is given"));
  add(F("optimizer.params.lr", Real(0, kInf, true, true), STRATA_M(optimizer.lr),
        "learning rate (auto: scheduler.params.warmup_max_lr if given, else 1e-3)", nullptr,
        kAuto));
  add(F(
      "optimizer.params.betas", Betas(),
      [](Config& c, const json& v) {
        c.optimizer.beta1 = v[0].get<double>();
        c.optimizer.beta2 = v[1].get<double>();
      },
      [](const Config& c) -> json {
        return json::array({c.optimizer.beta1, c.optimizer.beta2});
      },
      "[beta1, beta2], each in [0, 1) (auto: [0.9, 0.999])", nullptr, kAuto));
  add(F("optimizer.params.eps", Real(0, 1, true, false), STRATA_M(optimizer.eps),
        "denominator epsilon (auto: 1e-8)", nullptr, kAuto));
  add(F("optimizer.params.weight_decay", Real(0, kInf, false, true),
        STRATA_M(optimizer.weight_decay), "weight decay (auto: 0)", nullptr, kAuto));
  add(F("optimizer.params.adam_w_mode", Bool(), STRATA_M(optimizer.adam_w_mode),
        "Adam: decoupled weight decay (AdamW)"));
  add(F("optimizer.params.torch_adam", Bool(), STRATA_M(optimizer.torch_adam),
        "DeepSpeed: use torch's Adam", kOneAdam));
  add(F("optimizer.params.bias_correction", Bool(), STRATA_M(optimizer.bias_correction),
        "Adam bias correction"));

  // --- scheduler --------------------------------------------------------------------------------
  group("DeepSpeed: scheduler");
  add(F("scheduler.type", Enum("WarmupLR|WarmupDecayLR|WarmupCosineLR"), STRATA_M(scheduler.type),
        "lr schedule; absent = constant optimizer.params.lr", nullptr, 0, "\"\" (constant)"));
  add(F("scheduler.params.warmup_min_lr", Real(0, kInf, false, true),
        STRATA_M(scheduler.warmup_min_lr), "WarmupLR/WarmupDecayLR: lr at step 0 (auto: 0)",
        nullptr, kAuto));
  add(F("scheduler.params.warmup_max_lr", Real(0, kInf, true, true),
        STRATA_M(scheduler.warmup_max_lr), "WarmupLR/WarmupDecayLR: lr after warmup", nullptr,
        kAuto, "optimizer.params.lr"));
  add(F("scheduler.params.warmup_num_steps", Int(0, kMaxInt), STRATA_M(scheduler.warmup_num_steps),
        "warmup length (auto: train.steps / 10)", nullptr, kAuto));
  add(F("scheduler.params.warmup_type", Enum("log|linear"), STRATA_M(scheduler.warmup_type),
        "warmup curve"));
  add(F("scheduler.params.total_num_steps", Int(1, kMaxInt), STRATA_M(scheduler.total_num_steps),
        "WarmupDecayLR/WarmupCosineLR: schedule length", nullptr, kAuto, "train.steps"));
  add(F("scheduler.params.warmup_min_ratio", Real(0, 1), STRATA_M(scheduler.warmup_min_ratio),
        "WarmupCosineLR: lr ratio at step 0"));
  add(F("scheduler.params.cos_min_ratio", Real(0, 1), STRATA_M(scheduler.cos_min_ratio),
        "WarmupCosineLR: lr ratio at the end"));
  add(U("scheduler.params.last_batch_iteration", Int(-1, kMaxInt), "-1",
        "DeepSpeed: step to resume the schedule from", kResume));

  // --- zero_optimization --------------------------------------------------------------------
  group("DeepSpeed: zero_optimization");
  add(F("zero_optimization.stage", Int(0, 3), STRATA_M(zero.stage),
        "0 off, 1 optimizer states, 2 + gradients, 3 + parameters partitioned", kAlwaysStage3));
  const char* offload_dev = "none|cpu|nvme";
  add(F("zero_optimization.offload_param.device", Enum(offload_dev),
        STRATA_M(zero.offload_param.device), "home tier of parameters (stage 3 only)", nullptr));
  add(F("zero_optimization.offload_param.nvme_path", StrList(),
        STRATA_M(zero.offload_param.nvme_path), "swap directory, or a list to stripe over", nullptr,
        0, "[]"));
  add(F("zero_optimization.offload_param.buffer_count", Int(1, 65536),
        STRATA_M(zero.offload_param.buffer_count), "pinned staging buffers", kOwnStaging));
  add(F("zero_optimization.offload_param.buffer_size", Size(1),
        STRATA_M(zero.offload_param.buffer_size), "elements per staging buffer", kOwnStaging));
  add(F("zero_optimization.offload_param.max_in_cpu", Size(),
        STRATA_M(zero.offload_param.max_in_cpu), "elements kept in host RAM when device is nvme",
        kOwnStaging));
  add(F("zero_optimization.offload_param.pin_memory", Bool(),
        STRATA_M(zero.offload_param.pin_memory), "page-lock host buffers", nullptr));
  add(F("zero_optimization.offload_optimizer.device", Enum(offload_dev),
        STRATA_M(zero.offload_optimizer.device), "home tier of master weights and moments",
        nullptr));
  add(F("zero_optimization.offload_optimizer.nvme_path", StrList(),
        STRATA_M(zero.offload_optimizer.nvme_path), "swap directory, or a list to stripe over",
        nullptr, 0, "[]"));
  add(F("zero_optimization.offload_optimizer.buffer_count", Int(1, 65536),
        STRATA_M(zero.offload_optimizer.buffer_count), "pinned staging buffers", nullptr));
  add(F("zero_optimization.offload_optimizer.pin_memory", Bool(),
        STRATA_M(zero.offload_optimizer.pin_memory), "page-lock host buffers", nullptr));
  add(F("zero_optimization.offload_optimizer.pipeline_read", Bool(),
        STRATA_M(zero.offload_optimizer.pipeline_read), "overlap state reads with the step",
        kAlwaysPipelined));
  add(F("zero_optimization.offload_optimizer.pipeline_write", Bool(),
        STRATA_M(zero.offload_optimizer.pipeline_write), "overlap state writes with the step",
        kAlwaysPipelined));
  add(F("zero_optimization.offload_optimizer.fast_init", Bool(),
        STRATA_M(zero.offload_optimizer.fast_init), "DeepSpeed: fast swap-file init", kFastInit));
  add(F("zero_optimization.offload_optimizer.ratio", Real(0, 1),
        STRATA_M(zero.offload_optimizer.ratio),
        "fraction of optimizer state offloaded (< 1 needs stage 3)", nullptr));
  add(F("zero_optimization.overlap_comm", Bool(), STRATA_M(zero.overlap_comm),
        "several ranks: gradient reduce-scatters overlap the next module's backward (false: "
        "compute waits for each bucket's reduction)",
        nullptr, 0, "true at stage 3, else false"));
  add(F("zero_optimization.contiguous_gradients", Bool(), STRATA_M(zero.contiguous_gradients),
        "copy gradients into one buffer", kFlatModules));
  add(F("zero_optimization.reduce_scatter", Bool(), STRATA_M(zero.reduce_scatter),
        "reduce-scatter instead of all-reduce", kFlatModules));
  add(F("zero_optimization.reduce_bucket_size", Size(), STRATA_M(zero.reduce_bucket_size),
        "elements per gradient reduce-scatter bucket over ranks, capped at the largest module "
        "(auto: n_embd^2)",
        nullptr, kAuto));
  add(F("zero_optimization.allgather_bucket_size", Size(), STRATA_M(zero.allgather_bucket_size),
        "elements per all-gather", kGatherWindow));
  add(F("zero_optimization.allgather_partitions", Bool(), STRATA_M(zero.allgather_partitions),
        "all-gather (vs broadcasts) after the step", kGatherWindow));
  add(F("zero_optimization.round_robin_gradients", Bool(), STRATA_M(zero.round_robin_gradients),
        "stage 1/2: spread gradient copies over ranks", kAlwaysStage3));
  add(F("zero_optimization.sub_group_size", Size(1), STRATA_M(zero.sub_group_size),
        "elements per optimizer sub-group", kWholeModuleOptimizer));
  add(F("zero_optimization.stage3_prefetch_bucket_size", Size(),
        STRATA_M(zero.stage3_prefetch_bucket_size),
        "elements fetched ahead of use (auto: 0.9 n_embd^2)", nullptr, kAuto));
  add(F("zero_optimization.stage3_param_persistence_threshold", Size(),
        STRATA_M(zero.stage3_param_persistence_threshold),
        "parameters smaller than this stay unpartitioned (auto: 10 n_embd)", nullptr, kAuto));
  add(F("zero_optimization.stage3_max_live_parameters", Size(),
        STRATA_M(zero.stage3_max_live_parameters), "gathered elements resident per GPU (auto: 1e9)",
        kGatherWindow, kAuto));
  add(F("zero_optimization.stage3_max_reuse_distance", Size(),
        STRATA_M(zero.stage3_max_reuse_distance),
        "keep a gathered parameter reused within this many elements (auto: 1e9)", nullptr, kAuto));
  add(F("zero_optimization.stage3_gather_16bit_weights_on_model_save", Bool(),
        STRATA_M(zero.stage3_gather_16bit_weights_on_model_save),
        "gather full 16-bit weights when saving", kNo16bitSave));
  alias("zero_optimization.gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save");
  alias("zero_optimization.stage3_gather_fp16_weights_on_model_save",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save");
  alias("zero_optimization.prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size");
  alias("zero_optimization.param_persistence_threshold",
        "zero_optimization.stage3_param_persistence_threshold");
  alias("zero_optimization.max_live_parameters", "zero_optimization.stage3_max_live_parameters");
  alias("zero_optimization.max_reuse_distance", "zero_optimization.stage3_max_reuse_distance");
  // Further DeepSpeed ZeRO knobs seen in real configs: accepted, checked, not acted on.
  add(U("zero_optimization.stage3_model_persistence_threshold", Size(), "9223372036854775807",
        "cap on unpartitioned elements", kPersistence));
  add(U("zero_optimization.stage3_module_granularity_threshold", Size(), "0",
        "fetch fine-grained modules as one unit", kFlatModules));
  add(U("zero_optimization.stage3_use_all_reduce_for_fetch_params", Bool(), "false",
        "all-reduce when fetching parameters", kGatherWindow));
  add(U("zero_optimization.load_from_fp32_weights", Bool(), "true",
        "init master weights from fp32 checkpoint copies", kDsOnly));
  add(U("zero_optimization.elastic_checkpoint", Bool(), "false",
        "load checkpoints across GPU counts", kDsOnly));
  add(U("zero_optimization.ignore_unused_parameters", Bool(), "true", "tolerate unused parameters",
        kDsOnly));
  add(U("zero_optimization.use_multi_rank_bucket_allreduce", Bool(), "true",
        "combine reduce buckets of ranks", kFlatModules));
  add(U("zero_optimization.zero_hpz_partition_size", Int(0, kMaxInt), "1",
        "ZeRO++ secondary partition size", kDsOnly));
  add(U("zero_optimization.zero_quantized_weights", Bool(), "false", "ZeRO++ quantized weights",
        kDsOnly));
  add(U("zero_optimization.zero_quantized_gradients", Bool(), "false", "ZeRO++ quantized gradients",
        kDsOnly));
  add(U("zero_optimization.memory_efficient_linear", Bool(), "true",
        "DeepSpeed's memory-efficient linear", kDsOnly));

  // --- aio --------------------------------------------------------------------------------------
  group("DeepSpeed: aio");
  add(F("aio.backend", Enum("auto|io_uring|libaio|posix"), STRATA_M(aio.backend),
        "strata: storage engine", nullptr));
  add(F("aio.block_size", Size(4096, kInf, 4096), STRATA_M(aio.block_size),
        "bytes per I/O request, a multiple of 4096", nullptr));
  add(F("aio.queue_depth", Int(1, 65536), STRATA_M(aio.queue_depth), "requests in flight",
        nullptr));
  add(F("aio.intra_op_parallelism", Int(1, 1024), STRATA_M(aio.intra_op_parallelism),
        "I/O threads per request", nullptr));
  alias("aio.thread_count", "aio.intra_op_parallelism");
  add(F("aio.single_submit", Bool(), STRATA_M(aio.single_submit), "submit requests one by one",
        kIoWorker));
  add(F("aio.overlap_events", Bool(), STRATA_M(aio.overlap_events),
        "overlap submission and completion", kIoWorker));
  add(F("aio.use_gds", Bool(), STRATA_M(aio.use_gds), "GPUDirect Storage", kNoGds));

  // --- other DeepSpeed top-level keys: accepted, checked, not acted on ---------------------
  group("DeepSpeed: other sections (accepted, not acted on)");
  add(U("zero_allow_untested_optimizer", Bool(), "false", "DeepSpeed: allow client optimizers",
        kDsOnly));
  add(U("zero_force_ds_cpu_optimizer", Bool(), "true", "DeepSpeed: force its CPU Adam", kDsOnly));
  add(U("gradient_predivide_factor", Real(0, kInf, true, true), "1.0",
        "divide gradients before averaging", kFp32Grads));
  add(U("prescale_gradients", Bool(), "false", "scale gradients before all-reduce", kFp32Grads));
  add(U("communication_data_type", Enum("fp32|fp16|bf16"), "null",
        "dtype of gradient communication", kFp32Grads));
  add(U("memory_breakdown", Bool(), "false", "DeepSpeed memory report", kDsOnly));
  add(U("dump_state", Bool(), "false", "print DeepSpeed's state after init", kDsOnly));
  add(U("amp", Any(), "null", "NVIDIA Apex AMP settings (any keys)", kDsOnly));
  add(U("data_types.grad_accum_dtype", Enum("fp32|fp16|bf16"), "null",
        "gradient accumulation dtype", kDsOnly));
  add(U("activation_checkpointing.partition_activations", Bool(), "false",
        "true: strata.activations = recompute (keep each block's input, recompute the rest in "
        "backward) unless strata.activations is given",
        nullptr));
  add(U("activation_checkpointing.cpu_checkpointing", Bool(), "false",
        "true: strata.activations = offload (block inputs to host RAM) unless "
        "strata.activations is given",
        nullptr));
  add(U("activation_checkpointing.contiguous_memory_optimization", Bool(), "false",
        "checkpoints into one buffer", kActCkptContiguous));
  add(U("activation_checkpointing.number_checkpoints", Int(0, kMaxInt), "null",
        "checkpoints per step", kActCkptCount));
  add(U("activation_checkpointing.synchronize_checkpoint_boundary", Bool(), "false",
        "synchronize at checkpoint boundaries", kActCkptSync));
  add(U("activation_checkpointing.profile", Bool(), "false", "time checkpoint functions",
        kActCkptProfile));
  add(U("flops_profiler.enabled", Bool(), "false", "DeepSpeed flops profiler", kDsOnly));
  add(U("flops_profiler.recompute_fwd_factor", Real(0, kInf), "0.0", "", kDsOnly));
  add(U("flops_profiler.profile_step", Int(0, kMaxInt), "1", "", kDsOnly));
  add(U("flops_profiler.module_depth", Int(-1, kMaxInt), "-1", "", kDsOnly));
  add(U("flops_profiler.top_modules", Int(0, kMaxInt), "1", "", kDsOnly));
  add(U("flops_profiler.detailed", Bool(), "true", "", kDsOnly));
  add(U("flops_profiler.output_file", Str(), "null", "", kDsOnly));
  for (const char* m : {"tensorboard", "csv_monitor"}) {
    add(U(fmt::format("{}.enabled", m).c_str(), Bool(), "false", "", kMonitor));
    add(U(fmt::format("{}.output_path", m).c_str(), Str(), "\"\"", "", kMonitor));
    add(U(fmt::format("{}.job_name", m).c_str(), Str(), "\"DeepSpeedJobName\"", "", kMonitor));
  }
  add(U("wandb.enabled", Bool(), "false", "", kMonitor));
  add(U("wandb.group", Str(), "null", "", kMonitor));
  add(U("wandb.team", Str(), "null", "", kMonitor));
  add(U("wandb.project", Str(), "\"deepspeed\"", "", kMonitor));
  add(U("comms_logger.enabled", Bool(), "false", "DeepSpeed communication logger", kDsOnly));
  add(U("comms_logger.verbose", Bool(), "false", "", kDsOnly));
  add(U("comms_logger.prof_all", Bool(), "true", "", kDsOnly));
  add(U("comms_logger.debug", Bool(), "false", "", kDsOnly));
  add(U("comms_logger.prof_ops", StrList(), "[]", "", kDsOnly));

  // --- strata: model ----------------------------------------------------------------------------
  group("strata: model");
  add(F("model.type", Enum("gpt2|gpt|llama"), STRATA_M(model.type),
        "architecture: gpt2 (gpt is gpt2) or llama (Llama, Mistral, Qwen2 shapes)"));
  add(F("model.n_layer", Int(1, 4096), STRATA_M(model.n_layer), "transformer blocks"));
  add(F("model.n_head", Int(1, 4096), STRATA_M(model.n_head), "attention heads"));
  add(F("model.n_embd", Int(1, 1 << 20), STRATA_M(model.n_embd),
        "hidden size, divisible by n_head"));
  add(F("model.vocab_size", Int(1, 1 << 24), STRATA_M(model.vocab_size),
        "tokens in the vocabulary"));
  add(F("model.padded_vocab_size", Int(0, 1 << 24), STRATA_M(model.padded_vocab_size),
        "embedding rows, >= vocab_size; 0/auto: vocab_size rounded up to 64", nullptr, kAuto));
  add(F("model.context", Int(1, 1 << 24), STRATA_M(model.context), "maximum sequence length"));
  add(F("model.tied_embeddings", Bool(), STRATA_M(model.tied_embeddings),
        "share token embedding and output head"));
  add(F("model.intermediate_size", Int(0, 1 << 24), STRATA_M(model.intermediate_size),
        "llama: SwiGLU MLP width (required for llama)"));
  add(F("model.num_key_value_heads", Int(0, 4096), STRATA_M(model.num_key_value_heads),
        "llama: key/value heads (grouped-query attention), divides n_head; 0: n_head"));
  add(F("model.rope_theta", Real(1, kInf, true, true), STRATA_M(model.rope_theta),
        "llama: rotary embedding base"));
  add(F("model.rms_norm_eps", Real(0, 1, true, false), STRATA_M(model.rms_norm_eps),
        "llama: RMSNorm epsilon"));
  add(F("model.attention_bias", Bool(), STRATA_M(model.attention_bias),
        "llama: q/k/v projection biases (Qwen2)"));
  add(F("model.rope_scaling.type", Enum("none|llama3"), STRATA_M(model.rope_scaling.type),
        "llama: rotary frequency scaling (llama3: Llama 3.1's)"));
  add(F("model.rope_scaling.factor", Real(0, kInf, true, true), STRATA_M(model.rope_scaling.factor),
        "llama3 scaling: low-frequency divisor"));
  add(F("model.rope_scaling.low_freq_factor", Real(0, kInf, true, true),
        STRATA_M(model.rope_scaling.low_freq_factor), "llama3 scaling"));
  add(F("model.rope_scaling.high_freq_factor", Real(0, kInf, true, true),
        STRATA_M(model.rope_scaling.high_freq_factor), "llama3 scaling, > low_freq_factor"));
  add(F("model.rope_scaling.original_max_position_embeddings", Real(1, kInf, false, true),
        STRATA_M(model.rope_scaling.original_max_position_embeddings),
        "llama3 scaling: the context the model was pre-trained at"));

  // --- strata: data -----------------------------------------------------------------------------
  group("strata: data");
  add(F("data.source", Str(), STRATA_M(data.source), "\"synthetic\" or a token file path"));
  add(F("data.format", Enum("auto|uint16|uint32|llmc|text"), STRATA_M(data.format),
        "token file format"));
  add(F("data.seq_len", Int(0, 1 << 24), STRATA_M(data.seq_len),
        "tokens per sequence, <= model.context; 0/auto: model.context", nullptr, kAuto));
  add(F("data.eval_fraction", Real(0, 1, false, true), STRATA_M(data.eval_fraction),
        "held-out tail for eval loss"));
  add(F("data.eval_batches", Int(0, kMaxI32), STRATA_M(data.eval_batches),
        "batches per evaluation"));
  add(F("data.synthetic_tokens", Size(1), STRATA_M(data.synthetic_tokens),
        "tokens in the built-in corpus"));

  // --- strata: device ---------------------------------------------------------------------------
  group("strata: device");
  add(F("device.backend", Enum("auto|cpu|cuda"), STRATA_M(device.backend),
        "auto: cuda if a GPU is visible, else cpu"));
  add(F("device.memory_limit", Size(), STRATA_M(device.memory_limit),
        "device bytes to use; 0 = cpu: 1 GiB, cuda: free - reserve"));
  add(F("device.reserve", Size(), STRATA_M(device.reserve), "cuda: HBM left for libraries"));
  add(F("device.cpu_threads", Int(0, 4096), STRATA_M(device.cpu_threads), "0 = all cores"));
  add(F("device.ordinal", Int(-1, 1024), STRATA_M(device.ordinal), "cuda: -1 = local rank"));

  // --- strata: train ----------------------------------------------------------------------------
  group("strata: train");
  add(F("train.steps", Int(0, kMaxInt), STRATA_M(train.steps), "optimizer steps"));
  add(F("train.eval_interval", Int(0, kMaxInt), STRATA_M(train.eval_interval),
        "steps between evals; 0 = never"));
  add(F("train.checkpoint_dir", Str(), STRATA_M(train.checkpoint_dir), "run directory"));
  add(F("train.checkpoint_interval", Int(0, kMaxInt), STRATA_M(train.checkpoint_interval),
        "steps between checkpoints; 0 = at the end and on SIGINT/SIGTERM"));
  add(F("train.seed", Int(0, kMaxInt), STRATA_M(train.seed), "initialization and data seed"));
  add(F("train.log_file", Str(), STRATA_M(train.log_file),
        "JSONL metrics; \"\" = <checkpoint_dir>/metrics.jsonl"));

  // --- strata: engine knobs ---------------------------------------------------------------------
  group("strata: strata");
  add(F("strata.io.checksum", Bool(), STRATA_M(strata.io_checksum), "CRC32C per swapped extent",
        nullptr));
  add(F("strata.optimizer.moment_dtype", DTypeT(), STRATA_M(strata.moment_dtype),
        "dtype of Adam moments", nullptr));
  add(F("strata.optimizer.overlap", Bool(), STRATA_M(strata.optimizer_overlap),
        "step each module's optimizer state under the rest of backward, exact (rolled back and "
        "redone when clipping or an overflow says so)",
        nullptr));
  add(F("strata.optimizer.delayed_update", Bool(), STRATA_M(strata.delayed_update),
        "overlap step t's update with step t+1's forward and backward (one step stale: changes "
        "the numbers)",
        nullptr));
  add(F("strata.optimizer.delayed_update_warmup", Int(0, kMaxInt),
        STRATA_M(strata.delayed_update_warmup), "exact steps before the delayed update starts",
        nullptr));
  add(F("strata.comm.backend", Enum("auto|single|mpi|nccl"), STRATA_M(strata.comm_backend),
        "communicator", nullptr));
  add(F("strata.comm.timeout_s", Real(0, kInf, false, true), STRATA_M(strata.comm_timeout_s),
        "seconds a collective waits for its peers before failing (0 = forever)", nullptr));
  add(F("strata.activations", Enum("keep|recompute|offload"), STRATA_M(strata.activations),
        "block activations between forward and backward: keep on the device, recompute from "
        "each block's saved input, or offload the inputs to the host tier too"));
  add(F("strata.log_level", Enum("debug|info|warn|error|off"), STRATA_M(strata.log_level),
        "logger level"));
  add(F("strata.placement.params", Enum("device|host|nvme"), STRATA_M(strata.placement_params),
        "home tier of parameters (overrides offload_param.device)"));
  add(F("strata.placement.grads", Enum("device|host"), STRATA_M(strata.placement_grads),
        "where gradients accumulate between backward and the optimizer step"));
  add(F("strata.placement.master", Enum("device|host|nvme"), STRATA_M(strata.placement_master),
        "home tier of fp32 master weights (overrides offload_optimizer.device)"));
  add(F("strata.placement.moments", Enum("device|host|nvme"), STRATA_M(strata.placement_moments),
        "home tier of optimizer moments (overrides offload_optimizer.device)"));
  add(F("strata.host_memory_limit", Size(), STRATA_M(strata.host_memory_limit),
        "host tier budget in bytes; 0 = 90% of MemAvailable"));
  add(F("strata.trace_file", Str(), STRATA_M(strata.trace_file),
        "write the first step's access trace here (for strata trace replay)"));
  return k;
}

#undef STRATA_M

// The table with lookups: leaves by path, and the child names of every section.
struct Schema {
  std::vector<Key> keys;
  std::map<std::string, size_t> leaf;                           // path -> index
  std::map<std::string, std::set<std::string>> children;        // section ("" = root) -> names
  std::map<std::string, std::vector<std::string>> alias_group;  // canonical -> all spellings
};

const Schema& schema() {
  static const Schema* s = [] {
    auto* out = new Schema;
    out->keys = build_table();
    for (size_t i = 0; i < out->keys.size(); ++i) {
      const Key& k = out->keys[i];
      out->leaf[k.path] = i;
      std::string parent;
      size_t start = 0;
      for (;;) {
        size_t dot = k.path.find('.', start);
        std::string name = k.path.substr(start, dot == std::string::npos ? dot : dot - start);
        out->children[parent].insert(name);
        if (dot == std::string::npos) break;
        parent = k.path.substr(0, dot);
        start = dot + 1;
      }
      const std::string& canon = k.alias_of.empty() ? k.path : k.alias_of;
      out->alias_group[canon].push_back(k.path);
    }
    return out;
  }();
  return *s;
}

const std::string& canonical(const Key& k) { return k.alias_of.empty() ? k.path : k.alias_of; }

std::string join(std::string_view a, std::string_view b) {
  return a.empty() ? std::string(b) : fmt::format("{}.{}", a, b);
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (std::tolower(a[i - 1]) == std::tolower(b[j - 1]) ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// "path: unknown key; did you mean X?" where X is the closest sibling by edit distance, or the
// full path of a key of exactly this name in another section when no sibling is close (a key
// put at the wrong level).
Status unknown_key(const std::string& section, const std::string& name) {
  const Schema& s = schema();
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const std::string& k : s.children.at(section)) {
    size_t d = edit_distance(name, k);
    if (d < best_d) best_d = d, best = k;
  }
  if (best_d > 1) {
    std::string elsewhere;
    for (const auto& [parent, names] : s.children) {
      if (!names.count(name)) continue;
      std::string full = join(parent, name);
      if (elsewhere.empty() || full.size() < elsewhere.size()) elsewhere = full;
    }
    if (!elsewhere.empty()) best = elsewhere;
  }
  return invalid_argument(
      fmt::format("{}: unknown key; did you mean {}?", join(section, name), best));
}

std::string short_dump(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

Status type_error(const std::string& path, std::string_view expected, const json& v) {
  std::string hint;
  if (v.is_string() && v.get<std::string>() == "auto") hint = "; \"auto\" is not accepted here";
  return invalid_argument(
      fmt::format("{}: expected {}, got {}{}", path, expected, short_dump(v), hint));
}

std::string fmt_bound(double x, Kind kind) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (kind != Kind::kReal) return fmt::format("{}", static_cast<int64_t>(x));
  return fmt::format("{}", x);
}
std::string fmt_range(const Type& t) {
  return fmt::format("{}{}, {}{}", t.lo_open ? "(" : "[", fmt_bound(t.lo, t.kind),
                     fmt_bound(t.hi, t.kind), t.hi_open || std::isinf(t.hi) ? ")" : "]");
}
bool in_range(double x, const Type& t) {
  if (t.lo_open ? !(x > t.lo) : !(x >= t.lo)) return false;
  if (t.hi_open ? !(x < t.hi) : !(x <= t.hi)) return false;
  return true;
}
Status range_error(const std::string& path, const std::string& value, const Type& t) {
  return invalid_argument(fmt::format("{}: {} out of range {}", path, value, fmt_range(t)));
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t p = s.find(sep, start);
    out.emplace_back(s.substr(start, p == std::string_view::npos ? p : p - start));
    if (p == std::string_view::npos) return out;
    start = p + 1;
  }
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(a[i]) != std::tolower(b[i])) return false;
  }
  return true;
}

// Checks one leaf value and returns it normalized (sizes in bytes, enums spelled canonically,
// integers as integers, a single path as a list).
Result<json> check_value(const Type& t, const json& v, const std::string& path) {
  switch (t.kind) {
    case Kind::kBool:
      if (!v.is_boolean()) return type_error(path, "boolean", v);
      return v;
    case Kind::kInt: {
      double d;
      if (v.is_number_integer()) {
        if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{1} << 62) {
          return range_error(path, v.dump(), t);
        }
        d = static_cast<double>(v.get<int64_t>());
      } else if (v.is_number_float() && std::isfinite(v.get<double>()) &&
                 v.get<double>() == std::floor(v.get<double>())) {
        d = v.get<double>();
        if (std::fabs(d) > kIntLimit) return range_error(path, v.dump(), t);
      } else {
        return type_error(path, "integer", v);
      }
      if (!in_range(d, t)) return range_error(path, v.dump(), t);
      return json(static_cast<int64_t>(d));
    }
    case Kind::kReal: {
      if (!v.is_number()) return type_error(path, "number", v);
      double d = v.get<double>();
      if (!in_range(d, t)) return range_error(path, v.dump(), t);
      return json(d);
    }
    case Kind::kSize: {
      size_t bytes;
      if (v.is_number()) {
        double d = v.get<double>();
        if (d < 0 || !std::isfinite(d)) return range_error(path, v.dump(), t);
        if (d != std::floor(d)) {
          return invalid_argument(fmt::format("{}: {} is not a whole number", path, v.dump()));
        }
        if (d >= 1.8446744073709552e19) return range_error(path, v.dump(), t);
        bytes = static_cast<size_t>(d);
      } else if (v.is_string()) {
        Result<size_t> r = parse_size(v.get<std::string>());
        if (!r.is_ok()) return r.status().with_context(path);
        bytes = *r;
      } else {
        return type_error(path, "size (a number or a string like \"16GiB\")", v);
      }
      if (!in_range(static_cast<double>(bytes), t)) {
        return range_error(path, std::to_string(bytes), t);
      }
      if (t.multiple != 0 && bytes % t.multiple != 0) {
        return invalid_argument(
            fmt::format("{}: {} is not a multiple of {}", path, bytes, t.multiple));
      }
      return json(static_cast<uint64_t>(bytes));
    }
    case Kind::kString:
      if (!v.is_string()) return type_error(path, "string", v);
      return v;
    case Kind::kEnum:
    case Kind::kDType: {
      std::vector<std::string> allowed = split(t.values, '|');
      if (!v.is_string()) {
        return type_error(path, fmt::format("one of {}", fmt::join(allowed, ", ")), v);
      }
      std::string s = v.get<std::string>();
      if (t.kind == Kind::kDType) {
        DType d;
        if (parse_dtype(s, &d)) return json(dtype_name(d));
      } else {
        for (const std::string& a : allowed) {
          if (iequals(a, s)) return json(a);
        }
      }
      return invalid_argument(
          fmt::format("{}: \"{}\" is not one of {}", path, s, fmt::join(allowed, ", ")));
    }
    case Kind::kStringList:
      if (v.is_string()) return json::array({v});
      if (v.is_array() &&
          std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); })) {
        return v;
      }
      return type_error(path, "string or list of strings", v);
    case Kind::kBetas: {
      if (!v.is_array() || v.size() != 2) return type_error(path, "[beta1, beta2]", v);
      for (size_t i = 0; i < 2; ++i) {
        std::string p = fmt::format("{}[{}]", path, i);
        if (!v[i].is_number()) return type_error(p, "number", v[i]);
        if (!in_range(v[i].get<double>(), t)) return range_error(p, v[i].dump(), t);
      }
      return json::array({v[0].get<double>(), v[1].get<double>()});
    }
    case Kind::kAny:
      return v;
  }
  return internal_error("unreachable");
}

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
  json value = json::parse(value_text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = value_text;  // not JSON: a string

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

Status resolve(Ctx* ctx, int world_size) {
  Config& c = ctx->cfg;
  auto num = [](double x) { return fmt::format("{}", x); };

  // model
  if (c.model.n_embd % c.model.n_head != 0) {
    return invalid_argument(fmt::format("model.n_embd: {} is not divisible by model.n_head ({})",
                                        c.model.n_embd, c.model.n_head));
  }
  if (c.model.padded_vocab_size == 0) {
    c.model.padded_vocab_size = (c.model.vocab_size + 63) / 64 * 64;
    if (is_auto(*ctx, "model.padded_vocab_size")) {
      note_auto(ctx, "model.padded_vocab_size", std::to_string(c.model.padded_vocab_size));
    }
  } else if (c.model.padded_vocab_size < c.model.vocab_size) {
    return invalid_argument(
        fmt::format("model.padded_vocab_size: {} is smaller than model.vocab_size ({})",
                    c.model.padded_vocab_size, c.model.vocab_size));
  }
  if (c.data.seq_len == 0) {
    c.data.seq_len = c.model.context;
    if (is_auto(*ctx, "data.seq_len"))
      note_auto(ctx, "data.seq_len", std::to_string(c.data.seq_len));
  } else if (c.data.seq_len > c.model.context) {
    return invalid_argument(fmt::format("data.seq_len: {} is longer than model.context ({})",
                                        c.data.seq_len, c.model.context));
  }

  // precision
  if (is_auto(*ctx, "fp16.enabled")) note_auto(ctx, "fp16.enabled", "false");
  if (is_auto(*ctx, "bf16.enabled")) note_auto(ctx, "bf16.enabled", "false");
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

  STRATA_RETURN_IF_ERROR(resolve_batch(ctx, world_size), "");

  // optimizer
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

  // scheduler
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
    sc.warmup_num_steps = c.train.steps / 10;
    note_auto(ctx, "scheduler.params.warmup_num_steps", std::to_string(sc.warmup_num_steps));
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

  // zero
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

std::string value_text(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

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

std::string line_col(const std::string& text, size_t byte) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return fmt::format("line {} column {}", line, col);
}

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
  json doc;
  try {
    doc = json::parse(json_text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    // e.what(): "[json.exception.parse_error.101] parse error at line 3, column 1: <detail>".
    std::string what = e.what();
    size_t at = what.find("column");
    at = at == std::string::npos ? std::string::npos : what.find(": ", at);
    std::string detail = at == std::string::npos ? what : what.substr(at + 2);
    return invalid_argument(fmt::format("{}: invalid JSON at {}: {}", origin,
                                        line_col(json_text, e.byte == 0 ? 0 : e.byte - 1), detail));
  }
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
  return std::move(ctx.cfg);
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

std::string config_reference_markdown() {
  static const Config defaults;
  const Schema& s = schema();
  std::string out;
  std::string section;
  for (const Key& k : s.keys) {
    if (k.group != section) {
      section = k.group;
      out += fmt::format(
          "\n### {}\n\n| key | type | default | allowed | acted on | meaning |\n"
          "|---|---|---|---|---|---|\n",
          section);
    }
    std::string type, allowed;
    switch (k.type.kind) {
      case Kind::kBool:
        type = "bool";
        break;
      case Kind::kInt:
        type = "integer";
        allowed = fmt_range(k.type);
        break;
      case Kind::kReal:
        type = "number";
        allowed = fmt_range(k.type);
        break;
      case Kind::kSize:
        type = "size";
        allowed = fmt_range(k.type);
        if (k.type.multiple) allowed += fmt::format(", multiple of {}", k.type.multiple);
        break;
      case Kind::kString:
        type = "string";
        break;
      case Kind::kEnum:
      case Kind::kDType:
        type = "enum";
        allowed = fmt::format("{}", fmt::join(split(k.type.values, '|'), " \\| "));
        break;
      case Kind::kStringList:
        type = "string or list";
        break;
      case Kind::kBetas:
        type = "[number, number]";
        allowed = "each in " + fmt_range(k.type);
        break;
      case Kind::kAny:
        type = "object";
        break;
    }
    if (k.flags & kAuto) type += " or \"auto\"";
    std::string dflt;
    if (!k.alias_of.empty()) {
      dflt = "";
    } else if (k.get && k.dflt) {
      dflt = k.dflt;
    } else if (k.get) {
      dflt = k.get(defaults).dump();
    } else {
      dflt = k.dflt;
    }
    std::string acted = k.not_acted ? fmt::format("no: {}", k.not_acted) : "yes";
    std::string doc =
        k.alias_of.empty() ? std::string(k.doc) : fmt::format("alias of `{}`", k.alias_of);
    if (!k.alias_of.empty()) acted = "as its key";
    out += fmt::format("| `{}` | {} | {} | {} | {} | {} |\n", k.path, type,
                       dflt.empty() ? "" : "`" + dflt + "`", allowed, acted, doc);
  }
  return out;
}

}  // namespace strata
