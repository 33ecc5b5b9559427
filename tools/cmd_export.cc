// `strata export --config FILE --checkpoint PATH --out DIR [--set key=value]...`
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "src/hf/hf_export.h"
#include "src/train/checkpoint.h"
#include "strata/config.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

const char kUsage[] =
    "usage: strata export --config FILE --checkpoint PATH --out DIR [options]\n"
    "\n"
    "Writes the model of a strata checkpoint as a Hugging Face checkpoint directory:\n"
    "config.json and the weights in the model dtype (bf16.enabled / fp16.enabled) as\n"
    "model.safetensors, or as 5 GB shards with model.safetensors.index.json, which\n"
    "transformers' AutoModelForCausalLM.from_pretrained(DIR) loads. FILE is the config the\n"
    "checkpoint was trained with (its model section, e.g. model.from_pretrained). Files are\n"
    "written as temporaries and renamed into place once complete.\n"
    "\n"
    "options:\n"
    "  --config FILE        the training config (required)\n"
    "  --checkpoint PATH    a checkpoint file, a sharded checkpoint's manifest, or a run\n"
    "                       directory (its latest checkpoint) (required)\n"
    "  --out DIR            the output directory, created if missing (required)\n"
    "  --set KEY=VALUE      override a config key, as for strata train; repeatable\n"
    "  -h, --help           this text\n"
    "\n"
    "exit status: 0 written; 1 error (the message says what and how to fix it); 2 bad usage.\n";

}  // namespace

int cmd_export(int argc, char** argv) {
  std::string config_path, checkpoint, out;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string* dst) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "strata export: %s needs a value\n\n%s", a.c_str(), kUsage);
        return false;
      }
      *dst = argv[++i];
      return true;
    };
    std::string set;
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--config") {
      if (!value(&config_path)) return 2;
    } else if (a == "--checkpoint") {
      if (!value(&checkpoint)) return 2;
    } else if (a == "--out") {
      if (!value(&out)) return 2;
    } else if (a == "--set") {
      if (!value(&set)) return 2;
      overrides.push_back(set);
    } else {
      std::fprintf(stderr, "strata export: unknown option '%s'\n\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if (config_path.empty() || checkpoint.empty() || out.empty()) {
    std::fprintf(stderr, "strata export: --config, --checkpoint and --out are required\n\n%s",
                 kUsage);
    return 2;
  }
  Status st;
  std::error_code ec;
  if (std::filesystem::is_directory(checkpoint, ec)) {  // a run directory: its latest
    Result<std::string> latest = latest_checkpoint(checkpoint);
    if (latest.is_ok()) {
      checkpoint = *latest;
    } else {
      st = latest.status();
    }
  }
  // The config is read for the world size the checkpoint was written with (its batch sizes
  // are checked against it).
  int world = 1;
  if (st.is_ok()) {
    Result<ShardManifest> m = read_shard_manifest(checkpoint);
    if (m.is_ok()) {
      world = m->world_size;
    } else {
      st = m.status();
    }
  }
  Result<Config> cfg = st.is_ok() ? load_config(config_path, overrides, world) : st;
  if (st.is_ok()) st = cfg.is_ok() ? check_model_given(*cfg) : cfg.status();
  const auto t0 = std::chrono::steady_clock::now();
  if (st.is_ok()) st = export_checkpoint(checkpoint, cfg->model, out);
  if (!st.is_ok()) {
    std::fprintf(stderr, "strata export: %s\n", st.message().c_str());
    return 1;
  }
  std::printf("exported %s to %s in %.2f s\n", checkpoint.c_str(), out.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace strata::tools
