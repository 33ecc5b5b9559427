#include "src/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "src/base/json_depth.h"
#include "src/base/safe_file.h"
#include "strata/checksum.h"
#include "strata/log.h"
#include "strata/optimizer.h"

namespace strata {
namespace {

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'C', 'K'};
constexpr size_t kFixedHeader = 32;

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

Status read_all(int fd, void* data, size_t n, const std::string& path, uint64_t off) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, fmt::format("reading {} at offset {}", path, off));
    }
    if (r == 0) {
      return corrupt(
          fmt::format("{}: truncated: unexpected end of file at offset {} ({} more "
                      "bytes expected)",
                      path, off, n));
    }
    p += r;
    n -= size_t(r);
    off += size_t(r);
  }
  return Status::ok();
}

void put32(char* p, uint32_t v) { std::memcpy(p, &v, 4); }
void put64(char* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t get32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t get64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

std::string meta_json(const CheckpointMeta& m) {
  nlohmann::json j;
  j["step"] = m.step;
  j["opt_steps"] = m.opt_steps;
  j["loss_scale"] = m.loss_scale;
  j["scaler_cur_iter"] = m.scaler_cur_iter;
  j["scaler_last_overflow_iter"] = m.scaler_last_overflow_iter;
  j["scaler_cur_hysteresis"] = m.scaler_cur_hysteresis;
  j["model_shape"] = m.model_shape;
  j["moment_dtype"] = m.moment_dtype;
  if (!m.optimizer_state.empty()) j["optimizer_state"] = m.optimizer_state;
  j["seed"] = m.seed;
  if (m.micro_batch > 0) j["micro_batch"] = m.micro_batch;
  if (m.accumulation > 0) j["gradient_accumulation_steps"] = m.accumulation;
  if (m.schedule_steps > 0) j["schedule_steps"] = m.schedule_steps;
  if (m.pad_token_id >= -1) j["pad_token_id"] = m.pad_token_id;
  nlohmann::json mods = nlohmann::json::array();
  for (const auto& mod : m.modules) {
    mods.push_back({{"name", mod.name}, {"numel", mod.numel}, {"offset", mod.offset}});
  }
  j["modules"] = mods;
  j["world_size"] = m.world_size;
  j["rank"] = m.rank;
  j["run_id"] = m.run_id;
  return j.dump();
}

// Bytes of the payload; UINT64_MAX when the module sizes overflow (never a valid length).
uint64_t payload_bytes(const CheckpointMeta& m, size_t moment_bytes) {
  const uint64_t per = 4 + 2 * moment_bytes;
  uint64_t n = 0;
  for (const auto& mod : m.modules) {
    if (mod.numel > (UINT64_MAX - n) / per) return UINT64_MAX;
    n += mod.numel * per;
  }
  return n;
}

size_t moment_bytes_of(const std::string& dtype) { return dtype == "bf16" ? 2 : 4; }

// Strict field readers: the metadata is checksummed, but a checksum only says the bytes are
// the ones written, not that the writer was strata; every value is checked for its type and
// range here and against the run by check_resume (src/train/resume_check.h).
using json = nlohmann::json;
int64_t int_field(const json& j, const char* key, int64_t lo, int64_t hi) {
  const json& v = j.at(key);
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi))) {
    throw std::runtime_error(fmt::format("{} is {}, expected an integer in [{}, {}]", key,
                                         v.dump().substr(0, 40), lo, hi));
  }
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) {
    throw std::runtime_error(fmt::format("{} is {}, expected [{}, {}]", key, x, lo, hi));
  }
  return x;
}
uint64_t size_field(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_number_unsigned()) {
    throw std::runtime_error(
        fmt::format("{} is {}, expected a non-negative integer", key, v.dump().substr(0, 40)));
  }
  return v.get<uint64_t>();
}
std::string string_field(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_string()) {
    throw std::runtime_error(
        fmt::format("{} is {}, expected a string", key, v.dump().substr(0, 40)));
  }
  return v.get<std::string>();
}

