// Host memory that does not grow with the model: the optimizer pipeline steps sub-groups of
// zero_optimization.sub_group_size elements, and parameters are fetched from NVMe and published
// in the same pieces, so the host staging is a few sub-groups whatever a module's size, and the
// numbers do not depend on the sub-group size (the optimizer is elementwise): every schedule
// (the plain step, the optimizer under backward with rollbacks redone or skipped, the delayed
// update) trains bit-identically from one sub-group per module to ~100 per module.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "src/base/rng.h"
#include "src/model/gpt2.h"
#include "src/tiers/memory_model.h"
#include "src/tiers/placement.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "strata/storage_faults.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) { return test::temp_dir("strata_hostmem", name); }

// configs/tiny-cpu.json (clipping 1.0, AdamW, bf16) for `steps` steps, with overrides.
Config tiny(const std::string& dir, int steps, const std::vector<std::string>& extra) {
  return test::tiny_cpu(
      dir, {"train.steps=" + std::to_string(steps), "scheduler.params.warmup_num_steps=2"}, extra);
}

std::vector<std::string> on_nvme(const std::string& dir, bool params, bool optimizer) {
  fs::create_directories(dir + "/swap");
  const std::string path = "\"" + dir + "/swap\"";
  std::vector<std::string> ov;
  if (params) {
    ov.push_back("zero_optimization.offload_param.device=\"nvme\"");
    ov.push_back("zero_optimization.offload_param.nvme_path=" + path);
  } else {
    ov.push_back("zero_optimization.offload_param.device=\"cpu\"");
  }
  if (optimizer) {
    ov.push_back("zero_optimization.offload_optimizer.device=\"nvme\"");
    ov.push_back("zero_optimization.offload_optimizer.nvme_path=" + path);
  } else {
    ov.push_back("zero_optimization.offload_optimizer.device=\"cpu\"");
  }
  return ov;
}

// Trains `steps` steps of `tiny` with `base` under a roomy host limit (1 GiB) and under
// `budget`, in subdirectories of `dir`, and expects the same loss at every step and the same
// final weights: {roomy, tight}.
std::pair<TrainResult, TrainResult> roomy_and_tight(const std::string& dir, int steps,
                                                    const std::vector<std::string>& base,
                                                    size_t budget) {
  TrainResult roomy, tight;
  for (size_t limit : {size_t(1) << 30, budget}) {
    std::vector<std::string> ov = base;
    ov.push_back(fmt::format("strata.host_memory_limit={}", limit));
    const TrainResult r = test::must_train(tiny(fmt::format("{}/{}", dir, limit), steps, ov));
    EXPECT_EQ(r.losses.size(), size_t(steps));
    (limit == budget ? tight : roomy) = r;
  }
  for (size_t s = 0; s < size_t(steps) && s < tight.losses.size() && s < roomy.losses.size(); ++s) {
    EXPECT_EQ(tight.losses[s], roomy.losses[s]) << "loss differs at step " << s + 1;
  }
  EXPECT_EQ(tight.weights_crc, roomy.weights_crc) << "0: the checksum could not read them";
  return {roomy, tight};
}

struct Schedule {
  const char* name;
  bool nvme_params, nvme_optimizer;
  std::vector<std::string> ov;
};

class SubGroups : public ::testing::TestWithParam<Schedule> {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }
};

