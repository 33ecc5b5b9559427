#include "src/hf/hf_adapter.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <vector>

#include "src/base/json_text.h"
#include "src/base/safe_file.h"
#include "src/checkpoint/checkpoint.h"
#include "src/hf/hf_checkpoint.h"
#include "src/hf/hf_export.h"
#include "src/model/lora.h"

namespace strata {
namespace {

using json = nlohmann::json;

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t;
  for (int64_t d : s) t += (t.empty() ? "" : ", ") + std::to_string(d);
  return "[" + t + "]";
}

// The adapted sites' last names ("q_proj"), as PEFT's target_modules lists them.
std::set<std::string> target_names(const LoraLayout& L) {
  std::set<std::string> out;
  for (const LoraLayout::Target& t : L.targets) {
    const size_t dot = t.site.name.rfind('.');
    out.insert(dot == std::string::npos ? t.site.name : t.site.name.substr(dot + 1));
  }
  return out;
}

Result<json> read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found(fmt::format("{}: cannot open (not a PEFT adapter directory)", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_json_text(ss.str(), path);
}

int first_adapter(const Architecture& arch) {
  const auto& mods = arch.layout().modules;
  for (size_t m = 0; m < mods.size(); ++m) {
    if (mods[m].trainable) return int(m);
  }
  return int(mods.size());
}

}  // namespace

Result<std::unique_ptr<HfAdapterReader>> HfAdapterReader::open(const std::string& dir,
                                                               const Architecture& arch) {
  const LoraLayout* L = arch.lora();
  if (L == nullptr) {
    return invalid_argument(fmt::format(
        "{}: a LoRA adapter needs a model with adapters: add a \"lora\" section to the config",
        dir));
  }
  const std::string cfg_path = dir + "/adapter_config.json";
  STRATA_ASSIGN_OR_RETURN(json cfg, read_json(cfg_path), "");
  if (!cfg.is_object() || cfg.value("peft_type", json()) != "LORA") {
    return invalid_argument(
        fmt::format("{}: not a LoRA adapter (peft_type must be \"LORA\")", cfg_path));
  }
  const json dora = cfg.value("use_dora", json());
  if (!dora.is_null() && dora != false) {
    return invalid_argument(
        fmt::format("{}: use_dora is {}: DoRA adapters are not supported (only LoRA and rsLoRA)",
                    cfg_path, dora.dump().substr(0, 40)));
  }
  const json rslora_in = cfg.value("use_rslora", json());
  if (!rslora_in.is_null() && !rslora_in.is_boolean()) {
    return invalid_argument(fmt::format("{}: use_rslora is {}, not true or false", cfg_path,
                                        rslora_in.dump().substr(0, 40)));
  }
  const bool rslora = rslora_in == true;
  // lora_dropout shapes training only (the config's lora.lora_dropout decides a run's): read
  // and checked, not compared.
  const json dropout_in = cfg.value("lora_dropout", json());
  if (!dropout_in.is_null() &&
      !(dropout_in.is_number() && dropout_in.get<double>() >= 0 && dropout_in.get<double>() < 1)) {
    return invalid_argument(fmt::format("{}: lora_dropout is {}, not a number in [0, 1)", cfg_path,
                                        dropout_in.dump().substr(0, 40)));
  }
  const json bias = cfg.value("bias", json());
  if (!bias.is_null() && bias != "none") {
    return invalid_argument(fmt::format(
        "{}: bias is {}: the adapter carries trained biases of the base, which strata's frozen "
        "LoRA base cannot take (only bias \"none\" adapters load)",
        cfg_path, bias.dump().substr(0, 40)));
  }
  // What would give some layers other ranks, scalings or no adapter, or lora_B a bias: each
  // absent, false or empty in an adapter strata reads.
  for (const char* k : {"lora_bias", "layers_to_transform", "rank_pattern", "alpha_pattern"}) {
    const json v = cfg.value(k, json());
    if (!v.is_null() && v != false && !(v.is_object() && v.empty()) &&
        !(v.is_array() && v.empty())) {
      return invalid_argument(fmt::format(
          "{}: {} is {}: strata's adapters are one rank and scaling on every block, lora_B "
          "without a bias; such an adapter does not load",
          cfg_path, k, v.dump().substr(0, 80)));
    }
  }
  const json to_save = cfg.value("modules_to_save", json());
  if (!to_save.is_null() && !(to_save.is_array() && to_save.empty())) {
    return invalid_argument(fmt::format(
        "{}: modules_to_save is {}: the adapter carries whole trained modules beside its LoRA "
        "weights, which strata's frozen LoRA base cannot take",
        cfg_path, to_save.dump().substr(0, 80)));
  }
  const auto r_in = json_int_in(cfg.value("r", json()), 1, 1 << 20);
  const json alpha_in = cfg.value("lora_alpha", json());
  if (!r_in || !alpha_in.is_number()) {
    return invalid_argument(fmt::format(
        "{}: r must be a positive integer and lora_alpha a number (they are {} and {})", cfg_path,
        cfg.value("r", json()).dump().substr(0, 40), alpha_in.dump().substr(0, 40)));
  }
  const int r = int(*r_in);
  const double alpha = alpha_in.get<double>();
  const float scaling = float(rslora ? alpha / std::sqrt(double(r)) : alpha / r);
  if (r != L->r || scaling != L->scaling) {
    return invalid_argument(fmt::format(
        "{}: r {}, lora_alpha {} and use_rslora {} (scaling {}) differ from the config's lora.r "
        "{} and scaling {} (set lora.r, lora.lora_alpha and lora.use_rslora to the adapter's)",
        cfg_path, r, alpha, rslora, scaling, L->r, L->scaling));
  }
  const json targets_in = cfg.value("target_modules", json());
  if (targets_in.is_string()) {
    // A string: "all-linear", or a pattern the config must give too (the same selection).
    const std::string t = targets_in.get<std::string>();
    const bool same = t == "all-linear" ? L->all_sites : t == arch.shape().lora.target_pattern;
    if (!same) {
      return invalid_argument(fmt::format(
          "{}: target_modules \"{}\" selects other layers than the config's lora.target_modules: "
          "set lora.target_modules to the adapter's",
          cfg_path, t));
    }
  }
  std::set<std::string> targets;
  if (targets_in.is_string()) {
    targets = target_names(*L);
  } else if (targets_in.is_array()) {
    for (const json& t : targets_in) {
      if (!t.is_string()) {
        return invalid_argument(fmt::format("{}: target_modules holds {}, not a module name",
                                            cfg_path, t.dump().substr(0, 40)));
      }
      targets.insert(t.get<std::string>());
    }
  }
  if (targets != target_names(*L)) {
    std::string want;
    for (const std::string& t : target_names(*L)) want += (want.empty() ? "" : ", ") + t;
    return invalid_argument(
        fmt::format("{}: target_modules differ from the model's adapted layers ({}): set "
                    "lora.target_modules to the adapter's",
                    cfg_path, want));
  }
  auto r_ = std::unique_ptr<HfAdapterReader>(new HfAdapterReader());
  r_->arch_ = &arch;
  r_->dir_ = dir;
  STRATA_ASSIGN_OR_RETURN(r_->file_, SafetensorsFile::open(dir + "/adapter_model.safetensors"), "");
  const auto& mods = arch.layout().modules;
  for (size_t m = size_t(first_adapter(arch)); m < mods.size(); ++m) {
    for (const HfTensor& h : arch.hf_adapter_tensors(int(m))) {
      const SafetensorsTensor* t = r_->file_->find(h.name);
      if (t == nullptr) {
        return invalid_argument(fmt::format(
            "{}/adapter_model.safetensors: no tensor {}: the adapter was saved for another base "
            "model (or other target modules)",
            dir, h.name));
      }
      if (t->shape != h.shape) {
        return invalid_argument(fmt::format(
            "{}/adapter_model.safetensors: {} has shape {}, this model's is {}: the adapter was "
            "saved for another base model",
            dir, h.name, shape_text(t->shape), shape_text(h.shape)));
      }
    }
  }
  return r_;
}

Status HfAdapterReader::read_module(int m, float* out) const {
  const std::vector<HfTensor> hs = arch_->hf_adapter_tensors(m);
  if (hs.empty()) return invalid_argument(fmt::format("module {} is not an adapter", m));
  const ModuleSpec& spec = arch_->layout().modules[size_t(m)];
  for (const HfTensor& h : hs) {
    const SafetensorsTensor* t = file_->find(h.name);
    STRATA_CHECK(t != nullptr, "an adapter tensor open() checked");
    STRATA_RETURN_IF_ERROR(
        file_->read_as(*t, DType::kF32, out + spec.tensors[size_t(h.tensor)].offset), h.name);
  }
  return Status::ok();
}

Status write_hf_adapter(const std::string& dir, const Architecture& arch, const std::string& base,
                        const std::function<Status(int m, float* out)>& values) {
  const LoraLayout* L = arch.lora();
  if (L == nullptr) {
    return invalid_argument("--adapter: the model has no LoRA adapters (no \"lora\" section)");
  }
  // safetensors: u64 header length, the JSON header, the data (fp32, in the header's order).
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  std::string data;
  const auto& mods = arch.layout().modules;
  for (size_t m = size_t(first_adapter(arch)); m < mods.size(); ++m) {
    std::vector<float> v(mods[m].numel);
    STRATA_RETURN_IF_ERROR(values(int(m), v.data()), mods[m].name);
    for (const HfTensor& h : arch.hf_adapter_tensors(int(m))) {
      const TensorSpec& t = mods[m].tensors[size_t(h.tensor)];
      const size_t begin = data.size();
      data.append(reinterpret_cast<const char*>(v.data() + t.offset), t.numel * 4);
      header[h.name] = {
          {"dtype", "F32"}, {"shape", h.shape}, {"data_offsets", {begin, data.size()}}};
    }
  }
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  const uint64_t n = head.size();
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char((n >> (8 * i)) & 0xff);
  file += head;
  file += data;
  // As peft's LoraConfig saves itself: target_modules a list of last names (what "all-linear"
  // becomes in peft), or the config's pattern as given.
  const LoraConfig& lc = arch.shape().lora;
  const bool pattern = !lc.target_pattern.empty() && lc.target_pattern != "all-linear";
  json cfg = {{"peft_type", "LORA"},
              {"task_type", "CAUSAL_LM"},
              {"base_model_name_or_path", base},
              {"r", L->r},
              {"lora_alpha", lc.alpha},
              {"lora_dropout", lc.dropout},
              {"bias", "none"},
              {"fan_in_fan_out", arch.name() == "gpt2"},
              {"target_modules", pattern ? json(lc.target_pattern) : json(target_names(*L))},
              {"inference_mode", true},
              {"init_lora_weights", true},
              {"use_dora", false},
              {"use_rslora", lc.use_rslora},
              {"modules_to_save", nullptr}};
  // PEFT reads adapter_config.json, then adapter_model.safetensors (else adapter_model.bin): the
  // three are replaced together, so a reader never pairs one run's config with another's weights.
  return write_directory_atomically(
      dir, {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"},
      [&](const std::string& tmp) -> Status {
        STRATA_RETURN_IF_ERROR(
            write_file_atomically(tmp + "/adapter_model.safetensors", file, 0644), "");
        return write_file_atomically(tmp + "/adapter_config.json", cfg.dump(2) + "\n", 0644);
      });
}

Result<std::vector<std::vector<float>>> read_checkpoint_adapters(const std::string& checkpoint,
                                                                 const Architecture& arch) {
  const ModelLayout& layout = arch.layout();
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> files, checkpoint_files(checkpoint), "");
  std::vector<std::vector<float>> out(layout.modules.size());
  for (size_t i = 0; i < layout.modules.size(); ++i) {
    if (layout.modules[i].trainable) out[i].assign(layout.modules[i].numel, 0.0f);
  }
  std::vector<float> piece;
  for (const std::string& f : files) {
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(f), "");
    if (meta.model_shape != arch.shape_string() || meta.modules.size() != layout.modules.size()) {
      return invalid_argument(fmt::format(
          "{} holds a model of shape \"{}\", but the config describes \"{}\"; give the config "
          "the checkpoint was trained with (its lora section too)",
          f, meta.model_shape, arch.shape_string()));
    }
    auto staging = [&](size_t i, CheckpointBuffers* b) -> Status {
      piece.assign(meta.modules[i].numel, 0.0f);
      *b = {piece.data(), nullptr, nullptr, 4};
      return Status::ok();
    };
    auto sink = [&](size_t i, const CheckpointBuffers&) -> Status {
      const CheckpointModule& cm = meta.modules[i];
      if (cm.numel == 0 || out[i].empty()) return Status::ok();
      if (cm.offset + cm.numel > out[i].size()) {
        return corrupt(fmt::format("{}: module {} elements [{}, {}) past its {} elements", f,
                                   cm.name, cm.offset, cm.offset + cm.numel, out[i].size()));
      }
      std::copy(piece.begin(), piece.end(), out[i].begin() + long(cm.offset));
      return Status::ok();
    };
    STRATA_RETURN_IF_ERROR(read_checkpoint(f, staging, sink), "");
  }
  return out;
}

