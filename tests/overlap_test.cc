// The optimizer under backward: stepping each module's optimizer state as soon as its
// gradients are final, speculatively, must give bit-identical losses and weights to the plain
// schedule (all of backward, then the optimizer) — with clipping on and off, bf16 and fp16 with
// forced overflows, and optimizer state in host memory and on NVMe. The delayed update trains
// but is approximate.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "src/train/defer_choice.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"
#include "tests/wrapped_device.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) { return test::temp_dir("strata_overlap", name); }

using test::read_file;

// configs/tiny-cpu.json (README's default job, clipping 1.0) for 30 steps, with overrides.
Config tiny(const std::string& dir, const std::vector<std::string>& extra) {
  return test::tiny_cpu(dir, {"train.steps=30"}, extra);
}

using test::must_train;

std::vector<std::string> placement(const std::string& dir, bool nvme) {
  if (!nvme) {
    return {"zero_optimization.offload_param.device=\"cpu\"",
            "zero_optimization.offload_optimizer.device=\"cpu\""};
  }
  fs::create_directories(dir + "/swap");
  const std::string path = "\"" + dir + "/swap\"";
  return {"zero_optimization.offload_param.device=\"nvme\"",
          "zero_optimization.offload_param.nvme_path=" + path,
          "zero_optimization.offload_optimizer.device=\"nvme\"",
          "zero_optimization.offload_optimizer.nvme_path=" + path};
}

struct Case {
  const char* name;
  bool clip, fp16, nvme;
};

// The same `steps`-step run with the plain schedule and with the overlap; every loss and the
// final weights must be bit-identical.
struct PlainAndOver {
  TrainResult plain, over;
};
PlainAndOver train_both(const std::string& dir, const std::vector<std::string>& ov, size_t steps) {
  auto plain_ov = ov, over_ov = ov;
  plain_ov.push_back("strata.optimizer.overlap=false");
  over_ov.push_back("strata.optimizer.overlap=true");
  PlainAndOver r{must_train(tiny(dir + "/plain", plain_ov)),
                 must_train(tiny(dir + "/over", over_ov))};
  EXPECT_EQ(r.plain.losses.size(), steps);
  EXPECT_EQ(r.over.losses.size(), steps);
  for (size_t s = 0; s < steps && s < r.plain.losses.size() && s < r.over.losses.size(); ++s) {
    EXPECT_EQ(r.over.losses[s], r.plain.losses[s]) << "loss differs at step " << s + 1;
  }
  EXPECT_EQ(r.over.weights_crc, r.plain.weights_crc) << "final weights differ";
  return r;
}

class OverlapTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }
};

TEST_P(OverlapTest, OverlappedScheduleIsBitIdentical) {
  const Case c = GetParam();
  auto dir = temp_dir(c.name);
  std::vector<std::string> ov = placement(dir, c.nvme);
  // 2.0 clips some steps and not others (this config's norms fall from ~3 to ~1 over its 30
  // steps): a step after one that clipped is deferred, one after one that did not is
  // speculated, and rolled back when it clips after all.
  ov.push_back(c.clip ? "gradient_clipping=2.0" : "gradient_clipping=0");
  if (c.fp16) {
    // 2^24 overflows fp16 gradients at first: the scaler skips and halves (hysteresis 1), and
    // the window of 4 doubles the scale into overflow again later.
    for (const char* s : {"bf16.enabled=false", "fp16.enabled=true", "fp16.initial_scale_power=24",
                          "fp16.hysteresis=1", "fp16.loss_scale_window=4"}) {
      ov.push_back(s);
    }
  }
  const auto [plain, over] = train_both(dir, ov, 30);
  EXPECT_EQ(over.skipped_steps, plain.skipped_steps);
  EXPECT_EQ(plain.schedule.rollbacks, 0u);
  EXPECT_LT(plain.losses.back(), plain.losses.front() - 0.5) << "the reference did not train";
  if (c.fp16) {
    EXPECT_GT(plain.skipped_steps, 0) << "the test meant to force overflows";
  }
  EXPECT_GT(over.schedule.modules_stepped_under_backward, 0u)
      << "nothing was stepped under backward";
  // Each step's schedule: the plain run never steps under backward; a rolled-back step is one
  // rollback.
  ASSERT_EQ(plain.optimizer_schedule.size(), 30u);
  ASSERT_EQ(over.optimizer_schedule.size(), 30u);
  EXPECT_EQ(std::count(plain.optimizer_schedule.begin(), plain.optimizer_schedule.end(), 0), 30);
  EXPECT_EQ(uint64_t(std::count(over.optimizer_schedule.begin(), over.optimizer_schedule.end(), 2)),
            over.schedule.rollbacks);
  EXPECT_EQ(plain.schedule.modules_stepped_under_backward, 0u);
  // Clipping applies in the first steps of this config (norm > 1) and overflows skip steps:
  // both make the speculation roll back; bf16 without clipping never does.
  if (c.clip || c.fp16) {
    EXPECT_GT(over.schedule.rollbacks, 0u);
    EXPECT_GT(over.schedule.modules_redone, 0u);
    EXPECT_GT(std::count(over.optimizer_schedule.begin(), over.optimizer_schedule.end(), 3), 0)
        << "a step after a rolled-back one only reads ahead under backward, then is deferred";
  } else {
    EXPECT_EQ(over.schedule.rollbacks, 0u);
  }
  // Without undo state (bf16, no clipping) every module is stepped under backward; else the
  // steps after one that clipped or overflowed are deferred to the next forward.
  EXPECT_EQ(plain.schedule.modules_deferred, 0u);
  if (c.clip || c.fp16) {
    EXPECT_GT(over.schedule.modules_deferred, 0u);
  } else {
    EXPECT_EQ(over.schedule.modules_deferred, 0u);
  }
  EXPECT_GT(over.schedule.optimizer_s, 0.0);
  EXPECT_LE(over.schedule.optimizer_hidden_s, over.schedule.optimizer_s);
  EXPECT_FALSE(over.approximate);
  // Undo state without copies: host-homed state is stepped into a shadow buffer swapped in,
  // NVMe-homed state into fresh extents (the swap files have room here).
  EXPECT_EQ(over.schedule.undo_copy_bytes, 0u)
      << "the speculation copied optimizer state for its undo";
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Schedules, OverlapTest,
                         ::testing::Values(Case{"bf16_noclip_host", false, false, false},
                                           Case{"bf16_clip_host", true, false, false},
                                           Case{"bf16_clip_nvme", true, false, true},
                                           Case{"bf16_noclip_nvme", false, false, true},
                                           Case{"fp16_clip_host", true, true, false},
                                           Case{"fp16_noclip_nvme", false, true, true},
                                           Case{"fp16_clip_nvme", true, true, true}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::string(i.param.name);
                         });

