// `strata plan`: bytes per tier, fit, predicted step time and bottleneck for each placement of
// the training state; the fastest feasible one written as a config (src/plan/plan.h, docs/PLANNER.md).
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "src/plan/plan.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

constexpr const char* kUsage =
    "usage: strata plan (--model NAME | --layers L --width C --heads H [--vocab V] [--context T]\n"
    "                    | --config FILE) [options]\n\n"
    "For each placement of params / gradients / optimizer state over device, host and NVMe:\n"
    "the bytes each tier needs (state + buffers + activations), whether it fits, the predicted\n"
    "step time split by resource and the bottleneck. The fastest placement that fits is\n"
    "written as a config `strata train` runs as is. The model: docs/PLANNER.md.\n\n"
    "model:\n"
    "  --model NAME         gpt2-124m gpt2-350m gpt2-774m gpt2-1.5b gpt3-6.7b gpt3-13b gpt3-175b\n"
    "                       llama-7b llama-13b llama-70b (llama: its shape, GPT block arithmetic)\n"
    "  --layers/--width/--heads/--vocab/--context N   an explicit shape (vocab 50257, context\n"
    "                       1024 by default)\n"
    "  --config FILE        take model, batch and placement from a config and evaluate it too\n"
    "  --set KEY=VALUE      override a config key (with --config), repeatable\n"
    "batch:\n"
    "  --batch B            sequences per micro-batch per GPU (default 1)\n"
    "  --seq T              tokens per sequence (default: the model's context)\n"
    "  --accum A            micro-batches per step (default 1)\n"
    "  --dtype bf16|fp16|fp32   parameter/activation precision (default bf16)\n"
    "  --activations keep|recompute|offload\n"
    "                           strata.activations: keep every block's activations on the\n"
    "                           device, keep only block inputs and recompute the rest in\n"
    "                           backward, or also move the inputs to host memory (default\n"
    "                           keep, or the config's); the table lists all three\n"
    "hardware:\n"
    "  --backend cuda|cpu   what runs forward/backward (default: the profile's, else cuda)\n"
    "  --gpus N             ranks (default 1)\n"
    "  --gpu-mem SIZE       device memory per rank (default 80GiB for cuda, 1GiB for cpu)\n"
    "  --host-mem SIZE      host RAM for the host tier (default 90% of MemAvailable)\n"
    "  --nvme PATH[:GBps]   swap directory, optionally its read=write bandwidth; repeatable\n"
    "  --nvme-free SIZE     free bytes on the swap paths (default: statvfs of the paths)\n"
    "  --profile FILE       rates from `strata probe --json FILE`\n"
    "  --fastest            take each profile rate from its fastest pass, not the median\n"
    "                       (with --validate: compared with the fastest step)\n"
    "output:\n"
    "  --json FILE          the report as JSON\n"
    "  --svg FILE           stacked bars of each placement's time terms\n"
    "  --write-config FILE  the best placement as a config\n"
    "  --max-model          capacity mode: the most layers (at this width) that still fit\n"
    "  --validate           with --config: train it, print predicted vs measured step time and\n"
    "                       peak bytes per tier\n";

int fail(const Status& s) {
  std::fprintf(stderr, "strata plan: %s\n", s.message().c_str());
  return 1;
}

size_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string k;
  size_t v = 0;
  std::string unit;
  while (in >> k >> v >> unit) {
    if (k == "MemAvailable:") return v * 1024;
  }
  return 0;
}

