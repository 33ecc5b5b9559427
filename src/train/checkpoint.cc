#include "src/train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "strata/checksum.h"

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

Status write_all(int fd, const void* data, size_t n, const std::string& path, uint64_t* off) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, fmt::format("writing {} at offset {}", path, *off));
    }
    p += w;
    n -= size_t(w);
    *off += size_t(w);
  }
  return Status::ok();
}

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
  j["seed"] = m.seed;
  nlohmann::json mods = nlohmann::json::array();
  for (const auto& mod : m.modules) {
    mods.push_back({{"name", mod.name}, {"numel", mod.numel}, {"offset", mod.offset}});
  }
  j["modules"] = mods;
  j["world_size"] = m.world_size;
  j["rank"] = m.rank;
  return j.dump();
}

size_t payload_bytes(const CheckpointMeta& m, size_t moment_bytes) {
  size_t n = 0;
  for (const auto& mod : m.modules) n += mod.numel * (4 + 2 * moment_bytes);
  return n;
}

size_t moment_bytes_of(const std::string& dtype) { return dtype == "bf16" ? 2 : 4; }

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
  if (size != *payload_off + *payload_len) {
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
    auto j = nlohmann::json::parse(js);
    m.step = j.at("step");
    m.opt_steps = j.at("opt_steps");
    m.loss_scale = j.at("loss_scale");
    m.scaler_cur_iter = j.at("scaler_cur_iter");
    m.scaler_last_overflow_iter = j.at("scaler_last_overflow_iter");
    m.scaler_cur_hysteresis = j.at("scaler_cur_hysteresis");
    m.model_shape = j.at("model_shape");
    m.moment_dtype = j.at("moment_dtype");
    m.seed = j.at("seed");
    for (const auto& mod : j.at("modules")) {
      m.modules.push_back({mod.at("name"), mod.at("numel"), mod.value("offset", size_t{0})});
    }
    m.world_size = j.value("world_size", 1);
    m.rank = j.value("rank", 0);
  } catch (const std::exception& e) {
    return corrupt(fmt::format("{}: metadata is not valid: {}", path, e.what()));
  }
  if (payload_bytes(m, moment_bytes_of(m.moment_dtype)) != *payload_len) {
    return corrupt(fmt::format("{}: payload is {} bytes but the module list needs {}", path,
                               *payload_len, payload_bytes(m, moment_bytes_of(m.moment_dtype))));
  }
  return std::make_pair(std::move(m), pcrc);
}

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

Status fsync_dir(const std::string& dir) {
  Fd d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY)};
  if (d.fd < 0) return errno_status(errno, fmt::format("opening directory {}", dir));
  if (::fsync(d.fd) != 0) return errno_status(errno, fmt::format("fsync of directory {}", dir));
  return Status::ok();
}

}  // namespace

