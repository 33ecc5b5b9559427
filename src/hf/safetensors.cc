#include "src/hf/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "src/base/json_depth.h"
#include "src/base/json_text.h"

namespace strata {
namespace {

using json = nlohmann::json;

// The most header bytes accepted (the format's own reference limit is 100 MB).
constexpr uint64_t kMaxHeader = uint64_t{100} << 20;

Status pread_all(int fd, void* dst, uint64_t bytes, uint64_t offset, const std::string& what) {
  auto* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < bytes) {
    ssize_t r = ::pread(fd, p + done, bytes - done, off_t(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno_status(errno, fmt::format("{}: reading at offset {}", what, offset));
    if (r == 0) {
      return corrupt(fmt::format("{}: the file ends at offset {}, {} bytes short of the {} read",
                                 what, offset + done, bytes - done, bytes));
    }
    done += uint64_t(r);
  }
  return Status::ok();
}

}  // namespace

uint64_t SafetensorsTensor::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= uint64_t(d);
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd_ < 0) return errno_status(errno, fmt::format("{}: opening a safetensors file", path));
  struct stat st {};
  if (::fstat(f->fd_, &st) != 0) return errno_status(errno, path + ": stat");
  f->file_size_ = uint64_t(st.st_size);
  if (f->file_size_ < 8) {
    return corrupt(
        fmt::format("{}: {} bytes, too short for the 8-byte header length of a "
                    "safetensors file (truncated?)",
                    path, f->file_size_));
  }
  unsigned char len_bytes[8];
  STRATA_RETURN_IF_ERROR(pread_all(f->fd_, len_bytes, 8, 0, path), "the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];  // little-endian
  if (n > kMaxHeader || 8 + n > f->file_size_) {
    return corrupt(fmt::format(
        "{}: offset 0: the header length {} points past the end of the {}-byte file (truncated, "
        "or not a safetensors file)",
        path, n, f->file_size_));
  }
  std::string text(n, '\0');
  STRATA_RETURN_IF_ERROR(pread_all(f->fd_, text.data(), n, 8, path), "the JSON header");
  // Bounded nesting first: walking or destroying a deeply nested value recurses.
  if (Status d = check_json_depth(text); !d.is_ok()) {
    return corrupt(fmt::format("{}: the JSON header (from offset 8): {}", path, d.message()));
  }
  json h = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded() || !h.is_object()) {
    return corrupt(fmt::format("{}: offset 8: the {}-byte header is not a JSON object", path, n));
  }
  const uint64_t data_start = 8 + n, data_size = f->file_size_ - data_start;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) {
        return corrupt(fmt::format("{}: header: __metadata__ is not an object", path));
      }
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string()) {
          return corrupt(fmt::format("{}: header: __metadata__.{} is not a string", path, m.key()));
        }
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& why) {
      return corrupt(fmt::format("{}: tensor \"{}\": {}", path, name, why));
    };
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
        !e.contains("data_offsets")) {
      return bad("the entry needs dtype, shape and data_offsets");
    }
    if (!e["dtype"].is_string()) return bad("dtype is not a string");
    const std::string dt = e["dtype"].get<std::string>();
    SafetensorsTensor t;
    t.name = name;
    if (dt == "F32") {
      t.dtype = DType::kF32;
    } else if (dt == "F16") {
      t.dtype = DType::kF16;
    } else if (dt == "BF16") {
      t.dtype = DType::kBF16;
    } else {
      return invalid_argument(fmt::format(
          "{}: tensor \"{}\": dtype {} is not one strata reads (F32, F16, BF16)", path, name, dt));
    }
    if (!e["shape"].is_array()) return bad("shape is not an array");
    // The element count and the byte count must fit 64 bits: a shape like [2^63] of F16 would
    // otherwise wrap to 0 bytes and pass the size check below.
    uint64_t numel = 1, nbytes = 0;
    for (const json& d : e["shape"]) {
      if (!d.is_number_unsigned()) return bad("shape holds a value that is not a size");
      const uint64_t v = d.get<uint64_t>();
      if (v > uint64_t(INT64_MAX) || __builtin_mul_overflow(numel, v, &numel)) {
        return bad(
            fmt::format("shape {} has more elements than a file can hold", e["shape"].dump()));
      }
      t.shape.push_back(int64_t(v));
    }
    if (__builtin_mul_overflow(numel, uint64_t(dtype_size(t.dtype)), &nbytes)) {
      return bad(fmt::format("shape {} of {} needs more bytes than a file can hold",
                             e["shape"].dump(), dt));
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return bad("data_offsets is not [begin, end]");
    }
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (en < b) return bad(fmt::format("data_offsets [{}, {}] end before they begin", b, en));
    if (en - b != nbytes) {
      return bad(fmt::format("data_offsets [{}, {}] hold {} bytes, but shape {} of {} needs {}", b,
                             en, en - b, e["shape"].dump(), dt, nbytes));
    }
    if (en > data_size) {
      return bad(fmt::format(
          "data_offsets [{}, {}] lie past its end: the data region from offset {} holds {} bytes "
          "(truncated file, or a header pointing past the end)",
          b, en, data_start, data_size));
    }
    t.offset = data_start + b;
    t.bytes = nbytes;
    f->tensors_.push_back(std::move(t));
  }
  std::sort(f->tensors_.begin(), f->tensors_.end(),
            [](const auto& a, const auto& b) { return a.offset < b.offset; });
  // Each non-empty tensor against the last non-empty one before it (an empty tensor between
  // two overlapping ones must not hide the overlap).
  const SafetensorsTensor* p = nullptr;
  for (size_t i = 0; i < f->tensors_.size(); ++i) {
    const SafetensorsTensor& t = f->tensors_[i];
    if (t.bytes > 0) {
      if (p != nullptr && t.offset < p->offset + p->bytes) {
        return corrupt(
            fmt::format("{}: tensors \"{}\" (bytes [{}, {})) and \"{}\" (from offset {}) overlap",
                        path, p->name, p->offset, p->offset + p->bytes, t.name, t.offset));
      }
      p = &t;
    }
    f->by_name_[t.name] = i;
  }
  return f;
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Status SafetensorsFile::read(const SafetensorsTensor& t, void* dst) const {
  return pread_all(fd_, dst, t.bytes, t.offset,
                   fmt::format("{}: tensor \"{}\" (offset {})", path_, t.name, t.offset));
}

