// What the tier-part tests build their parts over: a CPU device of one thread and a layout of
// plain modules.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "src/model/architecture.h"
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
    s.name = "m" + std::to_string(i);
    s.numel = numel[i];
    l.modules.push_back(s);
  }
  return l;
}

}  // namespace strata::test
