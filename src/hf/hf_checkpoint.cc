#include "src/hf/hf_checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "src/base/json_text.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string shape_text(const std::vector<int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

}  // namespace

Result<std::unique_ptr<HfCheckpointReader>> HfCheckpointReader::open(const std::string& dir,
                                                                     const Architecture& arch) {
  std::unique_ptr<HfCheckpointReader> r(new HfCheckpointReader());
  r->arch_ = &arch;
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  // tensor name -> the file that holds it
  std::map<std::string, const SafetensorsFile*> where;
  std::string layout_name;  // for messages: what was looked in
  // transformers reads model.safetensors when a directory has it, the index only when not.
  if (is_file(single) && is_file(index)) {
    log_warn(
        "model.from_pretrained: {} holds both model.safetensors and model.safetensors.index.json; "
        "reading model.safetensors, as transformers does (the index and the shards it names are "
        "not read): remove the set that is not the model's",
        dir);
  }
  if (!is_file(single) && is_file(index)) {
    STRATA_ASSIGN_OR_RETURN(auto map, read_safetensors_index(index), "model.from_pretrained");
    std::map<std::string, const SafetensorsFile*> by_file;
    for (const auto& [name, file] : map) {
      if (by_file.count(file) == 0) {
        STRATA_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(dir + "/" + file),
                                fmt::format("model.from_pretrained (shard named by {})", index));
        by_file[file] = f.get();
        r->files_.push_back(std::move(f));
      }
      const SafetensorsFile* f = by_file[file];
      if (f->find(name) == nullptr) {
        return corrupt(
            fmt::format("{}: weight_map names tensor \"{}\" in {}, which does not hold it", index,
                        name, f->path()));
      }
      where[name] = f;
    }
    layout_name = index;
  } else if (is_file(single)) {
    STRATA_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(single), "model.from_pretrained");
    for (const SafetensorsTensor& t : f->tensors()) where[t.name] = f.get();
    r->files_.push_back(std::move(f));
    layout_name = single;
  } else {
    return not_found(
        fmt::format("model.from_pretrained: {} has neither model.safetensors nor "
                    "model.safetensors.index.json (a PyTorch .bin checkpoint can be converted with "
                    "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                    "safe_serialization=True))",
                    dir));
  }

  // Every tensor the model needs: present, the right shape.
  std::set<std::pair<const SafetensorsFile*, std::string>> used;
  const ModelLayout& layout = arch.layout();
  r->modules_.resize(layout.modules.size());
  for (size_t m = 0; m < layout.modules.size(); ++m) {
    for (HfTensor& hf : arch.hf_tensors(int(m))) {
      std::string name = hf.name;
      auto it = where.find(name);
      if (it == where.end() && !hf.alt_name.empty()) it = where.find(name = hf.alt_name);
      if (it == where.end()) {
        return invalid_argument(fmt::format(
            "model.from_pretrained: tensor \"{}\" (strata's {}.{}, shape {}) is missing from {}; "
            "is config.json the one these weights were saved with?",
            hf.name, layout.modules[m].name, layout.modules[m].tensors[size_t(hf.tensor)].name,
            shape_text(hf.shape), layout_name));
      }
      const SafetensorsFile* f = it->second;
      const SafetensorsTensor& t = *f->find(name);
      used.insert({f, name});
      bool ok = t.shape.size() == hf.shape.size();
      for (size_t d = 0; ok && d < t.shape.size(); ++d) {
        ok = t.shape[d] == hf.shape[d] || (d == 0 && hf.more_rows_ok && t.shape[0] > hf.shape[0]);
      }
      if (!ok) {
        return invalid_argument(fmt::format(
            "model.from_pretrained: {}: tensor \"{}\" at offset {} has shape {}, but config.json "
            "(and model.context) make it {}{}",
            f->path(), name, t.offset, shape_text(t.shape), shape_text(hf.shape),
            hf.more_rows_ok ? " (or more rows)" : ""));
      }
      Located loc;
      loc.file = f;
      loc.tensor = t;
      loc.stored = t;
      if (t.shape[0] != hf.shape[0]) {  // read only the leading rows
        const uint64_t row_bytes = t.bytes / uint64_t(t.shape[0]);
        loc.tensor.shape[0] = hf.shape[0];
        loc.tensor.bytes = row_bytes * uint64_t(hf.shape[0]);
      }
      const TensorSpec& spec = layout.modules[m].tensors[size_t(hf.tensor)];
      STRATA_CHECK(loc.tensor.numel() <= spec.numel, "a Hugging Face tensor larger than its home");
      r->bytes_ += loc.tensor.bytes;
      loc.hf = std::move(hf);
      r->modules_[m].push_back(std::move(loc));
    }
  }
  // Nothing else: an unread tensor means the weights and the config disagree.
  for (const auto& f : r->files_) {
    for (const SafetensorsTensor& t : f->tensors()) {
      if (used.count({f.get(), t.name}) || arch.hf_ignorable(t.name)) continue;
      return invalid_argument(fmt::format(
          "model.from_pretrained: {}: tensor \"{}\" (offset {}, shape {}) is not a parameter of "
          "the {} model config.json describes ({}); is config.json the one these weights were "
          "saved with?",
          f->path(), t.name, t.offset, shape_text(t.shape), arch.name(), arch.describe()));
    }
  }
  return r;
}

