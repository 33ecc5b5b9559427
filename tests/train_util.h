// Helpers for tests that train in-process (tests include from the repository root).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "src/train/trainer.h"
#include "strata/config.h"
#include "tests/test_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata::test {

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
