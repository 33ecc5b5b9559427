#include "src/plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/plan/plan_parts.h"
#include "src/tiers/memory_model.h"
#include "strata/log.h"
#include "strata/simulated_device.h"

namespace strata {
namespace {

using json = nlohmann::json;

}  // namespace

ActivationSizes activations_of(const ModelConfig& shape, int B, int T, DType dt,
                               ActivationMode mode) {
  auto arch = create_architecture(shape);
  return arch.is_ok() ? (*arch)->activation_plan(B, T, dt, mode) : ActivationSizes{};
}

// ---- placements -------------------------------------------------------------------------------

std::vector<PlacementOption> placement_options() {
  using T = Tier;
  // Gradients follow the optimizer onto the device, else stay on the host (parse_placement).
  auto p = [](const char* name, T params, T opt) {
    return PlacementOption{name, {params, opt, opt, opt == T::kDevice ? T::kDevice : T::kHost}};
  };
  return {p("all-device", T::kDevice, T::kDevice), p("opt-host", T::kDevice, T::kHost),
          p("opt-nvme", T::kDevice, T::kNvme), p("params-host", T::kHost, T::kHost),
          p("params-host+opt-nvme", T::kHost, T::kNvme),
          p("params-nvme+opt-host", T::kNvme, T::kHost),
          p("params-nvme+opt-nvme", T::kNvme, T::kNvme),
          // strata.placement.grads = nvme: no gradient accumulator in host memory (GradSpill).
          PlacementOption{"all-nvme", {T::kNvme, T::kNvme, T::kNvme, T::kNvme}}};
}

Config plan_default_config() {
  Config c;
  c.gradient_clipping = 1.0;
  c.train_micro_batch_size_per_gpu = 1;
  c.gradient_accumulation_steps = 1;
  return c;
}

void PlanRequest::set_model(const PlanModel& m) {
  const DType dt = config.model.dtype;
  model_name = m.name;
  model_note = m.note;
  config.model = m.shape;
  config.model.dtype = dt;
}

ActivationMode PlanRequest::activations() const {
  auto mode = parse_activation_mode(config.strata.activations);  // the parser checked the name
  return mode.is_ok() ? *mode : ActivationMode::kKeep;
}

ZeroPPOptions PlanRequest::zeropp() const {
  ZeroPPOptions z;
  z.quantized_weights = config.zero.zero_quantized_weights;
  z.hpz_partition_size = config.zero.zero_hpz_partition_size;
  z.quantized_gradients = config.zero.zero_quantized_gradients;
  return z;
}

TierOptions tier_options_of(const PlanRequest& r, const Placement& placement,
                            const ActivationSizes& acts) {
  Config c = r.config;
  c.strata.host_memory_limit = size_t(r.hw.host_mem / uint64_t(std::max(1, r.hw.gpus)));
  TierOptions to = TierOptions::from_config(c, r.dtype());
  to.placement = placement;
  to.nvme_paths = r.hw.nvme_paths;
  to.stash_layers = acts.stash_layers;
  to.stash_bytes = acts.stash_bytes;
  to.activation_slot_bytes = acts.slot_bytes;
  // strata.grouped_forwards for the request's accumulation and activations.
  c.gradient_accumulation_steps = std::max(1, r.accumulation());
  to.micro_batches = int(c.gradient_accumulation_steps);
  to.forward_group_max =
      r.activations() != ActivationMode::kOffload ? strata::forward_group_max(c) : 1;
  if (to.forward_group > r.accumulation() || r.activations() == ActivationMode::kOffload) {
    to.forward_group = r.activations() == ActivationMode::kOffload ? 1 : r.accumulation();
  }
  return to;
}

Result<PlanOption> evaluate_placement(const PlanRequest& r, const PlacementOption& pl) {
  // The shape is the model's to check (create_architecture: the decoder skeleton's checks and
  // its blocks'); the batch and the machine are the request's.
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<const Architecture> arch,
                          create_architecture(r.config.model), "model " + r.model_name);
  if (r.micro_batch() < 1 || r.seq() < 1 || r.accumulation() < 1 || r.hw.gpus < 1) {
    return invalid_argument("--batch, --seq, accumulation and --gpus must be >= 1");
  }
  if (r.seq() > r.config.model.context) {
    return invalid_argument(
        fmt::format("--seq {} exceeds the model's context {}", r.seq(), r.config.model.context));
  }
  const Placement& where = pl.where;
  // plan_memory names the model in its errors.
  STRATA_ASSIGN_OR_RETURN(PlanMemory mem, plan_memory(r, where, std::move(arch)), "");
  const PlanPeaks peaks = plan_peaks(r, where, mem);
  PlanTime time = plan_time(r, where, mem, peaks);

