// Helpers for tests that train in-process (tests include from the repository root).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/storage_faults.h"
#include "tests/test_util.h"
#include "tests/wrapped_device.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata::test {

// Training options that wrap the CPU backend as a device the host cannot address (as a GPU:
// tests/wrapped_device.h), without progress lines.
inline TrainOptions on_unaddressable_device() {
  TrainOptions o;
  o.progress = false;
  o.wrap_device = [](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
    return std::make_unique<WrappedDevice>(std::move(d), false);
  };
  return o;
}

// configs/tiny-cpu.json (README's default job) with its checkpoints in `dir`/ckpt, no evals and
// no progress reports, then `overrides` and `more` in that order; a bad override is a test
// failure.
inline Config tiny_cpu(const std::string& dir, std::vector<std::string> overrides,
                       const std::vector<std::string>& more = {}) {
  std::vector<std::string> ov = {"train.checkpoint_dir=\"" + dir + "/ckpt\"",
                                 "train.eval_interval=0", "steps_per_print=1000"};
  ov.insert(ov.end(), overrides.begin(), overrides.end());
  ov.insert(ov.end(), more.begin(), more.end());
  auto cfg = parse_config(read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"),
                          "configs/tiny-cpu.json", ov);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  return cfg.is_ok() ? *cfg : Config{};
}

// train(cfg) without progress lines; a failure is a test failure (and an empty result).
inline TrainResult must_train(const Config& cfg, TrainOptions opts = {}) {
  opts.progress = false;
  auto r = train(cfg, opts);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? *r : TrainResult{};
}

// The storage pieces a clean run of `cfg` has issued by the end of each of `steps` (one count
// each): the I/O sequence is deterministic, so an identical run with a FaultPlan's fail_nth can
// fail a piece of a chosen step. `result`, if given, gets the clean run's result.
inline std::vector<uint64_t> io_pieces_at_step_ends(const Config& cfg,
                                                    const std::vector<int64_t>& steps,
                                                    TrainResult* result = nullptr) {
  auto probe = std::make_shared<FaultPlan>();
  std::vector<uint64_t> at(steps.size(), 0);
  TrainOptions p;
  p.storage_faults = probe;
  p.on_step_end = [&](int64_t step) {
    for (size_t i = 0; i < steps.size(); ++i) {
      if (step == steps[i]) at[i] = probe->pieces.load();
    }
  };
  TrainResult r = must_train(cfg, p);
  if (result) *result = std::move(r);
  return at;
}

// A small GPT on the synthetic corpus with its optimizer state on "NVMe" (`dir`/swap) and its
// checkpoints in `dir`, then `extra` overrides.
inline Config small_config(const std::string& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {
      "train.checkpoint_dir=\"" + dir + "\"",
      "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\""};
  ov.insert(ov.end(), extra.begin(), extra.end());
  std::filesystem::create_directories(dir + "/swap");
  const char* json = R"({
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
    "gradient_clipping": 1.0, "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}},
    "aio": {"backend": "posix"},
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64, "context": 32},
    "data": {"synthetic_tokens": 65536, "eval_batches": 1},
    "device": {"backend": "cpu", "memory_limit": "256MiB", "cpu_threads": 2},
    "train": {"steps": 10, "eval_interval": 0, "seed": 42}
  })";
  auto cfg = parse_config(json, "<test>", ov);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  return cfg.is_ok() ? *cfg : Config{};
}

// train(cfg) without progress lines, from `resume` ("" fresh, "latest" or a path): its status.
inline Status train_status(const Config& cfg, const std::string& resume = "") {
  TrainOptions o;
  o.progress = false;
  o.resume = resume;
  return train(cfg, o).status();
}

// The least budget (bytes of a tier's limit: strata.host_memory_limit, device.memory_limit)
// that the preflight of make(budget) accepts, in whole `unit`s (4096: host buffers, 256: device
// allocations) between `refused` and `accepted`, by bisection. A try the preflight refuses
// returns before anything is allocated; one it accepts trains make(budget)'s steps (keep them
// few), and whether that succeeds is the caller's to check at the budget returned.
inline size_t least_accepted_budget(const std::function<Config(size_t budget)>& make,
                                    size_t refused, size_t accepted, size_t unit) {
  auto accepts = [&](size_t budget) {
    const Status st = train_status(make(budget));
    return st.is_ok() || st.message().find("preflight: this run does not fit") == std::string::npos;
  };
  EXPECT_FALSE(accepts(refused)) << refused;
  EXPECT_TRUE(accepts(accepted)) << accepted;
  size_t lo = refused / unit, hi = (accepted + unit - 1) / unit;
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    (accepts(mid * unit) ? hi : lo) = mid;
  }
  return hi * unit;
}

// "ckpt-<step, 8 digits>.bin".
inline std::string name_of(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof(b), "ckpt-%08lld.bin", static_cast<long long>(step));
  return b;
}

// The result's use of tier `name` (device | host | nvme); a missing tier is a test failure.
inline const TrainResult::TierUse& tier(const TrainResult& r, const std::string& name) {
  for (const auto& t : r.tiers) {
    if (t.name == name) return t;
  }
  static const TrainResult::TierUse none;
  ADD_FAILURE() << "no tier " << name;
  return none;
}

}  // namespace strata::test
