// `strata plan`: bytes per tier, fit, predicted step time and bottleneck for each placement of
// the training state; the fastest feasible one written as a config (src/plan/plan.h,
// docs/PLANNER.md). Arguments: plan_args.cc; --validate: plan_validate.cc.
#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "src/base/safe_file.h"
#include "src/hf/hf_config.h"
#include "src/model/architecture.h"
#include "src/model/base_quant.h"
#include "src/plan/plan.h"
#include "strata/log.h"
#include "strata/simulated_device.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/plan_cli.h"
#include "tools/plan_mark.h"

namespace strata::tools {
namespace {

bool write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  return bool(out);
}

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  return !a.empty() && !b.empty() && std::filesystem::equivalent(a, b, ec);
}

// The text of `path` ("" when it cannot be read, or is not a regular file: a device such as
// /dev/zero never ends).
std::string read_text(const std::string& path) {
  if (!expect_regular_file(path, "").is_ok()) return "";
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// May `flag` (--write-config, --json, --svg) write `out`? Never into --hf's model directory,
// nor over an input (--config, --profile; --write-config over its --config with --force), nor
// over a file strata plan did not write unless --force.
Status check_plan_output(const PlanArgs& a, const std::string& out, const std::string& flag) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!a.hf_dir.empty()) {
    const fs::path dir = fs::weakly_canonical(a.hf_dir, ec);
    const fs::path parent = fs::weakly_canonical(fs::absolute(out, ec).parent_path(), ec);
    if (!dir.empty() && parent == dir) {
      return invalid_argument(fmt::format(
          "{} {} is in --hf's model directory {} (its config.json is the model's): write it "
          "elsewhere",
          flag, out, a.hf_dir));
    }
  }
  if (!fs::exists(out, ec)) return Status::ok();
  for (const auto& [input, in_flag] :
       {std::pair{a.config_path, "--config"}, std::pair{a.profile_path, "--profile"}}) {
    if (!same_file(out, input)) continue;
    const bool may = flag == "--write-config" && std::string(in_flag) == "--config";
    if (a.force && may) return Status::ok();
    return invalid_argument(fmt::format("{} {} is the {} input; write it elsewhere{}", flag, out,
                                        in_flag, may ? " (or add --force to replace it)" : ""));
  }
  if (a.force || written_by_plan(flag, read_text(out))) return Status::ok();
  return invalid_argument(fmt::format(
      "{} {} exists and was not written by strata plan{}; give another path, or add --force to "
      "replace it",
      flag, out,
      flag == "--write-config" ? fmt::format(" (no strata.written_by \"{}\")", kPlanWrittenBy)
                               : ""));
}

