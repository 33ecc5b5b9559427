#include "src/hf/hf_export.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/base/safe_file.h"
#include "src/checkpoint/checkpoint.h"
#include "src/hf/hf_adapter.h"
#include "src/hf/hf_config.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;

const char* st_dtype(DType t) {
  return t == DType::kBF16 ? "BF16" : t == DType::kF16 ? "F16" : "F32";
}

Status pwrite_all(int fd, const void* data, size_t n, uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < n) {
    ssize_t w = ::pwrite(fd, p + done, n - done, off_t(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      return errno_status(
          errno, fmt::format("{}: writing {} bytes at offset {}", path, n - done, offset + done));
    }
    done += size_t(w);
  }
  return Status::ok();
}

bool is_regular_file(const std::string& path) {  // through a link (the Hugging Face cache's)
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Result<int> copy_tokenizer_files(const std::string& from, const std::string& dir) {
  int copied = 0;
  for (const char* name : kHfTokenizerFiles) {
    const std::string src = from + "/" + name;
    if (!is_regular_file(src)) continue;
    std::ifstream in(src, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in.good() && !in.eof()) return io_error(fmt::format("{}: cannot read", src));
    STRATA_RETURN_IF_ERROR(write_file_atomically(dir + "/" + name, ss.str(), 0644),
                           fmt::format("copying {}", src));
    ++copied;
  }
  return copied;
}

HfCheckpointWriter::~HfCheckpointWriter() {
  for (size_t i = 0; i < fds_.size(); ++i) {
    if (fds_[i] >= 0) {
      ::close(fds_[i]);
      ::unlink((dir_ + "/" + names_[i] + ".tmp").c_str());  // not finished: no trace
    }
  }
}

Result<std::unique_ptr<HfCheckpointWriter>> HfCheckpointWriter::create(
    const std::string& dir, const ModelConfig& model, const Architecture& arch,
    const HfExportOptions& options) {
  std::unique_ptr<HfCheckpointWriter> w(new HfCheckpointWriter());
  w->dir_ = dir;
  w->options_ = options;
  w->model_ = model;
  w->arch_ = &arch;
  w->dt_ = model.dtype;
  const ModelLayout& layout = arch.layout();
  if (!options.tokenizer_dir.empty() &&
      !is_regular_file(options.tokenizer_dir + "/tokenizer.json") &&
      !is_regular_file(options.tokenizer_dir + "/tokenizer.model") &&
      !is_regular_file(options.tokenizer_dir + "/vocab.json")) {
    return not_found(fmt::format(
        "export: --tokenizer {}: no tokenizer.json, tokenizer.model or vocab.json there; name "
        "the Hugging Face model directory whose tokenizer the model uses",
        options.tokenizer_dir));
  }
  // The stored rows past the model's (GPT-2's positions past model.context) come from the
  // checkpoint the model was imported from.
  bool more_rows = false;
  for (size_t m = 0; m < layout.modules.size(); ++m) {
    for (const HfTensor& hf : arch.hf_tensors(int(m))) more_rows |= hf.more_rows_ok;
  }
  if (more_rows && !model.from_pretrained.empty()) {
    STRATA_ASSIGN_OR_RETURN(
        w->source_, HfCheckpointReader::open(model.from_pretrained, arch),
        fmt::format("export: the rows past model.context are copied from model.from_pretrained "
                    "({})",
                    model.from_pretrained));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return io_error(fmt::format("{}: creating the export directory: {}", dir, ec.message()));
  // Plan: tensors in module order, a new shard when the next tensor would pass shard_bytes.
  const size_t es = dtype_size(w->dt_);
  std::vector<uint64_t> file_bytes = {0};
  w->modules_.resize(layout.modules.size());
  for (size_t m = 0; m < layout.modules.size(); ++m) {
    std::vector<HfTensor> tensors = arch.hf_tensors(int(m));
    for (size_t i = 0; i < tensors.size(); ++i) {
      HfTensor& hf = tensors[i];
      Planned p;
      p.index = i;
      p.model_rows = hf.shape[0];
      if (hf.more_rows_ok && w->source_) hf.shape[0] = w->source_->stored_rows(int(m), i);
      uint64_t n = 1;
      for (int64_t d : hf.shape) n *= uint64_t(d);
      p.bytes = n * es;
      if (file_bytes.back() > 0 && file_bytes.back() + p.bytes > options.shard_bytes) {
        file_bytes.push_back(0);
      }
      p.file = int(file_bytes.size() - 1);
      p.offset = file_bytes.back();
      file_bytes.back() += p.bytes;
      w->total_bytes_ += p.bytes;
      p.hf = std::move(hf);
      w->modules_[m].push_back(std::move(p));
    }
  }
  w->last_progress_ = now_s();
  const size_t nf = file_bytes.size();
  for (size_t f = 0; f < nf; ++f) {
    w->names_.push_back(nf == 1 ? "model.safetensors"
                                : fmt::format("model-{:05}-of-{:05}.safetensors", f + 1, nf));
  }
  // Headers: {"<name>": {"dtype", "shape", "data_offsets"}, "__metadata__": {"format": "pt"}},
  // padded with spaces to a multiple of 8 bytes (as the safetensors library writes them).
  std::vector<json> headers(nf, json::object());
  for (const auto& mod : w->modules_) {
    for (const Planned& p : mod) {
      headers[size_t(p.file)][p.hf.name] = {{"dtype", st_dtype(w->dt_)},
                                            {"shape", p.hf.shape},
                                            {"data_offsets", {p.offset, p.offset + p.bytes}}};
    }
  }
  for (size_t f = 0; f < nf; ++f) {
    headers[f]["__metadata__"] = {{"format", "pt"}};
    std::string text = headers[f].dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::string tmp = dir + "/" + w->names_[f] + ".tmp";
    STRATA_ASSIGN_OR_RETURN(int fd, create_temp_file(tmp, 0644), "exporting");
    w->fds_.push_back(fd);
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));
    uint64_t off = 0;
    STRATA_RETURN_IF_ERROR(write_fully(fd, len, 8, tmp, &off), "exporting");
    STRATA_RETURN_IF_ERROR(write_fully(fd, text.data(), text.size(), tmp, &off), "exporting");
    w->written_.push_back(off);
  }
  return w;
}