using test::tier;

// Clipping that bites at every step: after the first step (speculated, rolled back)
// nothing is stepped under backward; each step's whole optimizer pass is deferred to the next
// forward, module by module, and the numbers are the plain schedule's bit for bit — with
// gradient accumulation, all state on NVMe (gradients too), a checkpoint and a resume in the
// middle. The NVMe bytes equal the plain schedule's: nothing is read or written twice.
TEST(DeferredStep, ClippingAtEveryStepIsBitIdenticalAndMovesNoExtraBytes) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("deferred");
  std::vector<std::string> ov = placement(dir, /*nvme=*/true);
  for (const char* s : {"gradient_clipping=0.01", "train.steps=12", "gradient_accumulation_steps=2",
                        "scheduler.params.warmup_num_steps=2",
                        // No prefetch and a device that holds every parameter: which fetches a
                        // prefetch saves, and which copies a tight device evicts, depend on
                        // timing, so the bytes moved would differ run to run on either schedule.
                        "zero_optimization.stage3_prefetch_bucket_size=0",
                        "device.memory_limit=\"256MiB\"", "train_batch_size=8",
                        "strata.placement.grads=\"nvme\"", "strata.host_memory_limit=\"64MiB\""}) {
    ov.push_back(s);
  }
  ov.push_back("strata.optimizer.defer=\"always\"");
  const auto [plain, over] = train_both(dir, ov, 12);
  auto over_ov = ov;
  over_ov.push_back("strata.optimizer.overlap=true");
  // With clipping on, the first step is expected to clip: no step is speculated (so none is
  // rolled back) and every one is deferred whole.
  EXPECT_EQ(over.schedule.rollbacks, 0u);
  EXPECT_EQ(over.schedule.modules_stepped_under_backward, 0u);
  EXPECT_EQ(std::count(over.optimizer_schedule.begin(), over.optimizer_schedule.end(), 3), 12);
  // Nothing read or written twice: the NVMe bytes are the plain schedule's.
  const auto pn = tier(plain, "nvme"), on = tier(over, "nvme");
  EXPECT_EQ(on.bytes_out, pn.bytes_out);
  EXPECT_EQ(on.bytes_in, pn.bytes_in);

  // Stopped after step 5 and resumed: the same losses as the uninterrupted run.
  Config first = tiny(dir + "/resume", over_ov);
  first.train.checkpoint_interval = 5;
  TrainOptions to;
  to.stop_at_step = 5;
  const TrainResult r1 = must_train(first, to);
  EXPECT_TRUE(r1.stopped_early);
  TrainOptions again;
  again.resume = "latest";
  const TrainResult r2 = must_train(first, again);
  ASSERT_EQ(r2.losses.size(), 7u);
  for (size_t s = 0; s < 7; ++s) EXPECT_EQ(r2.losses[s], plain.losses[5 + s]) << "step " << 6 + s;
  EXPECT_EQ(r2.weights_crc, plain.weights_crc);
  fs::remove_all(dir);
}

