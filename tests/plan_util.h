// What the planner's tests share (tests include from the repository root): a named placement
// option and a small request on a CPU-backend machine.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "src/plan/plan.h"
#include "src/plan/probe_machine.h"

namespace strata::test {

// The placement option `name` of placement_options(); a missing name is a test failure.
inline PlacementOption find_placement(const std::string& name) {
  for (const auto& p : placement_options()) {
    if (p.name == name) return p;
  }
  ADD_FAILURE() << "no placement " << name;
  return {};
}

// The machine probe at its smallest (4 MiB of host memory, 64K parameters stepped on the host
// and on a GPU, a 64 x 64 GEMM, one timed pass, none discarded): the profile's fields and paths,
// not its rates.
inline MachineProbeOptions tiny_probe_options() {
  MachineProbeOptions po;
  po.host_bytes = 4 << 20;
  po.optimizer_params = 1 << 16;
  po.gemm_n = 64;
  po.gemm_c = 64;
  po.device_optimizer_params = 1 << 16;
  po.warmup = 0;
  po.repeats = 1;
  return po;
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
