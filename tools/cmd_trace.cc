// `strata trace replay --trace FILE --capacity SIZE [--bandwidth GB/s] [--prefetch SIZE]
//  [--max-reuse-distance SIZE] [--steps N] [--compute-ms MS]`
#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "src/base/safe_file.h"
#include "src/tiers/trace.h"
#include "strata/config.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

// The most steps a replay runs: each replays the whole trace, and the steady state shows
// after the first few.
constexpr long long kMaxReplaySteps = 100000;

const char kUsage[] =
    "usage: strata trace replay --trace FILE --capacity SIZE [options]\n"
    "\n"
    "Replays a recorded access trace (strata train --set strata.trace_file=FILE writes one\n"
    "after the first step) against a device cache of SIZE bytes and a modelled copy link,\n"
    "and prints, for strata's policy, LRU and Belady's optimum: bytes fetched, fetches, and\n"
    "the time compute waited for copies.\n"
    "\n"
    "options:\n"
    "  --trace FILE              the trace (JSON lines; required)\n"
    "  --capacity SIZE           device bytes for parameters, e.g. 64MiB (required)\n"
    "  --bandwidth GBPS          copy bandwidth in GB/s (default 25)\n"
    "  --prefetch SIZE           most bytes in flight ahead (default 50MB)\n"
    "  --max-reuse-distance SIZE drop after use beyond this reuse distance (default: never)\n"
    "  --steps N                 steps to replay, 1-100000 (default 3)\n"
    "  --compute-ms MS           compute time per access when the trace has none (default 1)\n";

}  // namespace

int cmd_trace(int argc, char** argv) {
  if (argc >= 2 && (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h"))) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (argc < 2 || std::strcmp(argv[1], "replay") != 0) {
    std::fprintf(stderr, "strata trace: expected 'replay'\n\n%s", kUsage);
    return 2;
  }
  std::string trace_path;
  ReplayOptions ro;
  ro.bandwidth = 25e9;
  double compute_ms = 1.0;
  bool have_capacity = false;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "strata trace replay: %s needs a value\n\n%s", a.c_str(), kUsage);
      return 2;
    }
    std::string v = argv[++i];
    auto bad_value = [&](const std::string& what) {
      std::fprintf(stderr, "strata trace replay: %s '%s': expected %s\n", a.c_str(), v.c_str(),
                   what.c_str());
      return 2;
    };
    auto size = [&](uint64_t* out) {
      auto r = parse_size(v);
      if (!r.is_ok()) {
        std::fprintf(stderr, "strata trace replay: %s: %s\n", a.c_str(),
                     r.status().message().c_str());
        return false;
      }
      *out = *r;
      return true;
    };
    if (a == "--trace") {
      trace_path = v;
    } else if (a == "--capacity") {
      if (!size(&ro.capacity)) return 2;
      have_capacity = true;
    } else if (a == "--prefetch") {
      if (!size(&ro.prefetch_bytes)) return 2;
    } else if (a == "--max-reuse-distance") {
      if (!size(&ro.max_reuse_distance)) return 2;
    } else if (a == "--bandwidth") {
      double g = 0;
      if (!parse_number_in(v, 1e-6, 1e6, &g)) return bad_value("a rate in GB/s, in [1e-6, 1e6]");
      ro.bandwidth = g * 1e9;
    } else if (a == "--steps") {
      long long n = 0;
      if (!parse_int_in(v, 1, kMaxReplaySteps, &n)) {
        return bad_value(fmt::format("a whole number of steps from 1 to {}", kMaxReplaySteps));
      }
      ro.steps = int(n);
    } else if (a == "--compute-ms") {
      if (!parse_number_in(v, 0, 1e9, &compute_ms)) return bad_value("milliseconds, 0 or more");
    } else {
      std::fprintf(stderr, "strata trace replay: unknown option '%s'\n\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if (trace_path.empty() || !have_capacity || ro.capacity == 0) {
    std::fprintf(stderr, "strata trace replay: --trace and --capacity (above 0) are required\n\n%s",
                 kUsage);
    return 2;
  }
  if (Status st = expect_regular_file(trace_path, "--trace"); !st.is_ok()) {
    std::fprintf(stderr, "strata trace replay: %s\n", st.message().c_str());
    return 1;
  }
  std::ifstream f(trace_path);
  if (!f) {
    std::fprintf(stderr, "strata trace replay: cannot open '%s'\n", trace_path.c_str());
    return 1;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  auto trace = Trace::from_jsonl(ss.str());
  if (!trace.is_ok()) {
    std::fprintf(stderr, "strata trace replay: %s: %s\n", trace_path.c_str(),
                 trace.status().message().c_str());
    return 1;
  }
  std::vector<Access> acc = trace->accesses();
  for (auto& a : acc) {
    if (a.compute_s <= 0) a.compute_s = compute_ms * 1e-3;
  }
  Trace t(std::move(acc));
  std::printf("trace %s: %zu accesses per step; capacity %.1f MiB, link %.1f GB/s, %d steps\n",
              trace_path.c_str(), t.size(), double(ro.capacity) / 1048576.0, ro.bandwidth / 1e9,
              ro.steps);
  std::printf("%-8s %14s %9s %12s %12s\n", "policy", "fetched MiB", "fetches", "compute s",
              "stall s");
  for (CachePolicy p : {CachePolicy::kStrata, CachePolicy::kBelady, CachePolicy::kLru}) {
    ReplayResult r = replay(t, p, ro);
    if (!r.fits) {
      std::printf("%-8s does not fit: an object is larger than the capacity\n",
                  cache_policy_name(p));
      continue;
    }
    std::printf("%-8s %14.2f %9llu %12.4f %12.4f\n", cache_policy_name(p),
                double(r.bytes_fetched) / 1048576.0, (unsigned long long)r.fetches, r.compute_s,
                r.stall_s);
  }
  return 0;
}

}  // namespace strata::tools
