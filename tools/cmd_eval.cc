// `strata eval --config FILE [--checkpoint PATH] [--json] [--set key=value]...`
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/checkpoint/checkpoint.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

const char kUsage[] =
    "usage: strata eval --config FILE [options]\n"
    "\n"
    "Mean next-token cross-entropy and perplexity of the model over every window of the token\n"
    "file data.source (all of it; data.eval_fraction plays no part), or data.eval_source when\n"
    "set. With T = model.context (data.seq_len when set) and N tokens in the file, windows\n"
    "start at token 0, T, 2T, ... while start + T + 1 <= N: inputs [s, s+T), targets\n"
    "[s+1, s+T+1). A file with a loss mask (<file>.mask, prepare_data.py --chat): packed\n"
    "windows of whole conversations, the mean over the assistant tokens only (\"tokens\"\n"
    "counts them). The model is set up as strata train sets it up (placement, offload, ZeRO-3\n"
    "under mpirun), forward only; train.checkpoint_dir is not touched.\n"
    "A file of preference pairs (prepare_data.py --format preference): the DPO loss (the dpo.*\n"
    "keys) over every pair, with TRL's reward accuracy and margin, of the checkpoint against\n"
    "the initial model (model.from_pretrained's weights; with LoRA, the base) as the\n"
    "reference, as strata train's evals compute it.\n"
    "\n"
    "options:\n"
    "  --config FILE        the config (required): its model, data.source (or\n"
    "                       data.eval_source), placement\n"
    "  --checkpoint PATH    a checkpoint file, a sharded checkpoint's manifest, or a run\n"
    "                       directory (its latest checkpoint); without it the initial\n"
    "                       weights: model.from_pretrained's, else train.seed's initialization\n"
    "  --json               print one line {\"loss\": L, \"perplexity\": P, \"tokens\": N}\n"
    "                       (preference pairs: {\"loss\", \"pairs\", \"tokens\",\n"
    "                       \"rewards/accuracies\", \"rewards/chosen\", \"rewards/rejected\",\n"
    "                       \"rewards/margins\", \"logps/chosen\", \"logps/rejected\"})\n"
    "  --set KEY=VALUE      override a config key, as for strata train; repeatable\n"
    "  --log-level LEVEL    debug | info | warn | error | off (default: strata.log_level)\n"
    "  -h, --help           this text\n"
    "\n"
    "exit status: 0 evaluated; 1 error (the message says what and how to fix it); 2 bad usage.\n";

}  // namespace

int cmd_eval(int argc, char** argv) {
  std::string config_path, checkpoint, log_level;
  std::vector<std::string> overrides;
  bool json = false;
  CliOptions cli("eval", kUsage);
  cli.value("--config", &config_path)
      .value("--checkpoint", &checkpoint)
      .flag("--json", &json)
      .repeated("--set", &overrides)
      .value("--log-level", &log_level);
  if (auto rc = cli.parse(argc, argv)) return *rc;
  if (config_path.empty()) return cli.usage_error("--config FILE is required");
  Config cfg;
  if (auto rc =
          load_cli_config(cli, config_path, overrides, launcher_world_size(), log_level, &cfg)) {
    return *rc;
  }
  if (!checkpoint.empty()) {
    Result<std::string> path = resolve_checkpoint(checkpoint);
    if (!path.is_ok()) return cli.fail("--checkpoint: " + path.status().message());
    checkpoint = *path;
  }
  EvalOptions opts;
  opts.checkpoint = checkpoint;
  Result<EvalResult> r = evaluate(cfg, opts);
  if (!r.is_ok()) return cli.fail(r.status().message());
  if (r->rank != 0) return 0;  // rank 0 reports
  const std::string what = !checkpoint.empty() ? "checkpoint " + checkpoint
                           : cfg.model.from_pretrained.empty()
                               ? std::string("initial weights (train.seed)")
                               : "weights of " + cfg.model.from_pretrained;
  // strata eval evaluates data.eval_source when set.
  const std::string& file = cfg.data.eval_source.empty() ? cfg.data.source : cfg.data.eval_source;
  if (r->preference) {
    const double margin = r->reward_chosen - r->reward_rejected;
    if (json) {
      const nlohmann::json line{{"loss", r->loss},
                                {"pairs", r->pairs},
                                {"tokens", r->tokens},
                                {"rewards/accuracies", r->reward_accuracy},
                                {"rewards/chosen", r->reward_chosen},
                                {"rewards/rejected", r->reward_rejected},
                                {"rewards/margins", margin},
                                {"logps/chosen", r->logp_chosen},
                                {"logps/rejected", r->logp_rejected}};
      std::printf("%s\n", line.dump().c_str());
    } else {
      std::printf(
          "eval DPO loss %.6f | reward accuracy %.4f | margin %.4f | %lld pairs of %s | %s "
          "against the initial model\n",
          r->loss, r->reward_accuracy, margin, (long long)r->pairs, file.c_str(), what.c_str());
    }
    return 0;
  }
  if (json) {
    const nlohmann::json line{
        {"loss", r->loss}, {"perplexity", r->perplexity}, {"tokens", r->tokens}};
    std::printf("%s\n", line.dump().c_str());
  } else {
    std::printf(
        "eval loss %.6f | perplexity %.4f | %lld tokens (%lld windows of %d) of %s (%lld "
        "tokens) | %s\n",
        r->loss, r->perplexity, (long long)r->tokens, (long long)r->windows, r->T, file.c_str(),
        (long long)r->corpus_tokens, what.c_str());
  }
  return 0;
}

}  // namespace strata::tools
