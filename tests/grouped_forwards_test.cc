// strata.grouped_forwards: a step's micro-batches run their forwards together,
// module by module, each on its own activation slot, then each its head and backward in the
// usual order. A step deferred into the next forward (clipping biting) overlaps its optimizer
// pass with all of these forwards. The same kernels run on the same inputs and the gradients
// accumulate in the same order, so every loss and weight is the one-at-a-time run's bit for bit:
// dense GPT and Llama, a mixture of experts (its routing kept per slot), LoRA and QLoRA, kept and
// recomputed activations, state in host memory and on NVMe, fp16 overflows, groups that do not
// divide the accumulation, and a resume. With strata.grouped_backwards (the default) the
// first group's backwards run together too, each further micro-batch's gradients in a part
// added to the first's on the device: each schedule runs one at a time, with the forwards
// grouped, and with both, the same bits, and with gradients on NVMe fewer bytes moved. The auto
// choice and the config's errors are checked here too; ranks in zero3_test (Zero3Variants), the
// planner in plan_test and plan_optimizer_test.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "src/tiers/memory_model.h"
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

std::string temp_dir(const std::string& name) { return test::temp_dir("strata_grouped", name); }

// tiny-cpu with clipping biting at every step (each step deferred into the next forward), a
// device that holds every parameter and up to 4 activation sets, no prefetch (which fetches a
// prefetch saves depends on timing, so the bytes would differ run to run), 8 steps.
std::vector<std::string> base(const std::string& dir, int accum, bool nvme) {
  std::vector<std::string> ov = {"train.steps=8",
                                 "gradient_clipping=0.01",
                                 "scheduler.params.warmup_num_steps=2",
                                 "train_micro_batch_size_per_gpu=2",
                                 "gradient_accumulation_steps=" + std::to_string(accum),
                                 "train_batch_size=" + std::to_string(2 * accum),
                                 "device.memory_limit=\"256MiB\"",
                                 "zero_optimization.stage3_prefetch_bucket_size=0",
                                 "strata.optimizer.defer=\"always\""};
  if (nvme) {
    fs::create_directories(dir + "/swap");
    const std::string path = "\"" + dir + "/swap\"";
    for (const std::string& s :
         std::vector<std::string>{"zero_optimization.offload_param.device=\"nvme\"",
                                  "zero_optimization.offload_param.nvme_path=" + path,
                                  "zero_optimization.offload_optimizer.device=\"nvme\"",
                                  "zero_optimization.offload_optimizer.nvme_path=" + path}) {
      ov.push_back(s);
    }
  } else {
    ov.push_back("zero_optimization.offload_param.device=\"cpu\"");
    ov.push_back("zero_optimization.offload_optimizer.device=\"cpu\"");
  }
  return ov;
}

std::vector<std::string> model_overrides(const std::string& model) {
  if (model == "llama") {
    return {"model.type=\"llama\"", "model.num_key_value_heads=2", "model.intermediate_size=256"};
  }
  if (model == "mixtral") {
    return {"model.type=\"mixtral\"",         "model.num_key_value_heads=2",
            "model.intermediate_size=64",     "model.num_experts=4",
            "model.num_experts_per_tok=2",    "model.tied_embeddings=false",
            "model.router_aux_loss_coef=0.01"};
  }
  if (model == "lora" || model == "qlora") {
    std::vector<std::string> ov = {"lora.r=8", "lora.lora_alpha=16",
                                   "lora.target_modules=[\"c_attn\",\"c_fc\"]"};
    // nf4: each block is dequantized into one scratch the group's slots share
    if (model == "qlora") ov.push_back("lora.base_quantization=\"nf4\"");
    return ov;
  }
  return {};
}

struct Case {
  const char* name;
  const char* model;        // gpt2 | llama | mixtral | lora
  const char* activations;  // keep | recompute
  bool nvme, fp16;
  int accum, group;
  bool grads_nvme = false;  // strata.placement.grads = nvme (GradSpill)
};

class GroupedForwards : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }
};

