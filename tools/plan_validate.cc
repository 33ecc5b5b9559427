// `strata plan --validate`: trains the config and compares the plan with what it measured.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "src/train/trainer.h"
#include "strata/log.h"
#include "tools/plan_cli.h"

namespace strata::tools {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// The lines of bytes_against_minimum for the planner's option `o`: the median of steps 3 on,
// leaving out the steps an fp16 overflow skipped and those after them (whose optimizer pass,
// deferred into them, did not run): they move less than a step that updates the weights.
std::string bytes_lines(const TrainResult& res, const PlanOption& o) {
  if (res.step_nvme_bytes.size() < 3 || res.step_device_bytes.size() < 3) return "";
  auto skipped = [&](size_t s) { return s < res.step_skipped.size() && res.step_skipped[s]; };
  std::vector<size_t> steps;  // 0-based
  for (size_t s = 2; s < res.step_nvme_bytes.size(); ++s) {
    if (!skipped(s) && !skipped(s - 1)) steps.push_back(s);
  }
  const size_t left_out = res.step_nvme_bytes.size() - 2 - steps.size();
  if (steps.empty()) return "";
  const std::string which =
      fmt::format("median of steps 3-{}{}", res.step_nvme_bytes.size(),
                  left_out ? fmt::format(" but {} skipped by fp16 overflow or after one", left_out)
                           : std::string());
  auto line = [&](const char* what, const std::vector<uint64_t>& per_step, double minimum,
                  const char* below = "") {
    std::vector<double> v;
    for (size_t s : steps) v.push_back(double(per_step[s]));
    const double got = median(std::move(v));
    if (got == 0 && minimum == 0) return std::string();
    return fmt::format(
        "{} bytes per step: {} ({}), the placement's minimum {}{}{}\n", what, format_bytes(got),
        which, format_bytes(minimum),
        minimum > 0 ? fmt::format(" ({:+.1f}%)", 100.0 * (got - minimum) / minimum) : std::string(),
        got < 0.99 * minimum ? below : "");
  };
  // What the host<->device bytes are made of, to tell an excess apart: each direction, and the
  // schedule each of those steps ran its optimizer in.
  auto split = [&]() {
    if (res.step_device_in.size() != res.step_device_bytes.size()) return std::string();
    std::vector<double> in, out;
    std::string sched;
    static const char* kSchedule[] = {"after backward", "under backward", "rolled back",
                                      "deferred"};
    for (size_t s : steps) {
      in.push_back(double(res.step_device_in[s]));
      out.push_back(double(res.step_device_bytes[s] - res.step_device_in[s]));
      const uint8_t k = s < res.optimizer_schedule.size() ? res.optimizer_schedule[s] : 0;
      sched += (sched.empty() ? "" : ", ") + std::string(kSchedule[std::min<uint8_t>(k, 3)]);
    }
    const double in_median = median(std::move(in)), out_median = median(std::move(out));
    if (in_median == 0 && out_median == 0) return std::string();
    return fmt::format(
        "  of which host->device {}, device->host {} (medians); the optimizer "
        "of those steps: {}\n",
        format_bytes(in_median), format_bytes(out_median), sched);
  };
  // The planner's NVMe bytes are the node's (its ranks share the disks); each rank reports its
  // own, as it does its host<->device bytes.
  const double W = double(std::max(1, res.world_size));
  std::string device = line("host<->device", res.step_device_bytes, double(o.link_bytes),
                            // The planner's link bytes are a GPU's; the host steps and reads
                            // the CPU backend's device memory in place.
                            res.device_in_rss ? "; the CPU backend's device is host memory, "
                                                "which the host reads and writes in place"
                                              : "");
  if (!device.empty()) device += split();
  return line("nvme", res.step_nvme_bytes, double(o.nvme_read_bytes + o.nvme_write_bytes) / W) +
         device;
}

}  // namespace

uint64_t default_host_budget() {
  std::ifstream in("/proc/meminfo");
  std::string k, unit;
  uint64_t v = 0;
  while (in >> k >> v >> unit) {
    if (k == "MemAvailable:") return uint64_t(double(v) * 1024 * 0.9);
  }
  return 0;
}

