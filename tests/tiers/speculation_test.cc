// The optimizer under backward (src/tiers/speculation.h) alone, over the optimizer pipeline on
// the CPU device: modules stepped as their gradients become final, with undo state kept in each
// way the header names (host-tier state stepped out of place, NVMe state into fresh extents, or
// host copies when the swap files have no room for them); a step that was speculated right is
// kept, one with another multiplier is undone and redone, a skipped one restored with its
// parameters re-derived, each with the bits of the plain schedule; without undo state a
// rollback is refused naming strata.optimizer.overlap.
#include "src/tiers/speculation.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/tiers/state_rig.h"

namespace strata {
namespace {

using test::ModuleState;
using test::StateRig;

OptimizerHyper hyper() { return test::step_hyper(3, 0.1f); }

struct Case {
  const char* name;
  Tier state;
  bool shadow_extents;
};
const Case kCases[] = {{"host state", Tier::kHost, false},
                       {"nvme state, shadow extents", Tier::kNvme, true},
                       {"nvme state, host copies", Tier::kNvme, false}};

enum class Outcome { kKept, kRedone, kSkipped };

// Speculates multiplier 1 for modules whose gradients become final in backward's order, then
// settles the step as `outcome` says; the state must be the plain schedule's.
void speculate(const Case& c, Outcome outcome, const std::string& name) {
  const std::vector<size_t> numel = {5000, 3000, 7000};
  StateRig r(name, numel, {Tier::kHost, c.state, c.state, Tier::kHost, 1.0}, 2048);
  Speculation spec(*r.homes, *r.pipeline, *r.stamps, c.shadow_extents, r.counters, r.errors);
  std::vector<ModuleState> want;
  for (int m = 0; m < 3; ++m) {
    want.push_back(test::random_state(numel[size_t(m)], 500 + m));
    r.set_state(m, want.back());
  }
  const std::vector<ModuleState> before = want;
  spec.begin(hyper(), 1.0f, /*keep_undo=*/true, /*step_modules=*/true);
  EXPECT_TRUE(spec.active());
  for (int m = 2; m >= 0; --m) {
    spec.grads_final(m);
    ASSERT_TRUE(spec.step_ready(false).is_ok());
  }
  ASSERT_TRUE(spec.step_ready(true).is_ok());
  EXPECT_TRUE(spec.stepped_any());
  EXPECT_EQ(spec.stepped_mask(), (std::vector<bool>{true, true, true}));
  EXPECT_TRUE(spec.matches(hyper(), 1.0f));
  EXPECT_FALSE(spec.matches(hyper(), 0.5f));
  OptimizerHyper later = hyper();
  later.step = 4;
  EXPECT_FALSE(spec.matches(later, 1.0f));
  switch (outcome) {
    case Outcome::kKept:
      for (auto& w : want) test::reference_step(w, hyper(), 1.0f);
      break;
    case Outcome::kRedone:  // clipping: the real multiplier is 0.5
      ASSERT_TRUE(spec.undo(true, hyper(), 0.5f).is_ok());
      for (auto& w : want) test::reference_step(w, hyper(), 0.5f);
      break;
    case Outcome::kSkipped:  // non-finite gradients: the state as it was
      ASSERT_TRUE(spec.undo(false, hyper(), 1.0f).is_ok());
      break;
  }
  spec.end();
  EXPECT_FALSE(spec.active());
  r.pipeline->end_step();
  ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
  EXPECT_TRUE(r.errors.take().is_ok());
  for (int m = 0; m < 3; ++m) {
    EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "module " << m;
  }
  if (outcome == Outcome::kSkipped) {
    for (int m = 0; m < 3; ++m) EXPECT_TRUE(test::same_bits(r.state(m), before[size_t(m)]));
  }
  // The homes the speculation swapped and the extents it freed leave a consistent tier: a
  // plain pass over it gives the reference's next step.
  OptimizerHyper next = hyper();
  next.step = 4;
  ASSERT_TRUE(r.pipeline->run({0, 1, 2}, next, 1.0f, nullptr).is_ok());
  ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
  for (int m = 0; m < 3; ++m) {
    test::reference_step(want[size_t(m)], next, 1.0f);
    EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "next step, module " << m;
  }
}

TEST(Speculation, ASpeculatedStepIsKept) {
  int i = 0;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    speculate(c, Outcome::kKept, "kept" + std::to_string(i++));
  }
}

TEST(Speculation, AnotherMultiplierIsUndoneAndRedoneBitIdentically) {
  int i = 0;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    speculate(c, Outcome::kRedone, "redo" + std::to_string(i++));
  }
}

