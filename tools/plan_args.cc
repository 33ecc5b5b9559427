// `strata plan`'s command line.
#include <cstdio>
#include <string>

#include "src/model/architecture.h"
#include "tools/plan_cli.h"

namespace strata::tools {
namespace {

constexpr const char* kUsage =
    "usage: strata plan (--model NAME | --hf DIR | --layers L --width C --heads H [--vocab V]\n"
    "                    [--context T] | --config FILE) [options]\n\n"
    "For each placement of params / gradients / optimizer state over device, host and NVMe:\n"
    "the bytes each tier needs (state + buffers + activations), whether it fits, the predicted\n"
    "step time split by resource and the bottleneck. The fastest placement that fits is\n"
    "written as a config `strata train` runs as is. The model: docs/PLANNER.md.\n\n"
    "model:\n"
    "  --model NAME         gpt2-124m gpt2-350m gpt2-774m gpt2-1.5b gpt3-6.7b gpt3-13b gpt3-175b\n"
    "                       llama2-7b llama2-13b llama2-70b llama3-8b llama3-70b llama3.1-405b\n"
    "                       qwen2.5-7b qwen2.5-72b qwen3-0.6b qwen3-8b qwen3-32b phi4-14b\n"
    "                       mistral-7b (llama, phi3: grouped-query attention, SwiGLU, as their\n"
    "                       config.json)\n"
    "                       mixtral-8x7b mixtral-8x22b qwen3-30b-a3b (mixtures of experts;\n"
    "                       FLOPs from the active experts)\n"
    "  --hf DIR             the shape of a Hugging Face model directory's config.json (--seq\n"
    "                       sets its context); a written config names DIR as from_pretrained\n"
    "  --layers/--width/--heads/--vocab/--context N   an explicit shape (vocab 50257, context\n"
    "                       1024 by default)\n"
    "  --config FILE        take model, batch and placement from a config and evaluate it too\n"
    "  --set KEY=VALUE      override a config key (with --config), repeatable\n"
    "  --lora R             LoRA adapters of rank R over a frozen base (the base has\n"
    "                       parameters only: no master weights, moments or gradients)\n"
    "  --lora-targets LIST  comma-separated PEFT layer names (default q_proj,v_proj; GPT:\n"
    "                       c_attn); lora_alpha is 2R\n"
    "  --base-quantization none|int8|nf4   with --lora: the frozen base's linear-layer\n"
    "                       weights stored quantized (lora.base_quantization: int8 1 B +\n"
    "                       a scale per row, nf4 0.5 B + a scale per 64) in every tier\n"
    "batch:\n"
    "  --batch B            sequences per micro-batch per GPU (default 1)\n"
    "  --seq T              tokens per sequence (default: the model's context, at most 8192)\n"
    "  --accum A            micro-batches per step (default 1)\n"
    "  --dtype bf16|fp16|fp32   parameter/activation precision (default bf16)\n"
    "  --activations keep|recompute|offload\n"
    "                           strata.activations: keep every block's activations on the\n"
    "                           device, keep only block inputs and recompute the rest in\n"
    "                           backward, or also move the inputs to host memory (default\n"
    "                           keep, or the config's); the table lists all three\n"
    "hardware:\n"
    "  --backend cuda|cpu   what runs forward/backward (default: the profile's, else the\n"
    "                       config's device.backend (cuda, else cpu), else cuda)\n"
    "  --gpus N             ranks (default 1)\n"
    "  --gpu-mem SIZE       device memory per rank (default: the config's simulated device's;\n"
    "                       on cpu the config's device.memory_limit; else 80GiB for cuda,\n"
    "                       1GiB for cpu)\n"
    "  --host-mem SIZE      host RAM for the host tier (default: the config's\n"
    "                       strata.host_memory_limit, else 90% of MemAvailable)\n"
    "  --nvme PATH[:GBps]   swap directory, optionally its read=write bandwidth; repeatable\n"
    "  --nvme-free SIZE     free bytes on the swap paths (default: statvfs of the paths)\n"
    "  --profile FILE       rates from `strata probe --json FILE`\n"
    "  --cpu-optimizer-rate R   the CPU optimizer's parameters/s beside the device's step,\n"
    "                       as `strata train` prints it for its kernel (the summary's\n"
    "                       optimizer line, metrics' cpu_optimizer_params_per_s): replaces\n"
    "                       the profile's rate, which a probe measures on the CPU alone\n"
    "  --fastest            take each profile rate from its fastest pass, not the median\n"
    "                       (with --validate: compared with the fastest step)\n"
    "output:\n"
    "  --json FILE          the report as JSON\n"
    "  --svg FILE           stacked bars of each placement's time terms\n"
    "  --write-config FILE  the best placement as a config (with strata.written_by \"strata\n"
    "                       plan\"); an existing FILE is replaced only when it holds that\n"
    "                       mark and is not an input (--config, --profile); never a file\n"
    "                       in --hf's directory\n"
    "  --force              --write-config, --json and --svg may replace a file strata\n"
    "                       plan did not write (--write-config also its --config input);\n"
    "                       without it an existing FILE is replaced only when plan wrote it\n"
    "  --max-model          capacity mode: the most layers (at this width) that still fit\n"
    "                       (its table only: not with --json, --svg, --write-config,\n"
    "                       --validate)\n"
    "  --validate           with --config: train it, print predicted vs measured step time and\n"
    "                       peak bytes per tier\n";

}  // namespace

int plan_fail(const Status& s) {
  std::fprintf(stderr, "strata plan: %s\n", s.message().c_str());
  return 1;
}

int parse_plan_args(int argc, char** argv, PlanArgs* out) {
  PlanArgs& p = *out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--max-model") {
      p.max_mode = true;
      continue;
    }
    if (a == "--validate") {
      p.validate = true;
      continue;
    }
    if (a == "--fastest") {
      p.fastest = true;
      continue;
    }
    if (a == "--force") {
      p.force = true;
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
      long long x = 0;
      if (!parse_int_in(v, 1, 1LL << 30, &x)) {
        std::fprintf(stderr, "strata plan: %s: '%s' is not a positive integer\n", a.c_str(),
                     v.c_str());
        return false;
      }
      *out = int(x);
      return true;
    };
    bool ok = true;
    if (a == "--model") {
      p.model_name = v;
    } else if (a == "--hf") {
      p.hf_dir = v;
    } else if (a == "--config") {
      p.config_path = v;
    } else if (a == "--set") {
      p.sets.push_back(v);
    } else if (a == "--lora") {
      ok = num(&p.lora_r);
    } else if (a == "--lora-targets") {
      p.lora_targets = v;
    } else if (a == "--base-quantization") {
      p.base_quant = v;
    } else if (a == "--layers") {
      ok = num(&p.layers);
    } else if (a == "--width") {
      ok = num(&p.width);
    } else if (a == "--heads") {
      ok = num(&p.heads);
    } else if (a == "--vocab") {
      ok = num(&p.vocab);
    } else if (a == "--context") {
      ok = num(&p.context);
    } else if (a == "--batch") {
      ok = num(&p.batch);
      p.have_batch = true;
    } else if (a == "--seq") {
      ok = num(&p.seq);
    } else if (a == "--accum") {
      ok = num(&p.accum);
    } else if (a == "--gpus") {
      ok = num(&p.gpus);
    } else if (a == "--gpu-mem") {
      ok = size(&p.gpu_mem);
    } else if (a == "--host-mem") {
      ok = size(&p.host_mem);
    } else if (a == "--nvme-free") {
      ok = size(&p.nvme_free);
    } else if (a == "--nvme") {
      p.nvme.push_back(v);
    } else if (a == "--profile") {
      p.profile_path = v;
    } else if (a == "--cpu-optimizer-rate") {
      if (!parse_number_in(v, 1e3, 1e15, &p.cpu_optimizer_rate)) {
        std::fprintf(stderr,
                     "strata plan: --cpu-optimizer-rate: '%s' is not parameters per second "
                     "between 1e3 and 1e15 (e.g. 3.6e9)\n",
                     v.c_str());
        return 2;
      }
    } else if (a == "--backend") {
      if (v != "cpu" && v != "cuda") {
        std::fprintf(stderr, "strata plan: --backend takes cpu or cuda, not '%s'\n", v.c_str());
        return 2;
      }
      p.backend = v;
    } else if (a == "--dtype") {
      if (!parse_dtype(v, &p.dt)) {
        std::fprintf(stderr, "strata plan: --dtype takes bf16, fp16 or fp32, not '%s'\n",
                     v.c_str());
        return 2;
      }
      p.have_dtype = true;
    } else if (a == "--activations") {
      if (!parse_activation_mode(v).is_ok()) {
        std::fprintf(stderr,
                     "strata plan: --activations takes keep, recompute or offload, not '%s'\n",
                     v.c_str());
        return 2;
      }
      p.activations = v;
    } else if (a == "--json") {
      p.json_path = v;
    } else if (a == "--svg") {
      p.svg_path = v;
    } else if (a == "--write-config") {
      p.cfg_out = v;
    } else {
      std::fprintf(stderr, "strata plan: unknown option '%s'\n\n%s", a.c_str(), kUsage);
      return 2;
    }
    if (!ok) return 2;
  }
  if (p.model_name.empty() && p.hf_dir.empty() && p.config_path.empty() && p.layers == 0) {
    std::fprintf(stderr,
                 "strata plan: give --model, --hf, --layers/--width/--heads or --config\n\n%s",
                 kUsage);
    return 2;
  }
  if (!p.model_name.empty() + !p.hf_dir.empty() + (p.layers > 0) > 1) {
    std::fprintf(stderr, "strata plan: give one of --model, --hf and --layers/--width/--heads\n");
    return 2;
  }
  if (p.model_name.empty() && p.layers > 0 && (p.width == 0 || p.heads == 0)) {
    std::fprintf(stderr, "strata plan: --layers needs --width and --heads\n");
    return 2;
  }
  if (p.validate && p.config_path.empty()) {
    std::fprintf(stderr, "strata plan: --validate needs --config\n");
    return 2;
  }
  if (p.max_mode &&
      (!p.json_path.empty() || !p.svg_path.empty() || !p.cfg_out.empty() || p.validate)) {
    std::fprintf(stderr,
                 "strata plan: --max-model prints its capacity table only: drop --json, --svg, "
                 "--write-config and --validate, or plan the model it finds (--layers N) with "
                 "them\n");
    return 2;
  }
  return -1;
}

}  // namespace strata::tools