CheckpointMeta parse_meta(const std::string& js) {
  Status depth = check_json_depth(js);
  if (!depth.is_ok()) throw std::runtime_error(depth.message());
  const json j = json::parse(js);
  if (!j.is_object()) throw std::runtime_error("not a JSON object");
  constexpr int64_t kMax = int64_t{1} << 62;
  CheckpointMeta m;
  m.step = int_field(j, "step", 0, kMax);
  m.opt_steps = int_field(j, "opt_steps", 0, m.step);
  const json& ls = j.at("loss_scale");
  if (!ls.is_number() || !std::isfinite(ls.get<double>()) || !(ls.get<double>() > 0)) {
    throw std::runtime_error(
        fmt::format("loss_scale is {}, expected a positive number", ls.dump().substr(0, 40)));
  }
  m.loss_scale = ls.get<double>();
  m.scaler_cur_iter = int_field(j, "scaler_cur_iter", 0, kMax);
  m.scaler_last_overflow_iter = int_field(j, "scaler_last_overflow_iter", -1, kMax);
  m.scaler_cur_hysteresis = static_cast<int>(int_field(j, "scaler_cur_hysteresis", 0, 1 << 30));
  m.model_shape = string_field(j, "model_shape");
  m.moment_dtype = string_field(j, "moment_dtype");
  if (m.moment_dtype != "fp32" && m.moment_dtype != "bf16") {
    throw std::runtime_error(
        fmt::format("moment_dtype is \"{}\", expected fp32 or bf16", m.moment_dtype.substr(0, 40)));
  }
  if (j.contains("optimizer_state")) {
    m.optimizer_state = string_field(j, "optimizer_state");
    if (find_optimizer_state(m.optimizer_state) == nullptr) {
      std::string names;
      for (const OptimizerState& st : kOptimizerStates) {
        names += fmt::format("{}{}", names.empty() ? "" : ", ", st.name);
      }
      throw std::runtime_error(fmt::format("optimizer_state is \"{}\", expected one of {}",
                                           m.optimizer_state.substr(0, 40), names));
    }
  }
  m.seed = size_field(j, "seed");
  if (j.contains("micro_batch")) m.micro_batch = int_field(j, "micro_batch", 1, INT32_MAX);
  if (j.contains("gradient_accumulation_steps")) {
    m.accumulation = int_field(j, "gradient_accumulation_steps", 1, INT32_MAX);
  }
  if (j.contains("schedule_steps")) m.schedule_steps = int_field(j, "schedule_steps", 1, INT32_MAX);
  if (j.contains("pad_token_id")) m.pad_token_id = int_field(j, "pad_token_id", -1, INT32_MAX);
  const json& mods = j.at("modules");
  if (!mods.is_array() || mods.empty()) throw std::runtime_error("modules is not a list");
  for (const auto& mod : mods) {
    if (!mod.is_object()) throw std::runtime_error("a module is not an object");
    CheckpointModule cm{string_field(mod, "name"), size_field(mod, "numel"), 0};
    if (mod.contains("offset")) cm.offset = size_field(mod, "offset");
    if (cm.offset > (uint64_t{1} << 62) || cm.numel > (uint64_t{1} << 62)) {
      throw std::runtime_error(fmt::format("module {}: numel/offset out of range", cm.name));
    }
    m.modules.push_back(std::move(cm));
  }
  m.world_size =
      j.contains("world_size") ? static_cast<int>(int_field(j, "world_size", 1, 1 << 20)) : 1;
  m.rank = j.contains("rank") ? static_cast<int>(int_field(j, "rank", 0, m.world_size - 1)) : 0;
  if (j.contains("run_id")) m.run_id = string_field(j, "run_id");
  return m;
}