// The optimizer's read-ahead (strata.optimizer.read_ahead): with a host budget that
// holds the optimizer state besides the tier's needs, each step's master weights and moments are
// read during backward instead of while the next forward waits for its update. The numbers and
// the NVMe bytes are those of reading the pipeline's staging ahead and of the plain schedule;
// the arena grows by the read-ahead and stays within the budget. The same whether the pass is
// deferred into the next forward or runs after backward (which steps the sub-groups it holds
// first and reads the rest ahead as deep as the read-ahead's room, its reads before the writes
// draining behind).
// With the gradients on NVMe the pass reads each sub-group's accumulator with its state, within
// the read-ahead's room: the same numbers and bytes.
struct ReadAheadCase {
  const char* defer;
  const char* grads;
};

class ReadAhead : public ::testing::TestWithParam<ReadAheadCase> {};

TEST_P(ReadAhead, DuringBackwardIsBitIdentical) {
  set_log_level(LogLevel::kWarn);
  const ReadAheadCase c = GetParam();
  auto dir = temp_dir(std::string("read_ahead_") + c.defer + "_" + c.grads);
  std::vector<std::string> ov = placement(dir, /*nvme=*/true);
  for (const char* s :
       {"gradient_clipping=0.01", "train.steps=8", "gradient_accumulation_steps=2",
        "train_batch_size=8", "scheduler.params.warmup_num_steps=2",
        "zero_optimization.stage3_prefetch_bucket_size=0", "device.memory_limit=\"256MiB\"",
        "zero_optimization.sub_group_size=8192", "strata.host_memory_limit=\"256MiB\""}) {
    ov.push_back(s);
  }
  ov.push_back(std::string("strata.placement.grads=\"") + c.grads + "\"");
  ov.push_back(std::string("strata.optimizer.defer=\"") + c.defer + "\"");
  const auto [plain, over] = train_both(dir, ov, 8);  // read_ahead unset: auto
  auto zero_ov = ov;
  zero_ov.push_back("strata.optimizer.overlap=true");
  zero_ov.push_back("strata.optimizer.read_ahead=0");
  const TrainResult zero = must_train(tiny(dir + "/zero", zero_ov));
  ASSERT_EQ(zero.losses.size(), 8u);
  for (size_t s = 0; s < 8; ++s) EXPECT_EQ(zero.losses[s], plain.losses[s]) << "step " << s + 1;
  EXPECT_EQ(zero.weights_crc, plain.weights_crc);
  // Deferred (or stepped after backward) every step after the first; without the read-ahead
  // at most the pipeline's staging (2 * buffer_count + 1 = 9 sub-groups) read ahead per step;
  // with it, up to every one of the ~100 read ahead or kept from the last pass (how many
  // depends on how soon the last pass's writes behind free their buffers, and gradients on NVMe
  // share the room: more than the staging's on any machine).
  EXPECT_EQ(over.schedule.modules_stepped_under_backward, 0u);
  EXPECT_EQ(zero.schedule.modules_stepped_under_backward, 0u);
  EXPECT_GT(zero.schedule.sub_groups_read_ahead, 0u);
  EXPECT_LE(zero.schedule.sub_groups_read_ahead, 9u * 8);
  EXPECT_GT(over.schedule.sub_groups_read_ahead + over.schedule.sub_groups_kept, 9u * 8);
  std::printf("sub-groups read ahead in 8 steps: %lld with read_ahead auto, %lld with 0\n",
              (long long)over.schedule.sub_groups_read_ahead,
              (long long)zero.schedule.sub_groups_read_ahead);
  // Gradient accumulators on NVMe are read with the state in the pass, within the read-ahead's
  // room (which only the overlap has): none without it.
  const bool nvme_grads = std::string(c.grads) == "nvme";
  EXPECT_EQ(over.schedule.grad_sub_groups_read_ahead > 0, nvme_grads);
  EXPECT_EQ(zero.schedule.grad_sub_groups_read_ahead, 0u);
  // Those of sub-groups read ahead whose module's gradients became final before backward ended
  // (the later modules): read under the rest of backward (prepare_grads_of), not in the pass.
  EXPECT_EQ(over.schedule.grad_sub_groups_read_under_backward > 0, nvme_grads);
  EXPECT_LE(over.schedule.grad_sub_groups_read_under_backward,
            over.schedule.grad_sub_groups_read_ahead);
  EXPECT_EQ(zero.schedule.grad_sub_groups_read_under_backward, 0u);
  std::printf("gradient sub-groups read ahead in 8 steps: %lld, %lld of them under backward\n",
              (long long)over.schedule.grad_sub_groups_read_ahead,
              (long long)over.schedule.grad_sub_groups_read_under_backward);
  const auto zh = tier(zero, "host"), oh = tier(over, "host");
  EXPECT_GT(oh.capacity, zh.capacity);
  EXPECT_LE(oh.capacity, size_t(256) << 20);
  EXPECT_LE(oh.peak, oh.capacity);
  // Nothing read or written twice; and the sub-groups a pass kept in the read-ahead's room for
  // the next step (their staging, written from) are not read back: fewer reads than the plain
  // schedule's, the same writes. Without the read-ahead's room nothing is kept.
  const auto pn = tier(plain, "nvme"), zn = tier(zero, "nvme"), on = tier(over, "nvme");
  EXPECT_GT(over.schedule.sub_groups_kept, 0u);
  EXPECT_EQ(zero.schedule.sub_groups_kept, 0u);
  EXPECT_LT(on.bytes_out, pn.bytes_out);
  EXPECT_EQ(on.bytes_in, pn.bytes_in);
  EXPECT_EQ(zn.bytes_out, pn.bytes_out);
  EXPECT_EQ(zn.bytes_in, pn.bytes_in);
  std::printf("sub-groups kept in 8 steps: %lld; NVMe reads %llu (plain schedule %llu)\n",
              (long long)over.schedule.sub_groups_kept, (unsigned long long)on.bytes_out,
              (unsigned long long)pn.bytes_out);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(DeferredStep, ReadAhead,
                         ::testing::Values(ReadAheadCase{"always", "host"},
                                           ReadAheadCase{"never", "host"},
                                           ReadAheadCase{"always", "nvme"},
                                           ReadAheadCase{"never", "nvme"}),
                         [](const ::testing::TestParamInfo<ReadAheadCase>& i) {
                           return std::string(i.param.defer) + "_grads_" + i.param.grads;
                         });

TEST(DeferChoice, AutoTimesBothSchedulesThenKeepsTheFaster) {
  for (const bool deferral_faster : {true, false}) {
    DeferChoice c(DeferChoice::parse("auto"));
    std::vector<bool> defers;
    for (int i = 0; i < 3 * DeferChoice::kTrial; ++i) {
      defers.push_back(c.defer());
      const bool timed_deferred = i >= DeferChoice::kTrial && i < 2 * DeferChoice::kTrial;
      // The untimed steps (warm-up, the first after the switch) are the slowest of all.
      const double s = i < DeferChoice::kTrial || i == 2 * DeferChoice::kTrial ? 9.0
                       : timed_deferred == deferral_faster                     ? 1.0
                                                                               : 2.0;
      EXPECT_EQ(c.record(s), i == 3 * DeferChoice::kTrial - 1) << i;
    }
    for (int i = 0; i < 3 * DeferChoice::kTrial; ++i) {
      EXPECT_EQ(defers[size_t(i)], i < 2 * DeferChoice::kTrial) << "trial step " << i;
    }
    EXPECT_DOUBLE_EQ(c.deferred_median(), deferral_faster ? 1.0 : 2.0);
    EXPECT_DOUBLE_EQ(c.plain_median(), deferral_faster ? 2.0 : 1.0);
    c.decide(c.deferred_median(), c.plain_median());
    EXPECT_EQ(c.defer(), deferral_faster);
    EXPECT_FALSE(c.record(0.5)) << "decided once";
    EXPECT_EQ(c.defer(), deferral_faster);
  }
  EXPECT_TRUE(DeferChoice(DeferChoice::parse("always")).defer());
  EXPECT_FALSE(DeferChoice(DeferChoice::parse("never")).defer());
}

// strata.optimizer.speculate's trial does not time a step under backward that ran part of its
// modules after backward while their undo room was made ready (`settled` false): the trial
// starts once such steps end, and only its own steps decide; past kMaxUnsettled they count.
TEST(DeferChoice, StepsThatMadeUndoRoomReadyAreNotTimed) {
  DeferChoice c(DeferChoice::parse("auto"));
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(c.defer());
    EXPECT_FALSE(c.record(50.0, /*settled=*/false));
  }
  EXPECT_EQ(c.unsettled(), 5);
  for (int i = 0; i < 3 * DeferChoice::kTrial; ++i) {
    EXPECT_EQ(c.defer(), i < 2 * DeferChoice::kTrial) << "trial step " << i;
    const bool deferring = i < 2 * DeferChoice::kTrial;
    if (deferring) {
      EXPECT_FALSE(c.record(50.0, false)) << "an unsettled step between";
    }
    // After the deferring half `settled` does not apply (those steps do not defer): they count.
    EXPECT_EQ(c.record(deferring ? 1.0 : 2.0, /*settled=*/deferring),
              i == 3 * DeferChoice::kTrial - 1)
        << i;
  }
  EXPECT_EQ(c.unsettled(), 5 + 2 * DeferChoice::kTrial);
  EXPECT_DOUBLE_EQ(c.deferred_median(), 1.0) << "no unsettled step timed";
  EXPECT_DOUBLE_EQ(c.plain_median(), 2.0);

  DeferChoice capped(DeferChoice::parse("auto"));
  for (int i = 0; i < DeferChoice::kMaxUnsettled; ++i) EXPECT_FALSE(capped.record(50.0, false));
  for (int i = 0; i < 3 * DeferChoice::kTrial - 1; ++i) EXPECT_FALSE(capped.record(7.0, false));
  EXPECT_TRUE(capped.record(7.0, false)) << "past the cap, unsettled steps count";
  EXPECT_DOUBLE_EQ(capped.deferred_median(), 7.0);
}

