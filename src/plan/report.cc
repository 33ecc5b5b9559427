// A plan's outputs: the config it writes, its JSON, the terminal table and the SVG chart.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/plan/plan.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;

std::string gb(double bytes) { return format_bytes(bytes); }

}  // namespace

// ---- outputs ----------------------------------------------------------------------------------

std::string plan_config_json(const PlanReport& rep, const PlanOption& o) {
  const PlanRequest& r = rep.request;
  const std::string nvme = r.hw.nvme_paths.empty() ? "runs/swap" : r.hw.nvme_paths.front();
  const Placement& w = o.placement.where;
  // Optimizer state or gradients on NVMe through strata.placement need a swap path even when
  // offload_optimizer.device does not say nvme.
  const bool opt_nvme =
      w.master == Tier::kNvme || w.moments == Tier::kNvme || w.grads == Tier::kNvme;
  auto offload = [&](Tier t, bool opt) {
    json j;
    j["device"] = t == Tier::kDevice ? "none" : t == Tier::kHost ? "cpu" : "nvme";
    if (t == Tier::kNvme || (opt && opt_nvme)) {
      j["nvme_path"] = r.hw.nvme_paths.empty() ? json(nvme) : json(r.hw.nvme_paths);
    }
    if (t != Tier::kDevice) j["pin_memory"] = true;
    if (opt && t == Tier::kNvme) j["buffer_count"] = r.config.zero.offload_optimizer.buffer_count;
    return j;
  };
  json c;
  const int64_t world = r.hw.gpus;
  c["train_micro_batch_size_per_gpu"] = r.micro_batch();
  c["gradient_accumulation_steps"] = r.accumulation();
  c["train_batch_size"] = int64_t(r.micro_batch()) * r.accumulation() * world;
  c["gradient_clipping"] = 1.0;
  if (r.dtype() == DType::kBF16) c["bf16"] = {{"enabled", true}};
  if (r.dtype() == DType::kF16) c["fp16"] = {{"enabled", true}};
  const ModelConfig& m = r.config.model;
  const bool finetune = !m.from_pretrained.empty();
  // Fine-tuning a checkpoint: a small learning rate and no weight decay (the usual starting
  // point, as the Hugging Face Trainer's defaults); pretraining: GPT-3's.
  c["optimizer"] = {{"type", "AdamW"},
                    {"params", finetune ? json{{"lr", 2e-5}, {"weight_decay", 0.0}}
                                        : json{{"lr", 3e-4}, {"weight_decay", 0.1}}}};
  json z;
  z["stage"] = 3;
  // offload_* say params and the optimizer's tier (master); strata.placement says what differs
  // from what they imply (parse_placement's rules), so the config asks for exactly this option.
  z["offload_param"] = offload(w.params, false);
  z["offload_optimizer"] = offload(w.master, true);
  double ratio = w.optimizer_ratio;
  if (!rep.options.empty() && &o >= &rep.options.front() && &o <= &rep.options.back()) {
    if (const RatioAdvice* a = rep.advice_for(int(&o - &rep.options.front()))) ratio = a->ratio;
  }
  if (ratio < 1.0) z["offload_optimizer"]["ratio"] = ratio;
  if (w.moments != w.master ||
      w.grads != (w.master == Tier::kDevice ? Tier::kDevice : Tier::kHost)) {
    c["strata"]["placement"] = {{"moments", tier_name(w.moments)}, {"grads", tier_name(w.grads)}};
  }
  z["stage3_prefetch_bucket_size"] = r.config.zero.stage3_prefetch_bucket_size;
  z["reduce_bucket_size"] = r.config.zero.reduce_bucket_size;
  c["zero_optimization"] = z;
  const MachineProfile& p = r.profile;
  c["aio"] = {{"block_size", p.aio_block_size}, {"queue_depth", p.aio_queue_depth}};
  if (p.aio_backend != "auto") c["aio"]["backend"] = p.aio_backend;
  // A fine-tune: the shape, norms' epsilon, rope and dtype all come from the checkpoint's
  // config.json; else the model section that builds this shape.
  c["model"] = finetune ? json{{"from_pretrained", m.from_pretrained}, {"context", r.seq()}}
                        : json::parse(model_section_json(m));
  if (m.lora.enabled) {
    c["lora"] = {{"r", m.lora.r}, {"lora_alpha", m.lora.alpha}};
    if (!m.lora.target_modules.empty()) c["lora"]["target_modules"] = m.lora.target_modules;
    if (!m.lora.target_pattern.empty()) c["lora"]["target_modules"] = m.lora.target_pattern;
    if (!m.lora.target_parameters.empty()) {
      c["lora"]["target_parameters"] = m.lora.target_parameters;
      if (m.lora.target_modules_none) c["lora"]["target_modules"] = json::array();
    }
    if (m.lora.use_rslora) c["lora"]["use_rslora"] = true;
    if (m.lora.dropout > 0) c["lora"]["lora_dropout"] = m.lora.dropout;
    if (m.lora.base_quantization != "none") {
      c["lora"]["base_quantization"] = m.lora.base_quantization;
    }
  }
  // A fine-tune's data: the token file tools/prepare_data.py writes with the checkpoint's
  // tokenizer (the `strata plan` message says how).
  c["data"] = {{"source", finetune ? "runs/train.bin" : "synthetic"}, {"seq_len", r.seq()}};
  json dev;
  dev["backend"] = p.cpu_backend ? "cpu" : "cuda";
  if (r.hw.gpu_mem > 0) dev["memory_limit"] = r.hw.gpu_mem;
  c["device"] = dev;
  if (r.hw.host_mem > 0) c["strata"]["host_memory_limit"] = r.hw.host_mem / uint64_t(world);
  if (r.config.strata.delayed_update) c["strata"]["optimizer"]["delayed_update"] = true;
  if (r.activations() != ActivationMode::kKeep) {
    c["strata"]["activations"] = activation_mode_name(r.activations());
  }
  c["train"] = {{"steps", 100}, {"checkpoint_dir", "runs/planned"}};
  if (finetune) c["train"]["export_dir"] = "runs/planned-hf";
  // The mark by which `strata plan --write-config` knows a file it may replace.
  c["strata"]["written_by"] = kPlanWrittenBy;
  return c.dump(2) + "\n";
}