TEST_P(GroupedForwards, BitIdenticalToOneMicroBatchAtATime) {
  const Case c = GetParam();
  const std::string dir = temp_dir(c.name);
  std::vector<std::string> ov = base(dir, c.accum, c.nvme);
  for (const std::string& s : model_overrides(c.model)) ov.push_back(s);
  ov.push_back(std::string("strata.activations=\"") + c.activations + "\"");
  if (c.fp16) {
    // 2^24 overflows fp16 gradients at first: the scaler skips and halves.
    for (const char* s : {"bf16.enabled=false", "fp16.enabled=true", "fp16.initial_scale_power=24",
                          "fp16.hysteresis=1", "fp16.loss_scale_window=4"}) {
      ov.push_back(s);
    }
  }
  if (c.grads_nvme) ov.push_back("strata.placement.grads=\"nvme\"");
  auto one_ov = ov, forwards_ov = ov, grouped_ov = ov;
  one_ov.push_back("strata.grouped_forwards=1");
  forwards_ov.push_back("strata.grouped_forwards=" + std::to_string(c.group));
  forwards_ov.push_back("strata.grouped_backwards=false");
  grouped_ov.push_back("strata.grouped_forwards=" + std::to_string(c.group));
  const TrainResult one = test::must_train(test::tiny_cpu(dir + "/one", one_ov));
  const TrainResult forwards = test::must_train(test::tiny_cpu(dir + "/forwards", forwards_ov));
  const TrainResult grouped = test::must_train(test::tiny_cpu(dir + "/grouped", grouped_ov));
  EXPECT_EQ(one.forward_group, 1);
  EXPECT_EQ(forwards.forward_group, c.group);
  EXPECT_EQ(grouped.forward_group, c.group);
  ASSERT_EQ(one.losses.size(), 8u);
  for (const TrainResult* r : {&forwards, &grouped}) {
    const char* which = r == &grouped ? "backwards grouped too" : "forwards grouped";
    ASSERT_EQ(r->losses.size(), 8u);
    for (size_t s = 0; s < 8; ++s) {
      EXPECT_EQ(r->losses[s], one.losses[s]) << which << ": step " << s + 1;
    }
    EXPECT_EQ(r->weights_crc, one.weights_crc) << which << ": final weights differ";
    EXPECT_EQ(r->skipped_steps, one.skipped_steps) << which;
    EXPECT_GT(r->schedule.modules_deferred, 0u)
        << which << ": no step was deferred into the forwards";
  }
  if (c.fp16) {
    EXPECT_GT(one.skipped_steps, 0) << "the test meant to force overflows";
    // A skipped step keeps the state read ahead under it for the next step
    // (OptimizerPipeline::end_step(skipped)): a second skipped step in a row reads none of it
    // again (the room holds tiny-cpu's 6 sub-groups; the device holds the parameters and,
    // unless on NVMe, the gradients stay on the host: nothing else crosses). Before, each
    // such step read the whole state again.
    for (const TrainResult* r : {&one, &forwards, &grouped}) {
      ASSERT_EQ(r->step_skipped.size(), r->step_nvme_bytes.size());
      EXPECT_EQ(std::count(r->step_skipped.begin(), r->step_skipped.end(), 1), r->skipped_steps);
      int runs = 0;
      for (size_t s = 1; s < r->step_skipped.size() && !c.grads_nvme; ++s) {
        if (!r->step_skipped[s] || !r->step_skipped[s - 1]) continue;
        ++runs;
        EXPECT_EQ(r->step_nvme_bytes[s], 0u) << "step " << s + 1 << " read again";
      }
      if (!c.grads_nvme) {
        EXPECT_GT(runs, 0) << "the test meant two skips in a row";
      }
    }
  }
  EXPECT_NE(one.losses.front(), one.losses.back()) << "the reference did not train";
  // No byte read or written twice: with forwards grouped, the NVMe bytes are the one-at-a-time
  // run's; parameters the device holds are not fetched again by the later forwards of a group.
  // The NVMe tier's bytes_in are the bytes written to it, bytes_out those read. (With fp16
  // overflows skipping steps the bytes read had differed by 8 KiB in about half of the runs,
  // because a skipped step dropped what was read ahead under its backward, and whether a
  // sub-group had been read before the skip depended on timing. The read-ahead now stays for
  // the next step, OptimizerPipeline::end_step(skipped).)
  const auto& on = test::tier(one, "nvme");
  const auto& fn = test::tier(forwards, "nvme");
  const auto& gn = test::tier(grouped, "nvme");
  EXPECT_EQ(fn.bytes_in, on.bytes_in);
  EXPECT_EQ(fn.bytes_out, on.bytes_out);
  EXPECT_LE(test::tier(forwards, "device").bytes_in, test::tier(one, "device").bytes_in);
  // With the backwards grouped too, the first group's gradients on NVMe are written once (not
  // written, then read and written again, by each further micro-batch): as many fewer bytes
  // read as written, (group - 1) accumulators' worth a step. Else the same bytes.
  if (c.grads_nvme) {
    EXPECT_GT(on.bytes_in, gn.bytes_in);
    EXPECT_EQ(on.bytes_in - gn.bytes_in, on.bytes_out - gn.bytes_out);
  } else {
    EXPECT_EQ(gn.bytes_in, on.bytes_in);
    EXPECT_EQ(gn.bytes_out, on.bytes_out);
  }
  EXPECT_LE(test::tier(grouped, "device").bytes_in, test::tier(forwards, "device").bytes_in);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, GroupedForwards,
    ::testing::Values(Case{"gpt2_keep_host", "gpt2", "keep", false, false, 2, 2},
                      Case{"gpt2_keep_nvme", "gpt2", "keep", true, false, 2, 2},
                      Case{"gpt2_recompute_nvme", "gpt2", "recompute", true, false, 4, 4},
                      Case{"gpt2_three_in_twos", "gpt2", "keep", false, false, 3, 2},
                      Case{"gpt2_fp16_nvme", "gpt2", "keep", true, true, 2, 2},
                      Case{"llama_keep_nvme", "llama", "keep", true, false, 2, 2},
                      Case{"mixtral_keep_host", "mixtral", "keep", false, false, 2, 2},
                      Case{"lora_recompute_host", "lora", "recompute", false, false, 2, 2},
                      Case{"qlora_keep_host", "qlora", "keep", false, false, 2, 2},
                      Case{"gpt2_keep_nvme_grads", "gpt2", "keep", true, false, 2, 2, true},
                      Case{"llama_recompute_nvme_grads_twos", "llama", "recompute", true, false, 4,
                           2, true},
                      Case{"gpt2_fp16_nvme_grads", "gpt2", "keep", true, true, 2, 2, true}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// Stopped after step 3 and resumed, grouped: the uninterrupted one-at-a-time run's losses.
TEST(GroupedForwardsResume, ResumedRunFollowsTheUngroupedCurve) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = temp_dir("resume");
  const std::vector<std::string> ov = base(dir, 2, /*nvme=*/true);
  auto one_ov = ov, grouped_ov = ov;
  one_ov.push_back("strata.grouped_forwards=1");
  grouped_ov.push_back("strata.grouped_forwards=2");
  const TrainResult one = test::must_train(test::tiny_cpu(dir + "/one", one_ov));
  Config first = test::tiny_cpu(dir + "/resume", grouped_ov);
  first.train.checkpoint_interval = 3;
  TrainOptions to;
  to.stop_at_step = 3;
  const TrainResult r1 = test::must_train(first, to);
  EXPECT_TRUE(r1.stopped_early);
  TrainOptions again;
  again.resume = "latest";
  const TrainResult r2 = test::must_train(first, again);
  ASSERT_EQ(r2.losses.size(), 5u);
  for (size_t s = 0; s < 5; ++s) EXPECT_EQ(r2.losses[s], one.losses[3 + s]) << "step " << 4 + s;
  EXPECT_EQ(r2.weights_crc, one.weights_crc);
  EXPECT_EQ(r2.forward_group, 2);
  fs::remove_all(dir);
}

// auto: the accumulation's micro-batches where the optimizer can be deferred or the backwards
// grouped, and the device holds their activation sets (and the gradient parts) without losing
// cached parameters; else 1.
TEST(GroupedForwardsAuto, GroupsWhereADeferredPassCanUseItAndTheDeviceHoldsIt) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = temp_dir("auto");
  auto group_of = [&](const std::string& tag, std::vector<std::string> extra) {
    std::vector<std::string> ov = base(dir + "/" + tag, 2, /*nvme=*/false);
    ov.push_back("train.steps=2");
    for (const auto& s : extra) ov.push_back(s);
    return test::must_train(test::tiny_cpu(dir + "/" + tag, ov)).forward_group;
  };
  EXPECT_EQ(group_of("clipping", {}), 2);
  EXPECT_EQ(group_of("recompute", {"strata.activations=\"recompute\""}), 2);
  EXPECT_EQ(group_of("fp16", {"gradient_clipping=0", "bf16.enabled=false", "fp16.enabled=true"}),
            2);
  // Nothing deferred: a group still runs its backwards together (one fetch, one drain).
  EXPECT_EQ(group_of("no_clipping", {"gradient_clipping=0"}), 2);
  EXPECT_EQ(group_of("no_overlap", {"strata.optimizer.overlap=false"}), 2);
  EXPECT_EQ(group_of("no_clipping_one_backward",
                     {"gradient_clipping=0", "strata.grouped_backwards=false"}),
            1)
      << "nothing is ever deferred and the backwards run one at a time";
  EXPECT_EQ(group_of("no_overlap_one_backward",
                     {"strata.optimizer.overlap=false", "strata.grouped_backwards=false"}),
            1);
  EXPECT_EQ(group_of("delayed", {"gradient_clipping=0", "strata.optimizer.delayed_update=true"}),
            1);
  EXPECT_EQ(group_of("offload", {"strata.activations=\"offload\""}), 1);
  // 8 MiB: one set (2.9 MiB) and the working set leave room for every parameter; a second set
  // fits (7 MiB in all) but would take the parameter cache's room.
  EXPECT_EQ(group_of("tight", {"device.memory_limit=\"8MiB\""}), 1);
  EXPECT_EQ(group_of("roomy", {"device.memory_limit=\"10MiB\""}), 2);
  fs::remove_all(dir);
}