// The hardware of the flags, else of the config (--config): its swap paths, simulated device,
// device memory limit and host memory limit, else the defaults (statvfs of the first swap path,
// 1 GiB on the CPU backend, 80 GiB on CUDA, 90% of MemAvailable). --nvme PATH:GBps rates
// replace the profile's NVMe rates (striped paths: they add up), --cpu-optimizer-rate its CPU
// optimizer's (set_cpu_optimizer_rate); a.nvme_free gets the free bytes found.
Result<Hardware> plan_hardware(PlanArgs& a, const Config& cfg, MachineProfile* profile) {
  MachineProfile& prof = *profile;
  Hardware hw;
  hw.gpus = a.gpus;
  hw.gpu_mem = a.gpu_mem;
  hw.host_mem = a.host_mem;
  for (const auto& n : a.nvme) {
    const size_t colon = n.rfind(':');
    std::string path = n;
    if (colon != std::string::npos && colon + 1 < n.size()) {
      const std::string rate = n.substr(colon + 1);
      char* end = nullptr;
      std::strtod(rate.c_str(), &end);
      double g = 0;
      // A suffix that reads as a number is the path's rate (else the colon is the path's own).
      if (*end == 0 && !parse_number_in(rate, 1e-6, 1e6, &g)) {
        return invalid_argument(fmt::format(
            "--nvme {}: the rate after the colon must be GB/s in [1e-6, 1e6] (e.g. {}:3.5)", n,
            n.substr(0, colon)));
      }
      if (g > 0) {
        path = n.substr(0, colon);
        // Paths are striped: bandwidths add up.
        const bool first = prof.nvme_read_gbps.source.rfind("--nvme", 0) != 0;
        prof.nvme_read_gbps = {(first ? 0 : prof.nvme_read_gbps.value) + g, "--nvme"};
        prof.nvme_write_gbps = {(first ? 0 : prof.nvme_write_gbps.value) + g, "--nvme"};
      }
    }
    hw.nvme_paths.push_back(path);
  }
  if (!a.config_path.empty() && hw.nvme_paths.empty()) {
    for (const auto& p : cfg.zero.offload_optimizer.nvme_path) hw.nvme_paths.push_back(p);
    if (hw.nvme_paths.empty()) hw.nvme_paths = cfg.zero.offload_param.nvme_path;
  }
  if (a.nvme_free == 0 && !hw.nvme_paths.empty()) {
    struct statvfs st;
    if (statvfs(hw.nvme_paths.front().c_str(), &st) == 0) {
      a.nvme_free = uint64_t(st.f_bavail) * st.f_frsize;
    }
  }
  hw.nvme_bytes = a.nvme_free;
  if (a.cpu_optimizer_rate > 0) {
    set_cpu_optimizer_rate(&prof, a.cpu_optimizer_rate, "--cpu-optimizer-rate");
  }
  if (!a.config_path.empty() && !cfg.device.simulate.empty()) {
    // The simulated device's rates over the host's profile (request_from_config), its memory.
    auto sim = simulated_device_options(cfg.device);
    if (!sim.is_ok()) return sim.status();
    if (hw.gpu_mem == 0) hw.gpu_mem = sim->memory;
  }
  if (hw.gpu_mem == 0) {
    if (!a.config_path.empty() && prof.cpu_backend) {
      hw.gpu_mem = cfg.device.memory_limit > 0 ? cfg.device.memory_limit : size_t{1} << 30;
    } else {
      hw.gpu_mem = prof.cpu_backend ? uint64_t{1} << 30 : uint64_t{80} << 30;
    }
  }
  if (hw.host_mem == 0) {
    hw.host_mem = !a.config_path.empty() && cfg.strata.host_memory_limit > 0
                      ? cfg.strata.host_memory_limit
                      : default_host_budget();
  }
  return hw;
}

