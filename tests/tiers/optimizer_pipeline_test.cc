// The optimizer pipeline (src/tiers/optimizer_pipeline.h) alone, over Homes and a device cache
// on the CPU device: a pass over modules whose state lives in the host tier or on NVMe, in one
// sub-group or several, gives the fused optimizer's bits over each whole module (the optimizer
// is elementwise); slots kept from one pass serve the next; the order modules are stepped in;
// a failed read names the module and sub-group.
#include "src/tiers/optimizer_pipeline.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "src/tiers/device_optimizer.h"
#include "strata/storage_faults.h"
#include "tests/tiers/state_rig.h"

namespace strata {
namespace {

using test::ModuleState;
using test::StateRig;

OptimizerHyper hyper(int64_t step) { return test::step_hyper(step, 0.1f); }

struct Case {
  const char* name;
  Placement placement;
  uint64_t sub_group;
};

const Case kCases[] = {
    {"host state, one sub-group", {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 0},
    {"host state, sub-groups", {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 2048},
    {"nvme state, one sub-group", {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 0},
    {"nvme state, sub-groups", {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048},
    {"nvme master, host moments", {Tier::kHost, Tier::kNvme, Tier::kHost, Tier::kHost, 1.0}, 2048},
    {"nvme state and parameters", {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048},
    {"device parameters", {Tier::kDevice, Tier::kHost, Tier::kNvme, Tier::kHost, 1.0}, 2048},
    // Master weights, moments and gradients in device memory: the device's optimizer kernel
    // (device_optimizer.h), which on the CPU backend gives the host path's bits.
    {"device state, host parameters",
     {Tier::kHost, Tier::kDevice, Tier::kDevice, Tier::kDevice, 1.0},
     2048},
    {"device state and parameters",
     {Tier::kDevice, Tier::kDevice, Tier::kDevice, Tier::kDevice, 1.0},
     0},
};

// Two steps of a pass over three modules, in an order of their own: every module's master
// weights, moments and new parameters are the fused optimizer's over the whole module.
TEST(OptimizerPipeline, PassGivesTheFusedOptimizersBitsOnEveryPlacement) {
  const std::vector<size_t> numel = {5000, 3000, 9000};
  int c = 0;
  for (const Case& k : kCases) {
    SCOPED_TRACE(k.name);
    StateRig r("pass" + std::to_string(c++), numel, k.placement, k.sub_group);
    EXPECT_EQ(steps_on_device(r.homes->module(0)), k.placement.master == Tier::kDevice);
    std::vector<ModuleState> want;
    for (int m = 0; m < 3; ++m) {
      want.push_back(test::random_state(numel[size_t(m)], 100 + m));
      r.set_state(m, want.back());
    }
    for (int step = 1; step <= 2; ++step) {
      ASSERT_TRUE(r.pipeline->run({2, 0, 1}, hyper(step), 0.5f, nullptr).is_ok());
      ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
      for (int m = 0; m < 3; ++m) test::reference_step(want[size_t(m)], hyper(step), 0.5f);
    }
    for (int m = 0; m < 3; ++m) {
      EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "module " << m;
    }
    EXPECT_TRUE(r.errors.take().is_ok());
  }
}

// A pass that keeps its staging (Pass::keep, within the read-ahead's room) leaves the kept
// sub-groups prepared; the next pass steps them without reading and gives the same bits.
TEST(OptimizerPipeline, KeptSlotsServeTheNextPass) {
  const std::vector<size_t> numel = {5000, 3000};
  StateRig r("kept", numel, {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048);
  r.pipeline->set_read_ahead(2);
  std::vector<ModuleState> want;
  for (int m = 0; m < 2; ++m) {
    want.push_back(test::random_state(numel[size_t(m)], 200 + m));
    r.set_state(m, want.back());
  }
  ASSERT_TRUE(r.pipeline->run({0, 1}, hyper(1), 1.0f, nullptr, /*keep=*/true).is_ok());
  EXPECT_EQ(r.pipeline->kept_count(), 2u);  // the first two sub-groups of NVMe state
  EXPECT_TRUE(r.pipeline->prepared(0, 0));
  EXPECT_TRUE(r.pipeline->prepared(0, 1));
  EXPECT_FALSE(r.pipeline->prepared(1, 0));
  ASSERT_TRUE(r.pipeline->run({1, 0}, hyper(2), 1.0f, nullptr, /*keep=*/true).is_ok());
  ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
  r.pipeline->drop_kept();
  EXPECT_EQ(r.pipeline->kept_count(), 0u);
  for (int m = 0; m < 2; ++m) {
    test::reference_step(want[size_t(m)], hyper(1), 1.0f);
    test::reference_step(want[size_t(m)], hyper(2), 1.0f);
    EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "module " << m;
  }
}

// Modules in the order their gradients became final, then the rest in index order; skipped
// and duplicate ones left out; end_step remembers the order and starts afresh.
TEST(OptimizerPipeline, StepOrder) {
  StateRig r("order", {100, 100, 100, 100},
             {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 0);
  EXPECT_EQ(r.pipeline->step_order({false, false, false, false}), (std::vector<int>{0, 1, 2, 3}));
  r.pipeline->grads_final(2);
  r.pipeline->grads_final(0);
  r.pipeline->grads_final(2);
  EXPECT_EQ(r.pipeline->step_order({false, false, false, false}), (std::vector<int>{2, 0, 1, 3}));
  EXPECT_EQ(r.pipeline->step_order({true, false, false, true}), (std::vector<int>{2, 1}));
  EXPECT_TRUE(r.pipeline->last_order().empty());
  r.pipeline->end_step();
  EXPECT_EQ(r.pipeline->last_order(), (std::vector<int>{2, 0, 2}));
  EXPECT_EQ(r.pipeline->step_order({false, false, false, false}), (std::vector<int>{0, 1, 2, 3}));
}

// prepared_first: the modules with state read ahead first, each part in its order; preparing
// reads the state and drain_prepared drops it.
TEST(OptimizerPipeline, PreparedModulesFirst) {
  StateRig r("prepared", {5000, 3000, 3000},
             {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048);
  auto p = r.pipeline->prepare(2, 1, false);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(*p);
  EXPECT_TRUE(r.pipeline->prepared(2, 1));
  EXPECT_EQ(r.pipeline->prepared_count(), 1u);
  EXPECT_EQ(r.pipeline->prepared_first({0, 1, 2}), (std::vector<int>{2, 0, 1}));
  r.pipeline->drain_prepared();
  EXPECT_EQ(r.pipeline->prepared_count(), 0u);
  EXPECT_EQ(r.pipeline->prepared_first({0, 1, 2}), (std::vector<int>{0, 1, 2}));
}

// An EIO on one of the pass's reads fails the pass, naming the module, the sub-group and the
// swap file.
TEST(OptimizerPipeline, AFailedReadNamesTheModuleAndSubGroup) {
  auto faults = std::make_shared<FaultPlan>();
  faults->fail_nth = 1;
  faults->fail_nth_kind = 1;  // reads
  StateRig r("eio", {5000}, {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048, false,
             faults);
  r.set_state(0, test::random_state(5000, 1));
  Status s = r.pipeline->run({0}, hyper(1), 1.0f, nullptr);
  ASSERT_FALSE(s.is_ok());
  // Which sub-group's read the disk served first is the I/O worker's timing.
  EXPECT_NE(s.to_string().find("reading m0 optimizer state (sub-group "), std::string::npos)
      << s.to_string();
  EXPECT_NE(s.to_string().find("strata-swap-r0.bin"), std::string::npos) << s.to_string();
  r.pipeline->drain_prepared();
  (void)r.pipeline->retire_writes(0);
}

}  // namespace
}  // namespace strata
