#include "src/hf/master_weights.h"

#include <fmt/format.h>

#include <algorithm>

#include "src/checkpoint/checkpoint.h"
#include "src/hf/hf_adapter.h"
#include "src/hf/hf_checkpoint.h"

namespace strata {

Result<std::vector<std::vector<float>>> load_master_weights(const Architecture& arch,
                                                            const ModelConfig& model,
                                                            const std::string& checkpoint) {
  const ModelLayout& layout = arch.layout();
  std::vector<std::vector<float>> w(layout.modules.size());
  for (size_t m = 0; m < w.size(); ++m) w[m].assign(layout.modules[m].numel, 0.0f);
  if (checkpoint.empty()) {
    if (model.from_pretrained.empty()) {
      return invalid_argument(
          "generate: no weights: give --checkpoint (a strata checkpoint or run directory) or a "
          "config with model.from_pretrained");
    }
    STRATA_ASSIGN_OR_RETURN(auto hf, HfCheckpointReader::open(model.from_pretrained, arch),
                            "generate");
    for (size_t m = 0; m < w.size(); ++m) {
      STRATA_RETURN_IF_ERROR(hf->read_module(int(m), w[m].data()), "generate");
    }
    return w;
  }
  if (arch.lora() != nullptr) {
    // A LoRA checkpoint holds the adapters alone: the base comes from model.from_pretrained
    // with the adapters merged in, exactly as `strata export` writes the model.
    STRATA_RETURN_IF_ERROR(merged_lora_modules(checkpoint, model, arch,
                                               [&](int m, const float* values) {
                                                 std::copy(values, values + w[size_t(m)].size(),
                                                           w[size_t(m)].begin());
                                                 return Status::ok();
                                               }),
                           "generate");
    return w;
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> files, checkpoint_files(checkpoint), "generate");
  std::vector<float> slice;
  for (const std::string& f : files) {
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(f), "generate");
    if (meta.model_shape != arch.shape_string() || meta.modules.size() != w.size()) {
      return invalid_argument(fmt::format(
          "generate: {} holds a model of shape \"{}\", but the config describes \"{}\"; give "
          "the config the checkpoint was trained with",
          f, meta.model_shape, arch.shape_string()));
    }
    auto staging = [&](size_t i, CheckpointBuffers* out) -> Status {
      slice.assign(meta.modules[i].numel, 0.0f);
      *out = {slice.data(), nullptr, nullptr, 4};
      return Status::ok();
    };
    auto sink = [&](size_t i, const CheckpointBuffers&) -> Status {
      const CheckpointModule& cm = meta.modules[i];
      if (cm.numel == 0) return Status::ok();  // a shard of padding only (offset past the end)
      if (cm.offset + cm.numel > w[i].size()) {
        return corrupt(fmt::format("{}: module {} elements [{}, {}) past its {} elements", f,
                                   cm.name, cm.offset, cm.offset + cm.numel, w[i].size()));
      }
      std::copy(slice.begin(), slice.begin() + ptrdiff_t(cm.numel),
                w[i].begin() + ptrdiff_t(cm.offset));
      return Status::ok();
    };
    STRATA_RETURN_IF_ERROR(read_checkpoint(f, staging, sink), "generate");
  }
  return w;
}

}  // namespace strata
