// The exact schedules against the plain one, on configurations drawn at random: the
// optimizer under backward, rolled back, deferred into the next forward or run after backward,
// the state read ahead, forwards and backwards grouped, a resume — every loss, every skipped
// step and the final weights must be the plain schedule's (overlap off, one micro-batch at a
// time) bit for bit, whatever the model, placement, accumulation, precision and clipping. Half
// the cases move the placement and budgets to the second run too: its numbers must be those of
// the plain schedule with everything in host memory (no tier changes a bit); where such a case
// stops and resumes, it runs up to the stop with the plain run's placement and resumes in the
// drawn one (the checkpoint's state moved into other tiers).
//
// Each case draws what decides the numbers (model, batch, precision and forced fp16 overflows,
// clipping from never to always biting, activations, placement, sub-group size, device and host
// budgets) and runs it twice: plain, and with the schedule's knobs drawn too
// (strata.optimizer.defer and read_ahead, strata.grouped_forwards and grouped_backwards, the
// staging buffers, the prefetch, and in some cases a stop and resume from a checkpoint). A
// combination the config refuses, or one that does not fit, is drawn again.
//
// Case/ScheduleFuzz.*/N (kCases of them, across placements for odd N) runs the first accepted
// combination from seed 100 * (N + 1). To look further (STRATA_SCHEDULE_FUZZ_ACROSS=1 for
// across placements):
//   STRATA_SCHEDULE_FUZZ_CASES=200 STRATA_SCHEDULE_FUZZ_SEED=1000 build/tests/schedule_fuzz_test
//     --gtest_filter='ScheduleFuzzExplore.*'
// A failure prints the seed and both runs' overrides (replay: STRATA_SCHEDULE_FUZZ_SEED=<seed>
// STRATA_SCHEDULE_FUZZ_CASES=1 with the Explore filter). STRATA_SCHEDULE_FUZZ_UNADDRESSABLE=1
// runs both on the CPU backend wrapped as a device the host cannot address (as a GPU): new
// parameters through staging pieces, later micro-batches' gradients through landing buffers,
// the host tier's arena as a GPU's sizes it.
#include "tests/schedule_fuzz.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;

constexpr int kCases = 20;  // the seeds ctest runs (each its own test)

using test::draw_case;
using test::FuzzCase;

// What the schedules did in the cases run (Explore prints it: the drawing reaches them).
struct Reached {
  int deferred = 0, rolled_back = 0, under_backward = 0, skipped = 0, read_ahead = 0, grouped = 0,
      resumed = 0;
} reached;