// "auto" switches schedules in the middle of a run that clips at every step: 8 steps deferred,
// 4 after backward, then the faster; the losses and weights stay the plain schedule's.
TEST(DeferChoice, AutoSwitchesMidRunWithTheSameBits) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("defer_auto");
  std::vector<std::string> ov = placement(dir, /*nvme=*/true);
  for (const char* s : {"gradient_clipping=0.01", "gradient_accumulation_steps=2",
                        "scheduler.params.warmup_num_steps=2", "train_batch_size=8",
                        "train.steps=16", "strata.optimizer.defer=\"auto\""}) {
    ov.push_back(s);
  }
  const auto [plain, over] = train_both(dir, ov, 16);
  ASSERT_EQ(over.optimizer_schedule.size(), 16u);
  // Step 0 clips as expected (deferred), and every later step follows a clipped one.
  for (size_t s = 0; s < 8; ++s) EXPECT_EQ(over.optimizer_schedule[s], 3) << "step " << s;
  for (size_t s = 8; s < 12; ++s) EXPECT_EQ(over.optimizer_schedule[s], 0) << "step " << s;
  for (size_t s = 13; s < 16; ++s) {
    EXPECT_EQ(over.optimizer_schedule[s], over.optimizer_schedule[12]) << "decided at 12";
  }
  fs::remove_all(dir);
}