Status write_checkpoint(const std::string& path, const CheckpointMeta& meta,
                        const CheckpointSource& source) {
  const size_t mb = moment_bytes_of(meta.moment_dtype);
  const std::string js = meta_json(meta);
  const std::string tmp = path + ".tmp";
  Fd f{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0) return errno_status(errno, fmt::format("creating checkpoint {}", tmp));
  // Header placeholder (all zero: never a valid magic), metadata, then streamed payload.
  char h[kFixedHeader] = {};
  uint64_t off = 0;
  Status st = write_all(f.fd, h, kFixedHeader, tmp, &off);
  if (st.is_ok()) st = write_all(f.fd, js.data(), js.size(), tmp, &off);
  uint32_t pcrc = 0;
  std::vector<char> zeros;
  for (size_t i = 0; st.is_ok() && i < meta.modules.size(); ++i) {
    const size_t n = meta.modules[i].numel;
    CheckpointBuffers b{};
    st = source(i, &b);
    if (!st.is_ok()) {
      st = st.with_context(fmt::format("reading state of module {}", meta.modules[i].name));
      break;
    }
    pcrc = crc32c(pcrc, b.master, n * 4);
    st = write_all(f.fd, b.master, n * 4, tmp, &off);
    for (void* mom : {b.m, b.v}) {
      if (!st.is_ok()) break;
      const void* src = mom;
      if (!src) {
        zeros.assign(n * mb, 0);
        src = zeros.data();
      }
      pcrc = crc32c(pcrc, src, n * mb);
      st = write_all(f.fd, src, n * mb, tmp, &off);
    }
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
    return st.with_context("writing checkpoint");
  }
  return fsync_dir(dir_of(path));
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

Status read_checkpoint(const std::string& path, const CheckpointSource& staging,
                       const CheckpointSink& sink) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return errno_status(errno, fmt::format("opening checkpoint {}", path));
  uint64_t plen, start;
  STRATA_ASSIGN_OR_RETURN(auto mh, read_header(f.fd, path, &plen, &start), "reading checkpoint");
  const CheckpointMeta& meta = mh.first;
  const size_t mb = moment_bytes_of(meta.moment_dtype);
  // Pass 1: verify the payload checksum without touching any state.
  {
    std::vector<char> chunk(size_t{8} << 20);
    uint32_t crc = 0;
    for (uint64_t off = start; off < start + plen;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), start + plen - off));
      STRATA_RETURN_IF_ERROR(read_all(f.fd, chunk.data(), n, path, off), "");
      crc = crc32c(crc, chunk.data(), n);
      off += n;
    }
    if (crc != mh.second) {
      return corrupt(
          fmt::format("{}: payload checksum mismatch (bytes {}..{}): the file is "
                      "damaged; resume from an earlier checkpoint",
                      path, start, start + plen));
    }
  }
  // Pass 2: module by module into staging, then to the sink.
  uint64_t off = start;
  std::vector<char> sinkhole;
  for (size_t i = 0; i < meta.modules.size(); ++i) {
    const size_t n = meta.modules[i].numel;
    CheckpointBuffers b{};
    STRATA_RETURN_IF_ERROR(staging(i, &b), "staging module " + meta.modules[i].name);
    STRATA_RETURN_IF_ERROR(read_all(f.fd, b.master, n * 4, path, off), "");
    off += n * 4;
    for (void* mom : {b.m, b.v}) {
      void* dst = mom;
      if (!dst) {
        sinkhole.resize(n * mb);
        dst = sinkhole.data();
      }
      STRATA_RETURN_IF_ERROR(read_all(f.fd, dst, n * mb, path, off), "");
      off += n * mb;
    }
    STRATA_RETURN_IF_ERROR(sink(i, b), "storing module " + meta.modules[i].name);
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

Status set_latest_checkpoint(const std::string& dir, const std::string& file_name) {
  const std::string tmp = dir + "/latest.tmp", dst = dir + "/latest";
  Fd f{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0) return errno_status(errno, fmt::format("creating {}", tmp));
  uint64_t off = 0;
  std::string line = file_name + "\n";
  STRATA_RETURN_IF_ERROR(write_all(f.fd, line.data(), line.size(), tmp, &off), "");
  if (::fsync(f.fd) != 0) return errno_status(errno, fmt::format("fsync {}", tmp));
  if (::rename(tmp.c_str(), dst.c_str()) != 0) {
    return errno_status(errno, fmt::format("renaming {} to {}", tmp, dst));
  }
  return fsync_dir(dir);
}

std::string shard_file_path(const std::string& path, int rank, int world_size) {
  return fmt::format("{}.rank{}-of-{}", path, rank, world_size);
}

Status write_shard_manifest(const std::string& path, int64_t step, int world_size) {
  nlohmann::json j;
  j["magic"] = "strata-shards";
  j["version"] = kCheckpointVersion;
  j["step"] = step;
  j["world_size"] = world_size;
  const std::string base = path.substr(path.find_last_of('/') + 1);
  nlohmann::json files = nlohmann::json::array();
  for (int r = 0; r < world_size; ++r) files.push_back(shard_file_path(base, r, world_size));
  j["files"] = files;
  const std::string tmp = path + ".tmp", text = j.dump(1) + "\n";
  {
    Fd f{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    if (f.fd < 0) return errno_status(errno, fmt::format("creating {}", tmp));
    uint64_t off = 0;
    STRATA_RETURN_IF_ERROR(write_all(f.fd, text.data(), text.size(), tmp, &off), "");
    if (::fsync(f.fd) != 0) return errno_status(errno, fmt::format("fsync {}", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return errno_status(errno, fmt::format("renaming {} to {}", tmp, path));
  }
  const size_t slash = path.find_last_of('/');
  return fsync_dir(slash == std::string::npos ? "." : path.substr(0, slash));
}

Result<std::vector<std::string>> checkpoint_files(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return errno_status(errno, fmt::format("opening checkpoint {}", path));
  std::string text(1 << 16, '\0');
  ssize_t n = ::read(f.fd, text.data(), text.size());
  if (n < 0) return errno_status(errno, fmt::format("reading {}", path));
  text.resize(size_t(n));
  // Anything but a JSON object is taken as a checkpoint file, whose reader says what is wrong.
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || text[first] != '{') return std::vector<std::string>{path};
  std::vector<std::string> out;
  try {
    auto j = nlohmann::json::parse(text);
    if (j.at("magic") != "strata-shards") throw std::runtime_error("wrong magic");
    const size_t slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
    for (const auto& name : j.at("files")) out.push_back(dir + name.get<std::string>());
    if (out.size() != j.at("world_size").get<size_t>()) throw std::runtime_error("file count");
  } catch (const std::exception& e) {
    return corrupt(fmt::format(
        "{}: neither a checkpoint (magic STRATACK) nor a shard manifest ({}); pass a file "
        "written by strata train",
        path, e.what()));
  }
  return out;
}

}  // namespace strata