  PlanOption o;
  o.placement = pl;
  o.device = mem.device;
  o.host = mem.host;
  o.nvme = mem.nvme;
  for (auto [tier, p] : {std::pair{&o.device, &peaks.device}, std::pair{&o.host, &peaks.host},
                         std::pair{&o.nvme, &peaks.nvme}}) {
    tier->peak = p->peak;
    tier->peak_deferred = p->peak_deferred;
    tier->undo = p->undo;
    tier->read_ahead = p->read_ahead;
  }
  o.why = std::move(mem.why);
  o.fits = o.why.empty();
  o.forward_group = mem.forward_group;
  if (!r.profile.cpu_backend) {
    Status st = check_placement(where, /*host_addressable=*/false, "cuda");
    if (!st.is_ok()) {
      o.runnable = false;
      o.why.push_back(st.message());
    }
  }
  o.time = std::move(time.time);
  o.nvme_read_bytes = time.nvme_read_bytes;
  o.nvme_write_bytes = time.nvme_write_bytes;
  o.link_bytes = time.link_bytes;
  o.flops = time.flops;
  o.deferred_pass = time.deferred_pass;
  o.after_backward_pass = time.after_backward_pass;
  o.first_forward_share = time.first_forward_share;
  o.backward_grouped = time.backward_grouped;
  return o;
}

Result<PlanReport> make_plan(const PlanRequest& request) {
  PlanReport rep;
  rep.request = request;
  if (auto arch = create_architecture(request.config.model); arch.is_ok()) {
    rep.params = (*arch)->layout().num_params();
    rep.model = (*arch)->describe();
  }
  for (const auto& pl : placement_options()) {
    STRATA_ASSIGN_OR_RETURN(PlanOption o, evaluate_placement(request, pl), "planning");
    rep.options.push_back(std::move(o));
  }
  for (size_t i = 0; i < rep.options.size(); ++i) {
    const auto& o = rep.options[i];
    if (!o.fits || !o.runnable) continue;
    if (rep.best < 0 || o.time.step_s < rep.options[size_t(rep.best)].time.step_s)
      rep.best = int(i);
  }
  return rep;
}

Status advise_optimizer_ratio(PlanReport& report, int option) {
  const PlanOption& o = report.options[size_t(option)];
  const PlacementOption base = o.placement;
  if (base.where.master == Tier::kDevice || base.where.moments == Tier::kDevice) {
    return Status::ok();
  }
  const PlanRequest& r = report.request;
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<const Architecture> arch,
                          create_architecture(r.config.model), "model " + r.model_name);
  // Each module's optimizer bytes in module order, as module_homes counts them at ratio 1; the
  // ratio that keeps the first k modules on the device lies between the boundaries k - 1 and k
  // (module_homes keeps a module while the bytes before it are below the share kept): the
  // middle of module k - 1, rounded to the four decimals a config carries.
  Placement at_1 = base.where;
  at_1.optimizer_ratio = 1.0;
  STRATA_ASSIGN_OR_RETURN(std::vector<ModuleHomes> homes,
                          module_homes(arch->layout(), at_1, r.hw.gpus, r.dtype(), r.moment_dtype(),
                                       r.config.strata.delayed_update, 0),
                          "model " + r.model_name);
  double total = 0;
  for (const auto& m : homes) total += double(m.master.bytes + m.moments.bytes);
  if (total <= 0) return Status::ok();
  std::vector<double> ratios = {1.0};
  double before = 0;
  for (const auto& m : homes) {
    const double b = double(m.master.bytes + m.moments.bytes);
    if (b <= 0) continue;
    const double keep = before + b / 2.0;
    before += b;
    // The last: every module's on the device, ratio 0.
    ratios.push_back(before >= total ? 0.0 : std::round((1.0 - keep / total) * 1e4) / 1e4);
  }
  RatioAdvice advice;
  advice.option = option;
  advice.clipped = r.config.gradient_clipping > 0 && r.config.device.simulate.empty();
  auto weighed = [&](const TimeTerms& t) { return advice.clipped ? t.step_after_s : t.expected_s; };
  std::vector<std::pair<double, TimeTerms>> fitting;  // (ratio, time), ratio descending
  for (double ratio : ratios) {
    if (!fitting.empty() && ratio >= fitting.back().first) continue;
    PlacementOption p = base;
    p.where.optimizer_ratio = ratio;
    p.grads_auto = false;  // the option's gradients are where it put them
    STRATA_ASSIGN_OR_RETURN(PlanOption at, evaluate_placement(r, p),
                            fmt::format("optimizer ratio {:g}", ratio));
    ++advice.candidates;
    if (ratio == 1.0) advice.step_at_1_s = weighed(at.time);
    if (at.fits && at.runnable) fitting.emplace_back(ratio, at.time);
  }
  advice.ratio = 1.0;
  advice.time = o.time;
  advice.step_s = weighed(o.time);
  if (!fitting.empty()) {
    advice.fastest_s = weighed(fitting.front().second);
    advice.fastest_ratio = fitting.front().first;
    for (const auto& [ratio, t] : fitting) {
      if (weighed(t) < advice.fastest_s) {
        advice.fastest_s = weighed(t);
        advice.fastest_ratio = ratio;
      }
    }
    // The largest ratio within the slack of the fastest (fitting is by ratio, descending).
    for (const auto& [ratio, t] : fitting) {
      if (weighed(t) <= kRatioSlack * advice.fastest_s) {
        advice.ratio = ratio;
        advice.time = t;
        advice.step_s = weighed(t);
        break;
      }
    }
  }
  report.ratio_advice.push_back(advice);
  return Status::ok();
}