Result<std::pair<CheckpointMeta, uint32_t>> read_header(int fd, const std::string& path,
                                                        uint64_t* payload_len,
                                                        uint64_t* payload_off) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return errno_status(errno, fmt::format("stat {}", path));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kFixedHeader) {
    return corrupt(fmt::format("{}: truncated: {} bytes, smaller than the {}-byte header", path,
                               size, kFixedHeader));
  }
  char h[kFixedHeader];
  STRATA_RETURN_IF_ERROR(read_all(fd, h, kFixedHeader, path, 0), "");
  if (std::memcmp(h, kMagic, 8) != 0) {
    return corrupt(fmt::format("{}: not a strata checkpoint (bad magic at offset 0)", path));
  }
  uint32_t version = get32(h + 8);
  if (version != kCheckpointVersion) {
    return corrupt(
        fmt::format("{}: checkpoint format version {} is not supported (this strata "
                    "reads version {})",
                    path, version, kCheckpointVersion));
  }
  uint32_t jlen = get32(h + 12), jcrc = get32(h + 16), pcrc = get32(h + 20);
  *payload_len = get64(h + 24);
  *payload_off = kFixedHeader + jlen;
  if (*payload_len > size || size - *payload_len != *payload_off) {
    return corrupt(
        fmt::format("{}: truncated or padded: file is {} bytes, header promises {} "
                    "(metadata {} + payload {})",
                    path, size, *payload_off + *payload_len, jlen, *payload_len));
  }
  std::string js(jlen, '\0');
  STRATA_RETURN_IF_ERROR(read_all(fd, js.data(), jlen, path, kFixedHeader), "");
  if (crc32c(0, js.data(), jlen) != jcrc) {
    return corrupt(fmt::format("{}: metadata checksum mismatch (bytes {}..{})", path, kFixedHeader,
                               kFixedHeader + jlen));
  }
  CheckpointMeta m;
  try {
    m = parse_meta(js);
  } catch (const std::exception& e) {
    return corrupt(fmt::format("{}: metadata (bytes {}..{}) is not valid: {}", path, kFixedHeader,
                               kFixedHeader + jlen, e.what()));
  }
  if (payload_bytes(m, moment_bytes_of(m.moment_dtype)) != *payload_len) {
    return corrupt(fmt::format("{}: payload is {} bytes but the module list needs {}", path,
                               *payload_len, payload_bytes(m, moment_bytes_of(m.moment_dtype))));
  }
  return std::make_pair(std::move(m), pcrc);
}

Status check_space(const std::string& path, uint64_t need) {
  struct statvfs vfs {};
  const std::string dir = directory_of(path);
  if (::statvfs(dir.c_str(), &vfs) != 0) return Status::ok();  // the write reports it
  const uint64_t avail = uint64_t(vfs.f_bavail) * vfs.f_frsize;
  if (avail < need) {
    return no_space(fmt::format(
        "{} needs {} bytes ({}), its file system has {} bytes ({}) free; free space there or "
        "point train.checkpoint_dir at a larger file system",
        path, need, format_bytes(double(need)), avail, format_bytes(double(avail))));
  }
  return Status::ok();
}

}  // namespace

namespace {

// The payload of one module, in file order: emit(bytes) appends the next bytes and their CRC.
using EmitFn = std::function<Status(const void* data, size_t bytes)>;
using ModuleWriter = std::function<Status(size_t module, const EmitFn& emit)>;

// The whole write (see the header): temp file, metadata, each module's payload through
// `write_module`, header last, fsync, rename.
Status write_checkpoint_with(const std::string& path, const CheckpointMeta& meta,
                             const ModuleWriter& write_module) {
  const size_t mb = moment_bytes_of(meta.moment_dtype);
  const std::string js = meta_json(meta);
  const std::string tmp = path + ".tmp";
  const uint64_t total = kFixedHeader + js.size() + payload_bytes(meta, mb);
  STRATA_RETURN_IF_ERROR(check_space(tmp, total), "writing checkpoint");
  STRATA_ASSIGN_OR_RETURN(int fd, create_temp_file(tmp, 0644), "writing checkpoint");
  Fd f{fd};
  // Header placeholder (all zero: never a valid magic), metadata, then streamed payload.
  char h[kFixedHeader] = {};
  uint64_t off = 0;
  Status st = write_fully(f.fd, h, kFixedHeader, tmp, &off);
  if (st.is_ok()) st = write_fully(f.fd, js.data(), js.size(), tmp, &off);
  uint32_t pcrc = 0;
  const EmitFn emit = [&](const void* data, size_t bytes) -> Status {
    pcrc = crc32c(pcrc, data, bytes);
    return write_fully(f.fd, data, bytes, tmp, &off);
  };
  for (size_t i = 0; st.is_ok() && i < meta.modules.size(); ++i) {
    st = write_module(i, emit);
    if (!st.is_ok()) st = st.with_context(fmt::format("module {}", meta.modules[i].name));
  }
  if (st.is_ok()) {
    std::memcpy(h, kMagic, 8);
    put32(h + 8, kCheckpointVersion);
    put32(h + 12, static_cast<uint32_t>(js.size()));
    put32(h + 16, crc32c(0, js.data(), js.size()));
    put32(h + 20, pcrc);
    put64(h + 24, payload_bytes(meta, mb));
    if (::pwrite(f.fd, h, kFixedHeader, 0) != static_cast<ssize_t>(kFixedHeader)) {
      st = errno_status(errno, fmt::format("writing header of {}", tmp));
    }
  }
  if (st.is_ok() && ::fsync(f.fd) != 0) st = errno_status(errno, fmt::format("fsync {}", tmp));
  if (st.is_ok() && ::close(f.fd) != 0) st = errno_status(errno, fmt::format("close {}", tmp));
  f.fd = -1;
  if (st.is_ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    st = errno_status(errno, fmt::format("renaming {} to {}", tmp, path));
  }
  if (!st.is_ok()) {
    ::unlink(tmp.c_str());  // never leave a partial file behind
    if (st.code() == StatusCode::kNoSpace) {
      st = st.with_context(fmt::format("{} of the checkpoint's {} bytes written", off, total));
    }
    return st.with_context("writing checkpoint");
  }
  return fsync_directory(directory_of(path));
}

}  // namespace