// What the planner is asked: the model (--model, --hf, an explicit shape, else the config's),
// the config's engine options (--config) or the defaults on `hw` and `prof`, then the flags
// over them as --set would set the run's config (--lora, --base-quantization, --batch, --seq,
// --accum, --dtype, --activations). Fails on a model or flag value strata train refuses.
Result<PlanRequest> plan_request(const PlanArgs& a, const Config& cfg, const Hardware& hw,
                                 const MachineProfile& prof) {
  PlanRequest req;
  std::optional<DType> hf_dtype;
  if (!a.config_path.empty() && a.model_name.empty() && a.hf_dir.empty() && a.layers == 0) {
    req = request_from_config(cfg, hw, prof);
    req.model_name = a.config_path;
  } else {
    PlanModel model;
    if (!a.model_name.empty()) {
      auto m = model_preset(a.model_name);
      if (!m.is_ok()) return m.status();
      model = *m;
    } else if (!a.hf_dir.empty()) {
      auto mc = model_config_from_hf(a.hf_dir, a.seq);
      if (!mc.is_ok()) {
        return mc.status().with_context("--hf (--seq sets its model.context)");
      }
      mc->from_pretrained = a.hf_dir;  // a written config fine-tunes this checkpoint
      model = {a.hf_dir, *mc, ""};
      hf_dtype = mc->dtype;
    } else {
      model = gpt_model("custom", a.layers, a.width, a.heads, a.vocab, a.context);
    }
    // The ranges a config's model section has (a billion layers is an error, not hours of
    // planning and gigabytes of layout).
    STRATA_RETURN_IF_ERROR(
        check_model_ranges(model.shape, !a.hf_dir.empty() ? a.hf_dir + "/config.json"
                                                          : std::string("the model shape")),
        "");
    if (!a.config_path.empty()) {
      req = request_from_config(cfg, hw, prof);  // the config's engine options, a new model
    } else {
      req.hw = hw;
      req.profile = prof;
    }
    req.set_model(model);
  }
  if (!a.base_quant.empty() && a.base_quant != "none" && a.lora_r <= 0 &&
      !req.config.model.lora.enabled) {
    return invalid_argument(
        "--base-quantization quantizes a frozen LoRA base: give --lora R as well");
  }
  if (!a.base_quant.empty()) {
    req.config.model.lora.base_quantization = a.base_quant;
    if (auto k = parse_base_quantization(a.base_quant); !k.is_ok()) {
      return invalid_argument(fmt::format(
          "--base-quantization: unknown value \"{}\"; use none, int8 or nf4", a.base_quant));
    }
  }
  if (a.lora_r > 0) {
    // The key table's ranges (lora.r at most 65536): the config written must be one strata
    // train takes. (A batch of its own: a config without one is refused before its ranges.)
    if (auto c = parse_config(fmt::format(R"({{"train_micro_batch_size_per_gpu": 1, "lora": )"
                                          R"({{"r": {}, "lora_alpha": {}}}}})",
                                          a.lora_r, 2.0 * a.lora_r),
                              "--lora");
        !c.is_ok()) {
      return c.status();
    }
    LoraConfig& l = req.config.model.lora;
    l.enabled = true;
    l.r = a.lora_r;
    l.alpha = 2.0 * a.lora_r;
    for (size_t b = 0; b < a.lora_targets.size();) {
      const size_t e = std::min(a.lora_targets.find(',', b), a.lora_targets.size());
      if (e > b) l.target_modules.push_back(a.lora_targets.substr(b, e - b));
      b = e + 1;
    }
    if (auto arch = create_architecture(req.config.model); !arch.is_ok()) {
      return arch.status().with_context("--lora");
    }
  }
  // The flags set the request's config, as --set would the run's.
  if (a.have_batch || a.config_path.empty()) req.config.train_micro_batch_size_per_gpu = a.batch;
  if (a.accum > 1 || a.config_path.empty()) req.config.gradient_accumulation_steps = a.accum;
  if (a.seq > 0) {
    req.config.data.seq_len = a.seq;
  } else if (a.config_path.empty() || !a.model_name.empty() || !a.hf_dir.empty()) {
    req.config.data.seq_len = std::min(req.config.model.context, 8192);
  }
  if (a.have_dtype) {
    req.config.model.dtype = a.dt;
  } else if (hf_dtype) {
    req.config.model.dtype = *hf_dtype;  // the checkpoint's own precision
  }
  if (!a.activations.empty()) req.config.strata.activations = a.activations;
  return req;
}

// --json, --svg and --write-config (the best placement, checked to be a config strata train
// takes; with --hf, how to make its data). Returns 0, else the exit code after the message.
int write_plan_files(const PlanArgs& a, const PlanReport& rep) {
  if (!a.json_path.empty() && !write_file(a.json_path, plan_json(rep))) {
    return plan_fail(io_error("writing " + a.json_path + ": " + std::strerror(errno)));
  }
  if (!a.svg_path.empty() && !write_file(a.svg_path, plan_svg(rep))) {
    return plan_fail(io_error("writing " + a.svg_path + ": " + std::strerror(errno)));
  }
  if (!a.cfg_out.empty()) {
    if (rep.best < 0) {
      std::fprintf(stderr, "strata plan: no placement fits, so no config written to %s\n",
                   a.cfg_out.c_str());
      return 1;
    }
    const std::string text = plan_config_json(rep, rep.options[size_t(rep.best)]);
    if (auto c = parse_config(text, a.cfg_out, {}, a.gpus); !c.is_ok()) {
      return plan_fail(c.status().with_context(
          "the config strata plan would write is one strata train refuses; change the flags"));
    }
    if (Status st = write_file_atomically(a.cfg_out, text, 0644); !st.is_ok()) {
      return plan_fail(st);
    }
    std::printf("config for %s written to %s (run: strata train --config %s)\n",
                rep.options[size_t(rep.best)].placement.name.c_str(), a.cfg_out.c_str(),
                a.cfg_out.c_str());
    if (!a.hf_dir.empty()) {
      std::printf(
          "it fine-tunes %s (model.from_pretrained) on runs/train.bin (data.source); make that "
          "with its tokenizer: python3 tools/prepare_data.py --model %s --input corpus.jsonl "
          "--out runs/train.bin\n",
          a.hf_dir.c_str(), a.hf_dir.c_str());
    }
  }
  return 0;
}

}  // namespace

