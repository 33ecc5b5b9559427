// `strata train --config FILE [--set key=value]... [--resume [PATH]]`
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "src/tiers/placement.h"
#include "src/train/stop_signals.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/plan_cli.h"

namespace strata::tools {
namespace {

std::atomic<int> g_stop_signal{0};

// Where the optimizer, stepped in host memory or from NVMe, was not hidden for a tenth of the
// steps or more on a device that is not the host's own cores (a GPU, or one simulated): the
// line that points at offload_optimizer.ratio, which has the device step the first modules'
// state and leaves the CPU a share its compute can hide; "" elsewhere. On the CPU backend the
// device's optimizer runs on the same cores, so the ratio has nothing to hide under.
std::string optimizer_ratio_hint(const Config& cfg, const std::string& config_path, bool with_sets,
                                 const TrainResult& res) {
  const ScheduleCounts& sc = res.schedule;
  const double open = sc.optimizer_s - sc.optimizer_hidden_s, steps = res.fwd_bwd_s + open;
  if (res.device_in_rss && cfg.device.simulate.empty()) return "";
  if (open <= 0 || steps <= 0 || open < 0.1 * steps || res.approximate) return "";
  Result<Placement> where = parse_placement(cfg);
  if (!where.is_ok() || where->optimizer_ratio <= 0 ||
      (where->master == Tier::kDevice && where->moments == Tier::kDevice)) {
    return "";
  }
  // The rate the CPU optimizer's kernel ran at beside the device: the planner's, from a probe
  // of the CPU alone, is often higher.
  const std::string rate = sc.cpu_optimizer_rate() > 0 ? fmt::format(" --cpu-optimizer-rate {:.3g}",
                                                                     sc.cpu_optimizer_rate())
                                                       : std::string();
  return fmt::format(
      "optimizer: {:.3g} s of the steps' {:.3g} s not hidden ({:.0f}%) at "
      "zero_optimization.offload_optimizer.ratio {:g}: a lower ratio has the device step the "
      "first modules' optimizer state (their master weights and moments in its memory) and "
      "leaves the CPU a share the device's compute hides; `strata plan --config {}{}`{} "
      "recommends one (with --profile from `strata probe` on this machine; "
      "--cpu-optimizer-rate: the CPU optimizer's rate in this run; docs/PLANNER.md)\n",
      open, steps, 100.0 * open / steps, where->optimizer_ratio, config_path, rate,
      with_sets ? " with the same --set options" : "");
}

const char kUsage[] =
    "usage: strata train --config FILE [options]\n"
    "\n"
    "Trains the model described by FILE (a strata config or a DeepSpeed ds_config.json with a\n"
    "\"model\" section). Prints a progress line every steps_per_print steps and an eval loss\n"
    "every train.eval_interval steps; appends metrics as JSONL (train.log_file, default\n"
    "<train.checkpoint_dir>/metrics.jsonl; each run's lines after one naming its run_id) and\n"
    "writes checkpoints to train.checkpoint_dir (and, with train.export_dir, the final one\n"
    "as a Hugging Face directory: checked before training, see strata export --help).\n"
    "At the end: each tier's peak and traffic, the peak RSS (the host tier's arena and undo\n"
    "room apart) and the RSS at the end, and the NVMe and host<->device\n"
    "bytes per step beside the placement's minimum (the planner's; docs/PLANNER.md; the\n"
    "median of steps 3 on, but those an fp16 overflow skipped and the ones after them),\n"
    "the host<->device bytes split by direction with the schedule each of those steps ran\n"
    "its optimizer in, the rate of the CPU optimizer's kernel (parameters/s), and on a GPU,\n"
    "where the CPU optimizer was not hidden for a tenth of the steps or more, how much\n"
    "(offload_optimizer.ratio, which strata plan recommends at that rate, has the device step\n"
    "part of it), and how many steps an fp16 overflow skipped (when any did) with the loss\n"
    "scale at the end.\n"
    "fp16: an overflow skips the step (DeepSpeed's loss scaler); an overflow at\n"
    "fp16.min_loss_scale, 20 in a row at a static fp16.loss_scale, or an inf or nan loss\n"
    "3 steps in a row stop the run with an error (bf16 and fp32: the first such loss).\n"
    "Preference data (prepare_data.py --format preference) trains DPO (the dpo.* keys: TRL's\n"
    "losses, sigmoid by default, against the initial model, whose log-probabilities of every\n"
    "pair are computed before the first step and again on --resume); the progress line shows\n"
    "the reward accuracy and margin, metrics.jsonl TRL's rewards/* and eval_rewards/*.\n"
    "With flops_profiler.enabled, one step's kernels, copies and host functions are timed\n"
    "on the device and logged as a table by op and stream (the op profile; the step after\n"
    "flops_profiler.profile_step steps: by default the second).\n"
    "Ctrl-C / SIGTERM: finishes the current step, writes a checkpoint and exits (a second\n"
    "signal exits at once). Under mpirun, launch with --mca odls_base_sigkill_timeout 60 so\n"
    "mpirun waits for the checkpoint before it kills the ranks.\n"
    "\n"
    "options:\n"
    "  --config FILE        the config (required)\n"
    "  --set KEY=VALUE      override any config key by its JSON path, e.g.\n"
    "                       --set train.steps=50 --set zero_optimization.stage=3\n"
    "                       (VALUE is parsed as JSON, else taken as a string); repeatable\n"
    "  --resume [PATH]      continue from PATH, or from the newest checkpoint in\n"
    "                       train.checkpoint_dir if PATH is omitted\n"
    "  --quiet              no progress lines (log lines still go to stderr)\n"
    "  --log-level LEVEL    debug | info | warn | error | off (default: strata.log_level)\n"
    "  -h, --help           this text\n"
    "\n"
    "exit status: 0 done; 1 error (the message says what and how to fix it), or the metrics\n"
    "log could not be written (training finished and saved); 2 bad usage; 128+N stopped by\n"
    "signal N after writing a checkpoint.\n";

}  // namespace

int cmd_train(int argc, char** argv) {
  std::string config_path, log_level;
  std::vector<std::string> overrides;
  TrainOptions opts;
  bool quiet = false;
  CliOptions cli("train", kUsage);
  cli.value("--config", &config_path)
      .repeated("--set", &overrides)
      .optional_value("--resume", &opts.resume, "latest")
      .flag("--quiet", &quiet)
      .value("--log-level", &log_level);
  if (auto rc = cli.parse(argc, argv)) return *rc;
  if (quiet) opts.progress = false;
  if (config_path.empty()) return cli.usage_error("--config FILE is required");
  Config cfg;
  if (auto rc =
          load_cli_config(cli, config_path, overrides, launcher_world_size(), log_level, &cfg)) {
    return *rc;
  }

  install_stop_handlers(&g_stop_signal, open_mpi_launcher_pid());
  opts.stop_signal = &g_stop_signal;
  const char* mpi_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (const std::string w = mpi_stop_window_warning();
      !w.empty() && mpi_rank && std::string(mpi_rank) == "0") {
    log_warn("{}", w);
  }
  if (const std::string n = mpi_stop_wait_note();
      !n.empty() && mpi_rank && std::string(mpi_rank) == "0") {
    log_info("{}", n);
  }

  Result<TrainResult> r = train(cfg, opts);
  if (!r.is_ok()) return cli.fail(r.status().message());
  const TrainResult& res = *r;
  const int sig = g_stop_signal.load();
  if (res.rank != 0) return res.stopped_early && sig != 0 ? 128 + sig : 0;  // rank 0 reports
  if (res.eval_losses.size() >= 2) {
    std::printf("eval loss: %.4f at step %lld -> %.4f at step %lld\n",
                res.eval_losses.front().second, (long long)res.eval_losses.front().first,
                res.eval_losses.back().second, (long long)res.eval_losses.back().first);
  }
  if (res.eval_accuracies.size() >= 2) {
    std::printf("eval reward accuracy (DPO): %.3f at step %lld -> %.3f at step %lld\n",
                res.eval_accuracies.front().second, (long long)res.eval_accuracies.front().first,
                res.eval_accuracies.back().second, (long long)res.eval_accuracies.back().first);
  }
  for (const auto& t : res.tiers) {
    if (t.capacity == 0) continue;
    std::printf("tier %-6s peak %s of %s; moved in %s, out %s%s\n", t.name.c_str(),
                format_bytes(double(t.peak)).c_str(), format_bytes(double(t.capacity)).c_str(),
                format_bytes(double(t.bytes_in)).c_str(), format_bytes(double(t.bytes_out)).c_str(),
                res.world_size > 1 ? " (rank 0's share)" : "");
  }
  if (res.peak_rss > 0) {
    // What the RSS is made of: the host tier's arena (resident whole: mlocked, or touched over
    // the run), the device's peak where device memory is host memory (the CPU backend), and the
    // rest (binary, libraries, threads, kernel scratch, the data): it does not grow with depth.
    size_t host = 0, undo = 0, given_back = 0, device_peak = 0, device_cap = 0;
    for (const auto& t : res.tiers) {
      if (t.name == "host") host = t.capacity, undo = t.undo_room, given_back = t.undo_given_back;
      if (t.name == "device" && res.device_in_rss) device_peak = t.peak, device_cap = t.capacity;
    }
    const double rest = std::max(0.0, double(res.peak_rss) - double(host) - double(device_peak));
    const std::string split =
        undo ? fmt::format(" (arena {} + undo room {}{})", format_bytes(double(host - undo)),
                           format_bytes(double(undo)),
                           given_back ? fmt::format(", {} of it given back once the run stopped "
                                                    "stepping under backward",
                                                    format_bytes(double(given_back)))
                                      : std::string())
             : std::string();
    std::printf(
        "host memory: peak RSS (VmHWM) %s = host tier %s%s%s + the rest %s (%s at start); "
        "VmRSS %s at the end\n",
        format_bytes(double(res.peak_rss)).c_str(), format_bytes(double(host)).c_str(),
        split.c_str(),
        device_cap ? fmt::format(" + device peak {} (arena {})", format_bytes(double(device_peak)),
                                 format_bytes(double(device_cap)))
                         .c_str()
                   : "",
        format_bytes(rest).c_str(), format_bytes(double(res.base_rss)).c_str(),
        format_bytes(double(res.end_rss)).c_str());
  }
  // Bytes per step against the placement's minimum (one rank's, as the tiers above).
  std::fputs(bytes_against_minimum(cfg, res).c_str(), stdout);
  if (const ScheduleCounts& sc = res.schedule; sc.optimizer_s > 0) {
    const std::string not_ready =
        sc.undo_not_ready > 0
            ? fmt::format(
                  "; {} step(s) stepped part of it after backward while undo room was "
                  "made ready",
                  sc.undo_not_ready)
            : std::string();
    const std::string kernel =
        sc.cpu_optimizer_s > 0
            ? fmt::format("; the CPU optimizer's kernel {:.3g} parameters/s ({:.3g} s of it)",
                          sc.cpu_optimizer_rate(), sc.cpu_optimizer_s)
            : std::string();
    std::printf("optimizer: %.1f s, %.0f%% of it hidden under %s; %lld rollback(s)%s%s%s\n",
                sc.optimizer_s, 100.0 * sc.optimizer_hidden_s / sc.optimizer_s,
                res.approximate ? "the next step (delayed update: approximate)" : "backward",
                (long long)sc.rollbacks,
                sc.rollbacks > 0 ? " (clipping applied or fp16 overflowed: redone exactly)" : "",
                not_ready.c_str(), kernel.c_str());
  }
  std::fputs(optimizer_ratio_hint(cfg, config_path, !overrides.empty(), res).c_str(), stdout);
  if (res.micro_batches_with_positions > 0) {
    // data.packing "sequence": how many micro-batches the attention masked per conversation.
    std::printf(
        "attention per conversation (data.packing \"sequence\"): %lld of %lld micro-batches; "
        "the rest held one conversation a row and ran plain causal attention%s\n",
        (long long)res.micro_batches_per_sequence, (long long)res.micro_batches_with_positions,
        !res.device_in_rss && cfg.device.simulate.empty() && res.micro_batches_per_sequence > 0
            ? " (masked per conversation, attention runs on strata's own kernels, not cuDNN's)"
            : "");
  }
  if (res.skipped_steps > 0) {
    std::printf(
        "fp16 overflow: %lld of %lld steps skipped (inf or nan gradients: no update); loss "
        "scale %g at the end\n",
        (long long)res.skipped_steps, (long long)(res.end_step - res.start_step), res.loss_scale);
  }
  std::printf("%s at step %lld; %.*f tokens/s; checkpoint %s\n",
              res.stopped_early ? "stopped" : "done", (long long)res.end_step,
              res.tokens_per_s < 10 ? 2 : 0, res.tokens_per_s,
              res.last_checkpoint.empty() ? "none (train.final_checkpoint false)"
                                          : res.last_checkpoint.c_str());
  if (!res.metrics_error.empty()) {
    std::fprintf(stderr, "strata train: %s (training itself finished; checkpoint %s)\n",
                 res.metrics_error.c_str(), res.last_checkpoint.c_str());
    return 1;
  }
  if (res.stopped_early && g_stop_signal.load() != 0) return 128 + g_stop_signal.load();
  return 0;
}

}  // namespace strata::tools
