// What the planner's tests share (tests include from the repository root): a named placement
// option and a small request on a CPU-backend machine.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "src/plan/plan.h"

namespace strata::test {

// The placement option `name` of placement_options(); a missing name is a test failure.
inline PlacementOption find_placement(const std::string& name) {
  for (const auto& p : placement_options()) {
    if (p.name == name) return p;
  }
  ADD_FAILURE() << "no placement " << name;
  return {};
}

// A one-layer GPT (width 64, one head, vocabulary 64, context 64), one sequence of 64 tokens per
// micro-batch, on 1 GiB of device and host memory, swap on /tmp, the CPU backend's default
// rates.
inline PlanRequest small_request() {
  PlanRequest r;
  r.set_model(gpt_model("t", 1, 64, 1, 64, 64));
  r.config.train_micro_batch_size_per_gpu = 1;
  r.config.data.seq_len = 64;
  r.hw.gpu_mem = uint64_t{1} << 30;
  r.hw.host_mem = uint64_t{1} << 30;
  r.hw.nvme_paths = {"/tmp"};
  r.profile = default_profile(true);
  return r;
}

}  // namespace strata::test
