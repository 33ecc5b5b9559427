// Random configurations for the schedule fuzz (tests/schedule_fuzz_test.cc, and zero3_test's
// ranks): a seeded draw of what decides the numbers and of the schedule's knobs.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace strata::test {

struct Draw {
  std::mt19937_64 rng;
  explicit Draw(uint64_t seed) : rng(seed * 0x9E3779B97F4A7C15ull + 1) {}
  int below(int n) { return int(rng() % uint64_t(n)); }
  template <class T>
  T pick(const std::vector<T>& v) {
    return v[size_t(below(int(v.size())))];
  }
  bool coin(int percent = 50) { return below(100) < percent; }
};

struct FuzzCase {
  std::vector<std::string> shared;    // what decides the numbers: both runs
  std::vector<std::string> schedule;  // the schedule's knobs: the second run only
  std::vector<std::string> plain;     // the first run only (across placements: its placement)
  int steps = 8;
  int stop_at = -1;  // > 0: the second run stops after this step and resumes
  std::string describe() const {
    std::string s = "both:";
    for (const auto& o : shared) s += " " + o;
    if (!plain.empty()) s += "\nplain:";
    for (const auto& o : plain) s += " " + o;
    s += "\nschedule:";
    for (const auto& o : schedule) s += " " + o;
    if (stop_at > 0) s += "\nstopped after step " + std::to_string(stop_at) + " and resumed";
    return s;
  }
};

// across: the placement and budgets are drawn for the second run only, the first keeps
// everything in host memory on a device that holds the parameters (the same numbers in every
// tier: STRATA_SCHEDULE_FUZZ_ACROSS=1 with Explore). ranks: for zero3_test's worker, which sets
// the batch for its world size (no batch keys drawn) and runs straight through (no resume).
inline FuzzCase draw_case(uint64_t seed, const std::string& dir, bool across, bool ranks = false) {
  Draw d(seed);
  FuzzCase c;
  auto& sh = c.shared;
  c.steps = 8 + d.below(7);
  sh.push_back("train.steps=" + std::to_string(c.steps));
  sh.push_back("scheduler.params.warmup_num_steps=2");
  // The model: tiny-cpu's GPT (its depth and width drawn), Llama, a mixture of experts, LoRA and
  // QLoRA over the GPT.
  const std::string model =
      d.pick<std::string>({"gpt2", "gpt2", "llama", "mixtral", "lora", "qlora"});
  sh.push_back("model.n_layer=" + std::to_string(1 + d.below(4)));
  sh.push_back(std::string("model.n_embd=") + (d.coin() ? "64" : "128"));
  if (model == "llama") {
    sh.insert(sh.end(), {"model.type=\"llama\"", "model.num_key_value_heads=2",
                         "model.intermediate_size=192"});
  } else if (model == "mixtral") {
    sh.insert(sh.end(),
              {"model.type=\"mixtral\"", "model.num_key_value_heads=2",
               "model.intermediate_size=64", "model.num_experts=4", "model.num_experts_per_tok=2",
               "model.tied_embeddings=false", "model.router_aux_loss_coef=0.01"});
  } else if (model == "lora" || model == "qlora") {
    sh.insert(sh.end(), {"lora.r=4", "lora.lora_alpha=8",
                         d.coin() ? "lora.target_modules=[\"c_attn\"]"
                                  : "lora.target_modules=[\"c_attn\",\"c_fc\",\"c_proj\"]"});
    if (model == "qlora") sh.push_back("lora.base_quantization=\"nf4\"");
  }
  // The batch.
  const int micro = 1 + d.below(3), drawn_accum = 1 + d.below(4);
  const int accum = ranks ? 2 : drawn_accum;  // the worker's
  if (!ranks) {
    sh.push_back("train_micro_batch_size_per_gpu=" + std::to_string(micro));
    sh.push_back("gradient_accumulation_steps=" + std::to_string(accum));
    sh.push_back("train_batch_size=" + std::to_string(micro * accum));
  }
  // Precision: bf16, or fp16 whose first scale overflows (the scaler skips and halves, and its
  // window doubles it into overflow again), or fp16 that does not.
  const int precision = d.below(3);
  if (precision > 0) {
    sh.insert(sh.end(), {"bf16.enabled=false", "fp16.enabled=true", "fp16.hysteresis=1",
                         "fp16.loss_scale_window=4"});
    sh.push_back(precision == 1 ? "fp16.initial_scale_power=24" : "fp16.initial_scale_power=8");
  }
  // Clipping: off, never biting, at thresholds these models' norms (0.7-4.4 in the first steps,
  // by shape and batch) cross now and then — a step speculated under backward then clips and is
  // rolled back —, always.
  sh.push_back("gradient_clipping=" +
               d.pick<std::string>({"0", "1000", "0.8", "1.5", "2.5", "3", "0.01"}));
  const std::string activations = d.pick<std::string>({"keep", "keep", "recompute", "offload"});
  sh.push_back("strata.activations=\"" + activations + "\"");
  // Placement: parameters on the device, in host memory or on NVMe; the optimizer's state in host
  // memory or on NVMe; the gradients with it, in host memory or on NVMe.
  std::filesystem::create_directories(dir + "/swap");
  auto& place = across ? c.schedule : sh;
  if (across) {
    c.plain = {"zero_optimization.offload_param.device=\"cpu\"",
               "zero_optimization.offload_optimizer.device=\"cpu\"",
               "device.memory_limit=\"64MiB\""};
  }
  const std::string swap = "\"" + dir + "/swap\"";
  const std::string params = d.pick<std::string>({"none", "cpu", "nvme"});
  const std::string opt = d.pick<std::string>({"none", "cpu", "nvme", "nvme"});
  place.push_back("zero_optimization.offload_param.device=\"" + params + "\"");
  place.push_back("zero_optimization.offload_param.nvme_path=" + swap);
  place.push_back("zero_optimization.offload_optimizer.device=\"" + opt + "\"");
  place.push_back("zero_optimization.offload_optimizer.nvme_path=" + swap);
  if (d.coin(40))
    place.push_back(std::string("strata.placement.grads=\"") +
                    (opt == "nvme" && d.coin() ? "nvme" : "host") + "\"");
  if (d.coin(40)) {
    place.push_back("zero_optimization.sub_group_size=" + d.pick<std::string>({"4096", "30000"}));
  }
  // Budgets: a device from one that caches part of the parameters to one that holds them all;
  // a host tier from what the state needs to much more (the read-ahead's room).
  place.push_back("device.memory_limit=\"" + d.pick<std::string>({"8MiB", "12MiB", "64MiB"}) +
                  "\"");
  if (d.coin(40)) {
    place.push_back("strata.host_memory_limit=\"" +
                    d.pick<std::string>({"16MiB", "24MiB", "48MiB"}) + "\"");
  }

  // The schedule.
  auto& s = c.schedule;
  s.push_back("strata.optimizer.overlap=true");
  s.push_back("strata.optimizer.defer=\"" + d.pick<std::string>({"auto", "always", "never"}) +
              "\"");
  if (d.coin()) {
    s.push_back("strata.optimizer.read_ahead=" + d.pick<std::string>({"0", "65536", "1048576"}));
  }
  if (activations != "offload" && accum > 1 && d.coin(70)) {
    s.push_back("strata.grouped_forwards=" +
                (d.coin() ? std::string("\"auto\"") : std::to_string(2 + d.below(accum - 1))));
  }
  s.push_back(std::string("strata.grouped_backwards=") + (d.coin(70) ? "true" : "false"));
  s.push_back("zero_optimization.offload_optimizer.buffer_count=" + std::to_string(1 + d.below(4)));
  if (d.coin()) s.push_back("zero_optimization.stage3_prefetch_bucket_size=0");
  if (d.coin(25) && !ranks) c.stop_at = 1 + d.below(c.steps - 1);
  return c;
}