// One sub-group per module (DeepSpeed's 1e9) is the reference; 16384 and 2048 elements cut
// the tiny model's blocks (~200k elements) into 13 and ~97 sub-groups.
TEST_P(SubGroups, EverySubGroupSizeTrainsBitIdentically) {
  const Schedule& c = GetParam();
  auto dir = temp_dir(c.name);
  const int steps = 10;
  TrainResult ref;
  for (uint64_t g : {uint64_t{1'000'000'000}, uint64_t{16384}, uint64_t{2048}}) {
    SCOPED_TRACE(fmt::format("sub_group_size {}", g));
    std::vector<std::string> ov = on_nvme(dir, c.nvme_params, c.nvme_optimizer);
    ov.insert(ov.end(), c.ov.begin(), c.ov.end());
    ov.push_back(fmt::format("zero_optimization.sub_group_size={}", g));
    const TrainResult r = test::must_train(tiny(fmt::format("{}/{}", dir, g), steps, ov));
    ASSERT_EQ(r.losses.size(), size_t(steps));
    for (const auto& t : r.tiers) EXPECT_LE(t.peak, t.capacity) << t.name;
    if (g == 1'000'000'000) {
      ref = r;
      EXPECT_LT(ref.losses.back(), ref.losses.front()) << "the reference did not train";
      if (std::string(c.name).rfind("overlap", 0) == 0) {
        EXPECT_GT(ref.schedule.rollbacks, 0u) << "the case meant to roll speculative steps back";
      }
      continue;
    }
    for (size_t s = 0; s < ref.losses.size(); ++s) {
      ASSERT_EQ(r.losses[s], ref.losses[s]) << "loss differs at step " << s + 1;  // bit for bit
    }
    EXPECT_EQ(r.weights_crc, ref.weights_crc) << "final weights differ";
    EXPECT_EQ(r.schedule.rollbacks, ref.schedule.rollbacks);
    if (c.nvme_optimizer) {  // staging a few sub-groups, not a few blocks
      EXPECT_LT(test::tier(r, "host").peak, test::tier(ref, "host").peak);
    }
    EXPECT_EQ(r.skipped_steps, ref.skipped_steps);
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, SubGroups,
    ::testing::Values(
        // The plain schedule, optimizer state on NVMe (and params).
        Schedule{"plain_nvme", true, true, {"strata.optimizer.overlap=false"}},
        // Under backward with clipping (2.0: step 7 does not clip, so step 8 is speculated,
        // clips, and is rolled back and redone from shadow extents on the disk; the steps
        // after clipped ones are deferred to the next forward).
        Schedule{"overlap_clip_nvme",
                 true,
                 true,
                 {"strata.optimizer.overlap=true", "gradient_clipping=2.0"}},
        // fp16 with forced overflows: speculative steps are undone and skipped.
        Schedule{"overlap_fp16_nvme",
                 false,
                 true,
                 {"strata.optimizer.overlap=true", "gradient_clipping=2.0", "bf16.enabled=false",
                  "fp16.enabled=true", "fp16.initial_scale_power=24", "fp16.hysteresis=1",
                  "fp16.loss_scale_window=4"}},
        // Host-homed state: sub-groups point into the homes; undo state is host copies.
        Schedule{"overlap_clip_host",
                 false,
                 false,
                 {"strata.optimizer.overlap=true", "gradient_clipping=2.0"}},
        // The delayed update's thread runs the same pass over the second accumulator.
        Schedule{"delayed_update_nvme", false, true, {"strata.optimizer.delayed_update=true"}},
        // ... and its parameter shadows are published to NVMe-homed parameters piece by piece.
        Schedule{
            "delayed_update_params_nvme", true, true, {"strata.optimizer.delayed_update=true"}}),
    [](const ::testing::TestParamInfo<Schedule>& i) { return std::string(i.param.name); });

// On a device the host cannot address (the CPU backend wrapped as one), new parameters reach
// their NVMe home and the cached device copy through staging pieces, and the device's own
// parameters (offload_param none) through pieces copied up: bit-identical whatever the piece
// size.
TEST(ParameterPieces, UnaddressableDeviceTrainsBitIdentically) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("unaddressable");
  const TrainOptions o = test::on_unaddressable_device();
  const int steps = 6;
  for (bool nvme_params : {true, false}) {
    SCOPED_TRACE(nvme_params ? "params on nvme" : "params on the device");
    TrainResult ref;
    for (uint64_t g : {uint64_t{1'000'000'000}, uint64_t{2048}}) {
      std::vector<std::string> ov = on_nvme(dir, nvme_params, true);
      if (!nvme_params) ov[0] = "zero_optimization.offload_param.device=\"none\"";
      ov.push_back(fmt::format("zero_optimization.sub_group_size={}", g));
      const TrainResult r =
          test::must_train(tiny(fmt::format("{}/{}_{}", dir, nvme_params, g), steps, ov), o);
      ASSERT_EQ(r.losses.size(), size_t(steps));
      if (g == 1'000'000'000) {
        ref = r;
        continue;
      }
      for (size_t s = 0; s < ref.losses.size(); ++s) {
        ASSERT_EQ(r.losses[s], ref.losses[s]) << "loss differs at step " << s + 1;
      }
      EXPECT_EQ(r.weights_crc, ref.weights_crc);
      EXPECT_LT(test::tier(r, "host").peak, test::tier(ref, "host").peak);
    }
  }
  fs::remove_all(dir);
}

// Everything on a device the host cannot address (a GPU's all-on-device run, one micro-batch,
// no clipping: no gradient landing, no undo room): the host tier holds only what moves state
// in and out, each sub-group of master weights staged with the piece its parameters are derived
// through beside it. Its peak, the init's, stays within the memory model's need (a GPU's run
// with a wide embedding had asked for more than its budget).
TEST(ParameterPieces, AllOnAnUnaddressableDeviceStaysInTheModelsHostNeed) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("all_on_device");
  const Config cfg =
      tiny(dir, 2,
           {"zero_optimization.offload_param.device=\"none\"",
            "zero_optimization.offload_optimizer.device=\"none\"", "train_batch_size=4",
            "gradient_accumulation_steps=1", "gradient_clipping=0", "model.vocab_size=4096",
            "device.memory_limit=\"256MiB\""});
  auto arch = create_gpt2(cfg.model);
  ASSERT_TRUE(arch.is_ok());
  TierOptions to = TierOptions::from_config(cfg, DType::kBF16);
  to.placement = {Tier::kDevice, Tier::kDevice, Tier::kDevice, Tier::kDevice, 1.0};
  to.micro_batches = 1;
  auto n = tier_needs(**arch, to, 1, DType::kBF16, DType::kF32, 0);
  ASSERT_TRUE(n.is_ok()) << n.status().to_string();
  const TrainResult r = test::must_train(cfg, test::on_unaddressable_device());
  ASSERT_EQ(r.losses.size(), 2u);
  EXPECT_GT(test::tier(r, "host").peak, 0u);
  EXPECT_LE(test::tier(r, "host").peak, n->host.total());
  fs::remove_all(dir);
}

// A checkpoint of NVMe-homed state with parameters in ~100 pieces per block: a run stopped at
// step 4 and resumed (parameters re-derived piece by piece from the loaded master weights)
// equals the uninterrupted run bit for bit.
TEST(ParameterPieces, CheckpointResumesBitIdentically) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("resume");
  const int steps = 8;
  auto cfg = [&](const std::string& sub) {
    std::vector<std::string> ov = on_nvme(dir, true, true);
    ov.push_back("zero_optimization.sub_group_size=2048");
    return tiny(dir + "/" + sub, steps, ov);
  };
  TrainOptions quiet;
  quiet.progress = false;
  const TrainResult whole = test::must_train(cfg("whole"), quiet);
  ASSERT_EQ(whole.losses.size(), size_t(steps));
  TrainOptions stop = quiet;
  stop.stop_at_step = 4;
  const TrainResult first = test::must_train(cfg("split"), stop);
  ASSERT_EQ(first.end_step, 4);
  TrainOptions resume = quiet;
  resume.resume = "latest";
  const TrainResult second = test::must_train(cfg("split"), resume);
  ASSERT_EQ(second.start_step, 4);
  ASSERT_EQ(second.losses.size(), size_t(steps - 4));
  for (size_t s = 0; s < second.losses.size(); ++s) {
    EXPECT_EQ(second.losses[s], whole.losses[4 + s]) << "step " << 5 + s;
  }
  EXPECT_EQ(second.weights_crc, whole.weights_crc);
  fs::remove_all(dir);
}

// Gradient accumulators on NVMe (strata.placement.grads = nvme): written and read back
// sub-group by sub-group (4 micro-batches: copied, then read-added-written three times), their
// norm reduced tile by tile: the same losses and weights as host-homed accumulators, bit for
// bit, in the plain schedule and under backward with clipping rollbacks and fp16 overflows.
TEST(GradsOnNvme, TrainBitIdenticallyToGradsInHostMemory) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("grads");
  struct Case {
    const char* name;
    std::vector<std::string> ov;
  };
  const std::vector<Case> cases = {
      {"plain", {"strata.optimizer.overlap=false"}},
      {"overlap_clip", {"strata.optimizer.overlap=true"}},
      {"overlap_fp16",
       {"strata.optimizer.overlap=true", "bf16.enabled=false", "fp16.enabled=true",
        "fp16.initial_scale_power=24", "fp16.hysteresis=1", "fp16.loss_scale_window=4"}},
  };
  const int steps = 8;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    TrainResult ref;
    for (const char* grads : {"host", "nvme"}) {
      std::vector<std::string> ov = on_nvme(dir, true, true);
      ov.insert(ov.end(), c.ov.begin(), c.ov.end());
      ov.push_back(fmt::format("strata.placement.grads=\"{}\"", grads));
      ov.push_back("zero_optimization.sub_group_size=65536");  // 4 sub-groups per block
      // The read-ahead (auto: half the budget) would hold as many sub-groups' gradients as
      // the host tier has room for; without it the accumulator's saving shows in the peak.
      ov.push_back("strata.optimizer.read_ahead=0");
      const TrainResult r =
          test::must_train(tiny(fmt::format("{}/{}_{}", dir, c.name, grads), steps, ov));
      ASSERT_EQ(r.losses.size(), size_t(steps));
      for (const auto& t : r.tiers) EXPECT_LE(t.peak, t.capacity) << t.name;
      if (std::string(grads) == "host") {
        ref = r;
        continue;
      }
      for (size_t s = 0; s < ref.losses.size(); ++s) {
        ASSERT_EQ(r.losses[s], ref.losses[s]) << "loss differs at step " << s + 1;
      }
      EXPECT_EQ(r.weights_crc, ref.weights_crc) << "final weights differ";
      EXPECT_EQ(r.schedule.rollbacks, ref.schedule.rollbacks);
      EXPECT_EQ(r.skipped_steps, ref.skipped_steps);
      // The accumulators' traffic: every micro-batch writes them, later ones read them too.
      EXPECT_GT(test::tier(r, "nvme").bytes_in, test::tier(ref, "nvme").bytes_in);
      EXPECT_LT(test::tier(r, "host").peak, test::tier(ref, "host").peak);
    }
  }
  fs::remove_all(dir);
}