Status HfCheckpointWriter::write_module(int m, const float* master) {
  STRATA_CHECK(m == next_module_, "modules are exported in order");
  ++next_module_;
  const ModuleSpec& spec = arch_->layout().modules[size_t(m)];
  std::vector<float> tmp;
  std::vector<char> out;
  for (const Planned& p : modules_[size_t(m)]) {
    const float* src = master + spec.tensors[size_t(p.hf.tensor)].offset;
    const size_t es = dtype_size(dt_);
    const size_t row = p.bytes / es / size_t(p.hf.shape[0]);
    const size_t n = size_t(p.model_rows) * row;  // from the master weights
    if (p.hf.transposed) {                        // strata's [out, in] -> stored [in, out]
      const size_t in = size_t(p.hf.shape[0]), o = size_t(p.hf.shape[1]);
      tmp.resize(n);
      for (size_t i = 0; i < in; ++i) {
        for (size_t j = 0; j < o; ++j) tmp[i * o + j] = src[j * in + i];
      }
      src = tmp.data();
    }
    out.resize(p.bytes);
    convert(src, DType::kF32, out.data(), dt_, n);
    if (p.hf.shape[0] > p.model_rows) {  // the stored rows past the model's, unchanged
      tmp.resize(size_t(p.hf.shape[0] - p.model_rows) * row);
      STRATA_RETURN_IF_ERROR(
          source_->read_stored_rows(m, p.index, p.model_rows, p.hf.shape[0], tmp.data()),
          fmt::format("exporting tensor \"{}\"", p.hf.name));
      convert(tmp.data(), DType::kF32, out.data() + n * es, dt_, tmp.size());
    }
    const int fd = fds_[size_t(p.file)];
    const std::string path = dir_ + "/" + names_[size_t(p.file)] + ".tmp";
    uint64_t off = written_[size_t(p.file)];
    STRATA_RETURN_IF_ERROR(write_fully(fd, out.data(), out.size(), path, &off),
                           fmt::format("exporting tensor \"{}\"", p.hf.name));
    written_[size_t(p.file)] = off;
    bytes_ += p.bytes;
  }
  if (options_.progress && now_s() - last_progress_ >= 10.0) {
    last_progress_ = now_s();
    log_info("export: {:.2f} of {:.2f} GB written ({} of {} modules)", double(bytes_) / 1e9,
             double(total_bytes_) / 1e9, m + 1, modules_.size());
  }
  return Status::ok();
}

Status HfCheckpointWriter::finish() {
  STRATA_CHECK(next_module_ == int(modules_.size()), "finish() after every module");
  for (size_t f = 0; f < fds_.size(); ++f) {
    const std::string tmp = dir_ + "/" + names_[f] + ".tmp";
    if (::fsync(fds_[f]) != 0) return errno_status(errno, tmp + ": fsync");
    if (::close(fds_[f]) != 0) {
      fds_[f] = -1;
      return errno_status(errno, tmp + ": close");
    }
    fds_[f] = -1;
  }
  for (size_t f = 0; f < names_.size(); ++f) {
    const std::string tmp = dir_ + "/" + names_[f] + ".tmp", fin = dir_ + "/" + names_[f];
    if (::rename(tmp.c_str(), fin.c_str()) != 0) {
      return errno_status(errno, fmt::format("renaming {} to {}", tmp, fin));
    }
  }
  const std::string index = dir_ + "/model.safetensors.index.json";
  if (names_.size() > 1) {
    json j;
    j["metadata"] = {{"total_size", bytes_}};
    j["weight_map"] = json::object();
    for (const auto& mod : modules_) {
      for (const Planned& p : mod) j["weight_map"][p.hf.name] = names_[size_t(p.file)];
    }
    STRATA_RETURN_IF_ERROR(write_file_atomically(index, j.dump(2) + "\n", 0644), "exporting");
    ::unlink((dir_ + "/model.safetensors").c_str());  // the other layout's weights
  } else {
    ::unlink(index.c_str());
  }
  STRATA_RETURN_IF_ERROR(write_file_atomically(dir_ + "/config.json", hf_config_json(model_), 0644),
                         "exporting");
  const std::string tok =
      options_.tokenizer_dir.empty() ? model_.from_pretrained : options_.tokenizer_dir;
  if (!tok.empty()) {
    STRATA_ASSIGN_OR_RETURN(int copied, copy_tokenizer_files(tok, dir_), "exporting");
    if (copied == 0) {
      log_warn(
          "export: {} holds no tokenizer files; {} has none (give strata export "
          "--tokenizer DIR)",
          tok, dir_);
    }
  }
  return fsync_directory(dir_);
}

