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
// A checkpoint's tensors are never truncated: where model.from_pretrained stores more rows than
// the model trained (GPT-2's position table past model.context, HfTensor::more_rows_ok), the
// trained rows are written followed by the stored ones beyond them, unchanged, and config.json
// keeps the checkpoint's n_positions.
//
// The directory is a complete model directory: the tokenizer and generation files
// (kHfTokenizerFiles) are copied from HfExportOptions::tokenizer_dir, or else from
// model.from_pretrained, so AutoTokenizer.from_pretrained(dir) and generate() work on it.
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

#include "src/hf/hf_checkpoint.h"
#include "src/model/architecture.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata {

inline constexpr uint64_t kHfShardBytes = 5'000'000'000;

// The files of a Hugging Face model directory that are not weights or config.json: the
// tokenizer (fast tokenizer.json, sentencepiece tokenizer.model, GPT-2's vocab.json +
// merges.txt), its config and special tokens, the chat template, generation defaults.
inline constexpr const char* kHfTokenizerFiles[] = {"tokenizer.json",
                                                    "tokenizer_config.json",
                                                    "special_tokens_map.json",
                                                    "added_tokens.json",
                                                    "tokenizer.model",
                                                    "vocab.json",
                                                    "merges.txt",
                                                    "chat_template.jinja",
                                                    "chat_template.json",
                                                    "generation_config.json"};

struct HfExportOptions {
  // Where the tokenizer and generation files come from: "" = model.from_pretrained (a model
  // trained from scratch has none, and its export then has none). A directory given here must
  // hold tokenizer.json, tokenizer.model or vocab.json.
  std::string tokenizer_dir;
  uint64_t shard_bytes = kHfShardBytes;
  // Log progress (bytes written, rate) about every 10 seconds.
  bool progress = false;
};

class HfCheckpointWriter {
 public:
  ~HfCheckpointWriter();
  HfCheckpointWriter(const HfCheckpointWriter&) = delete;
  HfCheckpointWriter& operator=(const HfCheckpointWriter&) = delete;

  // Plans the files for `arch` (which must outlive the writer) in `model.dtype` and creates
  // their temporaries in `dir`. Opens model.from_pretrained when a tensor's stored rows go
  // past the model's (its config.json and weights must still be there).
  static Result<std::unique_ptr<HfCheckpointWriter>> create(const std::string& dir,
                                                            const ModelConfig& model,
                                                            const Architecture& arch,
                                                            const HfExportOptions& options = {});

  // Module m's fp32 master weights. Modules must come in order 0, 1, ...
  Status write_module(int m, const float* master);

  // After the last module: syncs and renames the files into place, writes config.json (and
  // the index), copies the tokenizer files, syncs the directory. Until it returns OK the
  // directory's old files are intact.
  Status finish();

  // The files written (names in `dir`), and the bytes of tensor data.
  const std::vector<std::string>& files() const { return names_; }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Planned {
    HfTensor hf;  // shape: as written (the stored rows included)
    int file = 0;
    uint64_t offset = 0;  // in the file's data region
    uint64_t bytes = 0;
    int64_t model_rows = 0;  // rows from the master weights; the rest from `source_`
    size_t index = 0;        // in hf_tensors(m)
  };
  HfCheckpointWriter() = default;

  std::string dir_;
  HfExportOptions options_;
  std::unique_ptr<HfCheckpointReader> source_;  // model.from_pretrained, when rows come from it
  uint64_t total_bytes_ = 0;
  double last_progress_ = 0;
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
                         const std::string& dir, const HfExportOptions& options = {});

// Copies the kHfTokenizerFiles present in `from` into `dir`, each written as a temporary and
// renamed into place (never through a link in `dir`; a link in `from`, as in the Hugging Face
// cache, is read through). Returns how many were copied.
Result<int> copy_tokenizer_files(const std::string& from, const std::string& dir);

}  // namespace strata