Status export_adapter(const std::string& checkpoint, const ModelConfig& model,
                      const std::string& dir) {
  STRATA_ASSIGN_OR_RETURN(auto arch, create_architecture(model), "export --adapter");
  if (arch->lora() == nullptr) {
    return invalid_argument(
        "export --adapter: the config has no lora section, so its checkpoints hold no adapters "
        "(give the config the run was trained with)");
  }
  STRATA_ASSIGN_OR_RETURN(auto adapters, read_checkpoint_adapters(checkpoint, *arch),
                          "export --adapter");
  return write_hf_adapter(dir, *arch, model.from_pretrained, [&](int m, float* out) {
    std::copy(adapters[size_t(m)].begin(), adapters[size_t(m)].end(), out);
    return Status::ok();
  });
}

Status merged_lora_modules(const std::string& checkpoint, const ModelConfig& model,
                           const Architecture& arch,
                           const std::function<Status(int m, const float* values)>& sink) {
  const ModelLayout& layout = arch.layout();
  STRATA_CHECK(arch.lora() != nullptr, "merged_lora_modules of a model without adapters");
  STRATA_ASSIGN_OR_RETURN(auto adapters, read_checkpoint_adapters(checkpoint, arch), "export");
  std::unique_ptr<HfCheckpointReader> base;
  if (!model.from_pretrained.empty()) {
    STRATA_ASSIGN_OR_RETURN(base, HfCheckpointReader::open(model.from_pretrained, arch),
                            "export: the base model");
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> files, checkpoint_files(checkpoint), "export");
  STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(files.at(0)), "export");
  const int first = first_adapter(arch);
  std::vector<float> w;
  for (size_t m = 0; m < layout.modules.size(); ++m) {
    w.assign(layout.modules[m].numel, 0.0f);
    if (layout.modules[m].trainable) {
      std::copy(adapters[m].begin(), adapters[m].end(), w.begin());
    } else if (base) {
      STRATA_RETURN_IF_ERROR(base->read_module(int(m), w.data()), "export: the base model");
    } else {
      arch.init_module(int(m), meta.seed, w.data());
    }
    // Block l (module 1 + l) gets adapter module first + l merged in.
    const std::string& name = layout.modules[m].name;
    if (name.rfind("block.", 0) == 0 && name.find('.', 6) == std::string::npos) {
      const size_t l = std::stoul(name.substr(6));
      lora_merge(*arch.lora(), layout.modules[m], adapters[size_t(first) + l].data(), w.data());
    }
    STRATA_RETURN_IF_ERROR(sink(int(m), w.data()), layout.modules[m].name);
  }
  return Status::ok();
}

Status export_merged(const std::string& checkpoint, const ModelConfig& model,
                     const Architecture& arch, HfCheckpointWriter& writer) {
  return merged_lora_modules(checkpoint, model, arch, [&](int m, const float* values) {
    return writer.write_module(m, values);
  });
}

}  // namespace strata
