// Helpers for tests that train in-process (tests include from the repository root).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "src/train/trainer.h"

namespace strata::test {

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