// Runs case `seed`: false when the combination was refused (the config, or a budget it does not
// fit), so the caller draws another; the comparison's failures are test failures.
// A ctest case's seed: the first of the `span` seeds from `first` whose drawn combination `run`
// accepts (false from `run`: refused, the next seed). False when none was: the drawing is broken.
inline bool run_first_accepted(uint64_t first, uint64_t span,
                               const std::function<bool(uint64_t)>& run) {
  for (uint64_t seed = first; seed < first + span; ++seed) {
    if (run(seed)) return true;
  }
  return false;
}

// The Explore tests' seeds: from $<env>_SEED (default 1000000) until $<env>_CASES were accepted
// (`run` returns false for a drawn combination that was refused: not counted) or 100 times as
// many refused, stopping at the first failure. False, running nothing, when $<env>_CASES is
// unset (the caller skips, saying which variable to set).
struct Explored {
  int ran = 0, refused = 0;
};
inline bool explore_seeds(const std::string& env, const std::function<bool(uint64_t)>& run,
                          Explored* out) {
  const char* n = std::getenv((env + "_CASES").c_str());
  if (!n) return false;
  const char* s = std::getenv((env + "_SEED").c_str());
  const int cases = std::atoi(n);
  for (uint64_t seed = s ? std::strtoull(s, nullptr, 10) : 1000000;
       out->ran < cases && out->refused < 100 * cases && !::testing::Test::HasFailure(); ++seed) {
    run(seed) ? ++out->ran : ++out->refused;
  }
  return true;
}

}  // namespace strata::test