// Only the gradient accumulators on NVMe (4 sub-groups per block), the optimizer after
// backward: every NVMe piece is theirs.
std::vector<std::string> only_grads_on_nvme(const std::string& dir) {
  fs::create_directories(dir + "/swap");
  return {"zero_optimization.offload_param.device=\"cpu\"",
          "zero_optimization.offload_optimizer.device=\"cpu\"",
          "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"",
          "strata.placement.grads=\"nvme\"",
          "strata.optimizer.overlap=false",
          "zero_optimization.sub_group_size=65536"};
}

// The error of a 4-step run of only_grads_on_nvme() whose `nth` NVMe piece of `kind` (FaultPlan:
// 0 any, 1 reads, 2 writes) fails with EIO.
std::string error_of_failed_piece(const std::string& dir, uint64_t nth, int kind) {
  TrainOptions o;
  o.progress = false;
  auto faults = std::make_shared<FaultPlan>();
  faults->fail_nth = nth;
  faults->fail_nth_kind = kind;
  faults->fail_nth_errno = 5;  // EIO
  o.storage_faults = faults;
  auto r = train(tiny(dir + "/run", 4, only_grads_on_nvme(dir)), o);
  EXPECT_FALSE(r.is_ok()) << "an injected EIO must end the run";
  return r.is_ok() ? std::string() : r.status().message();
}

