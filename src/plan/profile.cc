// Machine profiles: the defaults, the probe's JSON file, and the GEMM rate at a shape.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/base/json_depth.h"
#include "src/base/json_text.h"
#include "src/base/safe_file.h"
#include "src/plan/plan.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;

}  // namespace

// ---- profiles ---------------------------------------------------------------------------------

MachineProfile default_profile(bool cpu_backend) {
  MachineProfile p;
  p.cpu_backend = cpu_backend;
  if (cpu_backend) {
    // Measured on the 2-core development host (docs/PLANNER.md); run `strata probe` for yours.
    p.gemm_flops = {6.0e10, "default (2-core dev host)"};
    p.link_gbps = {8.0, "default (host memcpy)"};
    p.host_copy_gbps = {8.0, "default"};
    p.optimizer_pps = {1.5e8, "default"};
    p.nvme_read_gbps = {1.5, "default"};
    p.nvme_write_gbps = {1.0, "default"};
  } else {
    // H100 SXM-class: bf16 dense GEMM at ~60% of 989 TFLOP/s peak, PCIe Gen5 pinned copies,
    // DeepSpeed-class CPU Adam on a 2-socket host, NVLink bus bandwidth (docs/PLANNER.md).
    p.gemm_flops = {6.0e14, "default (H100, 60% of bf16 peak)"};
    p.link_gbps = {25.0, "default (PCIe Gen5 x16, pinned)"};
    p.host_copy_gbps = {50.0, "default"};
    p.optimizer_pps = {1.0e9, "default (per node)"};
    p.nvme_read_gbps = {3.0, "default (one NVMe)"};
    p.nvme_write_gbps = {2.0, "default (one NVMe)"};
    p.collective_gbps = {200.0, "default (NVLink busbw)"};
    p.device_mem_gbps = {2000.0, "default (H100 HBM3, 60% of 3.35 TB/s)"};
  }
  return p;
}

MachineProfile simulated_profile(MachineProfile p, const SimulatedDeviceOptions& sim) {
  const std::string src = fmt::format("device.simulate {}", sim.preset.empty() ? "" : sim.preset);
  p.simulated = true;
  p.sim = sim;
  p.cpu_backend = false;
  p.gemm_flops = {sim.gemm_tflops * 1e12, src};
  p.gemm_by_width.clear();
  const Rate& copy = p.stream_copy_gbps.value > 0 ? p.stream_copy_gbps : p.host_copy_gbps;
  if (sim.link_gbps < copy.value) {
    p.link_gbps = {sim.link_gbps, src};
  } else {
    p.link_gbps = {copy.value,
                   fmt::format("{} (one thread's host copy, below the link's)", copy.source)};
  }
  p.device_mem_gbps = {sim.hbm_gbps, src};
  return p;
}

