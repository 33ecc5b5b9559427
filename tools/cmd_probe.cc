// `strata probe`: every probe into one machine profile (src/plan/probe_machine.h).
// `strata probe io`: sweeps the storage backends over block size x queue depth x read/write on
// one or more paths and writes a profile (see strata/io_probe.h for the method and format).
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/plan/probe_machine.h"
#include "strata/comm.h"
#include "strata/config.h"
#include "strata/io_probe.h"
#include "strata/log.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

// The most passes --repeats or --warmup asks for (each pass moves the whole span again).
constexpr long long kMaxPasses = 1000;

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
      "  --repeats N              timed passes per case, 1-1000 (default %d)\n"
      "  --warmup N               discarded passes per case, 0-1000 (default %d)\n"
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
  std::fprintf(stderr, "strata probe: %s\n", s.to_string().c_str());
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
    } else if (a == "--repeats" || a == "--warmup") {
      long long n = 0;
      if (!parse_int_in(v, a == "--repeats" ? 1 : 0, kMaxPasses, &n)) {
        std::fprintf(stderr, "strata probe io: %s '%s': expected a whole number from %d to %lld\n",
                     a.c_str(), v, a == "--repeats" ? 1 : 0, kMaxPasses);
        return 2;
      }
      (a == "--repeats" ? o.repeats : o.warmup) = int(n);
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

// `strata probe` with no subcommand (or only options): every probe, one machine profile.
int probe_all(int argc, char** argv) {
  MachineProbeOptions o;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: strata probe [--path DIR[,DIR...]] [--json FILE] [options]\n\n"
          "Runs every probe (host memory bandwidth: copy with all threads and with one, and the\n"
          "optimizer's read-modify-write; CPU optimizer params/s per thread count; device GEMM\n"
          "rate, and whole 2-layer training micro-batches' rates by width and tokens (small on\n"
          "the CPU backend, training's sizes on a GPU); host<->device bandwidth (CUDA); NVMe\n"
          "read/write on --path; collectives under mpirun) and writes one machine profile for\n"
          "`strata plan --profile FILE`. Warm-up discarded; median and spread.\n\n"
          "options:\n"
          "  --path DIR[,DIR...]  swap directories to probe (default: NVMe is not measured)\n"
          "  --json FILE          write the profile here (default: stdout summary only)\n"
          "  --repeats N          timed passes per case, 1-1000 (default %d)\n"
          "  --warmup N           discarded passes per case, 0-1000 (default %d)\n"
          "  --host-bytes SIZE    memory-bandwidth buffer (default %s: 4x the last-level\n"
          "                       cache, 256 MiB-2 GiB, at most 1/8 of the available memory;\n"
          "                       the CPU optimizer steps as many parameters' state)\n"
          "  --nvme-bytes SIZE    probe file per path (default %s)\n"
          "  --cpu                measure the CPU backend even when a GPU is present\n\n"
          "subcommands: strata probe io --help, strata probe comm --help\n",
          o.repeats, o.warmup, format_bytes(double(probe_span_bytes())).c_str(),
          format_bytes(double(o.nvme_file_bytes)).c_str());
      return 0;
    }
    if (a == "--cpu") {
      o.include_cuda = false;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "strata probe: %s needs a value (strata probe --help)\n", a.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--path") {
      o.nvme_paths = split(v);
    } else if (a == "--json") {
      json_path = v;
    } else if (a == "--repeats" || a == "--warmup") {
      long long n = 0;
      if (!parse_int_in(v, a == "--repeats" ? 1 : 0, kMaxPasses, &n)) {
        std::fprintf(stderr, "strata probe: %s '%s': expected a whole number from %d to %lld\n",
                     a.c_str(), v.c_str(), a == "--repeats" ? 1 : 0, kMaxPasses);
        return 2;
      }
      (a == "--repeats" ? o.repeats : o.warmup) = int(n);
    } else if (a == "--host-bytes" || a == "--nvme-bytes") {
      auto s = parse_size(v);
      if (!s.is_ok()) return fail(s.status().with_context(a));
      (a == "--host-bytes" ? o.host_bytes : o.nvme_file_bytes) = *s;
    } else {
      std::fprintf(stderr,
                   "strata probe: unknown option or probe '%s' (try: strata probe --help)\n",
                   a.c_str());
      return 2;
    }
  }
  // Under mpirun every rank runs the probes (the collectives need them all); rank 0 reports.
  bool rank0 = true;
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    if (const char* r = std::getenv(var); r != nullptr && std::atoi(r) != 0) rank0 = false;
  }
  auto profile = run_machine_probe(o, [rank0](int i, int n, const std::string& what) {
    if (!rank0) return;
    const int w = 24, filled = n > 0 ? i * w / n : w;
    std::fprintf(stderr, "\r[%-*s] %d/%d %-44s", w, std::string(size_t(filled), '#').c_str(), i, n,
                 what.c_str());
    if (i == n) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  });
  if (!profile.is_ok()) return fail(profile.status());
  if (!rank0) return 0;
  auto j = nlohmann::json::parse(*profile);
  auto g = [&](const char* a, const char* b) {
    return j[a].is_object() && j[a].contains(b) ? fmt::format("{:.3g}", j[a][b].get<double>())
                                                : std::string("-");
  };
  auto spread = [&](const char* a, const char* b, double scale) {
    if (!j[a].is_object() || !j[a].contains(b)) return std::string();
    const auto& s = j[a][b];
    return fmt::format(" (min..max {:.3g}..{:.3g})", s["min"].get<double>() * scale,
                       s["max"].get<double>() * scale);
  };
  std::printf("host memory    copy %s GB/s%s (one thread %s), optimizer pattern (rmw) %s GB/s%s\n",
              g("host", "copy_gbps").c_str(), spread("host", "copy_spread", 1).c_str(),
              g("host", "copy_one_thread_gbps").c_str(), g("host", "rmw_gbps").c_str(),
              spread("host", "rmw_spread", 1).c_str());
  std::printf("cpu optimizer  ");
  for (const auto& t : j["cpu_optimizer"]["by_threads"]) {
    std::printf("%d thr: %.3g Mparam/s  ", t["threads"].get<int>(),
                t["params_per_s"].get<double>() / 1e6);
  }
  std::printf("(%s, %.3g M params)\n", j["cpu_optimizer"]["isa"].get<std::string>().c_str(),
              j["cpu_optimizer"]["params"].get<double>() / 1e6);
  std::printf("device GEMM    %s: %.3g TFLOP/s%s\n",
              j["device"]["backend"].get<std::string>().c_str(),
              j["device"]["gemm_flops"].get<double>() / 1e12,
              spread("device", "gemm_flops_spread", 1e-12).c_str());
  if (j["device"].contains("mem_gbps")) {
    std::printf("device memory  %.4g GB/s%s (%s)\n", j["device"]["mem_gbps"].get<double>(),
                spread("device", "mem_gbps_spread", 1).c_str(),
                j["device"].value("mem_probe", std::string()).c_str());
  }
  if (j["device"].contains("gemm_by_width") && !j["device"]["gemm_by_width"].empty()) {
    std::printf("model steps    ");
    for (const auto& e : j["device"]["gemm_by_width"]) {
      std::printf("C %d %dx%d: %.3g  ", e["C"].get<int>(), e["B"].get<int>(), e["T"].get<int>(),
                  e["gemm_flops"].get<double>() / 1e12);
    }
    std::printf("TFLOP/s (2-layer training micro-batches, the planner's FLOPs)\n");
  }
  if (j["device"].contains("gemm_by_width_note")) {
    const bool none =
        !j["device"].contains("gemm_by_width") || j["device"]["gemm_by_width"].empty();
    std::printf("%s%s%s\n", none ? "model steps    " : "               ",
                j["device"]["gemm_by_width_note"].get<std::string>().c_str(),
                none ? " (the planner takes the GEMM rate)" : "");
  }
  auto line = [&](const char* key) {
    return j[key].is_string() ? j[key].get<std::string>() : std::string();
  };
  if (j["link"].is_object()) {
    std::printf(
        "host<->device  h2d pinned %s, d2h pinned %s, h2d pageable %s, d2h pageable %s GB/s\n",
        g("link", "h2d_pinned_gbps").c_str(), g("link", "d2h_pinned_gbps").c_str(),
        g("link", "h2d_pageable_gbps").c_str(), g("link", "d2h_pageable_gbps").c_str());
  } else {
    std::printf("host<->device  %s\n", line("link").c_str());
  }
  if (j["nvme"].is_object()) {
    for (const auto& p : j["nvme"]["per_path"]) {
      std::printf("nvme %-10s read %.3g GB/s, write %.3g GB/s (alone)\n",
                  p["path"].get<std::string>().c_str(), p["read_gbps"].get<double>(),
                  p["write_gbps"].get<double>());
    }
    std::printf("nvme           read %s GB/s, write %s GB/s (aio %s, block %s, qd %d)\n",
                g("nvme", "read_gbps").c_str(), g("nvme", "write_gbps").c_str(),
                j["nvme"]["aio"]["backend"].get<std::string>().c_str(),
                format_bytes(j["nvme"]["aio"]["block_size"].get<double>()).c_str(),
                j["nvme"]["aio"]["queue_depth"].get<int>());
  } else {
    std::printf("nvme           %s\n", line("nvme").c_str());
  }
  if (j["collectives"].is_object()) {
    std::printf("collectives    bus bandwidth %s GB/s\n", g("collectives", "busbw_gbps").c_str());
  } else {
    std::printf("collectives    %s\n", line("collectives").c_str());
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << *profile;
    if (!out) {
      return fail(io_error(fmt::format("writing profile {}: {}", json_path, strerror(errno))));
    }
    std::printf("profile written to %s (use: strata plan --profile %s ...)\n", json_path.c_str(),
                json_path.c_str());
  }
  return 0;
}

}  // namespace

int cmd_probe(int argc, char** argv) {
  if (argc >= 2 && (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h"))) {
    std::printf(
        "usage: strata probe [all|io|comm] [options]\n\n"
        "  all     (or none) every probe, one machine profile for strata plan --profile; its\n"
        "          options (--path, --json, --repeats, ...): strata probe all --help\n"
        "  io      storage throughput per backend, block size and queue depth\n"
        "          (strata probe io --help)\n"
        "  comm    collective bus bandwidth (strata probe comm --help)\n");
    return 0;
  }
  if (argc >= 2 && std::string(argv[1]) == "io") return probe_io(argc - 1, argv + 1);
  if (argc >= 2 && std::string(argv[1]) == "comm") return comm_probe_main(argc - 1, argv + 1);
  if (argc >= 2 && std::string(argv[1]) == "all") return probe_all(argc - 1, argv + 1);
  return probe_all(argc, argv);
}

}  // namespace strata::tools