// A failed write of a gradient accumulator (the ring keeps writes in flight under the next
// sub-groups' copies) ends the run at the step it belongs to, naming the module and sub-group,
// before the optimizer reads what was not written.
TEST(GradsOnNvme, AFailedWriteEndsTheRunNamingTheSubGroup) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("grads_eio");
  // Step 3's first NVMe piece is its first micro-batch's first gradient write.
  const uint64_t end2 =
      test::io_pieces_at_step_ends(tiny(dir + "/probe", 4, only_grads_on_nvme(dir)), {2})[0];
  ASSERT_GT(end2, 0u);
  const std::string msg = error_of_failed_piece(dir, end2 + 1, 0);
  EXPECT_TRUE(std::regex_search(
      msg, std::regex("^step 3: .*writing (embedding|block\\.[0-9]|final_norm) gradients "
                      "\\(sub-group [0-9]+\\).*Input/output error")))
      << msg;
  fs::remove_all(dir);
}

// A failed read of a gradient accumulator in a later micro-batch (read 3 sub-groups ahead of its
// add, GradSpill::kReadAhead) ends the run at that step, naming the module and sub-group; the
// reads still in flight ahead of it are waited for, not left writing into freed buffers.
TEST(GradsOnNvme, AFailedReadEndsTheRunNamingTheSubGroup) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("grads_read_eio");
  // The reads are the accumulators' (a later micro-batch's, and the optimizer's after
  // backward): the 5th is inside the first module's read-ahead window.
  const std::string msg = error_of_failed_piece(dir, 5, /*reads=*/1);
  EXPECT_TRUE(std::regex_search(
      msg, std::regex("^step 1: .*reading (embedding|block\\.[0-9]|final_norm|lm_head) "
                      "gradients \\(sub-group [0-9]+\\).*Input/output error")))
      << msg;
  fs::remove_all(dir);
}

