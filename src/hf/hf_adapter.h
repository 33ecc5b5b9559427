// PEFT adapter directories: adapter_config.json + adapter_model.safetensors, as
// peft.PeftModel.save_pretrained writes them and peft.PeftModel.from_pretrained(base, DIR) reads
// them, for a model with LoRA adapters (model.lora, src/model/lora.h).
//
// Tensors: Architecture::hf_adapter_tensors (lora_hf_tensors): "base_model.model.<block
// prefix><site>.lora_A.weight" [r, in] and "...lora_B.weight" [out, r], written in fp32.
// adapter_config.json: peft_type LORA, r, lora_alpha (= scaling * r), lora_dropout 0,
// target_modules (the adapted sites' last names), bias "none", fan_in_fan_out (GPT-2's Conv1D),
// base_model_name_or_path (model.from_pretrained).
//
// Reading checks the directory against the model before any value is used: the config's r,
// lora_alpha / r and target modules must be the model's lora section's, and every tensor must be
// there with the model's shape; an adapter saved for another base (other widths, other layer
// count) is an error naming the tensor and both shapes.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "src/hf/safetensors.h"
#include "src/model/architecture.h"
#include "strata/status.h"

namespace strata {

class HfAdapterReader {
 public:
  // Opens and checks `dir` against `arch` (which must have adapters and outlive the reader).
  static Result<std::unique_ptr<HfAdapterReader>> open(const std::string& dir,
                                                       const Architecture& arch);
  // Adapter module m's values (its numel fp32 elements); kInvalidArgument for a base module.
  Status read_module(int m, float* out) const;

 private:
  HfAdapterReader() = default;
  const Architecture* arch_ = nullptr;
  std::string dir_;
  std::unique_ptr<SafetensorsFile> file_;
};

// Writes `dir` (created with its parents if missing; its adapter files replaced together, by
// write_directory_atomically, so a reader or a kill sees the old pair or the new one, never a
// mix; written through no link)
// from each adapter module's fp32 values, which `values(m, out)` fills. `base` is the
// base_model_name_or_path to record.
Status write_hf_adapter(const std::string& dir, const Architecture& arch, const std::string& base,
                        const std::function<Status(int m, float* out)>& values);

// Each adapter module's fp32 master weights from strata checkpoint `checkpoint` (a checkpoint
// file or a sharded checkpoint's manifest; its shards' slices gathered), indexed by module
// (empty for the frozen base). The checkpoint's model shape must be `arch`'s.
Result<std::vector<std::vector<float>>> read_checkpoint_adapters(const std::string& checkpoint,
                                                                 const Architecture& arch);

// `strata export --adapter DIR`: the adapters of `checkpoint` as a PEFT adapter directory.
Status export_adapter(const std::string& checkpoint, const ModelConfig& model,
                      const std::string& dir);

// A LoRA run's model as one set of fp32 weights: the frozen base (model.from_pretrained's
// weights, else its initialization from the checkpoint's seed; a LoRA checkpoint holds only the
// adapters) with every block's adapters merged in (lora_merge), handed to `sink` module by
// module in order (an adapter module's own values are handed on as they are). The one
// reconstruction `strata export` and `strata generate --checkpoint` share, so both give the
// same tokens.
Status merged_lora_modules(const std::string& checkpoint, const ModelConfig& model,
                           const Architecture& arch,
                           const std::function<Status(int m, const float* values)>& sink);

// `strata export` of a LoRA run: merged_lora_modules written through `writer` module by module
// (the adapter modules have no tensors there).
class HfCheckpointWriter;
Status export_merged(const std::string& checkpoint, const ModelConfig& model,
                     const Architecture& arch, HfCheckpointWriter& writer);

}  // namespace strata
