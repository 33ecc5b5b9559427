// `strata eval --config FILE [--checkpoint PATH] [--json] [--set key=value]...`
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/train/checkpoint.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

const char kUsage[] =
    "usage: strata eval --config FILE [options]\n"
    "\n"
    "Mean next-token cross-entropy and perplexity of the model over every window of the token\n"
    "file data.source (all of it; data.eval_fraction plays no part). With T = model.context\n"
    "(data.seq_len when set) and N tokens in the file, windows start at token 0, T, 2T, ...\n"
    "while start + T + 1 <= N: inputs [s, s+T), targets [s+1, s+T+1). The model is set up as\n"
    "strata train sets it up (placement, offload, ZeRO-3 under mpirun), forward only;\n"
    "train.checkpoint_dir is not touched.\n"
    "\n"
    "options:\n"
    "  --config FILE        the config (required): its model, data.source, placement\n"
    "  --checkpoint PATH    a checkpoint file, a sharded checkpoint's manifest, or a run\n"
    "                       directory (its latest checkpoint); without it the initial\n"
    "                       weights: model.from_pretrained's, else train.seed's initialization\n"
    "  --json               print one line {\"loss\": L, \"perplexity\": P, \"tokens\": N}\n"
    "  --set KEY=VALUE      override a config key, as for strata train; repeatable\n"
    "  --log-level LEVEL    debug | info | warn | error (default: strata.log_level)\n"
    "  -h, --help           this text\n"
    "\n"
    "exit status: 0 evaluated; 1 error (the message says what and how to fix it); 2 bad usage.\n";

}  // namespace

int cmd_eval(int argc, char** argv) {
  std::string config_path, checkpoint, log_level;
  std::vector<std::string> overrides;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string* dst) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "strata eval: %s needs a value\n\n%s", a.c_str(), kUsage);
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
    } else if (a == "--json") {
      json = true;
    } else if (a == "--set") {
      if (!value(&set)) return 2;
      overrides.push_back(set);
    } else if (a == "--log-level") {
      if (!value(&log_level)) return 2;
    } else {
      std::fprintf(stderr, "strata eval: unknown option '%s'\n\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if (config_path.empty()) {
    std::fprintf(stderr, "strata eval: --config FILE is required\n\n%s", kUsage);
    return 2;
  }
  Result<Config> cfg = load_config(config_path, overrides, launcher_world_size());
  if (!cfg.is_ok()) {
    std::fprintf(stderr, "strata eval: %s\n", cfg.status().message().c_str());
    return 1;
  }
  LogLevel level;
  const std::string& lvl = log_level.empty() ? cfg->strata.log_level : log_level;
  if (!parse_log_level(lvl, &level)) {
    std::fprintf(stderr, "strata eval: --log-level: '%s' is not debug|info|warn|error|off\n",
                 lvl.c_str());
    return 2;
  }
  set_log_level(level);
  std::error_code ec;
  if (!checkpoint.empty() && std::filesystem::is_directory(checkpoint, ec)) {
    Result<std::string> latest = latest_checkpoint(checkpoint);  // a run directory: its latest
    if (!latest.is_ok()) {
      std::fprintf(stderr, "strata eval: --checkpoint: %s\n", latest.status().message().c_str());
      return 1;
    }
    checkpoint = *latest;
  }
  EvalOptions opts;
  opts.checkpoint = checkpoint;
  Result<EvalResult> r = evaluate(*cfg, opts);
  if (!r.is_ok()) {
    std::fprintf(stderr, "strata eval: %s\n", r.status().message().c_str());
    return 1;
  }
  if (r->rank != 0) return 0;  // rank 0 reports
  if (json) {
    const nlohmann::json line{
        {"loss", r->loss}, {"perplexity", r->perplexity}, {"tokens", r->tokens}};
    std::printf("%s\n", line.dump().c_str());
  } else {
    const std::string what = !checkpoint.empty() ? "checkpoint " + checkpoint
                             : cfg->model.from_pretrained.empty()
                                 ? std::string("initial weights (train.seed)")
                                 : "weights of " + cfg->model.from_pretrained;
    std::printf(
        "eval loss %.6f | perplexity %.4f | %lld tokens (%lld windows of %d) of %s (%lld "
        "tokens) | %s\n",
        r->loss, r->perplexity, (long long)r->tokens, (long long)r->windows, r->T,
        cfg->data.source.c_str(), (long long)r->corpus_tokens, what.c_str());
  }
  return 0;
}

}  // namespace strata::tools