std::string bytes_against_minimum(const Config& cfg, const TrainResult& res) {
  if (res.step_nvme_bytes.size() < 3 || res.step_device_bytes.size() < 3) return "";
  // The machine as the run had it: the device tier's capacity, the host budget, the ranks.
  Hardware hw;
  hw.gpus = res.world_size;
  for (const auto& t : res.tiers) {
    if (t.name == "device") hw.gpu_mem = t.capacity;
  }
  hw.host_mem = cfg.strata.host_memory_limit > 0 ? cfg.strata.host_memory_limit
                                                 : default_host_budget() * uint64_t(hw.gpus);
  hw.nvme_paths = cfg.zero.offload_optimizer.nvme_path;
  if (hw.nvme_paths.empty()) hw.nvme_paths = cfg.zero.offload_param.nvme_path;
  // The bytes do not depend on the rates: the default profile of the run's backend will do.
  PlanRequest req = request_from_config(cfg, hw, default_profile(res.device_in_rss));
  auto rep = make_plan(req);
  auto p = placement_of_config(cfg);
  if (!rep.is_ok() || !p.is_ok()) return "";
  auto i = add_placement(*rep, *p);
  if (!i.is_ok()) return "";
  return bytes_lines(res, rep->options[size_t(*i)]);
}

int validate_plan(const PlanArgs& args, const Config& cfg, const PlanRequest& req,
                  const PlanOption& o) {
  std::vector<double> step_s;
  auto last = std::chrono::steady_clock::now();
  TrainOptions to;
  to.progress = false;
  to.on_step_end = [&](int64_t) {
    const auto now = std::chrono::steady_clock::now();
    step_s.push_back(std::chrono::duration<double>(now - last).count());
    last = now;
  };
  Config c = cfg;
  c.train.eval_interval = 0;
  last = std::chrono::steady_clock::now();
  auto r = train(c, to);
  if (!r.is_ok()) return plan_fail(r.status());
  // Steps 1-2 are warm-up (trace recording, first touches): dropped.
  std::vector<uint8_t> sched = r->optimizer_schedule;
  sched.resize(step_s.size(), 1);
  if (step_s.size() > 3) {
    step_s.erase(step_s.begin(), step_s.begin() + 2);
    sched.erase(sched.begin(), sched.begin() + 2);
  }
  // Which schedule each measured step ran is decided by the data (a step after one that
  // clipped steps its optimizer after backward): each step is predicted with its own.
  const size_t under = size_t(std::count(sched.begin(), sched.end(), uint8_t{1}));
  // 0: after backward (overlap off, or strata.optimizer.defer chose it after a clipped step);
  // 1: under backward; 2: rolled back, redone (predicted as deferred); 3: deferred.
  auto predicted = [&](const TimeTerms& t, bool fastest_pass) {
    std::vector<double> p;
    for (uint8_t k : sched) {
      p.push_back(k == 1 ? t.step_s : k == 0 ? t.step_plain_s : t.step_deferred_s);
    }
    if (p.empty()) return t.step_s;
    return fastest_pass ? *std::min_element(p.begin(), p.end()) : median(p);
  };
  const double meas = median(step_s);
  const double fastest_step =
      step_s.empty() ? 0.0 : *std::min_element(step_s.begin(), step_s.end());
  std::printf(
      "\nvalidate %s (%s): measured median %.0f ms/step, fastest %.0f, slowest %.0f "
      "(%zu steps)\n",
      args.config_path.c_str(), o.placement.name.c_str(), meas * 1e3, fastest_step * 1e3,
      step_s.empty() ? 0.0 : *std::max_element(step_s.begin(), step_s.end()) * 1e3, step_s.size());
  // Median rates predict the median step; fastest-pass rates the fastest step (the machine
  // without the other work that shares it).
  if (o.time.falls_back) {
    const size_t after = size_t(std::count(sched.begin(), sched.end(), uint8_t{0}));
    std::printf(
        "  schedule: of %zu measured steps, %zu stepped the optimizer under backward (predicted "
        "%.0f ms), %zu after backward (%.0f ms) and %zu deferred to the next forward (%.0f ms), "
        "the last two because the step before clipped or overflowed; strata.optimizer.defer %s "
        "was predicted to run such steps %s\n",
        sched.size(), under, o.time.step_s * 1e3, after, o.time.step_plain_s * 1e3,
        sched.size() - under - after, o.time.step_deferred_s * 1e3,
        cfg.strata.optimizer_defer.c_str(),
        o.time.clipped_deferred ? "deferred" : "after backward");
  }
  for (const bool f : {false, true}) {
    double pred = predicted(o.time, f);
    if (f != args.fastest) {
      if (args.profile_path.empty()) continue;
      auto other = load_machine_profile(args.profile_path, f);
      if (!other.is_ok()) return plan_fail(other.status());
      PlanRequest r2 = req;
      r2.profile = *other;
      auto o2 = evaluate_placement(r2, o.placement);
      if (!o2.is_ok()) return plan_fail(o2.status());
      pred = predicted(o2->time, f);
    }
    const double ref = f ? fastest_step : meas;
    std::printf("  step time: predicted %.0f ms with %s rates vs measured %s %.0f ms: %+.1f%%\n",
                pred * 1e3, f ? "fastest-pass" : "median", f ? "fastest step" : "median", ref * 1e3,
                ref > 0 ? 100.0 * (pred - ref) / ref : 0.0);
  }
  const int64_t steps = std::max<int64_t>(1, r->end_step - r->start_step);
  std::printf(
      "  measured split per step: fwd/bwd %.0f ms (fetch wait %.0f), optimizer %.0f "
      "ms, io wait %.0f ms\n",
      1e3 * r->fwd_bwd_s / double(steps), 1e3 * r->schedule.compute_wait_s / double(steps),
      1e3 * r->schedule.optimizer_s / double(steps), 1e3 * r->io_wait_s / double(steps));
  // The placement's minimum for its accumulation steps (each byte the step must move, once)
  // against what the measured steps moved (after the first two: the trace recording).
  const std::string lines = bytes_lines(*r, o);  // each line ends in '\n'
  for (size_t a = 0; a < lines.size();) {
    const size_t b = lines.find('\n', a);
    std::printf("  %s\n", lines.substr(a, b - a).c_str());
    a = b + 1;
  }
  // The peaks are the whole run's: the rule of the schedule its steps ran. With the overlap on,
  // a run none of whose steps stepped under backward (each deferred to the next forward, or
  // after backward when strata.optimizer.defer chose it) holds no undo state and holds the
  // read-ahead into the pass either way: peak_deferred. One step under backward may hold undo
  // state: peak.
  const bool none_under = cfg.strata.optimizer_overlap && !r->optimizer_schedule.empty() &&
                          std::all_of(r->optimizer_schedule.begin(), r->optimizer_schedule.end(),
                                      [](uint8_t k) { return k == 0 || k == 3; });
  if (none_under) {
    std::printf(
        "  peaks: no step stepped its optimizer under backward (each deferred to the next "
        "forward or stepped after backward, the state read ahead): no undo state, predicted as "
        "such\n");
  }
  // Steps after backward among them (strata.optimizer.defer's trial) hold the plain pass's
  // staging too: the larger of the two rules.
  const bool some_after = std::any_of(r->optimizer_schedule.begin(), r->optimizer_schedule.end(),
                                      [](uint8_t k) { return k == 0; });
  for (const auto& t : r->tiers) {
    const TierBytes& b = t.name == "device" ? o.device : t.name == "host" ? o.host : o.nvme;
    const double pred =
        double(none_under ? (some_after && b.undo == 0 ? std::max(b.peak, b.peak_deferred)
                                                       : b.peak_deferred)
                          : b.peak);
    std::printf("  %-6s peak: predicted %s (reserved %s), measured %s (%+.1f%%)\n", t.name.c_str(),
                format_bytes(pred).c_str(), format_bytes(double(b.total())).c_str(),
                format_bytes(double(t.peak)).c_str(),
                t.peak ? 100.0 * (pred - double(t.peak)) / double(t.peak) : 0.0);
  }
  return 0;
}

}  // namespace strata::tools