namespace {
// The profile text as JSON, checked to be a machine profile of the version this strata reads.
Result<json> parse_profile_json(const std::string& text, const std::string& origin,
                                const std::string& regen) {
  json j;
  try {
    Status depth = check_json_depth(text);
    if (!depth.is_ok()) throw std::runtime_error(depth.message());
    j = json::parse(text);
  } catch (const std::exception& e) {
    return invalid_argument(fmt::format("{}: not a JSON profile ({}){}", origin, e.what(), regen));
  }
  if (!j.is_object() || !j.contains("magic") || j["magic"] != "strata-machine-profile") {
    return invalid_argument(fmt::format(
        "{}: magic is {}, expected \"strata-machine-profile\" (a `strata probe io` profile "
        "alone is not a machine profile){}",
        origin, j.is_object() && j.contains("magic") ? j["magic"].dump() : "missing", regen));
  }
  if (!j.contains("version") ||
      json_int_in(j["version"], 0, int64_t{1} << 30) != int64_t{kMachineProfileVersion}) {
    return invalid_argument(
        fmt::format("{}: profile version {} is not the version {} this strata "
                    "reads{}",
                    origin, j.contains("version") ? j["version"].dump() : "missing",
                    kMachineProfileVersion, regen));
  }
  return j;
}

// device.gemm_by_width: the model step's rate per width and tokens, sorted by tokens, width.
Status read_gemm_by_width(const json& by_width, const std::string& origin, const std::string& regen,
                          bool fastest, MachineProfile* prof) {
  MachineProfile& p = *prof;
  for (const auto& e : by_width) {
    if (!e.contains("C") || !e.contains("gemm_flops") || !e["gemm_flops"].is_number()) {
      return invalid_argument(fmt::format(
          "{}: device.gemm_by_width entry {} lacks C or gemm_flops{}", origin, e.dump(), regen));
    }
    const double med = e["gemm_flops"].get<double>();
    // Widths and shapes a probe measures: 1 .. 2^20 each (version-1 profiles: B 4, T 128).
    const auto C = json_int_in(e["C"], 1, 1 << 20);
    const auto B = e.contains("B") ? json_int_in(e["B"], 1, 1 << 20) : 4;
    const auto T = e.contains("T") ? json_int_in(e["T"], 1, 1 << 20) : 128;
    if (!C || !B || !T) {
      return invalid_argument(fmt::format(
          "{}: device.gemm_by_width entry {}: C, B and T must be integers from 1 to {}{}", origin,
          e.dump().substr(0, 200), 1 << 20, regen));
    }
    MachineProfile::GemmPoint g;
    g.width = int(*C);
    g.tokens = *B * *T;
    g.flops = fastest ? e.value("gemm_flops_max", med) : med;
    p.gemm_by_width.push_back(g);
  }
  std::sort(p.gemm_by_width.begin(), p.gemm_by_width.end(), [](const auto& a, const auto& b) {
    return std::tie(a.tokens, a.width) < std::tie(b.tokens, b.width);
  });
  return Status::ok();
}

// nvme.io_probe's cases and nvme.aio's recommended shape.
Status read_nvme_shapes(const json& n, const std::string& origin, const std::string& regen,
                        bool fastest, MachineProfile* prof) {
  MachineProfile& p = *prof;
  // An I/O shape's block size and queue depth: integers in range (converting an out-of-range
  // number would be undefined), required in a probe case, else keeping *bs and *qd.
  auto io_shape = [&](const json& o, const char* where, bool required, size_t* bs,
                      int* qd) -> Status {
    const auto b =
        json_int_in(o.value("block_size", required ? json() : json(*bs)), 512, int64_t{1} << 30);
    const auto q = json_int_in(o.value("queue_depth", required ? json() : json(*qd)), 1, 4096);
    if (!b || !q) {
      return invalid_argument(fmt::format(
          "{}: {}: block_size must be an integer from 512 to 2^30 and queue_depth from 1 to "
          "4096 (got {}){}",
          origin, where, o.dump().substr(0, 200), regen));
    }
    *bs = size_t(*b);
    *qd = int(*q);
    return Status::ok();
  };
  if (n.contains("io_probe") && n["io_probe"].is_object()) {
    for (const auto& c : n["io_probe"].value("cases", json::array())) {
      MachineProfile::NvmeCase k;
      k.backend = c.value("backend", "");
      STRATA_RETURN_IF_ERROR(io_shape(c, "nvme.io_probe case", true, &k.block_size, &k.queue_depth),
                             "");
      const double g = fastest ? c.value("gbps_max", 0.0) : c.value("gbps_median", 0.0);
      auto it = std::find_if(p.nvme_cases.begin(), p.nvme_cases.end(), [&](const auto& x) {
        return x.backend == k.backend && x.block_size == k.block_size &&
               x.queue_depth == k.queue_depth;
      });
      if (it == p.nvme_cases.end()) it = p.nvme_cases.insert(p.nvme_cases.end(), k);
      (c.value("op", "") == "read" ? it->read_gbps : it->write_gbps) = g;
    }
  }
  if (n.contains("aio") && n["aio"].is_object()) {
    p.aio_backend = n["aio"].value("backend", p.aio_backend);
    STRATA_RETURN_IF_ERROR(
        io_shape(n["aio"], "nvme.aio", false, &p.aio_block_size, &p.aio_queue_depth), "");
  }
  return Status::ok();
}

// A rate's fastest pass (its spread's max) with `fastest` where the profile has it, else `median`.
double fastest_or_median(const json& spread, double median, bool fastest) {
  return fastest && spread.is_object() && spread.contains("max") && spread["max"].is_number()
             ? spread["max"].get<double>()
             : median;
}

// cpu_optimizer.by_threads' rate at one thread fewer than the most it measured (linear between
// the thread counts around it), or 0 without such entries (optional: a malformed one is
// skipped).
double rate_beside_launcher(const json& opt, bool fastest) {
  std::vector<std::pair<int64_t, double>> by;  // (threads, rate)
  if (opt.is_object() && opt.contains("by_threads") && opt["by_threads"].is_array()) {
    for (const auto& t : opt["by_threads"]) {
      if (!t.is_object() || !t.contains("threads") || !t.contains("params_per_s") ||
          !t["params_per_s"].is_number()) {
        continue;
      }
      const auto n = json_int_in(t["threads"], 1, 1 << 16);
      const double r =
          fastest_or_median(t.value("spread", json()), t["params_per_s"].get<double>(), fastest);
      if (n && r > 0 && std::isfinite(r)) by.emplace_back(*n, r);
    }
  }
  if (by.empty()) return 0;
  std::sort(by.begin(), by.end());
  const int64_t want = std::max<int64_t>(1, by.back().first - 1);
  for (size_t i = 0; i < by.size(); ++i) {
    if (by[i].first < want) continue;
    if (by[i].first == want || i == 0) return by[i].second;
    const auto [t0, r0] = by[i - 1];
    const auto [t1, r1] = by[i];
    return r0 + (r1 - r0) * double(want - t0) / double(t1 - t0);
  }
  return by.back().second;
}

Result<MachineProfile> parse_profile_fields(const std::string& text, const std::string& origin,
                                            bool fastest) {
  const std::string regen =
      fmt::format("; regenerate it with `strata probe --path <nvme dir> --json {}`", origin);
  STRATA_ASSIGN_OR_RETURN(json j, parse_profile_json(text, origin, regen), "");
  MachineProfile p;
  const std::string src = "probe " + origin + (fastest ? " (fastest pass)" : "");
  // With `fastest`, a rate's fastest pass replaces its median where the profile has it.
  auto best_of = [&](const json& spread, double median) {
    return fastest_or_median(spread, median, fastest);
  };
  auto num = [&](const char* a, const char* b, double* out) -> Status {
    if (!j.contains(a) || !j[a].is_object() || !j[a].contains(b) || !j[a][b].is_number()) {
      return invalid_argument(
          fmt::format("{}: field {}.{} is missing or not a number{}", origin, a, b, regen));
    }
    *out = j[a][b].get<double>();
    // Every one is a rate the planner divides by: 0, negative or absurd ones planned nan or inf
    // steps with exit 0.
    if (!(*out > 0) || !(*out < 1e20)) {
      return invalid_argument(
          fmt::format("{}: field {}.{} is {}: a rate must be positive and "
                      "below 1e20{}",
                      origin, a, b, *out, regen));
    }
    return Status::ok();
  };
  double v = 0;
  if (!j.contains("device") || !j["device"].contains("backend") ||
      !j["device"]["backend"].is_string()) {
    return invalid_argument(fmt::format("{}: field device.backend is missing{}", origin, regen));
  }
  p.cpu_backend = j["device"]["backend"] == "cpu";
  STRATA_RETURN_IF_ERROR(num("device", "gemm_flops", &v), "");
  p.gemm_flops = {best_of(j["device"].value("gemm_flops_spread", json()), v), src};
  if (j["device"].contains("gemm_by_width") && j["device"]["gemm_by_width"].is_array()) {
    STRATA_RETURN_IF_ERROR(
        read_gemm_by_width(j["device"]["gemm_by_width"], origin, regen, fastest, &p), "");
  }
  STRATA_RETURN_IF_ERROR(num("host", "copy_gbps", &v), "");
  v = best_of(j["host"].value("copy_spread", json()), v);
  p.host_copy_gbps = {v, src};
  if (j["host"].contains("copy_one_thread_gbps") && j["host"]["copy_one_thread_gbps"].is_number()) {
    p.stream_copy_gbps = {best_of(j["host"].value("copy_one_thread_spread", json()),
                                  j["host"]["copy_one_thread_gbps"].get<double>()),
                          src};
  }
  if (p.cpu_backend) {
    p.link_gbps = {v, src + " (host copy: the CPU backend's link)"};
  } else {
    STRATA_RETURN_IF_ERROR(num("link", "h2d_pinned_gbps", &v), "");
    p.link_gbps = {v, src};
  }
  STRATA_RETURN_IF_ERROR(num("cpu_optimizer", "params_per_s", &v), "");
  if (fastest && j["cpu_optimizer"].contains("by_threads")) {
    for (const auto& t : j["cpu_optimizer"]["by_threads"]) {
      v = std::max(v, best_of(t.value("spread", json()), 0.0));
    }
  }
  p.optimizer_pps = {v, src};
  p.optimizer_pps_beside = rate_beside_launcher(j["cpu_optimizer"], fastest);
  // Optional (profiles without it keep the default): the device's memory bandwidth.
  if (j["device"].contains("mem_gbps") && j["device"]["mem_gbps"].is_number()) {
    p.device_mem_gbps = {j["device"]["mem_gbps"].get<double>(), src};
  }
  // The recommended case's fastest pass, from the embedded io probe report.
  auto nvme_best = [&](bool read, double median) {
    if (!fastest || !j["nvme"].contains("io_probe") || !j["nvme"].contains("aio")) return median;
    const json& a = j["nvme"]["aio"];
    for (const auto& c : j["nvme"]["io_probe"].value("cases", json::array())) {
      if (c.value("op", "") == (read ? "read" : "write") &&
          c.value("backend", "") == a.value("backend", "") &&
          c.value("block_size", json()) == a.value("block_size", json()) &&
          c.value("queue_depth", json()) == a.value("queue_depth", json())) {
        return c.value("gbps_max", median);
      }
    }
    return median;
  };
  if (j.contains("nvme") && j["nvme"].is_object()) {
    STRATA_RETURN_IF_ERROR(num("nvme", "read_gbps", &v), "");
    p.nvme_read_gbps = {nvme_best(true, v), src};
    STRATA_RETURN_IF_ERROR(num("nvme", "write_gbps", &v), "");
    p.nvme_write_gbps = {nvme_best(false, v), src};
    STRATA_RETURN_IF_ERROR(read_nvme_shapes(j["nvme"], origin, regen, fastest, &p), "");
  }
  if (j.contains("collectives") && j["collectives"].is_object()) {
    STRATA_RETURN_IF_ERROR(num("collectives", "busbw_gbps", &v), "");
    p.collective_gbps = {v, src};
  }
  return p;
}

}  // namespace