bool run_case(uint64_t seed, bool across) {
  const std::string dir = test::temp_dir("strata_schedule_fuzz", std::to_string(seed));
  const FuzzCase c = draw_case(seed, dir, across);
  auto plain_ov = c.shared;
  plain_ov.insert(plain_ov.end(), c.plain.begin(), c.plain.end());
  plain_ov.insert(plain_ov.end(), {"strata.optimizer.overlap=false", "strata.grouped_forwards=1",
                                   "strata.grouped_backwards=false"});
  auto cfg_plain = parse_config(
      test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"), "tiny-cpu", [&] {
        std::vector<std::string> ov = {"train.checkpoint_dir=\"" + dir + "/plain\"",
                                       "train.eval_interval=0", "steps_per_print=1000"};
        ov.insert(ov.end(), plain_ov.begin(), plain_ov.end());
        return ov;
      }());
  const bool verbose = std::getenv("STRATA_SCHEDULE_FUZZ_VERBOSE") != nullptr;
  if (!cfg_plain.is_ok()) {
    if (verbose)
      printf("seed %llu refused: %s\n", (unsigned long long)seed,
             cfg_plain.status().to_string().c_str());
    fs::remove_all(dir);
    return false;
  }
  TrainOptions quiet;
  quiet.progress = false;
  const bool unaddressable = std::getenv("STRATA_SCHEDULE_FUZZ_UNADDRESSABLE") != nullptr;
  if (unaddressable) quiet.wrap_device = test::on_unaddressable_device().wrap_device;
  auto plain = train(*cfg_plain, quiet);
  if (!plain.is_ok()) {  // does not fit, or the combination is refused at start
    if (verbose)
      printf("seed %llu refused: %s\n", (unsigned long long)seed,
             plain.status().to_string().c_str());
    fs::remove_all(dir);
    return false;
  }
  SCOPED_TRACE("seed " + std::to_string(seed) + "\n" + c.describe());
  if (verbose) printf("seed %llu:\n%s\n", (unsigned long long)seed, c.describe().c_str());
  auto sched_ov = c.shared;
  sched_ov.insert(sched_ov.end(), c.schedule.begin(), c.schedule.end());
  Config cfg = test::tiny_cpu(dir + "/sched", sched_ov);
  std::vector<double> losses;
  std::vector<uint8_t> skipped;
  TrainResult last;
  // The first run of the schedule may be refused before it starts where the plain one was not:
  // an explicit strata.grouped_forwards whose activation sets the device does not hold (the
  // preflight names the key and the fix), or, on a device the host cannot address, a drawn
  // placement that splits a module's optimizer state between device and host. Drawn again, as a
  // refused combination is.
  auto refused_at_start = [&](const Status& st) {
    const bool split = unaddressable && st.message().find(
                                            "optimizer state split between the "
                                            "device and the host") != std::string::npos;
    if (st.message().find("preflight") == std::string::npos && !split) return false;
    if (verbose)
      printf("seed %llu refused: %s\n", (unsigned long long)seed, st.to_string().c_str());
    fs::remove_all(dir);
    return true;
  };
  if (c.stop_at > 0) {
    cfg.train.checkpoint_interval = c.stop_at;
    TrainOptions first = quiet;
    first.stop_at_step = c.stop_at;
    // Across placements, the run before the stop keeps the plain run's placement: the resume
    // moves the checkpoint's state into the drawn tiers (as a user changing the offload
    // between runs does).
    Config before = cfg;
    if (across) {
      std::vector<std::string> ov = c.shared;
      for (const std::string& kv : c.schedule) {
        bool placement = false;
        for (const char* p :
             {"zero_optimization.offload_", "strata.placement.", "zero_optimization.sub_group_size",
              "device.memory_limit", "strata.host_memory_limit"}) {
          placement |= kv.rfind(p, 0) == 0 && kv.find("buffer_count") == std::string::npos;
        }
        if (!placement) ov.push_back(kv);
      }
      ov.insert(ov.end(), c.plain.begin(), c.plain.end());
      before = test::tiny_cpu(dir + "/sched", ov);
      before.train.checkpoint_interval = c.stop_at;
    }
    auto r1 = train(before, first);
    if (!r1.is_ok() && refused_at_start(r1.status())) return false;
    EXPECT_TRUE(r1.is_ok()) << r1.status().to_string();
    if (!r1.is_ok()) return true;
    EXPECT_TRUE(r1->stopped_early);
    losses = r1->losses;
    skipped = r1->step_skipped;
    TrainOptions again = quiet;
    again.resume = "latest";
    auto r2 = train(cfg, again);
    // Across placements the resume is the drawn placement's first start.
    if (!r2.is_ok() && across && refused_at_start(r2.status())) return false;
    EXPECT_TRUE(r2.is_ok()) << r2.status().to_string();
    if (!r2.is_ok()) return true;
    last = *r2;
  } else {
    auto r = train(cfg, quiet);
    if (!r.is_ok() && refused_at_start(r.status())) return false;
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    if (!r.is_ok()) return true;
    last = *r;
  }
  losses.insert(losses.end(), last.losses.begin(), last.losses.end());
  skipped.insert(skipped.end(), last.step_skipped.begin(), last.step_skipped.end());
  EXPECT_EQ(losses.size(), size_t(c.steps));
  EXPECT_EQ(plain->losses.size(), size_t(c.steps));
  for (size_t i = 0; i < losses.size() && i < plain->losses.size(); ++i) {
    EXPECT_EQ(losses[i], plain->losses[i]) << "loss differs at step " << i + 1;
  }
  EXPECT_EQ(skipped, plain->step_skipped) << "fp16 skipped other steps";
  EXPECT_EQ(last.weights_crc, plain->weights_crc) << "final weights differ";
  EXPECT_FALSE(last.approximate);
  reached.deferred += last.schedule.modules_deferred > 0;
  reached.rolled_back += last.schedule.rollbacks > 0;
  reached.under_backward += last.schedule.modules_stepped_under_backward > 0;
  reached.skipped += last.skipped_steps > 0;
  reached.read_ahead += last.schedule.sub_groups_read_ahead > 0;
  reached.grouped += last.forward_group > 1;
  reached.resumed += c.stop_at > 0;
  fs::remove_all(dir);
  return true;
}

class ScheduleFuzz : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { set_log_level(LogLevel::kError); }
};

// Case N runs the first combination at or after seed 100 * N that the config accepts and fits.
TEST_P(ScheduleFuzz, SameBitsAsThePlainSchedule) {
  const bool across = GetParam() % 2 == 0;
  EXPECT_TRUE(test::run_first_accepted(100 * uint64_t(GetParam()), 100,
                                       [&](uint64_t seed) { return run_case(seed, across); }))
      << "no combination from seed " << 100 * GetParam() << " was accepted: the drawing is broken";
}

INSTANTIATE_TEST_SUITE_P(Case, ScheduleFuzz, ::testing::Range(1, kCases + 1));

// Further seeds on demand (not in ctest: it skips without STRATA_SCHEDULE_FUZZ_CASES).
TEST(ScheduleFuzzExplore, Explore) {
  set_log_level(LogLevel::kError);
  const bool across = std::getenv("STRATA_SCHEDULE_FUZZ_ACROSS") != nullptr;
  test::Explored e;
  if (!test::explore_seeds(
          "STRATA_SCHEDULE_FUZZ", [&](uint64_t seed) { return run_case(seed, across); }, &e)) {
    GTEST_SKIP() << "set STRATA_SCHEDULE_FUZZ_CASES (and STRATA_SCHEDULE_FUZZ_SEED) to run";
  }
  printf(
      "%d cases run, %d combinations refused; cases with: a deferred pass %d, a rollback %d, "
      "modules stepped under backward %d, fp16 skips %d, state read ahead %d, forwards "
      "grouped %d, a resume %d\n",
      e.ran, e.refused, reached.deferred, reached.rolled_back, reached.under_backward,
      reached.skipped, reached.read_ahead, reached.grouped, reached.resumed);
}

}  // namespace
}  // namespace strata
