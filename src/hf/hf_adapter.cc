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

#include "src/base/safe_file.h"
#include "src/checkpoint/checkpoint.h"
#include "src/hf/adapter_config.h"
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

// The adapted expert parameters, as PEFT's target_parameters lists them ("experts.down_proj":
// the parameter and the module holding it).
std::set<std::string> target_parameter_names(const LoraLayout& L) {
  std::set<std::string> out;
  for (const LoraLayout::Target& t : L.experts) {
    const std::string& n = t.site.name;
    const size_t dot = n.rfind('.', n.rfind('.') - 1);
    out.insert(dot == std::string::npos ? n : n.substr(dot + 1));
  }
  return out;
}

std::set<std::string> expert_site_names(const LoraLayout& L) {
  std::set<std::string> out;
  for (const LoraLayout::Target& t : L.experts) out.insert(t.site.name);
  return out;
}

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found(fmt::format("{}: cannot open (not a PEFT adapter directory)", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
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
  STRATA_ASSIGN_OR_RETURN(std::string cfg_text, read_text(cfg_path), "");
  STRATA_RETURN_IF_ERROR(
      check_adapter_config(cfg_text, cfg_path,
                           {L->r, L->scaling, target_names(*L), L->all_sites,
                            arch.shape().lora.target_pattern, expert_site_names(*L)}),
      "");
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
  if (!L->experts.empty()) cfg["target_parameters"] = target_parameter_names(*L);
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
    // Block l (module 1 + l) gets adapter module first + l merged in, its experts
    // ("block.<l>.expert.<e>") the adapter's expert parameters.
    const std::string& name = layout.modules[m].name;
    if (name.rfind("block.", 0) == 0 && name.find('.', 6) == std::string::npos) {
      const size_t l = std::stoul(name.substr(6));
      lora_merge(*arch.lora(), layout.modules[m], adapters[size_t(first) + l].data(), w.data());
    } else if (const size_t x = name.find(".expert.");
               name.rfind("block.", 0) == 0 && x != std::string::npos) {
      const size_t l = std::stoul(name.substr(6, x - 6));
      const int e = std::stoi(name.substr(x + 8));
      lora_merge_expert(*arch.lora(), e, layout.modules[m], adapters[size_t(first) + l].data(),
                        w.data());
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