Status SafetensorsFile::read_as(const SafetensorsTensor& t, DType dst_dtype, void* dst) const {
  if (dst_dtype == t.dtype) return read(t, dst);
  std::vector<unsigned char> raw(t.bytes);
  STRATA_RETURN_IF_ERROR(read(t, raw.data()), "reading before converting");
  convert(raw.data(), t.dtype, dst, dst_dtype, t.numel());
  return Status::ok();
}

SafetensorsTensor tensor_elements(const SafetensorsTensor& t, size_t first, size_t n) {
  SafetensorsTensor r = t;
  const uint64_t eb = dtype_size(t.dtype);
  r.offset += first * eb;
  r.bytes = n * eb;
  r.shape = {int64_t(n)};
  return r;
}

Result<std::map<std::string, std::string>> read_safetensors_index(const std::string& path) {
  std::ifstream in(path);
  if (!in) return io_error(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  Result<json> parsed = parse_json_text(ss.str(), path);
  if (!parsed.is_ok()) return corrupt(parsed.status().message());
  json j = std::move(parsed).value();
  if (!j.is_object()) return corrupt(path + ": not a JSON object");
  if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
    return corrupt(path + ": weight_map: missing or not an object of tensor -> file name");
  }
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) {
      return corrupt(fmt::format("{}: weight_map.{}: not a file name", path, name));
    }
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") {
      return corrupt(
          fmt::format("{}: weight_map.{}: \"{}\" is not a file name in the checkpoint's directory",
                      path, name, f));
    }
    map[name] = f;
  }
  return map;
}

}  // namespace strata
