// The delayed parameter update (src/tiers/delayed_update.h) alone, over the optimizer pipeline
// on the CPU device: start() swaps the gradient accumulators and steps on its own thread, so
// the parameters stay one step stale until finish() publishes them, whatever the thread's
// timing; gradients written meanwhile go to the other accumulator and feed the next update;
// the results are the fused optimizer's bits; a failed read comes back from finish() named.
#include "src/tiers/delayed_update.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "strata/storage_faults.h"
#include "tests/tiers/state_rig.h"

namespace strata {
namespace {

using test::ModuleState;
using test::StateRig;

OptimizerHyper hyper(int64_t step) { return test::step_hyper(step, 0.0f); }

// Module k's parameters, from their home in the host tier (no read from the disk).
std::vector<uint16_t> params_of(StateRig& r, int k) {
  r.sync();
  const Module& mod = r.homes->module(k);
  EXPECT_EQ(mod.p.tier, Tier::kHost);
  std::vector<uint16_t> p(mod.sn);
  std::memcpy(p.data(), mod.p.ptr(), mod.sn * 2);
  return p;
}

TEST(DelayedUpdate, ParametersAreOneStepStaleUntilFinish) {
  const std::vector<size_t> numel = {5000, 3000};
  for (Tier state : {Tier::kHost, Tier::kNvme}) {
    SCOPED_TRACE(tier_name(state));
    StateRig r(std::string("stale_") + tier_name(state), numel,
               {Tier::kHost, state, state, Tier::kHost, 1.0}, 2048, /*delayed_update=*/true);
    DelayedUpdate du(*r.homes, *r.cache, *r.pipeline, r.counters);
    EXPECT_FALSE(du.pending());
    EXPECT_TRUE(du.finish().is_ok());  // none pending: nothing to do
    std::vector<ModuleState> want;
    for (int m = 0; m < 2; ++m) {
      want.push_back(test::random_state(numel[size_t(m)], 300 + m));
      r.set_state(m, want.back());
    }
    const std::vector<uint16_t> before0 = params_of(r, 0), before1 = params_of(r, 1);

    // Step 1 from the gradients now in the accumulators.
    du.start({1, 0}, hyper(1), 0.5f);
    EXPECT_TRUE(du.pending());
    // The next step's backward fills the other accumulator meanwhile.
    std::vector<std::vector<float>> next(2);
    for (int m = 0; m < 2; ++m) {
      next[size_t(m)] = test::random_state(numel[size_t(m)], 400 + m).grad;
      Module& mod = r.homes->module(m);
      ASSERT_EQ(mod.gacc.tier, Tier::kHost);
      std::memcpy(mod.gacc.ptr(), next[size_t(m)].data(), mod.sn * 4);
    }
    // Until finish, the parameters are the ones before the update.
    EXPECT_EQ(params_of(r, 0), before0);
    EXPECT_EQ(params_of(r, 1), before1);
    ASSERT_TRUE(du.finish().is_ok());
    EXPECT_FALSE(du.pending());
    for (int m = 0; m < 2; ++m) {
      test::reference_step(want[size_t(m)], hyper(1), 0.5f);
      EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "step 1, module " << m;
    }

    // Step 2 reads what the backward wrote during step 1's update.
    du.start({0, 1}, hyper(2), 1.0f);
    ASSERT_TRUE(du.finish().is_ok());
    for (int m = 0; m < 2; ++m) {
      want[size_t(m)].grad = next[size_t(m)];
      test::reference_step(want[size_t(m)], hyper(2), 1.0f);
      EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "step 2, module " << m;
    }
  }
}

// A read that fails on the update's thread is finish()'s error, named.
TEST(DelayedUpdate, AFailedReadIsFinishsError) {
  auto faults = std::make_shared<FaultPlan>();
  faults->fail_nth = 1;
  faults->fail_nth_kind = 1;  // reads
  StateRig r("eio", {5000}, {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048, true,
             faults);
  r.set_state(0, test::random_state(5000, 1));
  const std::vector<uint16_t> before = params_of(r, 0);
  DelayedUpdate du(*r.homes, *r.cache, *r.pipeline, r.counters);
  du.start({0}, hyper(1), 1.0f);
  Status s = du.finish();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.to_string().find("delayed optimizer update"), std::string::npos) << s.to_string();
  EXPECT_NE(s.to_string().find("reading m0 optimizer state"), std::string::npos) << s.to_string();
  EXPECT_EQ(params_of(r, 0), before);  // nothing published
  (void)r.pipeline->retire_writes(0);
}

// Destroyed while an update runs: it is joined (its result dropped), nothing left running.
TEST(DelayedUpdate, DestructionJoinsARunningUpdate) {
  StateRig r("join", {50'000}, {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 2048,
             true);
  r.set_state(0, test::random_state(50'000, 2));
  {
    DelayedUpdate du(*r.homes, *r.cache, *r.pipeline, r.counters);
    du.start({0}, hyper(1), 1.0f);
  }
  // The homes are still consistent: a plain pass over them runs.
  EXPECT_TRUE(r.pipeline->run({0}, hyper(2), 1.0f, nullptr).is_ok());
}

}  // namespace
}  // namespace strata
