// Writing strata's weights as a Hugging Face checkpoint directory (`strata export`,
// train.export_dir): config.json (hf_config_json) and the weights in the model dtype as
// model.safetensors, or — past `shard_bytes` (5 GB, transformers' default) — as
// model-0000K-of-0000N.safetensors shards with model.safetensors.index.json, which
// transformers' AutoModelForCausalLM.from_pretrained(dir) loads.
//
// Names, shapes and layouts are the architecture's (Architecture::hf_tensors): GPT-2's Conv1D
// weights are written transposed back, the vocabulary's padding rows are left out. Every tensor
// is converted from the fp32 master weights with round-to-nearest-even, so a bf16 checkpoint
// imported (bf16 -> fp32 is exact) and exported unchanged gives back the same tensor bytes.
//
// Files are written safely, as checkpoints are (src/base/safe_file.h): each as <name>.tmp
// created with O_EXCL | O_NOFOLLOW, fsynced, renamed over <name> only once every file is
// complete, then the directory fsynced. The file of the other layout (model.safetensors vs. the
// index) is removed, so a directory never holds two sets of weights. Modules are written as
// they come (one in memory at a time); the output directory is created if missing.
//
// Thread safety: one writer is driven by one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata {

inline constexpr uint64_t kHfShardBytes = 5'000'000'000;

class HfCheckpointWriter {
 public:
  ~HfCheckpointWriter();
  HfCheckpointWriter(const HfCheckpointWriter&) = delete;
  HfCheckpointWriter& operator=(const HfCheckpointWriter&) = delete;

  // Plans the files for `arch` (which must outlive the writer) in `model.dtype` and creates
  // their temporaries in `dir`.
  static Result<std::unique_ptr<HfCheckpointWriter>> create(const std::string& dir,
                                                            const ModelConfig& model,
                                                            const Architecture& arch,
                                                            uint64_t shard_bytes = kHfShardBytes);

  // Module m's fp32 master weights. Modules must come in order 0, 1, ...
  Status write_module(int m, const float* master);

  // After the last module: syncs and renames the files into place, writes config.json (and
  // the index), syncs the directory. Until it returns OK the directory's old files are intact.
  Status finish();

  // The files written (names in `dir`), and the bytes of tensor data.
  const std::vector<std::string>& files() const { return names_; }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Planned {
    HfTensor hf;
    int file = 0;
    uint64_t offset = 0;  // in the file's data region
    uint64_t bytes = 0;
  };
  HfCheckpointWriter() = default;

  std::string dir_;
  ModelConfig model_;
  const Architecture* arch_ = nullptr;
  DType dt_ = DType::kBF16;
  std::vector<std::vector<Planned>> modules_;
  std::vector<std::string> names_;
  std::vector<int> fds_;
  std::vector<uint64_t> written_;  // per file: bytes written so far (header included)
  int next_module_ = 0;
  uint64_t bytes_ = 0;
};

// Exports the whole-model checkpoint `checkpoint` (a strata checkpoint file or the manifest of
// a sharded one) of the model `model` describes to `dir`. The checkpoint's model shape must be
// the model's. Module by module: never more than one module's master weights in memory, except
// for a sharded checkpoint, whose shards are gathered into a scratch file in `dir` first.
Status export_checkpoint(const std::string& checkpoint, const ModelConfig& model,
                         const std::string& dir, uint64_t shard_bytes = kHfShardBytes);

}  // namespace strata