// strata.optimizer.speculate: with clipping that never bites, "never" runs every step as a
// clipped one (nothing stepped under backward: deferred into the next forward, or after
// backward); "auto" on a device the host cannot address (a GPU's paths, through the test
// double) speculates on the first 8 steps after an unclipped one, not on the next 4, then keeps
// the faster, and on the CPU backend is "always". Every loss and the weights stay the plain
// schedule's.
TEST(SpeculateChoice, NeverAndAutoKeepThePlainBits) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("speculate_choice");
  struct Run {
    const char* mode;
    bool gpu_paths;
  };
  for (const Run run : {Run{"never", false}, Run{"auto", true}, Run{"auto", false}}) {
    const std::string d = dir + "/" + run.mode + (run.gpu_paths ? "_gpu" : "_cpu");
    std::vector<std::string> ov = placement(d, /*nvme=*/false);
    for (const char* x :
         {"gradient_clipping=1000", "scheduler.params.warmup_num_steps=2", "train.steps=16"}) {
      ov.push_back(x);
    }
    ov.push_back(std::string("strata.optimizer.speculate=\"") + run.mode + "\"");
    TrainOptions o;
    if (run.gpu_paths) {
      o.wrap_device = [](std::unique_ptr<Device> dev) -> std::unique_ptr<Device> {
        return std::make_unique<test::WrappedDevice>(std::move(dev), /*host_addressable=*/false);
      };
    }
    auto plain_ov = ov, over_ov = ov;
    plain_ov.push_back("strata.optimizer.overlap=false");
    const TrainResult plain = must_train(tiny(d + "/plain", plain_ov), o);
    const TrainResult over = must_train(tiny(d + "/over", over_ov), o);
    std::string sched;
    for (uint8_t k : over.optimizer_schedule) sched += char('0' + k);
    SCOPED_TRACE(::testing::Message()
                 << run.mode << (run.gpu_paths ? " (GPU paths)" : "") << ", schedule " << sched);
    ASSERT_EQ(over.losses.size(), 16u);
    ASSERT_EQ(plain.losses.size(), 16u);
    for (size_t s = 0; s < 16; ++s) EXPECT_EQ(over.losses[s], plain.losses[s]) << "step " << s;
    EXPECT_EQ(over.weights_crc, plain.weights_crc);
    ASSERT_EQ(over.optimizer_schedule.size(), 16u);
    EXPECT_EQ(over.optimizer_schedule[0], 3) << "the first step follows no norm";
    EXPECT_EQ(over.schedule.rollbacks, 0u);
    if (std::string(run.mode) == "never") {
      // Deferred (3) or after backward (0), as strata.optimizer.defer's trial has it.
      for (size_t s = 1; s < 16; ++s) {
        EXPECT_TRUE(over.optimizer_schedule[s] == 3 || over.optimizer_schedule[s] == 0)
            << "step " << s;
      }
      EXPECT_EQ(over.schedule.modules_stepped_under_backward, 0u);
    } else if (!run.gpu_paths) {
      for (size_t s = 1; s < 16; ++s) EXPECT_EQ(over.optimizer_schedule[s], 1) << "step " << s;
    } else {
      for (size_t s = 1; s < 9; ++s) EXPECT_EQ(over.optimizer_schedule[s], 1) << "step " << s;
      for (size_t s = 9; s < 13; ++s) EXPECT_EQ(over.optimizer_schedule[s], 3) << "step " << s;
      for (size_t s = 14; s < 16; ++s) {
        EXPECT_EQ(over.optimizer_schedule[s], over.optimizer_schedule[13]) << "decided at 13";
      }
    }
  }
  fs::remove_all(dir);
}