Status write_checkpoint(const std::string& path, const CheckpointMeta& meta,
                        const CheckpointSource& source) {
  const size_t mb = moment_bytes_of(meta.moment_dtype);
  std::vector<char> zeros;
  return write_checkpoint_with(path, meta, [&](size_t i, const EmitFn& emit) -> Status {
    const size_t n = meta.modules[i].numel;
    CheckpointBuffers b{};
    STRATA_RETURN_IF_ERROR(source(i, &b), "reading its state");
    STRATA_RETURN_IF_ERROR(emit(b.master, n * 4), "writing its master weights");
    for (void* mom : {b.m, b.v}) {
      const void* src = mom;
      if (!src) {
        zeros.assign(n * mb, 0);
        src = zeros.data();
      }
      STRATA_RETURN_IF_ERROR(emit(src, n * mb), mom == b.m ? "writing its first moments"
                                                           : "writing its second moments");
    }
    return Status::ok();
  });
}

Status write_checkpoint_ranges(const std::string& path, const CheckpointMeta& meta,
                               const std::function<size_t(size_t)>& range,
                               const CheckpointRangeFn& read) {
  const size_t mb = moment_bytes_of(meta.moment_dtype);
  std::vector<char> buf;
  return write_checkpoint_with(path, meta, [&](size_t i, const EmitFn& emit) -> Status {
    const size_t n = meta.modules[i].numel, r = std::max<size_t>(1, range(i));
    for (CheckpointPart part :
         {CheckpointPart::kMaster, CheckpointPart::kFirstMoment, CheckpointPart::kSecondMoment}) {
      const size_t eb = part == CheckpointPart::kMaster ? 4 : mb;
      for (size_t o = 0; o < n; o += r) {
        const size_t c = std::min(r, n - o);
        buf.resize(c * eb);
        STRATA_RETURN_IF_ERROR(read(i, part, o, c, buf.data()),
                               fmt::format("reading elements [{}, {}) of its state", o, o + c));
        STRATA_RETURN_IF_ERROR(emit(buf.data(), c * eb),
                               fmt::format("writing elements [{}, {}) of its state", o, o + c));
      }
    }
    return Status::ok();
  });
}

Status write_checkpoint(const std::string& path, const CheckpointMeta& meta,
                        const std::vector<CheckpointBuffers>& buffers) {
  STRATA_CHECK(buffers.size() == meta.modules.size());
  return write_checkpoint(path, meta, [&](size_t i, CheckpointBuffers* out) {
    *out = buffers[i];
    return Status::ok();
  });
}

Result<CheckpointMeta> read_checkpoint_meta(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return errno_status(errno, fmt::format("opening checkpoint {}", path));
  uint64_t plen, poff;
  STRATA_ASSIGN_OR_RETURN(auto mh, read_header(f.fd, path, &plen, &poff), "reading checkpoint");
  return std::move(mh.first);
}