// Only trainable modules have accumulators on NVMe: a frozen base's modules (LoRA's), whose
// homes are where the placement puts them but hold nothing, do not size the gradients' staging.
// At the least host budget the preflight accepts (and 64 KiB above), adapters over the tiny GPT
// with their gradients on NVMe train; their staging had been sized by the base's largest
// module, over the budget.
TEST(GradsOnNvme, AFrozenBaseDoesNotSizeTheStaging) {
  set_log_level(LogLevel::kError);
  const std::string dir = temp_dir("frozen_base");
  std::vector<std::string> base = on_nvme(dir, false, true);
  base.insert(base.end(), {"strata.placement.grads=\"nvme\"", "aio.backend=\"posix\"",
                           "zero_optimization.offload_optimizer.buffer_count=2", "lora.r=16",
                           "lora.target_modules=\"all-linear\"", "device.memory_limit=\"64MiB\""});
  auto make = [&](size_t budget, int steps) {
    std::vector<std::string> ov = base;
    ov.push_back(fmt::format("strata.host_memory_limit={}", budget));
    return tiny(fmt::format("{}/{}-{}", dir, budget, steps), steps, ov);
  };
  const size_t least = test::least_accepted_budget([&](size_t budget) { return make(budget, 2); },
                                                   4096, size_t{256} << 20, 4096);
  for (size_t budget : {least, least + (64 << 10)}) {
    SCOPED_TRACE(fmt::format("strata.host_memory_limit {}", budget));
    const TrainResult r = test::must_train(make(budget, 3));
    EXPECT_EQ(r.losses.size(), 3u);
    EXPECT_GT(test::tier(r, "nvme").bytes_in, 0u);
  }
  fs::remove_all(dir);
}

// With strata.placement.grads unset and the optimizer state on NVMe, the gradients go to NVMe
// exactly when the host budget cannot hold them (one rank, no delayed update), else stay on the
// host.
TEST(GradsDefault, NvmeOnlyWhenTheHostBudgetIsShort) {
  const Placement opt_nvme{Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0};
  EXPECT_EQ(auto_grads_placement(opt_nvme, 100, 50, 99, false, false), Tier::kNvme);
  EXPECT_EQ(auto_grads_placement(opt_nvme, 100, 50, 100, false, false), Tier::kHost);  // fits
  EXPECT_EQ(auto_grads_placement(opt_nvme, 100, 100, 99, false, false), Tier::kHost);  // no gain
  EXPECT_EQ(auto_grads_placement(opt_nvme, 100, 50, 99, true, false), Tier::kHost);    // ranks
  EXPECT_EQ(auto_grads_placement(opt_nvme, 100, 50, 99, false, true), Tier::kHost);    // delayed
  Placement opt_host = opt_nvme;
  opt_host.master = opt_host.moments = Tier::kHost;
  EXPECT_EQ(auto_grads_placement(opt_host, 100, 50, 99, false, false), Tier::kHost);
  Placement on_device = opt_nvme;
  on_device.grads = Tier::kDevice;
  EXPECT_EQ(auto_grads_placement(on_device, 100, 50, 99, false, false), Tier::kDevice);
}