TEST(Speculation, ASkippedStepRestoresTheState) {
  int i = 0;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    speculate(c, Outcome::kSkipped, "skip" + std::to_string(i++));
  }
}

// Stepped without undo state (bf16 without clipping), a rollback is refused, naming the module
// and the key that turns the optimizer under backward off.
TEST(Speculation, RollbackWithoutUndoStateNamesTheKey) {
  StateRig r("noundo", {5000}, {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 2048);
  Speculation spec(*r.homes, *r.pipeline, *r.stamps, false, r.counters, r.errors);
  r.set_state(0, test::random_state(5000, 9));
  spec.begin(hyper(), 1.0f, /*keep_undo=*/false, /*step_modules=*/true);
  spec.grads_final(0);
  ASSERT_TRUE(spec.step_ready(true).is_ok());
  EXPECT_EQ(spec.stepped_mask(), std::vector<bool>{true});
  Status s = spec.undo(true, hyper(), 0.5f);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("m0"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("strata.optimizer.overlap: false"), std::string::npos) << s.message();
  // A skip (non-finite gradients) says first that training diverged, and what to change; it
  // named bf16 whatever the dtype.
  s = spec.undo(false, hyper(), 0.0f);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.message().find("the gradients are not finite (inf or nan): training diverged; "
                             "lower optimizer.params.lr"),
            0u)
      << s.message();
  EXPECT_NE(s.message().find("strata.optimizer.overlap: false"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find("bf16"), std::string::npos) << s.message();
  spec.end();
  r.pipeline->end_step();
}

// Without stepping (the step deferred to the next forward), modules whose gradients are final
// are only read ahead: nothing is stepped, the state is unchanged.
TEST(Speculation, WithoutSteppingNothingIsStepped) {
  StateRig r("nostep", {5000, 3000}, {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0},
             2048);
  Speculation spec(*r.homes, *r.pipeline, *r.stamps, true, r.counters, r.errors);
  const ModuleState s0 = test::random_state(5000, 1), s1 = test::random_state(3000, 2);
  r.set_state(0, s0);
  r.set_state(1, s1);
  spec.begin(hyper(), 1.0f, true, /*step_modules=*/false);
  spec.grads_final(1);
  spec.grads_final(0);
  ASSERT_TRUE(spec.step_ready(true).is_ok());
  EXPECT_FALSE(spec.stepped_any());
  EXPECT_GT(r.pipeline->prepared_count(), 0u);  // read ahead for the deferred pass
  spec.end();
  r.pipeline->end_step();
  EXPECT_TRUE(test::same_bits(r.state(0), s0));
  EXPECT_TRUE(test::same_bits(r.state(1), s1));
}

// Host-tier state speculated step after step, kept or rolled back: the undo room holds one
// step's undo state (each step reuses the buffers the last one's held), the arena's use is
// where it started, and the state is the plain schedule's.
TEST(Speculation, StepAfterStepReusesTheUndoRoom) {
  const std::vector<size_t> numel = {5000, 3000, 7000};
  StateRig r("reuse", numel, {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 2048);
  Speculation spec(*r.homes, *r.pipeline, *r.stamps, false, r.counters, r.errors);
  std::vector<ModuleState> want;
  for (int m = 0; m < 3; ++m) {
    want.push_back(test::random_state(numel[size_t(m)], 700 + m));
    r.set_state(m, want.back());
  }
  const size_t arena = r.homes->pool().in_use();
  size_t room = 0;
  for (int step = 3; step < 7; ++step) {
    OptimizerHyper h = test::step_hyper(step, 0.1f);
    spec.begin(h, 1.0f, /*keep_undo=*/true, /*step_modules=*/true);
    for (int m = 2; m >= 0; --m) {
      spec.grads_final(m);
      ASSERT_TRUE(spec.step_ready(false).is_ok());
    }
    ASSERT_TRUE(spec.step_ready(true).is_ok());
    ASSERT_EQ(spec.stepped_mask(), (std::vector<bool>{true, true, true})) << "step " << step;
    const float mult = step % 2 ? 0.5f : 1.0f;  // odd steps clip: rolled back and redone
    if (mult != 1.0f) {
      ASSERT_TRUE(spec.undo(true, h, mult).is_ok());
    }
    for (auto& w : want) test::reference_step(w, h, mult);
    spec.end();
    r.pipeline->end_step();
    ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
    ASSERT_TRUE(r.errors.take().is_ok());
    if (step == 3) room = r.homes->undo_capacity();
    EXPECT_EQ(r.homes->undo_capacity(), room) << "step " << step << " took more undo room";
    EXPECT_EQ(r.homes->pool().in_use(), arena) << "step " << step;
    for (int m = 0; m < 3; ++m) {
      EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)]))
          << "step " << step << " module " << m;
    }
  }
  EXPECT_GT(room, 0u);
}

