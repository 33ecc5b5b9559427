// `strata probe io`: sweeps the storage backends over block size x queue depth x read/write on
// one or more paths and writes a profile (see strata/io_probe.h for the method and format).
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/config.h"
#include "strata/io_probe.h"
#include "strata/log.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

void usage(FILE* out) {
  const IoProbeOptions d;
  std::fprintf(
      out,
      "usage: strata probe io --path DIR[,DIR...] [options]\n\n"
      "Measures sequential read and write throughput of each storage backend on DIR (several\n"
      "directories: blocks are striped over them) for every block size and queue depth, discards\n"
      "warm-up passes, prints GB/s (median and min..max over repeats), writes a JSON profile and\n"
      "the `aio` config block it recommends.\n\n"
      "options:\n"
      "  --path DIR[,DIR...]      directories to probe (required); a probe file is made in each\n"
      "  --size BYTES             probe file size per path (default %s; e.g. 4GiB)\n"
      "  --backends LIST          io_uring,libaio,posix (default: all three)\n"
      "  --block-sizes LIST       e.g. 256KiB,1MiB,4MiB (default)\n"
      "  --queue-depths LIST      e.g. 4,8,32 (default)\n"
      "  --ops LIST               read,write (default both)\n"
      "  --repeats N              timed passes per case (default %d)\n"
      "  --warmup N               discarded passes per case (default %d)\n"
      "  --json FILE              write the profile here (default: none)\n"
      "  --keep-files             keep the probe files (e.g. to run fio on the same file)\n",
      format_bytes(static_cast<double>(d.file_bytes)).c_str(), d.repeats, d.warmup);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata probe io: %s\n", s.to_string().c_str());
  return 1;
}

int probe_io(int argc, char** argv) {
  IoProbeOptions o;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (a == "--keep-files") {
      o.keep_files = true;
      continue;
    }
    const char* v = value();
    if (v == nullptr) {
      std::fprintf(stderr, "strata probe io: %s needs a value\n\n", a.c_str());
      usage(stderr);
      return 2;
    }
    if (a == "--path") {
      o.paths = split(v);
    } else if (a == "--size") {
      auto s = parse_size(v);
      if (!s.is_ok()) return fail(s.status().with_context("--size"));
      o.file_bytes = *s;
    } else if (a == "--backends") {
      o.backends = split(v);
    } else if (a == "--block-sizes") {
      o.block_sizes.clear();
      for (const auto& x : split(v)) {
        auto s = parse_size(x);
        if (!s.is_ok()) return fail(s.status().with_context("--block-sizes"));
        o.block_sizes.push_back(*s);
      }
    } else if (a == "--queue-depths") {
      o.queue_depths.clear();
      for (const auto& x : split(v)) o.queue_depths.push_back(std::atoi(x.c_str()));
    } else if (a == "--ops") {
      o.ops.clear();
      for (const auto& x : split(v)) {
        if (x != "read" && x != "write") {
          std::fprintf(stderr, "strata probe io: --ops takes read and/or write, not '%s'\n",
                       x.c_str());
          return 2;
        }
        o.ops.push_back(x == "read" ? IoOp::kRead : IoOp::kWrite);
      }
    } else if (a == "--repeats") {
      o.repeats = std::atoi(v);
    } else if (a == "--warmup") {
      o.warmup = std::atoi(v);
    } else if (a == "--json") {
      json_path = v;
    } else {
      std::fprintf(stderr, "strata probe io: unknown option '%s'\n\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  if (o.paths.empty()) {
    std::fprintf(stderr, "strata probe io: --path is required\n\n");
    usage(stderr);
    return 2;
  }
  std::printf("probing %zu path(s), %s per path, %d warm-up + %d timed passes per case\n",
              o.paths.size(), format_bytes(static_cast<double>(o.file_bytes)).c_str(), o.warmup,
              o.repeats);
  std::printf("%-9s %-5s %10s %4s %12s %18s\n", "backend", "op", "block", "qd", "GB/s median",
              "min..max");
  auto report = run_io_probe(o, [](const IoProbeCase& c) {
    std::printf("%-9s %-5s %10s %4d %12.3f %8.3f..%-8.3f\n", c.backend.c_str(),
                c.op == IoOp::kRead ? "read" : "write",
                format_bytes(static_cast<double>(c.block_size)).c_str(), c.queue_depth, c.median,
                c.min, c.max);
    std::fflush(stdout);
  });
  if (!report.is_ok()) return fail(report.status());
  for (const auto& s : report->skipped) std::printf("skipped %s\n", s.c_str());
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << io_probe_json(*report);
    if (!out)
      return fail(io_error(fmt::format("writing profile {}: {}", json_path, strerror(errno))));
    std::printf("profile written to %s\n", json_path.c_str());
  }
  std::printf(
      "recommended config:\n  \"aio\": {\"backend\": \"%s\", \"block_size\": %zu, "
      "\"queue_depth\": %d}\n",
      report->rec_backend.c_str(), report->rec_block_size, report->rec_queue_depth);
  return 0;
}

}  // namespace

int cmd_probe(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fprintf(argc < 2 ? stderr : stdout,
                 "usage: strata probe <what> [options]\n\n"
                 "  io     storage throughput per backend, block size and queue depth\n"
                 "  comm   collective bus bandwidth (strata probe comm --help)\n\n"
                 "not built yet: probe of host memory, host<->GPU, CPU optimizer (issue #8)\n"
                 "strata probe io --help for its options\n");
    return argc < 2 ? 2 : 0;
  }
  if (std::string(argv[1]) == "io") return probe_io(argc - 1, argv + 1);
  if (std::string(argv[1]) == "comm") return comm_probe_main(argc - 1, argv + 1);
  std::fprintf(stderr, "strata probe: unknown probe '%s' (try: io, comm)\n", argv[1]);
  return 2;
}

}  // namespace strata::tools