Result<PlacementOption> placement_of_config(const Config& cfg) {
  // parse_placement's message names the key; no context to add.
  STRATA_ASSIGN_OR_RETURN(Placement where, parse_placement(cfg), "");
  const bool grads_auto = cfg.strata.placement_grads.empty();
  for (auto o : placement_options()) {
    o.grads_auto = grads_auto;
    if (o.where == where) return o;
  }
  return PlacementOption{"config", where, grads_auto};
}

Result<int> add_placement(PlanReport& report, const PlacementOption& asked) {
  PlacementOption p = asked;
  if (p.grads_auto && p.where.grads == Tier::kHost) {
    // The gradients go where TierManager::create would put them, by the same function over the
    // same options (one rank's).
    const PlanRequest& r = report.request;
    STRATA_ASSIGN_OR_RETURN(const auto arch, create_architecture(r.config.model),
                            "model " + r.model_name);
    const ActivationSizes acts =
        arch->activation_plan(r.micro_batch(), r.seq(), r.dtype(), r.activations());
    TierOptions to = tier_options_of(r, p.where, acts);
    to.grads_auto = true;
    const Tier g =
        default_grads_tier(*arch, to, r.hw.gpus, r.dtype(), r.moment_dtype(), acts.bytes);
    if (g != p.where.grads) {
      p.where.grads = g;
      p.name = "config";
      for (const auto& o : placement_options()) {
        if (o.where == p.where) p.name = o.name;
      }
    }
  }
  for (size_t i = 0; i < report.options.size(); ++i) {
    if (report.options[i].placement.where == p.where) return int(i);
  }
  STRATA_ASSIGN_OR_RETURN(PlanOption o, evaluate_placement(report.request, p),
                          "planning the placement " + p.name);
  report.options.push_back(std::move(o));
  return int(report.options.size() - 1);
}

PlanRequest request_from_config(const Config& cfg, const Hardware& hw,
                                const MachineProfile& profile) {
  PlanRequest r;
  r.model_name = "config";
  r.config = cfg;
  r.config.data.seq_len = r.seq();  // "auto": the config's model's context, whatever model follows
  r.hw = hw;
  r.profile = profile;
  // A simulated device: its compute rates over the host's (an unknown preset is the run's
  // error, and cmd_plan's).
  if (!cfg.device.simulate.empty() && !profile.simulated) {
    if (auto sim = simulated_device_options(cfg.device); sim.is_ok()) {
      r.profile = simulated_profile(profile, *sim);
    }
  }
  // The NVMe rates of the aio case this config runs (aio.backend "auto" is io_uring where it
  // starts, which the probe's case list then has), when the profile measured it.
  const std::string backend = cfg.aio.backend == "auto" ? "io_uring" : cfg.aio.backend;
  for (const auto& c : profile.nvme_cases) {
    if (c.backend == backend && c.block_size == cfg.aio.block_size &&
        c.queue_depth == cfg.aio.queue_depth && c.read_gbps > 0 && c.write_gbps > 0) {
      const std::string src = fmt::format("{} ({} qd {}, the config's aio)",
                                          profile.nvme_read_gbps.source, backend, c.queue_depth);
      r.profile.nvme_read_gbps = {c.read_gbps, src};
      r.profile.nvme_write_gbps = {c.write_gbps, src};
    }
  }
  return r;
}

Result<CapacityResult> max_model(const PlanRequest& request) {
  // Grow the layer count at the request's width: fitting is monotone in layers (every tier's
  // need grows with it), so a doubling search then a bisection finds the boundary.
  auto fits = [&](int layers, PlanReport* out) -> Result<bool> {
    PlanRequest r = request;
    r.config.model.n_layer = layers;
    r.model_name = fmt::format("{}-{}L", request.model_name, layers);
    STRATA_ASSIGN_OR_RETURN(PlanReport rep, make_plan(r), fmt::format("{} layers", layers));
    const bool ok = rep.best >= 0;
    if (out) *out = std::move(rep);
    return ok;
  };
  STRATA_ASSIGN_OR_RETURN(bool one, fits(1, nullptr), "capacity search");
  if (!one) {
    return out_of_memory(
        fmt::format("capacity: even 1 layer of width {} does not fit at micro-batch {} x {} tokens",
                    request.config.model.n_embd, request.micro_batch(), request.seq()));
  }
  int lo = 1, hi = 2;
  while (hi < (1 << 20)) {
    STRATA_ASSIGN_OR_RETURN(bool f, fits(hi, nullptr), "capacity search");
    if (!f) break;
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    STRATA_ASSIGN_OR_RETURN(bool f, fits(mid, nullptr), "capacity search");
    (f ? lo : hi) = mid;
  }
  CapacityResult c;
  STRATA_ASSIGN_OR_RETURN(bool f, fits(lo, &c.report), "capacity search");
  (void)f;
  c.model = c.report.request.model();
  c.params = c.report.params;
  return c;
}

}  // namespace strata