// Once every gradient of the step is final the norm is known: the modules the optimizer has
// not reached by then are left to the step after validation, exactly, and take no undo room;
// the room holds the undo buffers of the modules stepped under backward, no more. The state is
// the plain schedule's.
TEST(Speculation, ModulesLeftOnceEveryGradientIsFinalTakeNoUndoRoom) {
  const std::vector<size_t> numel = {5000, 3000, 7000};
  StateRig r("left", numel, {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 2048);
  Speculation spec(*r.homes, *r.pipeline, *r.stamps, false, r.counters, r.errors);
  std::vector<ModuleState> want;
  for (int m = 0; m < 3; ++m) {
    want.push_back(test::random_state(numel[size_t(m)], 900 + m));
    r.set_state(m, want.back());
  }
  spec.begin(hyper(), 1.0f, /*keep_undo=*/true, /*step_modules=*/true);
  spec.grads_final(2);
  ASSERT_TRUE(r.dev->synchronize(r.dev->d2h_stream()).is_ok());
  ASSERT_TRUE(spec.step_ready(false).is_ok());  // module 2 under backward
  spec.grads_final(1);
  spec.grads_final(0);
  ASSERT_TRUE(r.dev->synchronize(r.dev->d2h_stream()).is_ok());
  ASSERT_TRUE(spec.step_ready(true).is_ok());  // every gradient final: 1 and 0 left
  const std::vector<bool> stepped = spec.stepped_mask();
  EXPECT_EQ(stepped, (std::vector<bool>{false, false, true}));
  const Module& two = r.homes->module(2);
  auto page = [](size_t b) { return (b + 4095) / 4096 * 4096; };
  EXPECT_EQ(r.homes->undo_capacity(), page(two.master.bytes) + page(two.mom.bytes));
  ASSERT_TRUE(spec.matches(hyper(), 1.0f));
  ASSERT_TRUE(r.pipeline->run(r.pipeline->step_order(stepped), hyper(), 1.0f, nullptr).is_ok());
  spec.end();
  r.pipeline->end_step();
  ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
  ASSERT_TRUE(r.errors.take().is_ok());
  for (int m = 0; m < 3; ++m) {
    test::reference_step(want[size_t(m)], hyper(), 1.0f);
    EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "module " << m;
  }
}

// A run that steps nothing under backward any more gives the undo room back: the host-tier homes
// a kept step left in the room go back to the arena buffers they swapped with, every region is
// freed, the slots read ahead point at the homes where they are now, and later speculations
// take no undo room (their modules are stepped after backward). The state is the plain
// schedule's throughout; master weights in the host tier, moments there or on NVMe.
TEST(Speculation, TheUndoRoomIsGivenBackWithTheHomesInTheArena) {
  const std::vector<size_t> numel = {5000, 3000, 7000};
  for (Tier moments : {Tier::kHost, Tier::kNvme}) {
    SCOPED_TRACE(moments == Tier::kHost ? "moments in the host tier" : "moments on NVMe");
    StateRig r(moments == Tier::kHost ? "give_back_host" : "give_back_nvme", numel,
               {Tier::kHost, Tier::kHost, moments, Tier::kHost, 1.0}, 2048);
    Speculation spec(*r.homes, *r.pipeline, *r.stamps, /*shadow_extents=*/true, r.counters,
                     r.errors);
    std::vector<ModuleState> want;
    for (int m = 0; m < 3; ++m) {
      want.push_back(test::random_state(numel[size_t(m)], 1100 + m));
      r.set_state(m, want.back());
    }
    const size_t arena = r.homes->pool().in_use();
    auto speculated_step = [&](int step, bool expect_stepped) {
      const OptimizerHyper h = test::step_hyper(step, 0.1f);
      spec.begin(h, 1.0f, /*keep_undo=*/true, /*step_modules=*/true);
      for (int m = 2; m >= 0; --m) {
        spec.grads_final(m);
        ASSERT_TRUE(spec.step_ready(false).is_ok());
      }
      ASSERT_TRUE(spec.step_ready(true).is_ok());
      EXPECT_EQ(spec.stepped_any(), expect_stepped) << "step " << step;
      const std::vector<bool> stepped = spec.stepped_mask();
      ASSERT_TRUE(r.pipeline->run(r.pipeline->step_order(stepped), h, 1.0f, nullptr).is_ok());
      spec.end();
      r.pipeline->end_step();
      ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
      ASSERT_TRUE(r.errors.take().is_ok());
      for (auto& w : want) test::reference_step(w, h, 1.0f);
    };
    speculated_step(3, true);  // kept: the master weights' homes are now in the room
    const Module& two = r.homes->module(2);
    ASSERT_TRUE(r.homes->in_undo_room(two.master.host.data()));
    const size_t room = r.homes->undo_capacity();
    ASSERT_GT(room, 0u);
    // The next step's state read ahead (slots pointing into the homes), then the room given back.
    for (int m = 0; m < 3; ++m) {
      for (size_t j = 0; j < r.pipeline->sub_groups(m); ++j) {
        ASSERT_TRUE(r.pipeline->prepare(m, j, false).is_ok());
      }
    }
    EXPECT_EQ(spec.release_undo_room(), room);
    EXPECT_EQ(r.homes->undo_given_back(), room);
    EXPECT_EQ(r.homes->undo_capacity(), room) << "the room taken, given back or not";
    EXPECT_EQ(r.homes->undo_in_use(), 0u);
    EXPECT_EQ(r.homes->host_capacity(), r.homes->pool().capacity() + room);
    for (int m = 0; m < 3; ++m) {
      const Module& mod = r.homes->module(m);
      EXPECT_FALSE(r.homes->in_undo_room(mod.master.host.data())) << "module " << m;
      EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "module " << m;
    }
    // A plain pass steps the slots read ahead; a speculation after it steps nothing under
    // backward (no undo room) and leaves its modules to the step after backward.
    OptimizerHyper h = test::step_hyper(4, 0.1f);
    ASSERT_TRUE(r.pipeline->run({0, 1, 2}, h, 1.0f, nullptr).is_ok());
    r.pipeline->end_step();
    ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
    for (auto& w : want) test::reference_step(w, h, 1.0f);
    speculated_step(5, false);
    EXPECT_EQ(r.homes->undo_in_use(), 0u);
    EXPECT_EQ(r.homes->pool().in_use(), arena);
    for (int m = 0; m < 3; ++m) {
      EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "module " << m;
    }
  }
}

}  // namespace
}  // namespace strata
