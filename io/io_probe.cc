// Storage probe: sweep, statistics, profile JSON (see strata/io_probe.h).
#include "strata/io_probe.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "strata/buffer_pool.h"
#include "strata/log.h"
#include "strata/swap_space.h"

namespace strata {
namespace {

std::string probe_file(const std::string& dir) { return dir + "/strata-probe-io.dat"; }

// Buffered backends: flush the files and drop them from the page cache, so a pass measures the
// drive and not host memory.
void flush_and_drop_cache(const std::vector<std::string>& paths) {
  for (const auto& p : paths) {
    int fd = ::open(probe_file(p).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// One pass over all files: block-size requests, striped over the files, `slots` in flight, each
// with its own slot of `buf` (a slot is reused only once its request has completed: two reads
// in flight into one slot would race, as ThreadSanitizer found with the posix backend).
// Buffered backends also flush and drop the cache inside the timed region after writes.
Result<double> one_pass(Storage& st, const std::vector<std::string>& paths,
                        const std::vector<FileId>& files, IoOp op, size_t bs, uint64_t file_bytes,
                        char* buf, size_t slots) {
  const bool buffered = !st.capabilities().direct_io;
  if (buffered) flush_and_drop_cache(paths);
  const uint64_t blocks_per_file = file_bytes / bs;
  const uint64_t total = blocks_per_file * files.size();
  uint64_t next = 0;  // the next request to issue
  std::vector<IoRequest> reqs;
  auto issue = [&](uint64_t slot) {  // request `next` into `slot` (its cookie)
    reqs.push_back(
        {op, files[next % files.size()], (next / files.size()) * bs, bs, buf + slot * bs, slot});
    ++next;
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t slot = 0; slot < slots && next < total; ++slot) issue(slot);
  STRATA_RETURN_IF_ERROR(st.submit(reqs), "probe pass");
  std::vector<IoCompletion> done(256);
  uint64_t got = 0;
  while (got < total) {
    const size_t n = st.reap(done, 1);
    reqs.clear();
    for (size_t i = 0; i < n; ++i) {
      if (!done[i].status.is_ok()) {
        // Drain the rest so no I/O targets the buffer after we return.
        while (st.pending() > 0) st.reap(done, st.pending());
        return done[i].status;
      }
      if (next < total) issue(done[i].cookie);
    }
    got += n;
    if (reqs.empty()) continue;
    if (Status s = st.submit(reqs); !s.is_ok()) {
      while (st.pending() > 0) st.reap(done, st.pending());
      return s.with_context("probe pass");
    }
  }
  if (buffered && op == IoOp::kWrite) flush_and_drop_cache(paths);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(total * bs) / s / 1e9;
}

void summarize(IoProbeCase* c) {
  std::vector<double> v = c->gbps;
  std::sort(v.begin(), v.end());
  if (v.empty()) return;
  c->min = v.front();
  c->max = v.back();
  const size_t m = v.size() / 2;
  c->median = v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

void recommend(IoProbeReport* r) {
  double best = -1;
  for (const auto& a : r->cases) {
    if (a.op != IoOp::kRead) continue;
    for (const auto& b : r->cases) {
      if (b.op != IoOp::kWrite || b.backend != a.backend || b.block_size != a.block_size ||
          b.queue_depth != a.queue_depth)
        continue;
      const double h = 2.0 / (1.0 / std::max(a.median, 1e-9) + 1.0 / std::max(b.median, 1e-9));
      if (h > best) {
        best = h;
        r->rec_backend = a.backend;
        r->rec_block_size = a.block_size;
        r->rec_queue_depth = a.queue_depth;
      }
    }
  }
  if (best < 0 && !r->cases.empty()) {  // only one op measured: best median
    const auto& c = *std::max_element(r->cases.begin(), r->cases.end(),
                                      [](auto& x, auto& y) { return x.median < y.median; });
    r->rec_backend = c.backend;
    r->rec_block_size = c.block_size;
    r->rec_queue_depth = c.queue_depth;
  }
}

}  // namespace

Result<IoProbeReport> run_io_probe(const IoProbeOptions& o,
                                   const std::function<void(const IoProbeCase&)>& on_case) {
  if (o.paths.empty()) return invalid_argument("probe io: give at least one path (--path DIR)");
  if (o.block_sizes.empty() || o.queue_depths.empty() || o.ops.empty() || o.repeats < 1)
    return invalid_argument("probe io: empty sweep (block sizes, queue depths, ops, repeats)");
  if (o.warmup < 0) {
    return invalid_argument(
        fmt::format("probe io: {} warm-up passes: give 0 or more (--warmup)", o.warmup));
  }
  // The storage engine's range (aio.queue_depth): checked before the buffers of the deepest
  // case are made (6000 took 6 GiB before the engine refused it).
  for (int qd : o.queue_depths) {
    if (qd < 1 || qd > 4096) {
      return invalid_argument(
          fmt::format("probe io: queue depth {} must be between 1 and 4096 (--queue-depths)", qd));
    }
  }
  const size_t max_bs = *std::max_element(o.block_sizes.begin(), o.block_sizes.end());
  const int max_qd = *std::max_element(o.queue_depths.begin(), o.queue_depths.end());
  if (o.file_bytes < max_bs) {
    return invalid_argument(fmt::format(
        "probe io: a file of {} bytes holds no block of {} bytes: give --size at least the "
        "largest block size",
        o.file_bytes, max_bs));
  }
  for (size_t bs : o.block_sizes)
    if (bs == 0 || bs % kStorageAlignment || o.file_bytes % bs)
      return invalid_argument(fmt::format(
          "probe io: block size {} must be a multiple of 4096 that divides the file size {}", bs,
          o.file_bytes));
  for (const auto& p : o.paths)
    STRATA_RETURN_IF_ERROR(check_nvme_path(p, o.file_bytes, false, probe_file(p)), "probe io");

  IoProbeReport report;
  report.paths = o.paths;
  report.file_bytes = o.file_bytes;
  BufferPoolOptions po;
  po.name = "probe buffers";
  // At least one huge page, so even a 1 MiB x QD 1 sweep gets huge-page buffers (buffer_pool.h)
  // and measures what the engine does with a real BufferPool arena.
  STRATA_ASSIGN_OR_RETURN(auto pool,
                          BufferPool::create(std::max(max_bs * max_qd, BufferPool::kHugePage), po),
                          "probe io");
  STRATA_ASSIGN_OR_RETURN(PinnedBuffer buf, pool->acquire(max_bs * max_qd), "probe io");
  for (size_t i = 0; i < buf.size(); ++i) buf.as<char>()[i] = static_cast<char>(i * 131 + 7);

  bool filled = false;
  Status status;
  for (const std::string& backend : o.backends) {
    std::string why;
    if (!storage_backend_available(backend, &why)) {
      report.skipped.push_back(backend + ": " + why);
      continue;
    }
    for (size_t bs : o.block_sizes) {
      for (int qd : o.queue_depths) {
        StorageOptions so;
        so.backend = backend;
        so.block_size = bs;
        so.queue_depth = qd;
        so.posix_threads = qd;
        auto st = open_storage(so);
        if (!st.is_ok()) {
          report.skipped.push_back(
              fmt::format("{} bs {} qd {}: {}", backend, bs, qd, st.status().message()));
          continue;
        }
        Storage& s = **st;
        s.register_buffer(pool->base(), pool->capacity()).ignore();
        std::vector<FileId> files;
        for (const auto& p : o.paths) {
          auto f = s.open(probe_file(p), {.create = true});
          if (!f.is_ok()) {
            status = f.status().with_context("probe io");
            break;
          }
          files.push_back(*f);
        }
        if (!status.is_ok()) return status;
        if (!filled) {  // write the files once before anything is timed (kept files: reused)
          filled = true;
          for (const auto& p : o.paths) {
            struct stat sb {};
            if (::stat(probe_file(p).c_str(), &sb) != 0 ||
                static_cast<uint64_t>(sb.st_size) < o.file_bytes)
              filled = false;
          }
        }
        if (!filled) {
          auto w = one_pass(s, o.paths, files, IoOp::kWrite, bs, o.file_bytes, buf.as<char>(), qd);
          if (!w.is_ok()) return w.status().with_context("probe io: filling probe files");
          filled = true;
        }
        for (IoOp op : o.ops) {
          IoProbeCase c;
          c.backend = s.capabilities().backend;
          c.op = op;
          c.block_size = bs;
          c.queue_depth = qd;
          for (int r = 0; r < o.warmup + o.repeats; ++r) {
            auto g = one_pass(s, o.paths, files, op, bs, o.file_bytes, buf.as<char>(), qd);
            if (!g.is_ok()) return g.status().with_context("probe io");
            if (r >= o.warmup) c.gbps.push_back(*g);
          }
          summarize(&c);
          if (on_case) on_case(c);
          report.cases.push_back(std::move(c));
        }
      }
    }
  }
  if (!o.keep_files)
    for (const auto& p : o.paths) ::unlink(probe_file(p).c_str());
  recommend(&report);
  return report;
}

std::string io_probe_json(const IoProbeReport& r) {
  nlohmann::json j;
  j["magic"] = "strata-io-probe";
  j["version"] = kIoProbeFormatVersion;
  j["paths"] = r.paths;
  j["file_bytes"] = r.file_bytes;
  j["cases"] = nlohmann::json::array();
  for (const auto& c : r.cases)
    j["cases"].push_back({{"backend", c.backend},
                          {"op", c.op == IoOp::kRead ? "read" : "write"},
                          {"block_size", c.block_size},
                          {"queue_depth", c.queue_depth},
                          {"gbps_median", c.median},
                          {"gbps_min", c.min},
                          {"gbps_max", c.max},
                          {"gbps", c.gbps}});
  j["skipped"] = r.skipped;
  j["recommended"]["aio"] = {{"backend", r.rec_backend},
                             {"block_size", r.rec_block_size},
                             {"queue_depth", r.rec_queue_depth}};
  return j.dump(2) + "\n";
}

Result<IoProbeReport> parse_io_probe_json(const std::string& text, const std::string& origin) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument(fmt::format("{}: not a JSON object", origin));
  if (j.value("magic", "") != "strata-io-probe")
    return corrupt(fmt::format("{}: not a strata io probe profile (magic)", origin));
  if (j.value("version", 0) != kIoProbeFormatVersion)
    return invalid_argument(
        fmt::format("{}: profile version {} (this build reads {}); re-run "
                    "`strata probe io`",
                    origin, j.value("version", 0), kIoProbeFormatVersion));
  IoProbeReport r;
  try {
    r.paths = j.at("paths").get<std::vector<std::string>>();
    r.file_bytes = j.at("file_bytes").get<uint64_t>();
    for (const auto& c : j.at("cases")) {
      IoProbeCase x;
      x.backend = c.at("backend").get<std::string>();
      x.op = c.at("op").get<std::string>() == "read" ? IoOp::kRead : IoOp::kWrite;
      x.block_size = c.at("block_size").get<size_t>();
      x.queue_depth = c.at("queue_depth").get<int>();
      x.median = c.at("gbps_median").get<double>();
      x.min = c.at("gbps_min").get<double>();
      x.max = c.at("gbps_max").get<double>();
      x.gbps = c.at("gbps").get<std::vector<double>>();
      r.cases.push_back(std::move(x));
    }
    const auto& a = j.at("recommended").at("aio");
    r.rec_backend = a.at("backend").get<std::string>();
    r.rec_block_size = a.at("block_size").get<size_t>();
    r.rec_queue_depth = a.at("queue_depth").get<int>();
  } catch (const std::exception& e) {
    return invalid_argument(fmt::format("{}: malformed profile: {}", origin, e.what()));
  }
  return r;
}

}  // namespace strata