// strata.optimizer.speculate "auto" that settles on not stepping under backward gives back the
// undo room its trial took (the homes a kept step left there copied back to the arena), whether
// a deferred step is pending then or not; one that settles on stepping under backward keeps it.
// The plain schedule's bits either way. The trial sees given times (TrainOptions::trial_time):
// steps under backward twice or half as long as the others.
TEST(SpeculateChoice, SettlingOnNotGivesTheUndoRoomBack) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("speculate_give_back");
  auto gpu_paths = [](std::unique_ptr<Device> dev) -> std::unique_ptr<Device> {
    return std::make_unique<test::WrappedDevice>(std::move(dev), /*host_addressable=*/false);
  };
  auto overrides = [&](const std::string& d) {
    std::vector<std::string> ov = placement(d, /*nvme=*/false);
    for (const char* x : {"gradient_clipping=1000", "scheduler.params.warmup_num_steps=2",
                          "train.steps=16", "strata.optimizer.speculate=\"auto\""}) {
      ov.push_back(x);
    }
    return ov;
  };
  TrainOptions o;
  o.wrap_device = gpu_paths;
  std::vector<std::string> plain_ov = overrides(dir + "/plain");
  plain_ov.push_back("strata.optimizer.overlap=false");
  const TrainResult plain = must_train(tiny(dir + "/plain", plain_ov), o);
  struct Run {
    const char* name;
    double under_backward_s;  // the trial's time of a step under backward (others: 1 s)
    const char* defer;
  };
  for (const Run run :
       {Run{"not, deferred", 2.0, "always"}, Run{"not, after backward", 2.0, "never"},
        Run{"under backward", 0.5, "always"}}) {
    const std::string d = dir + "/" + std::to_string(run.under_backward_s) + run.defer;
    std::vector<std::string> ov = overrides(d);
    ov.push_back(std::string("strata.optimizer.defer=\"") + run.defer + "\"");
    TrainOptions oo = o;
    oo.trial_time = [t = run.under_backward_s](int64_t, bool under_backward, double) {
      return under_backward ? t : 1.0;
    };
    const TrainResult over = must_train(tiny(d, ov), oo);
    std::string sched;
    for (uint8_t k : over.optimizer_schedule) sched += char('0' + k);
    SCOPED_TRACE(::testing::Message() << run.name << ", schedule " << sched);
    ASSERT_EQ(over.losses.size(), 16u);
    for (size_t s = 0; s < 16; ++s) EXPECT_EQ(over.losses[s], plain.losses[s]) << "step " << s;
    EXPECT_EQ(over.weights_crc, plain.weights_crc);
    const bool gives_back = run.under_backward_s > 1.0;
    for (size_t s = 13; s < 16; ++s) {
      EXPECT_EQ(over.optimizer_schedule[s] == 1, !gives_back) << "step " << s;
    }
    const auto host = std::find_if(over.tiers.begin(), over.tiers.end(),
                                   [](const TrainResult::TierUse& t) { return t.name == "host"; });
    ASSERT_NE(host, over.tiers.end());
    EXPECT_GT(host->undo_room, 0u) << "the trial's steps under backward took no undo room";
    EXPECT_EQ(host->undo_given_back, gives_back ? host->undo_room : 0u);
  }
  fs::remove_all(dir);
}

