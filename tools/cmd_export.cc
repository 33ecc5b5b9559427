// `strata export --config FILE --checkpoint PATH (--out DIR | --adapter DIR) [--set key=value]...`
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "src/checkpoint/checkpoint.h"
#include "src/hf/export_dir.h"
#include "src/hf/hf_adapter.h"
#include "src/hf/hf_export.h"
#include "strata/config.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

const char kUsage[] =
    "usage: strata export --config FILE --checkpoint PATH (--out DIR | --adapter DIR) [options]\n"
    "\n"
    "Writes the model of a strata checkpoint as a Hugging Face checkpoint directory:\n"
    "config.json and the weights in the model dtype (bf16.enabled / fp16.enabled) as\n"
    "model.safetensors, or as 5 GB shards with model.safetensors.index.json, which\n"
    "transformers' AutoModelForCausalLM.from_pretrained(DIR) loads, and the tokenizer and\n"
    "generation files (tokenizer.json, tokenizer_config.json, special_tokens_map.json,\n"
    "generation_config.json, ...) of model.from_pretrained or --tokenizer, for\n"
    "AutoTokenizer.from_pretrained(DIR). FILE is the config the checkpoint was trained with\n"
    "(its model section, e.g. model.from_pretrained). A tensor model.from_pretrained stores\n"
    "more rows of than the model trained (GPT-2's positions past model.context) is written\n"
    "whole: the trained rows, then the stored ones. Files are written as temporaries and\n"
    "renamed into place once complete; progress is printed every 10 s. A LoRA run's\n"
    "checkpoint (a config with a lora section) exports as the base with its adapters\n"
    "merged (W += lora_alpha/r * B A); --adapter DIR writes its adapters alone as a PEFT\n"
    "adapter directory (adapter_config.json + adapter_model.safetensors, fp32) that\n"
    "peft.PeftModel.from_pretrained(base, DIR) loads.\n"
    "\n"
    "options:\n"
    "  --config FILE        the training config (required)\n"
    "  --checkpoint PATH    a checkpoint file, a sharded checkpoint's manifest, or a run\n"
    "                       directory (its latest checkpoint) (required)\n"
    "  --out DIR            the output directory, created if missing (required); one that\n"
    "                       holds another model (a base model, another run's export) is\n"
    "                       refused, an earlier export of the same run is replaced;\n"
    "                       model.from_pretrained's directory is never written\n"
    "  --adapter DIR        a LoRA run: write its adapters as a PEFT adapter directory\n"
    "                       instead of a merged model, with --out's guards (DIR and its\n"
    "                       parents created if missing; one holding a model or another\n"
    "                       run's adapter refused; never model.from_pretrained's directory);\n"
    "                       the two files are replaced together (a kill leaves the old pair\n"
    "                       or the new one)\n"
    "  --force              replace the model (or adapter) DIR holds: its model files that\n"
    "                       the export does not rewrite are removed once it is complete\n"
    "  --tokenizer DIR      copy the tokenizer files from DIR (default: model.from_pretrained)\n"
    "  --set KEY=VALUE      override a config key, as for strata train; repeatable\n"
    "  -h, --help           this text\n"
    "\n"
    "exit status: 0 written; 1 error (the message says what and how to fix it); 2 bad usage.\n";

}  // namespace

int cmd_export(int argc, char** argv) {
  std::string config_path, checkpoint, out, adapter;
  HfExportOptions options;
  options.progress = true;
  std::vector<std::string> overrides;
  bool force = false;
  CliOptions cli("export", kUsage);
  cli.value("--config", &config_path)
      .value("--checkpoint", &checkpoint)
      .value("--out", &out)
      .value("--adapter", &adapter)
      .flag("--force", &force)
      .value("--tokenizer", &options.tokenizer_dir)
      .repeated("--set", &overrides);
  if (auto rc = cli.parse(argc, argv)) return *rc;
  if (config_path.empty() || checkpoint.empty() || out.empty() == adapter.empty()) {
    return cli.usage_error("--config, --checkpoint and one of --out and --adapter are required");
  }
  Result<std::string> path = resolve_checkpoint(checkpoint);
  if (!path.is_ok()) return cli.fail(path.status().message());
  checkpoint = *path;
  // The config is read for the world size the checkpoint was written with (its batch sizes
  // are checked against it).
  Result<ShardManifest> manifest = read_shard_manifest(checkpoint);
  if (!manifest.is_ok()) return cli.fail(manifest.status().message());
  Result<Config> cfg = load_config(config_path, overrides, manifest->world_size);
  if (!cfg.is_ok()) return cli.fail(cfg.status().message());
  if (Status st = check_model_given(*cfg); !st.is_ok()) return cli.fail(st.message());
  Result<CheckpointMeta> meta = read_checkpoint_meta(manifest->files.at(0));
  if (!meta.is_ok()) return cli.fail(meta.status().message());
  const auto t0 = std::chrono::steady_clock::now();
  if (!adapter.empty()) {
    // The guards of --out: never model.from_pretrained's directory, another model or another
    // run's adapter (unless --force); missing parents created (and removed again on failure).
    const ExportTarget target{adapter,
                              "--adapter",
                              meta->run_id,
                              meta->step,
                              cfg->model.from_pretrained,
                              force,
                              ", or add --force to replace it",
                              /*adapter=*/true};
    if (Status st = export_as_owner(
            target, [&] { return export_adapter(checkpoint, cfg->model, adapter); });
        !st.is_ok()) {
      return cli.fail(st.message());
    }
    std::printf("exported the adapters of %s to %s in %.2f s\n", checkpoint.c_str(),
                adapter.c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  }
  const ExportTarget target{out,
                            "--out",
                            meta->run_id,
                            meta->step,
                            cfg->model.from_pretrained,
                            force,
                            ", or add --force to replace it"};
  if (Status st = export_as_owner(
          target, [&] { return export_checkpoint(checkpoint, cfg->model, out, options); });
      !st.is_ok()) {
    return cli.fail(st.message());
  }
  std::printf("exported %s to %s in %.2f s\n", checkpoint.c_str(), out.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace strata::tools