// The engine applies it: the tiny model with its optimizer on NVMe and a host budget between
// the host tier's need with gradients on NVMe and with them on the host trains with them on
// NVMe (the accumulators' NVMe traffic, a smaller host peak), to the same numbers as a budget
// that holds them on the host.
TEST(GradsDefault, TheEnginePutsThemOnNvmeUnderASmallBudget) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("grads_default");
  // The smallest sub-groups, so the budget does not change the sub-group size; width 256, so
  // the whole model's fp32 gradients (13 MB) outweigh the NVMe gradients' staging.
  std::vector<std::string> base = on_nvme(dir, true, true);
  base.push_back("zero_optimization.sub_group_size=2048");
  base.push_back("model.n_embd=256");
  base.push_back("device.memory_limit=\"64MiB\"");
  auto needs = [&](Tier grads) {
    Config cfg = tiny(dir + "/probe", 3, base);
    auto arch = create_gpt2(cfg.model);
    EXPECT_TRUE(arch.is_ok());
    TierOptions to = TierOptions::from_config(cfg, DType::kBF16);
    to.placement = {Tier::kNvme, Tier::kNvme, Tier::kNvme, grads, 1.0};
    const size_t acts = (*arch)->activation_plan(4, 64, DType::kBF16, ActivationMode::kKeep).bytes;
    auto n = tier_needs(**arch, to, 1, DType::kBF16, DType::kF32, acts);
    EXPECT_TRUE(n.is_ok()) << n.status().to_string();
    return n->host.total();
  };
  const size_t with_host = needs(Tier::kHost), with_nvme = needs(Tier::kNvme);
  ASSERT_GT(with_host, with_nvme);
  const size_t budget = (with_host + with_nvme) / 2 / 4096 * 4096;  // the arena is whole pages
  const auto [roomy, tight] = roomy_and_tight(dir, 3, base, budget);
  EXPECT_LE(test::tier(tight, "host").capacity, budget);
  EXPECT_LT(test::tier(tight, "host").peak, test::tier(roomy, "host").peak);
  EXPECT_GT(test::tier(tight, "nvme").bytes_in, test::tier(roomy, "nvme").bytes_in);
  fs::remove_all(dir);
}

// Init in pieces: a module's initial weights in any ranges are those of the whole-module init,
// bit for bit, and those are the sequential draw every checkpoint and golden curve was made
// with (the reference below: one stream per module continuing across its tensors, the
// vocabulary's padding rows drawn and then zeroed).
void sequential_init(const ModuleSpec& m, uint64_t stream, size_t pad_lo, size_t pad_hi,
                     float* master) {
  Rng rng(1234, stream);
  for (const TensorSpec& t : m.tensors) {
    float* p = master + t.offset;
    if (t.init_kind == 0) {
      for (size_t i = 0; i < t.numel; ++i) p[i] = static_cast<float>(rng.normal()) * t.init_std;
    } else {
      std::fill(p, p + t.numel, t.init_kind == 2 ? 1.0f : 0.0f);
    }
  }
  std::fill(master + pad_lo, master + pad_hi, 0.0f);
}