Status export_checkpoint(const std::string& checkpoint, const ModelConfig& model,
                         const std::string& dir, const HfExportOptions& options) {
  STRATA_ASSIGN_OR_RETURN(auto arch, create_architecture(model), "export");
  const ModelLayout& layout = arch->layout();
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> files, checkpoint_files(checkpoint), "export");
  for (const std::string& f : files) {
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(f), "export");
    if (meta.model_shape != arch->shape_string() || meta.modules.size() != layout.modules.size()) {
      return invalid_argument(fmt::format(
          "export: {} holds a model of shape \"{}\", but the config describes \"{}\"; give the "
          "config the checkpoint was trained with",
          f, meta.model_shape, arch->shape_string()));
    }
  }
  STRATA_ASSIGN_OR_RETURN(auto w, HfCheckpointWriter::create(dir, model, *arch, options), "export");
  if (arch->lora()) {  // a LoRA run: the base with the adapters merged in
    STRATA_RETURN_IF_ERROR(export_merged(checkpoint, model, *arch, *w), "");
    return w->finish();
  }
  std::vector<float> master;
  if (files.size() == 1) {  // a whole-model checkpoint: module by module
    auto staging = [&](size_t i, CheckpointBuffers* out) -> Status {
      master.assign(layout.modules[i].numel, 0.0f);
      *out = {master.data(), nullptr, nullptr, 4};
      return Status::ok();
    };
    auto sink = [&](size_t i, const CheckpointBuffers&) -> Status {
      return w->write_module(int(i), master.data());
    };
    STRATA_RETURN_IF_ERROR(read_checkpoint(files[0], staging, sink), "export");
    return w->finish();
  }
  // Shards (one per rank, each a slice of every module): gathered into a scratch file of fp32
  // master weights, then exported module by module from it.
  const std::string scratch = dir + "/.strata-export-scratch.tmp";
  ::unlink(scratch.c_str());  // a killed export's leftover (or a planted link: never followed)
  const int fd = ::open(scratch.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return errno_status(errno, scratch + ": creating the export's scratch file");
  struct Closer {
    int fd;
    std::string path;
    ~Closer() {
      ::close(fd);
      ::unlink(path.c_str());
    }
  } closer{fd, scratch};
  std::vector<uint64_t> start(layout.modules.size() + 1, 0);
  for (size_t i = 0; i < layout.modules.size(); ++i) {
    start[i + 1] = start[i] + layout.modules[i].numel * 4;
  }
  if (::ftruncate(fd, off_t(start.back())) != 0) return errno_status(errno, scratch + ": size");
  for (const std::string& f : files) {
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(f), "export");
    auto staging = [&](size_t i, CheckpointBuffers* out) -> Status {
      master.assign(meta.modules[i].numel, 0.0f);
      *out = {master.data(), nullptr, nullptr, 4};
      return Status::ok();
    };
    auto sink = [&](size_t i, const CheckpointBuffers&) -> Status {
      const CheckpointModule& cm = meta.modules[i];
      if (cm.numel == 0) return Status::ok();  // a shard of padding only (offset past the end)
      if (cm.offset + cm.numel > layout.modules[i].numel) {
        return corrupt(fmt::format("{}: module {} elements [{}, {}) past its {} elements", f,
                                   cm.name, cm.offset, cm.offset + cm.numel,
                                   layout.modules[i].numel));
      }
      return pwrite_all(fd, master.data(), cm.numel * 4, start[i] + cm.offset * 4, scratch);
    };
    STRATA_RETURN_IF_ERROR(read_checkpoint(f, staging, sink), "export");
  }
  for (size_t i = 0; i < layout.modules.size(); ++i) {
    master.resize(layout.modules[i].numel);
    size_t done = 0;
    char* p = reinterpret_cast<char*>(master.data());
    const size_t n = master.size() * 4;
    while (done < n) {
      ssize_t r = ::pread(fd, p + done, n - done, off_t(start[i] + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return errno_status(r < 0 ? errno : EIO, scratch + ": reading back");
      done += size_t(r);
    }
    STRATA_RETURN_IF_ERROR(w->write_module(int(i), master.data()), "export");
  }
  return w->finish();
}

}  // namespace strata