// The speculation under backward keeps the sub-groups it steps in the read-ahead's room for the
// next step, as a pass does, whether or not it holds undo state (without it, with clipping on
// but not biting, every step had read its whole state again — GPT-2 124M with the optimizer on
// NVMe moved 2.78 GiB a step where the minimum is 1.63). Clipping at 1000 never bites (every
// step after the first is speculated and kept: the same NVMe writes as the plain schedule,
// fewer reads); at 2.0 a step rolls back, which drops the kept slots before the restore writes
// the homes. The same bits as the plain schedule either way.
class SpeculationKeeps : public ::testing::TestWithParam<const char*> {};

TEST_P(SpeculationKeeps, SubGroupsForTheNextStepWithTheSameBits) {
  set_log_level(LogLevel::kWarn);
  const std::string clip = GetParam();
  auto dir = temp_dir("spec_keeps_" + clip);
  fs::create_directories(dir + "/swap");
  const std::string path = "\"" + dir + "/swap\"";
  const std::vector<std::string> ov = {"zero_optimization.offload_param.device=\"cpu\"",
                                       "zero_optimization.offload_optimizer.device=\"nvme\"",
                                       "zero_optimization.offload_optimizer.nvme_path=" + path,
                                       "gradient_clipping=" + clip,
                                       "train.steps=12",
                                       "scheduler.params.warmup_num_steps=2",
                                       "zero_optimization.sub_group_size=8192",
                                       "strata.host_memory_limit=\"256MiB\""};
  const auto [plain, over] = train_both(dir, ov, 12);
  EXPECT_GT(over.schedule.modules_stepped_under_backward, 0u);
  EXPECT_GT(over.schedule.sub_groups_kept, 0u);
  const auto pn = tier(plain, "nvme"), on = tier(over, "nvme");
  EXPECT_LT(on.bytes_out, pn.bytes_out);
  if (clip == "1000") {
    EXPECT_EQ(over.schedule.rollbacks, 0u);
    EXPECT_EQ(on.bytes_in, pn.bytes_in);
  } else {
    // A rolled-back module's state is written twice (stepped, then redone).
    EXPECT_GT(over.schedule.rollbacks, 0u);
    EXPECT_GT(on.bytes_in, pn.bytes_in);
  }
  std::printf("clipping %s: sub-groups kept %lld, rollbacks %lld; NVMe reads %llu (plain %llu)\n",
              clip.c_str(), (long long)over.schedule.sub_groups_kept,
              (long long)over.schedule.rollbacks, (unsigned long long)on.bytes_out,
              (unsigned long long)pn.bytes_out);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Clipping, SpeculationKeeps, ::testing::Values("1000", "2.0"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(i.param) == "1000" ? "never_bites" : "bites_some";
                         });

// With the optimizer state on NVMe, what a rollback restores stays on the disk: the speculative
// step is written to fresh (shadow) extents and the old ones are kept until the step is
// validated, so the NVMe peak holds the state twice (with host copies it would hold it once).
TEST(OverlapUndo, NvmeStateIsShadowedOnTheDiskNotCopiedToHost) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("shadow");
  fs::create_directories(dir + "/swap");
  const std::string path = "\"" + dir + "/swap\"";
  const std::vector<std::string> ov = {"zero_optimization.offload_param.device=\"cpu\"",
                                       "zero_optimization.offload_optimizer.device=\"nvme\"",
                                       "zero_optimization.offload_optimizer.nvme_path=" + path,
                                       "gradient_clipping=2.0",
                                       "train.steps=12",
                                       "scheduler.params.warmup_num_steps=2"};
  const auto [plain, over] = train_both(dir, ov, 12);
  ASSERT_GT(over.schedule.modules_stepped_under_backward, 0u);
  EXPECT_GT(over.schedule.rollbacks,
            0u);  // a step after an unclipped one clips: redone from the disk
  // NVMe holds only master + moments here: a speculated step shadows all of them, and every
  // old extent is freed again once a step is kept or rolled back.
  const auto pn = tier(plain, "nvme"), on = tier(over, "nvme");
  ASSERT_GT(pn.peak, 0u);
  EXPECT_EQ(on.peak, 2 * pn.peak);
  EXPECT_EQ(on.current, pn.current);
  fs::remove_all(dir);
}

// Host-homed optimizer state, blocks of 3.1 M parameters (12.6 MB of master weights: undo
// regions above Homes::kUndoPrepareBytes), clipping that never bites.
std::vector<std::string> large_blocks_in_host_ram(int steps) {
  return {"zero_optimization.offload_param.device=\"cpu\"",
          "zero_optimization.offload_optimizer.device=\"cpu\"",
          "model.n_layer=2",
          "model.n_embd=512",
          "model.n_head=8",
          "train_batch_size=4",
          "gradient_accumulation_steps=1",
          "device.memory_limit=\"256MiB\"",
          "gradient_clipping=1e6",
          "train.steps=" + std::to_string(steps),
          "scheduler.params.warmup_num_steps=2"};
}