bool write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  return bool(out);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int cmd_plan(int argc, char** argv) {
  std::string model_name, config_path, json_path, svg_path, cfg_out, profile_path, backend;
  std::vector<std::string> sets, nvme;
  int layers = 0, width = 0, heads = 0, vocab = 50257, context = 1024;
  int batch = 1, seq = 0, accum = 1, gpus = 1;
  uint64_t gpu_mem = 0, host_mem = 0, nvme_free = 0;
  bool max_mode = false, validate = false, fastest = false;
  DType dt = DType::kBF16;
  bool have_dtype = false, have_batch = false;
  std::string activations;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--max-model") {
      max_mode = true;
      continue;
    }
    if (a == "--validate") {
      validate = true;
      continue;
    }
    if (a == "--fastest") {
      fastest = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "strata plan: %s needs a value\n\n%s", a.c_str(), kUsage);
      return 2;
    }
    const std::string v = argv[++i];
    auto size = [&](uint64_t* out) -> bool {
      auto s = parse_size(v);
      if (!s.is_ok()) {
        std::fprintf(stderr, "strata plan: %s: %s\n", a.c_str(), s.status().message().c_str());
        return false;
      }
      *out = *s;
      return true;
    };
    auto num = [&](int* out) -> bool {
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != 0 || x < 1 || x > (1L << 30)) {
        std::fprintf(stderr, "strata plan: %s: '%s' is not a positive integer\n", a.c_str(),
                     v.c_str());
        return false;
      }
      *out = int(x);
      return true;
    };
    bool ok = true;
    if (a == "--model") {
      model_name = v;
    } else if (a == "--config") {
      config_path = v;
    } else if (a == "--set") {
      sets.push_back(v);
    } else if (a == "--layers") {
      ok = num(&layers);
    } else if (a == "--width") {
      ok = num(&width);
    } else if (a == "--heads") {
      ok = num(&heads);
    } else if (a == "--vocab") {
      ok = num(&vocab);
    } else if (a == "--context") {
      ok = num(&context);
    } else if (a == "--batch") {
      ok = num(&batch);
      have_batch = true;
    } else if (a == "--seq") {
      ok = num(&seq);
    } else if (a == "--accum") {
      ok = num(&accum);
    } else if (a == "--gpus") {
      ok = num(&gpus);
    } else if (a == "--gpu-mem") {
      ok = size(&gpu_mem);
    } else if (a == "--host-mem") {
      ok = size(&host_mem);
    } else if (a == "--nvme-free") {
      ok = size(&nvme_free);
    } else if (a == "--nvme") {
      nvme.push_back(v);
    } else if (a == "--profile") {
      profile_path = v;
    } else if (a == "--backend") {
      if (v != "cpu" && v != "cuda") {
        std::fprintf(stderr, "strata plan: --backend takes cpu or cuda, not '%s'\n", v.c_str());
        return 2;
      }
      backend = v;
    } else if (a == "--dtype") {
      if (!parse_dtype(v, &dt)) {
        std::fprintf(stderr, "strata plan: --dtype takes bf16, fp16 or fp32, not '%s'\n",
                     v.c_str());
        return 2;
      }
      have_dtype = true;
    } else if (a == "--activations") {
      if (!parse_activation_mode(v).is_ok()) {
        std::fprintf(stderr,
                     "strata plan: --activations takes keep, recompute or offload, not '%s'\n",
                     v.c_str());
        return 2;
      }
      activations = v;
    } else if (a == "--json") {
      json_path = v;
    } else if (a == "--svg") {
      svg_path = v;
    } else if (a == "--write-config") {
      cfg_out = v;
    } else {
      std::fprintf(stderr, "strata plan: unknown option '%s'\n\n%s", a.c_str(), kUsage);
      return 2;
    }
    if (!ok) return 2;
  }
  if (model_name.empty() && config_path.empty() && layers == 0) {
    std::fprintf(stderr, "strata plan: give --model, --layers/--width/--heads or --config\n\n%s",
                 kUsage);
    return 2;
  }
  if (validate && config_path.empty()) {
    std::fprintf(stderr, "strata plan: --validate needs --config\n");
    return 2;
  }

  // The machine: a profile, else defaults for the backend.
  MachineProfile prof;
  if (!profile_path.empty()) {
    auto p = load_machine_profile(profile_path, fastest);
    if (!p.is_ok()) return fail(p.status());
    prof = *p;
    if (!backend.empty() && (backend == "cpu") != prof.cpu_backend) {
      return fail(invalid_argument(
          fmt::format("--backend {} disagrees with the profile {} (measured on the {} backend)",
                      backend, profile_path, prof.cpu_backend ? "cpu" : "cuda")));
    }
  }
  Result<Config> cfg = Config{};
  if (!config_path.empty()) {
    cfg = load_config(config_path, sets, gpus);
    if (!cfg.is_ok()) return fail(cfg.status());
    if (backend.empty() && profile_path.empty()) {
      backend = cfg->device.backend == "cuda" ? "cuda" : "cpu";
    }
  }
  if (profile_path.empty()) prof = default_profile(backend == "cpu");

  Hardware hw;
  hw.gpus = gpus;
  hw.gpu_mem = gpu_mem;
  hw.host_mem = host_mem;
  for (const auto& n : nvme) {
    const size_t colon = n.rfind(':');
    std::string path = n;
    if (colon != std::string::npos && colon + 1 < n.size()) {
      char* end = nullptr;
      const double g = std::strtod(n.c_str() + colon + 1, &end);
      if (*end == 0 && g > 0) {
        path = n.substr(0, colon);
        // Paths are striped: bandwidths add up.
        const bool first = prof.nvme_read_gbps.source.rfind("--nvme", 0) != 0;
        prof.nvme_read_gbps = {(first ? 0 : prof.nvme_read_gbps.value) + g, "--nvme"};
        prof.nvme_write_gbps = {(first ? 0 : prof.nvme_write_gbps.value) + g, "--nvme"};
      }
    }
    hw.nvme_paths.push_back(path);
  }
  if (!config_path.empty() && hw.nvme_paths.empty()) {
    for (const auto& p : cfg->zero.offload_optimizer.nvme_path) hw.nvme_paths.push_back(p);
    if (hw.nvme_paths.empty()) hw.nvme_paths = cfg->zero.offload_param.nvme_path;
  }
  if (nvme_free == 0 && !hw.nvme_paths.empty()) {
    struct statvfs st;
    if (statvfs(hw.nvme_paths.front().c_str(), &st) == 0) {
      nvme_free = uint64_t(st.f_bavail) * st.f_frsize;
    }
  }
  hw.nvme_bytes = nvme_free;
  if (hw.gpu_mem == 0) {
    if (!config_path.empty() && prof.cpu_backend) {
      hw.gpu_mem = cfg->device.memory_limit > 0 ? cfg->device.memory_limit : size_t{1} << 30;
    } else {
      hw.gpu_mem = prof.cpu_backend ? uint64_t{1} << 30 : uint64_t{80} << 30;
    }
  }
  if (hw.host_mem == 0) {
    hw.host_mem = !config_path.empty() && cfg->strata.host_memory_limit > 0
                      ? cfg->strata.host_memory_limit
                      : uint64_t(double(mem_available()) * 0.9);
  }

  PlanRequest req;
  if (!config_path.empty() && model_name.empty() && layers == 0) {
    req = request_from_config(*cfg, hw, prof);
    req.model.name = config_path;
  } else {
    if (!model_name.empty()) {
      auto m = model_preset(model_name);
      if (!m.is_ok()) return fail(m.status());
      req.model = *m;
    } else {
      req.model = {"custom", layers, width, heads, vocab, context, ""};
    }
    if (!config_path.empty()) {
      PlanRequest c = request_from_config(*cfg, hw, prof);
      c.model = req.model;
      req = c;
    } else {
      req.hw = hw;
      req.profile = prof;
    }
  }
  if (model_name.empty() && layers > 0) {
    if (width == 0 || heads == 0) {
      std::fprintf(stderr, "strata plan: --layers needs --width and --heads\n");
      return 2;
    }
  }
  if (have_batch || config_path.empty()) req.micro_batch = batch;
  if (accum > 1 || config_path.empty()) req.accumulation = accum;
  if (seq > 0) {
    req.seq = seq;
  } else if (config_path.empty() || !model_name.empty()) {
    req.seq = req.model.context;
  }
  if (have_dtype) req.dtype = dt;
  if (!activations.empty()) req.activations = *parse_activation_mode(activations);

  if (max_mode) {
    auto c = max_model(req);
    if (!c.is_ok()) return fail(c.status());
    std::printf(
        "capacity: at width %d, %d heads, micro-batch %d x %d tokens, the largest model that "
        "fits has %d layers = %.4gB params (one more layer does not fit)\n\n",
        c->model.width, c->model.heads, req.micro_batch, req.seq, c->model.layers,
        double(c->params) / 1e9);
    std::fputs(plan_table(c->report).c_str(), stdout);
    return 0;
  }

  auto rep = make_plan(req);
  if (!rep.is_ok()) return fail(rep.status());
  std::fputs(plan_table(*rep).c_str(), stdout);
  int asked = -1;
  if (!config_path.empty()) {
    const PlacementOption p = placement_of_config(*cfg);
    for (size_t i = 0; i < rep->options.size(); ++i) {
      if (rep->options[i].placement.params == p.params &&
          rep->options[i].placement.optimizer == p.optimizer) {
        asked = int(i);
      }
    }
    if (asked >= 0) {
      const PlanOption& o = rep->options[size_t(asked)];
      std::printf("config %s asks for %s: %s, predicted %.0f ms/step (bound by %s)\n",
                  config_path.c_str(), o.placement.name.c_str(), o.fits ? "fits" : "does NOT fit",
                  o.time.step_s * 1e3, o.time.bottleneck.c_str());
    }
  }
  if (!json_path.empty() && !write_file(json_path, plan_json(*rep))) {
    return fail(io_error("writing " + json_path + ": " + std::strerror(errno)));
  }
  if (!svg_path.empty() && !write_file(svg_path, plan_svg(*rep))) {
    return fail(io_error("writing " + svg_path + ": " + std::strerror(errno)));
  }
  if (!cfg_out.empty()) {
    if (rep->best < 0) {
      std::fprintf(stderr, "strata plan: no placement fits, so no config written to %s\n",
                   cfg_out.c_str());
      return 1;
    }
    if (!write_file(cfg_out, plan_config_json(*rep, rep->options[size_t(rep->best)]))) {
      return fail(io_error("writing " + cfg_out + ": " + std::strerror(errno)));
    }
    std::printf("config for %s written to %s (run: strata train --config %s)\n",
                rep->options[size_t(rep->best)].placement.name.c_str(), cfg_out.c_str(),
                cfg_out.c_str());
  }

  if (validate) {
    if (asked < 0)
      return fail(
          invalid_argument("--validate: the config's placement is not one "
                           "the planner models"));
    const PlanOption& o = rep->options[size_t(asked)];
    std::vector<double> step_s;
    auto last = std::chrono::steady_clock::now();
    TrainOptions to;
    to.progress = false;
    to.on_step_end = [&](int64_t) {
      const auto now = std::chrono::steady_clock::now();
      step_s.push_back(std::chrono::duration<double>(now - last).count());
      last = now;
    };
    Config c = *cfg;
    c.train.eval_interval = 0;
    last = std::chrono::steady_clock::now();
    auto r = train(c, to);
    if (!r.is_ok()) return fail(r.status());
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
    auto predicted = [&](const TimeTerms& t, bool fastest_pass) {
      std::vector<double> p;
      for (uint8_t k : sched) p.push_back(k == 1 ? t.step_s : t.step_after_s);
      if (p.empty()) return t.step_s;
      return fastest_pass ? *std::min_element(p.begin(), p.end()) : median(p);
    };
    const double meas = median(step_s);
    const double fastest_step =
        step_s.empty() ? 0.0 : *std::min_element(step_s.begin(), step_s.end());
    std::printf(
        "\nvalidate %s (%s): measured median %.0f ms/step, fastest %.0f, slowest %.0f "
        "(%zu steps)\n",
        config_path.c_str(), o.placement.name.c_str(), meas * 1e3, fastest_step * 1e3,
        step_s.empty() ? 0.0 : *std::max_element(step_s.begin(), step_s.end()) * 1e3,
        step_s.size());
    // Median rates predict the median step; fastest-pass rates the fastest step (the machine
    // without the other work that shares it).
    if (o.time.step_after_s != o.time.step_s) {
      std::printf(
          "  schedule: %zu of %zu measured steps stepped the optimizer under backward (predicted "
          "%.0f ms), the rest after it because the step before clipped or overflowed (%.0f ms)\n",
          under, sched.size(), o.time.step_s * 1e3, o.time.step_after_s * 1e3);
    }
    for (const bool f : {false, true}) {
      double pred = predicted(o.time, f);
      if (f != fastest) {
        if (profile_path.empty()) continue;
        auto other = load_machine_profile(profile_path, f);
        if (!other.is_ok()) return fail(other.status());
        PlanRequest r2 = req;
        r2.profile = *other;
        auto o2 = evaluate_placement(r2, o.placement);
        if (!o2.is_ok()) return fail(o2.status());
        pred = predicted(o2->time, f);
      }
      const double ref = f ? fastest_step : meas;
      std::printf("  step time: predicted %.0f ms with %s rates vs measured %s %.0f ms: %+.1f%%\n",
                  pred * 1e3, f ? "fastest-pass" : "median", f ? "fastest step" : "median",
                  ref * 1e3, ref > 0 ? 100.0 * (pred - ref) / ref : 0.0);
    }
    const int64_t steps = std::max<int64_t>(1, r->end_step - r->start_step);
    std::printf(
        "  measured split per step: fwd/bwd %.0f ms (fetch wait %.0f), optimizer %.0f "
        "ms, io wait %.0f ms\n",
        1e3 * r->fwd_bwd_s / double(steps), 1e3 * r->compute_wait_s / double(steps),
        1e3 * r->optimizer_s / double(steps), 1e3 * r->io_wait_s / double(steps));
    for (const auto& t : r->tiers) {
      const TierBytes& b = t.name == "device" ? o.device : t.name == "host" ? o.host : o.nvme;
      const double pred = double(b.peak);
      std::printf("  %-6s peak: predicted %s (reserved %s), measured %s (%+.1f%%)\n",
                  t.name.c_str(), format_bytes(pred).c_str(),
                  format_bytes(double(b.total())).c_str(), format_bytes(double(t.peak)).c_str(),
                  t.peak ? 100.0 * (pred - double(t.peak)) / double(t.peak) : 0.0);
    }
  }
  return 0;
}

}  // namespace strata::tools