namespace {

// Opens checkpoint `path` and verifies its payload checksum (pass 1 of the readers: a damaged
// file is refused before any state changes). `start`: the payload's offset.
Status open_verified(const std::string& path, Fd* f, CheckpointMeta* meta, uint64_t* start) {
  f->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd < 0) return errno_status(errno, fmt::format("opening checkpoint {}", path));
  uint64_t plen;
  STRATA_ASSIGN_OR_RETURN(auto mh, read_header(f->fd, path, &plen, start), "reading checkpoint");
  *meta = std::move(mh.first);
  std::vector<char> chunk(size_t{8} << 20);
  uint32_t crc = 0;
  for (uint64_t off = *start; off < *start + plen;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), *start + plen - off));
    STRATA_RETURN_IF_ERROR(read_all(f->fd, chunk.data(), n, path, off), "verifying the payload");
    crc = crc32c(crc, chunk.data(), n);
    off += n;
  }
  if (crc != mh.second) {
    return corrupt(
        fmt::format("{}: payload checksum mismatch (bytes {}..{}): the file is "
                    "damaged; resume from an earlier checkpoint",
                    path, *start, *start + plen));
  }
  return Status::ok();
}

}  // namespace

Status read_checkpoint(const std::string& path, const CheckpointSource& staging,
                       const CheckpointSink& sink) {
  Fd f;
  CheckpointMeta meta;
  uint64_t start = 0;
  STRATA_RETURN_IF_ERROR(open_verified(path, &f, &meta, &start), "");
  const size_t mb = moment_bytes_of(meta.moment_dtype);
  // Pass 2: module by module into staging, then to the sink.
  uint64_t off = start;
  std::vector<char> sinkhole;
  for (size_t i = 0; i < meta.modules.size(); ++i) {
    const size_t n = meta.modules[i].numel;
    CheckpointBuffers b{};
    STRATA_RETURN_IF_ERROR(staging(i, &b), "staging module " + meta.modules[i].name);
    STRATA_RETURN_IF_ERROR(read_all(f.fd, b.master, n * 4, path, off),
                           "reading module " + meta.modules[i].name + " master weights");
    off += n * 4;
    for (void* mom : {b.m, b.v}) {
      void* dst = mom;
      if (!dst) {
        sinkhole.resize(n * mb);
        dst = sinkhole.data();
      }
      STRATA_RETURN_IF_ERROR(read_all(f.fd, dst, n * mb, path, off),
                             "reading module " + meta.modules[i].name + " moments");
      off += n * mb;
    }
    STRATA_RETURN_IF_ERROR(sink(i, b), "storing module " + meta.modules[i].name);
  }
  return Status::ok();
}

Status read_checkpoint_ranges(const std::string& path, const std::function<size_t(size_t)>& range,
                              const CheckpointRangeFn& write) {
  Fd f;
  CheckpointMeta meta;
  uint64_t start = 0;
  STRATA_RETURN_IF_ERROR(open_verified(path, &f, &meta, &start), "");
  const size_t mb = moment_bytes_of(meta.moment_dtype);
  // Pass 2: range by range to `write`.
  uint64_t off = start;
  std::vector<char> buf;
  for (size_t i = 0; i < meta.modules.size(); ++i) {
    const size_t n = meta.modules[i].numel, r = std::max<size_t>(1, range(i));
    for (CheckpointPart part :
         {CheckpointPart::kMaster, CheckpointPart::kFirstMoment, CheckpointPart::kSecondMoment}) {
      const size_t eb = part == CheckpointPart::kMaster ? 4 : mb;
      for (size_t o = 0; o < n; o += r) {
        const size_t c = std::min(r, n - o);
        buf.resize(c * eb);
        STRATA_RETURN_IF_ERROR(read_all(f.fd, buf.data(), c * eb, path, off), "");
        off += c * eb;
        STRATA_RETURN_IF_ERROR(
            write(i, part, o, c, buf.data()),
            fmt::format("storing elements [{}, {}) of module {}", o, o + c, meta.modules[i].name));
      }
    }
  }
  return Status::ok();
}

Status read_checkpoint(const std::string& path, const std::vector<CheckpointBuffers>& buffers) {
  return read_checkpoint(
      path,
      [&](size_t i, CheckpointBuffers* out) {
        STRATA_CHECK(i < buffers.size());
        *out = buffers[i];
        return Status::ok();
      },
      [](size_t, const CheckpointBuffers&) { return Status::ok(); });
}