// Undo buffers of a module whose region is large (a fresh region's pages cost the kernel's
// faults) come from regions made ready off the step's thread: the first step that would
// speculate such a module stops there and steps the rest after backward (undo_not_ready); a
// later step, its region ready, steps it under backward. The same bits as the plain schedule.
TEST(OverlapUndo, LargeModulesUndoRegionsAreMadeReadyOffTheStep) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("undo_ready");
  const auto [plain, over] = train_both(dir, large_blocks_in_host_ram(12), 12);
  EXPECT_GT(over.schedule.undo_not_ready, 0u) << "a large region was taken on the step's thread";
  // Every speculated step (all but the first) steps the final norm, whose undo buffers are
  // small; a block is stepped too once its regions are ready.
  EXPECT_GT(over.schedule.modules_stepped_under_backward, 11u)
      << "no region made ready was used by a later step";
  EXPECT_EQ(plain.schedule.undo_not_ready, 0u);
  fs::remove_all(dir);
}

// strata.optimizer.speculate "auto" on a device the host cannot address (a GPU's paths, through
// the test double) with blocks whose undo regions are made ready off the step's thread: the
// steps that stepped part of the optimizer after backward for want of them are not timed, so
// the trial's 8 steps under backward start once the regions are ready (one such step per block
// here), then 4 not under backward, then the faster. The plain schedule's bits throughout.
TEST(OverlapUndo, SpeculateAutoTimesStepsWhoseUndoRoomIsReady) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("undo_ready_auto");
  std::vector<std::string> ov = large_blocks_in_host_ram(18);
  ov.push_back("strata.optimizer.speculate=\"auto\"");
  TrainOptions o;
  o.wrap_device = [](std::unique_ptr<Device> dev) -> std::unique_ptr<Device> {
    return std::make_unique<test::WrappedDevice>(std::move(dev), /*host_addressable=*/false);
  };
  auto plain_ov = ov;
  plain_ov.push_back("strata.optimizer.overlap=false");
  const TrainResult plain = must_train(tiny(dir + "/plain", plain_ov), o);
  const TrainResult over = must_train(tiny(dir + "/over", ov), o);
  ASSERT_EQ(over.losses.size(), 18u);
  for (size_t s = 0; s < 18; ++s) EXPECT_EQ(over.losses[s], plain.losses[s]) << "step " << s;
  EXPECT_EQ(over.weights_crc, plain.weights_crc);
  std::string sched;
  for (uint8_t k : over.optimizer_schedule) sched += char('0' + k);
  SCOPED_TRACE("schedule " + sched);
  // At most one module a step waits for its region: each such step counts once.
  const size_t warm = over.schedule.undo_not_ready;
  ASSERT_GT(warm, 0u) << "no step waited for an undo region";
  const size_t trial = 1 + warm + 2 * size_t(DeferChoice::kTrial);  // past the last under it
  ASSERT_LE(trial + DeferChoice::kTrial, 18u);
  for (size_t s = 1; s < trial; ++s) EXPECT_EQ(over.optimizer_schedule[s], 1) << "step " << s;
  for (size_t s = trial; s < trial + DeferChoice::kTrial; ++s) {
    EXPECT_NE(over.optimizer_schedule[s], 1) << "step " << s << ": the trial's other half";
  }
  fs::remove_all(dir);
}

TEST(DelayedUpdate, TrainsAndIsReportedApproximate) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("delayed");
  auto ov = placement(dir, /*nvme=*/true);
  const TrainResult exact = must_train(tiny(dir + "/exact", ov));
  ov.push_back("strata.optimizer.delayed_update=true");
  ov.push_back("strata.optimizer.delayed_update_warmup=5");
  const TrainResult dpu = must_train(tiny(dir + "/dpu", ov));
  ASSERT_EQ(dpu.losses.size(), 30u);
  // Steps 1-6 see the same parameters (5 exact warm-up updates; step 6 is the first whose
  // update is delayed, and its own forward still saw update 5); step 7 runs without update 6.
  for (size_t s = 0; s < 6; ++s) EXPECT_EQ(dpu.losses[s], exact.losses[s]) << "step " << s + 1;
  bool differs = false;
  for (size_t s = 6; s < 30; ++s) differs = differs || dpu.losses[s] != exact.losses[s];
  EXPECT_TRUE(differs) << "a delayed update cannot give the exact numbers";
  EXPECT_LT(dpu.losses.back(), dpu.losses.front() - 0.5) << "the delayed update did not train";
  EXPECT_TRUE(dpu.approximate);
  EXPECT_GT(dpu.schedule.optimizer_s, 0.0);
  EXPECT_FALSE(exact.approximate);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