// The rule itself: a second set must fit and cost no parameter fetches (the planner's cache
// model); sharded, nothing is cached, so a group only saves gathers.
TEST(GroupedForwardsAuto, TheCacheModel) {
  TierNeeds one;
  one.device.activations = 10;
  one.device.working_set = 40;  // total 50
  const uint64_t params = 100;
  EXPECT_EQ(auto_forward_group(1, one, 10, 0, 1000, params, false), 1);
  EXPECT_EQ(auto_forward_group(4, one, 10, 0, 1000, params, false), 4);  // all cached either way
  EXPECT_EQ(auto_forward_group(4, one, 10, 0, 79, params, false), 1);    // does not fit
  // 150 of capacity: one set leaves 100 (all cached), four leave 70: 30% fetched 5 times.
  EXPECT_EQ(auto_forward_group(4, one, 10, 0, 150, params, false), 1);
  // 100 of capacity: one set leaves 50 (50% fetched 8 times = 4), four leave 20 (80% x 5 = 4).
  EXPECT_EQ(auto_forward_group(4, one, 10, 0, 100, params, false), 4);
  EXPECT_EQ(auto_forward_group(2, one, 10, 0, 100, params, true), 2);  // sharded: gathers saved
  EXPECT_EQ(auto_forward_group(2, one, 10, 0, 100, 0, false), 2);      // every parameter on device
  // Backward groups (part_bytes > 0) fetch twice a step, not A + 1 times. 120 of capacity: one
  // set leaves 70 (30% fetched 8 times = 2.4); four sets without backward groups leave 40
  // (60% x 5 = 3: not grouped); with them and 10 of parts, 30 (70% x 2 = 1.4: grouped).
  EXPECT_EQ(auto_forward_group(4, one, 10, 0, 120, params, false), 1);
  EXPECT_EQ(auto_forward_group(4, one, 10, 10, 120, params, false), 4);
  EXPECT_EQ(auto_forward_group(4, one, 10, 41, 120, params, false), 1);  // 121: does not fit
}

// Bad values name the key and the fix.
TEST(GroupedForwardsConfig, ErrorsNameTheKeyAndTheFix) {
  const std::string tiny =
      test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json");
  auto more = parse_config(tiny, "tiny", {"strata.grouped_forwards=5"});
  ASSERT_FALSE(more.is_ok());
  EXPECT_NE(more.status().message().find("strata.grouped_forwards: 5 is more than "
                                         "gradient_accumulation_steps (4)"),
            std::string::npos)
      << more.status().message();
  auto off =
      parse_config(tiny, "tiny", {"strata.grouped_forwards=2", "strata.activations=\"offload\""});
  ASSERT_FALSE(off.is_ok());
  EXPECT_NE(off.status().message().find("strata.grouped_forwards: 2 under strata.activations = "
                                        "offload"),
            std::string::npos)
      << off.status().message();
  auto zero = parse_config(tiny, "tiny", {"strata.grouped_forwards=0"});
  EXPECT_FALSE(zero.is_ok());
  auto ok = parse_config(tiny, "tiny", {"strata.grouped_forwards=\"auto\""});
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->strata.grouped_forwards, 0);
}

}  // namespace
}  // namespace strata