namespace {

// A non-finite element among the `n` values read from tensor `t` is an error naming it, the file
// and the byte offset; `stored(k)` is the k-th value's element index in the stored tensor.
template <typename StoredIndex>
Status check_finite(const float* v, size_t n, const SafetensorsTensor& t, const std::string& file,
                    StoredIndex stored) {
  for (size_t k = 0; k < n; ++k) {
    if (std::isfinite(v[k])) continue;
    const uint64_t e = stored(k);
    return corrupt(fmt::format(
        "model.from_pretrained: {}: tensor \"{}\" element {} (byte offset {}) is {}: the "
        "checkpoint's weights must be finite (training from them diverges at the first step); "
        "re-download or re-save the checkpoint",
        file, t.name, e, t.offset + e * dtype_size(t.dtype), v[k]));
  }
  return Status::ok();
}

}  // namespace

Status HfCheckpointReader::read_range(int m, size_t begin, size_t count, float* out) const {
  const ModuleSpec& spec = arch_->layout().modules[size_t(m)];
  STRATA_CHECK(begin + count <= spec.numel, "a range past the module's end");
  // Padding rows and anything not in the checkpoint are zero.
  std::fill(out, out + count, 0.0f);
  const size_t end = begin + count;
  std::vector<float> tmp;
  for (const Located& loc : modules_[size_t(m)]) {
    const size_t t0 = spec.tensors[size_t(loc.hf.tensor)].offset, n = loc.tensor.numel();
    const size_t lo = std::max(begin, t0), hi = std::min(end, t0 + n);
    if (lo >= hi) continue;
    float* dst = out + (lo - begin);
    if (!loc.hf.transposed) {
      STRATA_RETURN_IF_ERROR(
          loc.file->read_as(tensor_elements(loc.tensor, lo - t0, hi - lo), DType::kF32, dst),
          "model.from_pretrained");
      STRATA_RETURN_IF_ERROR(check_finite(dst, hi - lo, loc.tensor, loc.file->path(),
                                          [&](size_t k) { return lo - t0 + k; }),
                             "");
      continue;
    }
    // Stored [in, out]; strata keeps [out, in]: element o * in + i is stored at i * out + o. The
    // range needs strata's rows [o0, o1), columns [o0, o1) of every stored row.
    const size_t in = size_t(loc.tensor.shape[0]), cols = size_t(loc.tensor.shape[1]);
    const size_t e0 = lo - t0, e1 = hi - t0, o0 = e0 / in, o1 = (e1 - 1) / in + 1;
    const size_t rows = o1 - o0;
    tmp.resize(in * rows);  // tmp[i * rows + (o - o0)]
    if (rows == cols) {
      STRATA_RETURN_IF_ERROR(loc.file->read_as(loc.tensor, DType::kF32, tmp.data()),
                             "model.from_pretrained");
    } else {
      for (size_t i = 0; i < in; ++i) {
        STRATA_RETURN_IF_ERROR(loc.file->read_as(tensor_elements(loc.tensor, i * cols + o0, rows),
                                                 DType::kF32, tmp.data() + i * rows),
                               "model.from_pretrained");
      }
    }
    STRATA_RETURN_IF_ERROR(check_finite(tmp.data(), in * rows, loc.tensor, loc.file->path(),
                                        [&](size_t k) { return k / rows * cols + o0 + k % rows; }),
                           "");
    for (size_t e = e0; e < e1; ++e) dst[e - e0] = tmp[(e % in) * rows + (e / in - o0)];
  }
  return Status::ok();
}

int64_t HfCheckpointReader::stored_rows(int m, size_t i) const {
  return modules_[size_t(m)][i].stored.shape[0];
}

Status HfCheckpointReader::read_stored_rows(int m, size_t i, int64_t row0, int64_t row1,
                                            float* out) const {
  const SafetensorsTensor& t = modules_[size_t(m)][i].stored;
  STRATA_CHECK(!modules_[size_t(m)][i].hf.transposed, "rows of a tensor stored as strata's");
  STRATA_CHECK(0 <= row0 && row0 <= row1 && row1 <= t.shape[0], "rows within the tensor");
  const size_t row = t.numel() / size_t(t.shape[0]);
  return modules_[size_t(m)][i].file->read_as(
      tensor_elements(t, size_t(row0) * row, size_t(row1 - row0) * row), DType::kF32, out);
}

Status HfCheckpointReader::read_module(int m, float* master) const {
  return read_range(m, 0, arch_->layout().modules[size_t(m)].numel, master);
}

}  // namespace strata
