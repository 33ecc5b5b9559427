// A reader of Hugging Face's safetensors files, validating everything before a byte is used.
//
// Format: an 8-byte little-endian header length n, then n bytes of JSON
//   {"<name>": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string>", ...}}
// then the data region; a tensor's bytes are [8 + n + begin, 8 + n + end) of the file.
//
// open() checks, and names the file, the tensor and the byte offset in every error: the header
// length against the file size, the JSON, every entry's keys and types, the dtype (F32, F16,
// BF16), that end - begin equals the shape's elements times the dtype's size, that no tensor
// points past the end of the file (a truncated file), and that no two tensors overlap.
// Reading a tensor reads only its bytes (pread), so a model streams tensor by tensor.
//
// Thread safety: after open(), read() may be called from several threads at once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "strata/dtype.h"
#include "strata/status.h"

namespace strata {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // absolute byte offset in the file
  uint64_t bytes = 0;
  uint64_t numel() const;
};

// Elements [first, first + n) of tensor t, as a tensor of their own (a byte range of its data,
// shape [n]): what read() and read_as() take to read part of a tensor.
SafetensorsTensor tensor_elements(const SafetensorsTensor& t, size_t first, size_t n);

// The weight map of a sharded checkpoint's index (model.safetensors.index.json: {"weight_map":
// {"<tensor>": "<file>", ...}}): tensor -> shard file name, a plain name in the index's
// directory. kCorrupt naming the file (and the line and column of invalid JSON) when it is not
// such a map; kIoError when it cannot be read.
Result<std::map<std::string, std::string>> read_safetensors_index(const std::string& path);

class SafetensorsFile {
 public:
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // Opens and validates `path` (see above). kCorrupt for a malformed file, kIoError when it
  // cannot be read, kInvalidArgument for a dtype strata does not read.
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);

  const std::string& path() const { return path_; }
  // Tensors in file order (ascending offsets).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const SafetensorsTensor* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Reads tensor t's bytes into dst (t.bytes bytes, the file's dtype). A short read names the
  // tensor, the file and the offset.
  Status read(const SafetensorsTensor& t, void* dst) const;
  // Reads tensor t and converts it to `dst_dtype` (dst holds numel() elements of it).
  Status read_as(const SafetensorsTensor& t, DType dst_dtype, void* dst) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  int fd_ = -1;
  uint64_t file_size_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace strata