int cmd_plan(int argc, char** argv) {
  PlanArgs a;
  if (const int rc = parse_plan_args(argc, argv, &a); rc >= 0) return rc;
  for (const auto& [out, flag] :
       {std::pair{a.cfg_out, "--write-config"}, std::pair{a.json_path, "--json"},
        std::pair{a.svg_path, "--svg"}}) {
    if (out.empty()) continue;
    if (Status st = check_plan_output(a, out, flag); !st.is_ok()) return plan_fail(st);
  }

  // The machine: a profile, else defaults for the backend.
  MachineProfile prof;
  if (!a.profile_path.empty()) {
    auto p = load_machine_profile(a.profile_path, a.fastest);
    if (!p.is_ok()) return plan_fail(p.status());
    prof = *p;
    if (!a.backend.empty() && (a.backend == "cpu") != prof.cpu_backend) {
      return plan_fail(invalid_argument(
          fmt::format("--backend {} disagrees with the profile {} (measured on the {} backend)",
                      a.backend, a.profile_path, prof.cpu_backend ? "cpu" : "cuda")));
    }
  }
  Result<Config> cfg = Config{};
  if (!a.config_path.empty()) {
    cfg = load_config(a.config_path, a.sets, a.gpus);
    if (!cfg.is_ok()) return plan_fail(cfg.status());
    if (a.backend.empty() && a.profile_path.empty()) {
      a.backend = cfg->device.backend == "cuda" ? "cuda" : "cpu";
    }
  }
  if (a.profile_path.empty()) prof = default_profile(a.backend == "cpu");

  auto hw = plan_hardware(a, *cfg, &prof);
  if (!hw.is_ok()) return plan_fail(hw.status());

  auto request = plan_request(a, *cfg, *hw, prof);
  if (!request.is_ok()) return plan_fail(request.status());
  const PlanRequest& req = *request;

  if (a.max_mode) {
    auto c = max_model(req);
    if (!c.is_ok()) return plan_fail(c.status());
    std::printf(
        "capacity: at width %d, %d heads, micro-batch %d x %d tokens, the largest model that "
        "fits has %d layers = %.4gB params (one more layer does not fit)\n\n",
        c->model.shape.n_embd, c->model.shape.n_head, req.micro_batch(), req.seq(),
        c->model.shape.n_layer, double(c->params) / 1e9);
    std::fputs(plan_table(c->report).c_str(), stdout);
    return 0;
  }

  auto rep = make_plan(req);
  if (!rep.is_ok()) return plan_fail(rep.status());
  int asked = -1;
  if (!a.config_path.empty()) {
    // The config's placement: one of the named options, else evaluated as an extra row.
    auto p = placement_of_config(*cfg);
    if (!p.is_ok()) return plan_fail(p.status());
    auto i = add_placement(*rep, *p);
    if (!i.is_ok()) return plan_fail(i.status());
    asked = *i;
    rep->asked = asked;
  }
  // The optimizer ratio for the config's placement and the best (the one --write-config writes).
  for (int k : {asked, rep->best}) {
    if (k < 0 || rep->advice_for(k)) continue;
    if (Status st = advise_optimizer_ratio(*rep, k); !st.is_ok()) return plan_fail(st);
  }
  std::fputs(plan_table(*rep).c_str(), stdout);
  if (asked >= 0) {
    const PlanOption& o = rep->options[size_t(asked)];
    std::printf(
        "config %s asks for %s: %s, predicted %.0f ms/step (bound by %s); the schedule it runs: "
        "%s, %.0f ms/step\n",
        a.config_path.c_str(), o.placement.name.c_str(), o.fits ? "fits" : "does NOT fit",
        o.time.step_s * 1e3, o.time.bottleneck.c_str(), o.time.schedule.c_str(),
        o.time.expected_s * 1e3);
    if (asked != rep->best) std::fputs(schedule_notes(*rep, o).c_str(), stdout);
  }
  if (const int rc = write_plan_files(a, *rep); rc != 0) return rc;

  if (a.validate) {
    if (asked < 0) {
      return plan_fail(
          invalid_argument("--validate: the config's placement is not one the planner models"));
    }
    return validate_plan(a, *cfg, req, rep->options[size_t(asked)]);
  }
  return 0;
}

}  // namespace strata::tools
