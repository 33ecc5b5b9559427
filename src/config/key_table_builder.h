// The key table's builder (key_table.cc, key_table_model.cc): the types and helpers its parts
// write keys with, and TableBuilder, which adds them part by part in docs/CONFIG.md's order.
#pragma once

#include <fmt/format.h>

#include <string>
#include <type_traits>
#include <vector>

#include "src/config/key_table.h"
#include "src/model/family.h"

namespace strata::config_internal::table {

// ---------------------------------------------------------------------------------------------
// Why a setting is accepted but not acted on. When a feature lands, set its keys' reason to
// nullptr in the table (key_table.cc, key_table_model.cc; or retire the constant): this is the one
// list to shrink.
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
constexpr const char* kIoWorker =
    "the I/O worker batches submissions and reaps completions on its own thread";
constexpr const char* kNoGds = "NVMe data moves through pinned host buffers (no GPUDirect Storage)";
constexpr const char* kFp32Grads =
    "gradients are reduced in fp32 and scaled once by 1/(tokens of the global batch)";
constexpr const char* kTimers = "the trainer prints its own time split with each log line";
constexpr const char* kNoCast = "inputs are token ids; there is nothing to cast";
constexpr const char* kOneAdam = "strata has one Adam implementation per backend";
constexpr const char* kMonitor =
    "strata writes JSONL metrics (train.log_file), TensorBoard event files (tensorboard) and CSV "
    "(csv_monitor)";
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
constexpr const char* kOpProfile =
    "the op profile is per kernel op and stream, with every op of the step (no module tree)";
constexpr const char* kResume = "resume restores the step from the checkpoint";
constexpr const char* kAlwaysPipelined =
    "strata always pipelines optimizer-state reads and writes (depth: buffer_count)";
constexpr const char* kOwnStaging =
    "strata stages parameters in zero_optimization.sub_group_size pieces: 3 host buffers for "
    "NVMe reads, offload_optimizer.buffer_count + 1 for writes";

inline Type Bool() { return {Kind::kBool}; }
inline Type Int(double lo, double hi) { return {Kind::kInt, lo, hi}; }
inline Type Real(double lo, double hi, bool lo_open = false, bool hi_open = false) {
  return {Kind::kReal, lo, hi, lo_open, hi_open};
}
inline Type Size(double lo = 0, double hi = kInf, uint64_t multiple = 0) {
  return {Kind::kSize, lo, hi, false, hi == kInf, nullptr, multiple};
}
inline Type Str() { return {Kind::kString}; }
inline Type Enum(const char* values) { return {Kind::kEnum, 0, 0, false, false, values}; }
inline Type StrList() { return {Kind::kStringList}; }
// A string or a list of strings, kept as given (the setter tells them apart).
inline Type StrOrList() { return {Kind::kStringOrList}; }
inline Type EnumList(const char* values) { return {Kind::kEnumList, 0, 0, false, false, values}; }
inline Type RealList(double lo, double hi, bool lo_open = false, bool hi_open = false) {
  return {Kind::kRealList, lo, hi, lo_open, hi_open};
}
inline Type Betas() { return {Kind::kBetas, 0, 1, false, true}; }
// A dtype by any name parse_dtype takes, one of `values` (canonical names) once parsed.
inline Type DTypeT(const char* values) { return {Kind::kDType, 0, 0, false, false, values}; }
inline Type Any() { return {Kind::kAny}; }

// model.type's names and doc line, from the model families' registry (src/model/family.h): a new
// family adds its names here without a line in this table. Built once; the table keeps pointers.
inline const char* model_type_values() {
  static const std::string kValues = [] {
    std::string s;
    for (const ModelFamily* f : model_families()) {
      for (const std::string& t : f->types) s += (s.empty() ? "" : "|") + t;
    }
    return s;
  }();
  return kValues.c_str();
}
inline const char* model_type_doc() {
  static const std::string kDoc = [] {
    std::string s;
    for (const ModelFamily* f : model_families()) {
      std::string names, archs;
      for (const std::string& t : f->types) names += (names.empty() ? "" : " or ") + t;
      for (const std::string& a : f->hf_architectures) archs += (archs.empty() ? "" : ", ") + a;
      s += fmt::format("{}{} ({})", s.empty() ? "" : ", ", names, archs);
    }
    return "architecture, one model family, with the config.json architectures it reads: " + s;
  }();
  return kDoc.c_str();
}

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

inline Key F(const char* path, Type t, Setter s, Getter g, const char* doc,
             const char* not_acted = nullptr, unsigned flags = 0, const char* dflt_note = nullptr) {
  return Key{path, t, s, g, doc, not_acted, flags, dflt_note, "", ""};
}
// Unbound: accepted, checked, never acted on.
inline Key U(const char* path, Type t, const char* dflt_json, const char* doc,
             const char* not_acted) {
  return Key{path, t, nullptr, nullptr, doc, not_acted, 0, dflt_json, "", ""};
}

// Builds the key table one part at a time, in the order docs/CONFIG.md lists the keys.
class TableBuilder {
 public:
  std::vector<Key> build() {
    add_training_keys();
    add_zero_keys();
    add_aio_and_unbound_keys();
    add_model_keys();
    add_run_keys();
    add_engine_keys();
    return std::move(k_);
  }

 private:
  void group(const char* h) { heading_ = h; }
  void add(Key key) {
    key.group = heading_;
    k_.push_back(std::move(key));
  }
  void alias(const char* path, const char* canonical) {
    for (const Key& c : k_) {
      if (c.path == canonical) {
        Key a = c;
        a.path = path;
        a.alias_of = canonical;
        a.doc = "alias";
        k_.push_back(std::move(a));
        return;
      }
    }
    STRATA_CHECK(false, "alias of an unknown key");
  }
  void add_training_keys();         // batch, clipping, printing; fp16 / bf16; optimizer; scheduler
  void add_zero_keys();             // zero_optimization, its aliases and unbound keys
  void add_aio_and_unbound_keys();  // aio; the other DeepSpeed sections (accepted, not acted on)
  void add_model_keys();            // model; lora
  void add_run_keys();              // data; device; train
  void add_engine_keys();           // the strata section

  std::vector<Key> k_;
  const char* heading_ = "";
};

}  // namespace strata::config_internal::table