TEST(ModulePieces, InitRangesEqualTheSequentialWholeModuleInit) {
  ModelConfig mc;
  mc.n_layer = 2;
  mc.vocab_size = 250;  // padded: rows 250..255 of the embedding are zero
  mc.context = 32;
  for (const char* type : {"gpt2", "llama"}) {
    SCOPED_TRACE(type);
    mc.type = type;
    // GPT at an odd width: tensors of odd sizes, so a tensor's first normal is a pair's second.
    mc.n_head = 5;
    mc.n_embd = 95;
    if (std::string(type) == "llama") {  // rotary embeddings need an even head size
      mc.n_head = 4;
      mc.n_embd = 96;
      mc.num_key_value_heads = 2;
      mc.intermediate_size = 250;  // odd-sized pieces of the stream
    }
    auto arch = create_architecture(mc);
    ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
    const ModelLayout& lay = (*arch)->layout();
    for (size_t i = 0; i < lay.modules.size(); ++i) {
      const ModuleSpec& m = lay.modules[i];
      SCOPED_TRACE(m.name);
      const bool vocab = m.name == "embedding" || m.name == "head";
      const uint64_t stream = (std::string(type) == "gpt2" ? 0x9e11 : 0x11a3a) + i;
      std::vector<float> ref(m.numel, -1.0f), whole(m.numel, -2.0f);
      const size_t C = size_t(mc.n_embd);
      sequential_init(m, stream, vocab ? 250 * C : 0, vocab ? 256 * C : 0, ref.data());
      (*arch)->init_module(int(i), 1234, whole.data());
      ASSERT_EQ(std::memcmp(ref.data(), whole.data(), m.numel * 4), 0);
      EXPECT_NE(ref[0], 0.0f);  // drawn, not zeros
      // Pieces of odd and even sizes, starting at odd and even normals, across tensor ends.
      for (size_t piece : {size_t(1), size_t(777), size_t(2048), m.numel - 1}) {
        std::vector<float> got(m.numel, -3.0f);
        for (size_t a = 0; a < m.numel; a += piece) {
          (*arch)->init_range(int(i), 1234, a, std::min(piece, m.numel - a), got.data() + a);
        }
        ASSERT_EQ(std::memcmp(ref.data(), got.data(), m.numel * 4), 0) << "pieces of " << piece;
      }
      // Out of order, as a shard of a sharded module asks for its own range only.
      std::vector<float> tail(m.numel / 3);
      (*arch)->init_range(int(i), 1234, m.numel - tail.size(), tail.size(), tail.data());
      EXPECT_EQ(std::memcmp(ref.data() + m.numel - tail.size(), tail.data(), tail.size() * 4), 0);
    }
  }
}

// A module far larger than the host tier: the tiny model at width 512 (a block's fp32 master
// weights are 12.6 MB) with everything on NVMe and a 10 MiB host budget, sub-groups of 64K
// elements (~48 per block). Init writes the master weights a sub-group at a time and the final
// weights' checksum reads them so; it trains to the same numbers as a 1 GiB budget. (Staging a
// whole block's master weights, init failed here: "asking for 12.03 MiB ... of its 10.00 MiB
// budget".)
TEST(ModulePieces, ModuleLargerThanTheHostBudgetInitializesAndTrainsBitIdentically) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("wide");
  std::vector<std::string> base = on_nvme(dir, true, true);
  base.push_back("strata.placement.grads=\"nvme\"");
  base.push_back("zero_optimization.sub_group_size=2048");  // 64K: gradients on NVMe
  base.push_back("model.n_embd=512");
  base.push_back("device.memory_limit=\"64MiB\"");
  const size_t budget = size_t(10) << 20;
  const auto [roomy, tight] = roomy_and_tight(dir, 2, base, budget);
  const size_t block_master = size_t(12) * 512 * 512 * 4;
  EXPECT_LE(test::tier(tight, "host").capacity, budget);
  EXPECT_LT(test::tier(tight, "host").peak, block_master);
  EXPECT_NE(roomy.weights_crc, 0u);
  fs::remove_all(dir);
}

// train.final_checkpoint = false (the benchmark whose state would not fit on the disk twice,
// configs/hostmem-2b.json): the run ends without writing a checkpoint.
TEST(FinalCheckpoint, FalseWritesNoneAtTheEnd) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("no_final");
  // The optimizer in host memory: tiny-cpu.json's nvme_path (runs/swap) is relative to the
  // working directory, which a test does not choose.
  const std::string host_opt = "zero_optimization.offload_optimizer.device=\"cpu\"";
  const TrainResult r = test::must_train(tiny(dir, 2, {"train.final_checkpoint=false", host_opt}));
  ASSERT_EQ(r.losses.size(), 2u);
  EXPECT_TRUE(r.last_checkpoint.empty()) << r.last_checkpoint;
  for (const auto& e : fs::directory_iterator(dir + "/ckpt")) {
    EXPECT_EQ(e.path().filename().string().rfind("ckpt-", 0), std::string::npos) << e.path();
  }
  // The export needs the final checkpoint: refused before training.
  auto cfg = tiny(
      dir, 2, {"train.final_checkpoint=false", host_opt, "train.export_dir=\"" + dir + "/hf\""});
  auto bad = train(cfg, {});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("train.final_checkpoint"), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
