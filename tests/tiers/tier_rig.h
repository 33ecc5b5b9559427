// What the tier-part tests build their parts over: a CPU device of one thread, a layout of
// plain modules, the members every part's rig holds, and random gradients.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "src/tiers/counters.h"
#include "src/tiers/homes.h"
#include "src/tiers/placement.h"
#include "strata/device.h"

namespace strata::test {

// A CPU device of `capacity` bytes and one thread; nullptr (with a test failure) if it cannot be
// made.
inline std::unique_ptr<Device> cpu_device(size_t capacity) {
  auto d = create_cpu_device({.capacity = capacity, .threads = 1});
  EXPECT_TRUE(d.is_ok()) << d.status().to_string();
  return d.is_ok() ? std::move(*d) : nullptr;
}

// Modules "m0", "m1", ... of numel[i] elements each.
inline ModelLayout plain_modules(const std::vector<size_t>& numel) {
  ModelLayout l;
  for (size_t i = 0; i < numel.size(); ++i) {
    ModuleSpec s;
    s.name = fmt::format("m{}", i);  // not "m" + to_string: GCC 12 -Wrestrict misfires there
    s.numel = numel[i];
    l.modules.push_back(s);
  }
  return l;
}

// What every part's rig holds (a rig derives from it and adds its part): the device, the homes
// over it, the tier options, and the counters and first asynchronous error the parts share.
struct TierParts {
  std::unique_ptr<Device> dev;
  std::unique_ptr<Homes> homes;
  TierOptions options;
  TierCounters counters;
  AsyncError errors;
};

// n normally distributed values (mean 0, deviation 1) from `seed`.
inline std::vector<float> random_grad(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> g(n);
  for (float& x : g) x = d(rng);
  return g;
}

}  // namespace strata::test