Result<std::string> latest_checkpoint(const std::string& dir) {
  const std::string p = dir + "/latest";
  Fd f{::open(p.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) {
    return not_found(
        fmt::format("no checkpoint to resume from: {} does not exist (train once "
                    "with train.checkpoint_dir={} first)",
                    p, dir));
  }
  char buf[512];
  ssize_t n = ::read(f.fd, buf, sizeof(buf) - 1);
  if (n <= 0) return corrupt(fmt::format("{}: empty", p));
  std::string name(buf, size_t(n));
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return dir + "/" + name;
}

Result<std::string> resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return path;
  return latest_checkpoint(path);
}

Status set_latest_checkpoint(const std::string& dir, const std::string& file_name) {
  return write_file_atomically(dir + "/latest", file_name + "\n", 0644);
}

std::string shard_file_path(const std::string& path, int rank, int world_size) {
  return fmt::format("{}.rank{}-of-{}", path, rank, world_size);
}

Status write_shard_manifest(const std::string& path, int64_t step, int world_size,
                            const std::string& run_id) {
  nlohmann::json j;
  j["magic"] = "strata-shards";
  j["version"] = kCheckpointVersion;
  j["step"] = step;
  j["world_size"] = world_size;
  j["run_id"] = run_id;
  const std::string base = path.substr(path.find_last_of('/') + 1);
  nlohmann::json files = nlohmann::json::array();
  for (int r = 0; r < world_size; ++r) files.push_back(shard_file_path(base, r, world_size));
  j["files"] = files;
  return write_file_atomically(path, j.dump(1) + "\n", 0644);
}

Result<ShardManifest> read_shard_manifest(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return errno_status(errno, fmt::format("opening checkpoint {}", path));
  std::string text(1 << 16, '\0');
  ssize_t n = ::read(f.fd, text.data(), text.size());
  if (n < 0) return errno_status(errno, fmt::format("reading {}", path));
  text.resize(size_t(n));
  ShardManifest out;
  // Anything but a JSON object is taken as a checkpoint file, whose reader says what is wrong.
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || text[first] != '{') {
    out.files = {path};
    return out;
  }
  try {
    Status depth = check_json_depth(text);
    if (!depth.is_ok()) throw std::runtime_error(depth.message());
    const auto j = nlohmann::json::parse(text);
    if (!j.is_object() || j.value("magic", "") != "strata-shards") {
      throw std::runtime_error("wrong magic");
    }
    out.world_size = static_cast<int>(int_field(j, "world_size", 1, 1 << 20));
    out.step = int_field(j, "step", 0, int64_t{1} << 62);
    if (j.contains("run_id")) out.run_id = string_field(j, "run_id");
    const json& files = j.at("files");
    if (!files.is_array() || files.size() != size_t(out.world_size)) {
      throw std::runtime_error(fmt::format("files does not list {} shard files", out.world_size));
    }
    const size_t slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
    const std::string base = path.substr(slash == std::string::npos ? 0 : slash + 1);
    for (int r = 0; r < out.world_size; ++r) {
      // Only the names strata writes: a manifest never points outside its directory.
      const std::string want = shard_file_path(base, r, out.world_size);
      if (!files[size_t(r)].is_string() || files[size_t(r)].get<std::string>() != want) {
        throw std::runtime_error(fmt::format("files[{}] is {}, expected \"{}\"", r,
                                             files[size_t(r)].dump().substr(0, 60), want));
      }
      out.files.push_back(dir + want);
    }
  } catch (const std::exception& e) {
    return corrupt(fmt::format(
        "{}: neither a checkpoint (magic STRATACK) nor a shard manifest ({}); pass a file "
        "written by strata train",
        path, e.what()));
  }
  return out;
}

Result<std::vector<std::string>> checkpoint_files(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(ShardManifest m, read_shard_manifest(path), "listing the shard set");
  return std::move(m.files);
}

uint64_t checkpoint_file_bytes(const CheckpointMeta& meta) {
  return kFixedHeader + meta_json(meta).size() +
         payload_bytes(meta, moment_bytes_of(meta.moment_dtype));
}

}  // namespace strata