std::string plan_json(const PlanReport& rep) {
  const PlanRequest& r = rep.request;
  json j;
  j["magic"] = "strata-plan";
  j["version"] = 1;
  const ModelConfig& m = r.config.model;
  j["model"] = {{"name", r.model_name},
                {"type", m.type},
                {"layers", m.n_layer},
                {"width", m.n_embd},
                {"heads", m.n_head},
                {"vocab", m.vocab_size},
                {"context", m.context},
                {"params", rep.params},
                {"note", r.model_note},
                {"description", rep.model},
                {"config", json::parse(model_section_json(m))}};
  j["batch"] = {
      {"micro_batch", r.micro_batch()}, {"seq", r.seq()}, {"accumulation", r.accumulation()}};
  {
    json a;
    a["mode"] = activation_mode_name(r.activations());
    for (auto mode :
         {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
      const ActivationSizes x =
          activations_of(r.config.model, r.micro_batch(), r.seq(), r.dtype(), mode);
      a[activation_mode_name(mode)] = {{"device", x.bytes}, {"host", x.host_bytes}};
    }
    j["activations"] = a;
  }
  j["hardware"] = {{"gpus", r.hw.gpus},
                   {"gpu_mem", r.hw.gpu_mem},
                   {"host_mem", r.hw.host_mem},
                   {"nvme_paths", r.hw.nvme_paths}};
  const MachineProfile& p = r.profile;
  auto rate = [](const Rate& x) { return json{{"value", x.value}, {"source", x.source}}; };
  j["rates"] = {{"backend", p.cpu_backend ? "cpu" : "cuda"},
                {"gemm_flops", rate(p.gemm_flops)},
                {"link_gbps", rate(p.link_gbps)},
                {"optimizer_params_per_s", rate(p.optimizer_pps)},
                {"nvme_read_gbps", rate(p.nvme_read_gbps)},
                {"nvme_write_gbps", rate(p.nvme_write_gbps)},
                {"collective_busbw_gbps", rate(p.collective_gbps)},
                {"device_mem_gbps", rate(p.device_mem_gbps)}};
  if (p.simulated) {
    j["rates"]["simulated"] = {{"preset", p.sim.preset},
                               {"gemm_tflops", p.sim.gemm_tflops},
                               {"attention_fwd_tflops", p.sim.attention_fwd_tflops},
                               {"attention_bwd_tflops", p.sim.attention_bwd_tflops},
                               {"hbm_gbps", p.sim.hbm_gbps},
                               {"link_gbps", p.sim.link_gbps}};
  }
  json opts = json::array();
  for (const auto& o : rep.options) {
    auto tb = [](const TierBytes& b) {
      return json{{"state", b.state},
                  {"buffers", b.buffers},
                  {"activations", b.activations},
                  {"total", b.total()},
                  {"peak", b.peak},
                  {"peak_deferred", b.peak_deferred},
                  {"undo", b.undo},
                  {"read_ahead", b.read_ahead},
                  {"capacity", b.capacity}};
    };
    opts.push_back(
        {{"name", o.placement.name},
         {"params", tier_name(o.placement.where.params)},
         {"optimizer", tier_name(o.placement.where.master)},
         {"master", tier_name(o.placement.where.master)},
         {"moments", tier_name(o.placement.where.moments)},
         {"grads", tier_name(o.placement.where.grads)},
         {"optimizer_ratio", o.placement.where.optimizer_ratio},
         {"device", tb(o.device)},
         {"host", tb(o.host)},
         {"nvme", tb(o.nvme)},
         {"fits", o.fits},
         {"runnable", o.runnable},
         {"why", o.why},
         {"flops", o.flops},
         {"link_bytes", o.link_bytes},
         {"nvme_read_bytes", o.nvme_read_bytes},
         {"nvme_write_bytes", o.nvme_write_bytes},
         {"time_s",
          {{"compute", o.time.compute_s},
           {"link", o.time.link_s},
           {"nvme", o.time.nvme_s},
           {"cpu_optimizer", o.time.cpu_optim_s},
           {"device_optimizer", o.time.device_optim_s},
           {"collectives", o.time.collectives_s},
           {"step", o.time.step_s},
           {"step_after_backward", o.time.step_after_s},
           {"step_clipped_deferred", o.time.step_deferred_s},
           {"step_clipped_plain", o.time.step_plain_s},
           {"optimizer_hidden_share", o.time.hidden_share},
           {"expected", o.time.expected_s}}},
         {"expected_schedule", o.time.schedule},
         {"clipped_schedule", o.time.clipped_deferred ? "deferred" : "after backward"},
         {"clipped_pass_bytes",
          {{"deferred", {{"read", o.deferred_pass.read}, {"write", o.deferred_pass.write}}},
           {"after_backward",
            {{"read", o.after_backward_pass.read}, {"write", o.after_backward_pass.write}}}}},
         {"first_forward_share", o.first_forward_share},
         {"forward_group", o.forward_group},
         {"backward_grouped", o.backward_grouped},
         {"bottleneck", o.time.bottleneck}});
  }
  j["options"] = opts;
  json advice = json::array();
  for (const RatioAdvice& a : rep.ratio_advice) {
    advice.push_back({{"option", rep.options[size_t(a.option)].placement.name},
                      {"ratio", a.ratio},
                      {"expected_s", a.time.expected_s},
                      {"schedule", a.time.schedule},
                      {"weighs", a.clipped ? "clipped step" : "expected step"},
                      {"step_s", a.step_s},
                      {"cpu_optimizer_s", a.time.cpu_optim_s},
                      {"compute_s", a.time.compute_s},
                      {"step_at_ratio_1_s", a.step_at_1_s},
                      {"fastest_s", a.fastest_s},
                      {"fastest_ratio", a.fastest_ratio},
                      {"candidates", a.candidates}});
  }
  j["optimizer_ratio_advice"] = advice;
  j["asked"] = rep.asked >= 0 ? json(rep.options[size_t(rep.asked)].placement.name) : json(nullptr);
  j["best"] = rep.best >= 0 ? json(rep.options[size_t(rep.best)].placement.name) : json(nullptr);
  return j.dump(2) + "\n";
}

namespace {

// The lines above the table: model, batch, rates, activations per mode.
std::string plan_head(const PlanReport& rep) {
  const PlanRequest& r = rep.request;
  std::string s = fmt::format("model {}: {}\n", r.model_name, rep.model);
  if (!r.model_note.empty()) s += "  note: " + r.model_note + "\n";
  s += fmt::format(
      "batch: {} x {} tokens per micro-batch, {} micro-batches per step, {} rank(s); {} backend\n",
      r.micro_batch(), r.seq(), r.accumulation(), r.hw.gpus,
      r.profile.simulated     ? "simulated " + r.profile.sim.preset + " (cpu)"
      : r.profile.cpu_backend ? std::string("cpu")
                              : std::string("cuda"));
  const MachineProfile& p = r.profile;
  s += fmt::format(
      "rates: GEMM {:.3g} TFLOP/s{} [{}], link {:.3g} GB/s [{}], CPU optimizer {:.3g} Mparam/s "
      "[{}], NVMe read {:.3g} / write {:.3g} GB/s [{}]{}\n",
      p.gemm_flops.value / 1e12,
      p.gemm_by_width.empty() || rep.options.empty()
          ? std::string()
          : fmt::format(" (model step at width {}, {} tokens per micro-batch: {:.3g})",
                        r.config.model.n_embd, r.micro_batch() * r.seq(),
                        rep.options[0].time.gemm_flops / 1e12),
      p.gemm_flops.source, p.link_gbps.value, p.link_gbps.source, p.optimizer_pps.value / 1e6,
      p.optimizer_pps.source, p.nvme_read_gbps.value, p.nvme_write_gbps.value,
      p.nvme_read_gbps.source,
      r.hw.gpus > 1 ? fmt::format(", collectives {:.3g} GB/s [{}]", p.collective_gbps.value,
                                  p.collective_gbps.source)
                    : "");
  if (!p.cpu_backend && !p.simulated && p.gemm_by_width.empty()) {
    s += "  note: the compute rate is one GEMM's (no device.gemm_by_width: the defaults, or a "
         "profile of an earlier strata probe); a GPU runs training's GEMMs well above it (an "
         "H200 400-730 TFLOP/s where one 1024-token GEMM ran at 283), so the compute term is too "
         "long: `strata probe --json FILE` times whole training micro-batches\n";
  }
  {
    // Activations per micro-batch under each strata.activations mode (rank 0's; every rank
    // holds the same).
    std::string line = "activations (strata.activations):";
    for (auto mode :
         {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
      const ActivationSizes x =
          activations_of(r.config.model, r.micro_batch(), r.seq(), r.dtype(), mode);
      line += fmt::format(" {}{} {} device{}{}", activation_mode_name(mode),
                          mode == r.activations() ? " [this plan]" : "", gb(double(x.bytes)),
                          x.host_bytes ? " + " + gb(double(x.host_bytes)) + " host" : "",
                          mode == ActivationMode::kOffload ? "" : ",");
    }
    s += line + "\n";
  }
  return s;
}

}  // namespace

// How option `b`'s step runs: the micro-batches grouped, a step after one that clipped, one after
// one that did not, and what the optimizer under backward holds.
std::string schedule_notes(const PlanReport& rep, const PlanOption& b) {
  const PlanRequest& r = rep.request;
  std::string s;
  if (b.forward_group > 1) {
    s += fmt::format(
        "  micro-batches: {} forwards run together (strata.grouped_forwards){}\n", b.forward_group,
        b.backward_grouped ? ", and their backwards: each module fetched and its gradients "
                             "drained once for them (strata.grouped_backwards)"
                           : "");
  }
  if (b.time.falls_back) {
    s += fmt::format(
        "  a step after one that clipped (or overflowed): {:.3g} s deferred into the next "
        "forward, {:.3g} s stepped after backward; strata.optimizer.defer {} runs it {}\n",
        b.time.step_deferred_s, b.time.step_plain_s, r.config.strata.optimizer_defer,
        b.time.clipped_deferred ? "deferred" : "after backward");
    const auto& pass = b.time.clipped_deferred ? b.deferred_pass : b.after_backward_pass;
    if (pass.read + pass.write > 0) {
      s += fmt::format(
          "    its optimizer pass moves {} of NVMe ({} read, {} written) that the step waits "
          "on{}\n",
          gb(double(pass.read + pass.write)), gb(double(pass.read)), gb(double(pass.write)),
          !b.time.clipped_deferred ? std::string()
          : b.forward_group > 1
              ? fmt::format(", beside the first {} micro-batches' forwards ({:.0f}% of compute, "
                            "strata.grouped_forwards)",
                            b.forward_group, 100 * b.first_forward_share)
              : fmt::format(", beside the first forward ({:.0f}% of compute)",
                            100 * b.first_forward_share));
    }
  }
  if (b.time.falls_back && !b.time.every_step_clips && b.time.cpu_optim_s > 0) {
    // Where a step that does not clip runs: under backward with undo state, or as one that
    // clipped (strata.optimizer.speculate).
    const std::string& spec = r.config.strata.optimizer_speculate;
    const std::string how =
        spec == "always"  ? "steps it under backward"
        : spec == "never" ? "runs it as one that clipped, without undo state"
        : r.profile.cpu_backend
            ? "steps it under backward (on the CPU backend the device's work shares the host's "
              "cores)"
            : fmt::format(
                  "times both on the run's first such steps and keeps the faster: "
                  "expected {}",
                  b.time.speculates ? "under backward"
                                    : "as one that clipped, the undo room its trial took "
                                      "given back");
    s += fmt::format(
        "  a step after one that did not clip: {:.3g} s with the optimizer under backward (undo "
        "state kept), {:.3g} s as one that clipped; strata.optimizer.speculate {} {}\n",
        b.time.step_s, b.time.step_after_s, spec, how);
  }
  if (b.nvme.undo > 0) {
    s += fmt::format(
        "  optimizer under backward: the pre-step master + moments stay on NVMe while the step "
        "goes to fresh extents: {} more NVMe at the peak\n",
        gb(double(b.nvme.undo)));
  }
  if (b.host.undo > 0 || b.time.hidden_share < 1.0) {
    s += fmt::format(
        "  optimizer under backward: undo state of master + moments takes up to {} of host "
        "memory beyond the reservation, as speculated steps use it (given back where "
        "strata.optimizer.speculate auto settles on not stepping under backward){}\n",
        gb(double(b.host.undo)),
        b.time.hidden_share < 1.0
            ? fmt::format(" — only {:.0f}% fit, the rest is stepped after backward",
                          100.0 * b.time.hidden_share)
            : std::string());
  }
  return s;
}

namespace {

// The notes on the best placement: its rate and how its step runs.
std::string best_notes(const PlanReport& rep) {
  const PlanRequest& r = rep.request;
  const auto& b = rep.options[size_t(rep.best)];
  const double tok = double(r.micro_batch()) * r.seq() * r.accumulation() * r.hw.gpus;
  return fmt::format("best: {} — {:.3g} s/step, {:.0f} tokens/s, bound by {}\n", b.placement.name,
                     b.time.step_s, tok / b.time.step_s, b.time.bottleneck) +
         schedule_notes(rep, b);
}

// Why no placement fits: what the activations take and what would take less.
std::string no_fit_note(const PlanReport& rep) {
  const PlanRequest& r = rep.request;
  std::string s;
  s += "no placement fits this machine at this batch";
  // Which activation mode would need less device memory (the table above has the numbers).
  const ActivationSizes now =
      activations_of(r.config.model, r.micro_batch(), r.seq(), r.dtype(), r.activations());
  const ActivationSizes rec = activations_of(r.config.model, r.micro_batch(), r.seq(), r.dtype(),
                                             ActivationMode::kRecompute);
  const ActivationSizes off =
      activations_of(r.config.model, r.micro_batch(), r.seq(), r.dtype(), ActivationMode::kOffload);
  bool device_short = false;  // some placement failed on the device (not only host/nvme)
  for (const auto& o : rep.options) {
    for (const auto& w : o.why) device_short |= w.rfind("device needs", 0) == 0;
  }
  s += fmt::format(": activations ({}) take {} of device memory at micro-batch {} x {} tokens",
                   activation_mode_name(r.activations()), gb(double(now.bytes)), r.micro_batch(),
                   r.seq());
  if (!device_short) {
    s += " and fit; host or nvme is short (above)";
  } else if (r.activations() == ActivationMode::kKeep) {
    s += fmt::format("; strata.activations = recompute needs {}, offload {} (+ {} host)",
                     gb(double(rec.bytes)), gb(double(off.bytes)), gb(double(off.host_bytes)));
  } else if (r.activations() == ActivationMode::kRecompute) {
    s += fmt::format("; strata.activations = offload needs {} (+ {} host)", gb(double(off.bytes)),
                     gb(double(off.host_bytes)));
  }
  s += device_short ? "; lower --batch or --seq, or add devices\n" : "\n";
  return s;
}

// One line per offload_optimizer.ratio advice.
std::string ratio_advice_lines(const PlanReport& rep) {
  std::string s;
  for (const RatioAdvice& a : rep.ratio_advice) {
    const PlanOption& o = rep.options[size_t(a.option)];
    if (a.ratio < 1.0) {
      s += fmt::format(
          "{}: zero_optimization.offload_optimizer.ratio {:g} (the first {:.0f}% of the "
          "optimizer state on the device): {} {:.3g} s/step {}, against {:.3g} at ratio 1 "
          "and {:.3g} the fastest (ratio {:g}); {} ratios evaluated\n",
          o.placement.name, a.ratio, 100.0 * (1.0 - a.ratio),
          a.clipped ? "a step that clips (the norm unknown: the ratio holds whatever the clipping)"
                    : "expected",
          a.step_s,
          a.clipped ? (a.time.clipped_deferred ? "next forward" : "after backward")
                    : a.time.schedule,
          a.step_at_1_s, a.fastest_s, a.fastest_ratio, a.candidates);
    } else {
      s += fmt::format(
          "{}: zero_optimization.offload_optimizer.ratio 1: optimizer state on the device gains "
          "under {:.0f}% (the fastest, ratio {:g}: {:.3g} s/step against {:.3g}); {} ratios "
          "evaluated\n",
          o.placement.name, (kRatioSlack - 1.0) * 100.0, a.fastest_ratio, a.fastest_s,
          a.step_at_1_s, a.candidates);
    }
  }
  return s;
}

}  // namespace

std::string plan_table(const PlanReport& rep) {
  std::string s = plan_head(rep);
  s += fmt::format(
      "{:<22} {:>10} {:>10} {:>10} {:>5} {:>9} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}  {}\n",
      "placement", "device", "host", "nvme", "fits", "step", "compute", "link", "nvme", "cpu-opt",
      "dev-opt", "coll", "bottleneck");
  auto ms = [](double x) { return fmt::format("{:.0f}ms", x * 1e3); };
  auto sec = [&](double x) { return x >= 10 ? fmt::format("{:.1f}s", x) : ms(x); };
  for (size_t i = 0; i < rep.options.size(); ++i) {
    const auto& o = rep.options[i];
    s += fmt::format(
        "{:<22} {:>10} {:>10} {:>10} {:>5} {:>9} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}  {}{}\n",
        o.placement.name + (int(i) == rep.best ? " *" : ""), gb(double(o.device.total())),
        gb(double(o.host.total())), gb(double(o.nvme.total())),
        !o.runnable ? "n/a"
        : o.fits    ? "yes"
                    : "no",
        sec(o.time.step_s), sec(o.time.compute_s), sec(o.time.link_s), sec(o.time.nvme_s),
        sec(o.time.cpu_optim_s), sec(o.time.device_optim_s), sec(o.time.collectives_s),
        o.time.bottleneck, !o.runnable ? " (the backend cannot run this placement)" : "");
  }
  for (const auto& o : rep.options) {
    for (const auto& w : o.why) s += fmt::format("  {} does not fit: {}\n", o.placement.name, w);
  }
  s += rep.best >= 0 ? best_notes(rep) : no_fit_note(rep);
  s += ratio_advice_lines(rep);
  return s;
}

std::string plan_svg(const PlanReport& rep) {
  const int W = 900, row = 34, top = 70, left = 190, barw = 560;
  const int H = top + row * int(rep.options.size()) + 60;
  double maxt = 1e-9;
  for (const auto& o : rep.options) {
    const auto& t = o.time;
    maxt = std::max(
        {maxt, t.step_s, t.compute_s + t.link_s + t.nvme_s + t.cpu_optim_s + t.collectives_s});
  }
  const char* colors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f"};
  // XML text: "<" and ">" escaped.
  const char* names[] = {"compute", "host&lt;-&gt;device link", "nvme", "cpu optimizer",
                         "collectives"};
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n{}\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n<text x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"bold\">strata "
      "plan: {} ({:.3g}B params), {} x {} tokens x {} micro-batches, {} rank(s)</text>\n",
      W, H, kPlanSvgMark, rep.request.model_name, double(rep.params) / 1e9,
      rep.request.micro_batch(), rep.request.seq(), rep.request.accumulation(),
      rep.request.hw.gpus);
  for (int k = 0; k < 5; ++k) {
    s += fmt::format(
        "<rect x=\"{}\" y=\"36\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" "
        "y=\"46\">{}</text>\n",
        10 + k * 150, colors[k], 26 + k * 150, names[k]);
  }
  for (size_t i = 0; i < rep.options.size(); ++i) {
    const auto& o = rep.options[i];
    const int y = top + row * int(i);
    const double v[] = {o.time.compute_s, o.time.link_s, o.time.nvme_s, o.time.cpu_optim_s,
                        o.time.collectives_s};
    s += fmt::format("<text x=\"10\" y=\"{}\"{}>{}{}</text>\n", y + 16,
                     o.fits && o.runnable ? "" : " fill=\"#999\"", o.placement.name,
                     int(i) == rep.best ? " (best)"
                     : !o.fits          ? " (does not fit)"
                                        : "");
    double x = left;
    for (int k = 0; k < 5; ++k) {
      const double w = v[k] / maxt * barw;
      if (w <= 0) continue;
      s += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"20\" fill=\"{}\" "
          "opacity=\"{}\"><title>{}: {:.1f} ms</title></rect>\n",
          x, y + 2, w, colors[k], o.fits && o.runnable ? "1" : "0.35", names[k], v[k] * 1e3);
      x += w;
    }
    const double sx = left + o.time.step_s / maxt * barw;
    s += fmt::format(
        "<line x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"{}\" y2=\"{}\" stroke=\"black\" "
        "stroke-width=\"2\"/><text x=\"{:.1f}\" y=\"{}\">step {:.3g} s</text>\n",
        sx, sx, y, y + 24, std::max(x, sx) + 6, y + 16, o.time.step_s);
  }
  s += fmt::format(
      "<text x=\"10\" y=\"{}\" fill=\"#555\">bars: each resource's busy time per step (stacked); "
      "black line: predicted step time (overlapping terms counted once)</text>\n</svg>\n",
      H - 20);
  return s;
}

}  // namespace strata