Result<MachineProfile> parse_machine_profile(const std::string& text, const std::string& origin,
                                             bool fastest) {
  // A field of the wrong type (a string where an object or a number belongs) throws inside
  // nlohmann::json: an invalid profile, never an abort.
  try {
    return parse_profile_fields(text, origin, fastest);
  } catch (const std::exception& e) {
    return invalid_argument(fmt::format(
        "{}: not a valid profile ({}); regenerate it with `strata probe --path <nvme dir> --json "
        "{}`",
        origin, e.what(), origin));
  }
}

void set_cpu_optimizer_rate(MachineProfile* profile, double beside_pps, const std::string& source) {
  MachineProfile& p = *profile;
  const double beside = p.optimizer_pps_beside > 0 ? p.optimizer_pps_beside : p.optimizer_pps.value;
  const double alone = p.optimizer_pps.value * beside_pps / beside;
  p.optimizer_pps = {alone, fmt::format("{} (beside the device: {:.3g})", source, beside_pps)};
  if (p.optimizer_pps_beside > 0) p.optimizer_pps_beside = beside_pps;
}

Result<MachineProfile> load_machine_profile(const std::string& path, bool fastest) {
  STRATA_RETURN_IF_ERROR(expect_regular_file(path, "--profile"), "");
  std::ifstream in(path);
  if (!in) {
    return not_found(
        fmt::format("--profile {}: cannot open; create it with `strata probe --path "
                    "<nvme dir> --json {}`",
                    path, path));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_machine_profile(ss.str(), path, fastest);
}

namespace {
// Log-log interpolation of (x, y) points sorted by x, clamped at the ends.
double interpolate_log(const std::vector<std::pair<double, double>>& pts, double x) {
  if (x <= pts.front().first) return pts.front().second;
  if (x >= pts.back().first) return pts.back().second;
  for (size_t i = 1; i < pts.size(); ++i) {
    if (x > pts[i].first) continue;
    const double f = std::log(x / pts[i - 1].first) / std::log(pts[i].first / pts[i - 1].first);
    return std::exp(std::log(pts[i - 1].second) * (1 - f) + std::log(pts[i].second) * f);
  }
  return pts.back().second;
}
}  // namespace

double gemm_rate_at(const MachineProfile& p, int width, int tokens) {
  if (p.gemm_by_width.empty()) return p.gemm_flops.value;
  // Per token count: the rate at this width; then across token counts.
  std::vector<std::pair<double, double>> by_tokens;
  for (size_t i = 0; i < p.gemm_by_width.size();) {
    const int tk = p.gemm_by_width[i].tokens;
    std::vector<std::pair<double, double>> by_width;
    for (; i < p.gemm_by_width.size() && p.gemm_by_width[i].tokens == tk; ++i) {
      by_width.emplace_back(p.gemm_by_width[i].width, p.gemm_by_width[i].flops);
    }
    by_tokens.emplace_back(tk, interpolate_log(by_width, width));
  }
  return interpolate_log(by_tokens, tokens);
}

}  // namespace strata
