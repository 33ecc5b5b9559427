// `strata plan`'s pieces: its arguments (plan_args.cc), the run (cmd_plan.cc) and --validate
// (plan_validate.cc), which trains the config and compares the plan with what it measured.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/plan/plan.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::tools {

// The command line, as given (defaults are resolved by the run).
struct PlanArgs {
  std::string model_name, hf_dir, config_path, json_path, svg_path, cfg_out, profile_path, backend;
  std::vector<std::string> sets, nvme;
  int layers = 0, width = 0, heads = 0, vocab = 50257, context = 1024;
  int batch = 1, seq = 0, accum = 1, gpus = 1;
  uint64_t gpu_mem = 0, host_mem = 0, nvme_free = 0;
  double cpu_optimizer_rate = 0;  // --cpu-optimizer-rate: parameters/s beside the device (0: none)
  bool max_mode = false, validate = false, fastest = false;
  bool force = false;  // --force: --write-config may replace a file it did not write
  DType dt = DType::kBF16;
  bool have_dtype = false, have_batch = false;
  std::string activations;
  int lora_r = 0;            // --lora: adapters of this rank over a frozen base (0: none)
  std::string lora_targets;  // --lora-targets, comma-separated ("": PEFT's default)
  std::string base_quant;    // --base-quantization none|int8|nf4 ("": none)
};

// Parses argv into `out`. Returns -1 to go on, or the exit code to return now (0 after --help,
// 2 after a usage error, which it has printed).
int parse_plan_args(int argc, char** argv, PlanArgs* out);

// Prints `s` as `strata plan: ...` on stderr; returns 1.
int plan_fail(const Status& s);

// --validate: trains `cfg`, then prints the measured step time (median, fastest, slowest; the
// first two steps dropped) against `planned`'s prediction for the schedule each step ran, the
// measured time split, and each tier's measured peak against the predicted one. With a profile,
// the other rate set (median / fastest pass) is evaluated too. Returns the exit code.
int validate_plan(const PlanArgs& args, const Config& cfg, const PlanRequest& req,
                  const PlanOption& planned);

// 90% of /proc/meminfo's MemAvailable: strata.host_memory_limit's default, as the engine has it.
uint64_t default_host_budget();

// A run's bytes per step against the placement's minimum (the planner's bytes for the config's
// placement on this run's device, host budget and ranks: docs/PLANNER.md): one line each for
// NVMe and host<->device, medians over the steps after the first two (the trace recording), or
// nothing when there are fewer than 3 steps, nothing moved, or the planner cannot evaluate the
// config. The summary of `strata train` prints it; so does --validate.
std::string bytes_against_minimum(const Config& cfg, const TrainResult& res);

}  // namespace strata::tools
