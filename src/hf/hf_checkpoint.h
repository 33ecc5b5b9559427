// Reading a Hugging Face checkpoint directory into strata's modules (model.from_pretrained).
//
// The directory holds model.safetensors, or model.safetensors.index.json ({"weight_map":
// {"<tensor>": "<file>", ...}}) naming the shard files beside it; when it holds both,
// model.safetensors is read (as transformers reads it), with a warning. open() validates everything
// before a weight is read, against the architecture's Hugging Face tensor list
// (Architecture::hf_tensors): every file's header (src/hf/safetensors.h: header length, JSON,
// dtype, sizes, truncation, overlaps), that every tensor the model needs is present — in the
// file the index names — with the shape config.json implies and a dtype strata reads (F32, F16,
// BF16), and that no file holds a tensor the model does not read (other than the buffers
// Architecture::hf_ignorable names). Each error names the tensor, the file and the byte offset.
// read_range() refuses a weight that is not finite (NaN, inf), naming it the same way.
//
// read_range() then reads a range of one module's elements from its tensors' bytes (safetensors
// data is random access: pread of the range), converts them to fp32, transposes GPT-2's Conv1D
// weights and zero-fills the vocabulary's padding rows: a model streams a sub-group at a time
// into its homes (device, host or NVMe) through TierManager::init_state, and never needs a
// whole module in memory.
//
// Thread safety: after open(), read_range() may be called from several threads at once.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "src/hf/safetensors.h"
#include "src/model/architecture.h"
#include "strata/status.h"

namespace strata {

class HfCheckpointReader {
 public:
  // Opens and validates `dir` for `arch` (which must outlive the reader). kNotFound when the
  // directory has no safetensors weights, kCorrupt for malformed files, kInvalidArgument when
  // the tensors do not match the architecture.
  static Result<std::unique_ptr<HfCheckpointReader>> open(const std::string& dir,
                                                          const Architecture& arch);

  // Fills out[0, count) with elements [begin, begin + count) of module m's master weights
  // (fp32, in strata's layout: a transposed tensor's range is gathered from the stored columns,
  // one read per stored row unless the range covers the whole tensor).
  Status read_range(int m, size_t begin, size_t count, float* out) const;
  // The whole module (its numel elements).
  Status read_module(int m, float* master) const;

  // The bytes of weights the checkpoint holds (all files, the tensors read).
  uint64_t bytes() const { return bytes_; }

  // The rows the checkpoint stores for module m's i-th Hugging Face tensor (hf_tensors order):
  // more than its shape[0] where HfTensor::more_rows_ok let the import read only the leading
  // ones (GPT-2's positions beyond model.context). The export writes them back unchanged.
  int64_t stored_rows(int m, size_t i) const;
  // Rows [row0, row1) of that tensor as stored, converted to fp32 into out[0, (row1 - row0) *
  // row length).
  Status read_stored_rows(int m, size_t i, int64_t row0, int64_t row1, float* out) const;

 private:
  struct Located {
    HfTensor hf;
    const SafetensorsFile* file = nullptr;
    SafetensorsTensor tensor;  // the part read (the leading rows when more_rows_ok)
    SafetensorsTensor stored;  // the whole tensor in the file
  };
  HfCheckpointReader() = default;

  const Architecture* arch_ = nullptr;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::vector<Located>> modules_;
  uint64_t bytes_ = 0;
};

}  // namespace strata
