// Activation checkpointing (strata.activations): keep, recompute and offload train to the same
// bits; a run whose activations do not fit under keep is refused before it starts with
// strata.activations named as the fix, and trains under recompute and offload; offloaded block
// inputs go through the host tier (its byte counters), and the tier manager's stash/restore
// API refuses what it has no room for.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "src/model/gpt2.h"
#include "src/model/llama.h"
#include "src/tiers/tier_manager.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"
#include "tests/wrapped_device.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) { return test::temp_dir("strata_act", name); }

// configs/tiny-cpu.json's model and placement (params and optimizer in host memory), two
// micro-batches per step (so block inputs are stashed and restored twice per step), an eval
// pass (forward only) every 5 steps, clipping on.
Config act_config(const std::string& dir, const std::string& mode,
                  std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"train.checkpoint_dir=\"" + dir + "\"",
                                 "strata.activations=" + mode};
  ov.insert(ov.end(), extra.begin(), extra.end());
  const char* json = R"({
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2, "steps_per_print": 1000, "gradient_clipping": 1.0,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu"}},
    "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 256, "context": 64},
    "data": {"synthetic_tokens": 262144, "eval_batches": 2},
    "device": {"backend": "cpu", "memory_limit": "64MiB", "cpu_threads": 2},
    "strata": {"host_memory_limit": "256MiB"},
    "train": {"steps": 12, "eval_interval": 5, "seed": 7}
  })";
  auto cfg = parse_config(json, "<test>", ov);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  return cfg.is_ok() ? *cfg : Config{};
}

using test::must_train;

using test::tier;

ActivationSizes sizes_of(const Config& cfg, ActivationMode mode, bool fused_attention = true) {
  auto arch = create_gpt2(cfg.model);
  EXPECT_TRUE(arch.is_ok());
  return (*arch)->activation_plan(int(cfg.train_micro_batch_size_per_gpu), cfg.data.seq_len,
                                  cfg.model.dtype, mode, fused_attention);
}

// Trains cfg on a CPU device whose kernels claim no fused attention: the models' plain path.
TrainResult train_plain_attention(const Config& cfg) {
  TrainOptions o;
  o.wrap_device = [](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
    auto w = std::make_unique<test::WrappedDevice>(std::move(d), /*host_addressable=*/true);
    w->disable_fused_attention();
    return w;
  };
  return must_train(cfg, o);
}

class ActivationsTest : public ::testing::Test {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }
};

TEST_F(ActivationsTest, DeviceBytesShrinkWithEachMode) {
  Config cfg = act_config("unused", "keep");
  const ActivationSizes keep = sizes_of(cfg, ActivationMode::kKeep);
  const ActivationSizes rec = sizes_of(cfg, ActivationMode::kRecompute);
  const ActivationSizes off = sizes_of(cfg, ActivationMode::kOffload);
  EXPECT_LT(rec.bytes, keep.bytes / 2);
  EXPECT_LT(off.bytes, rec.bytes);
  // Offload keeps two of the four block inputs (256 rows x 128 channels x 2 bytes) fewer.
  const size_t input = size_t(4) * 64 * 128 * 2;
  EXPECT_EQ(rec.bytes - off.bytes, 2 * input);
  EXPECT_EQ(off.stash_layers, 3);
  EXPECT_EQ(off.stash_bytes, input);
  EXPECT_EQ(off.host_bytes, 3 * input);
  EXPECT_EQ(keep.host_bytes, 0u);
  EXPECT_EQ(rec.host_bytes, 0u);
}

// With the fused attention a layer keeps each row's log-sum-exp [B, heads, T] instead of the
// probabilities [B, heads, T, T], and so does the backward's scratch: one carve says so for
// the runner, the trainer's preflight and the planner. tiny: B 4, 4 heads, T 64.
TEST_F(ActivationsTest, FusedAttentionCarvesNoTimesTSquare) {
  Config cfg = act_config("unused", "keep");
  const size_t probs = size_t(4) * 4 * 64 * 64 * 4, lse = size_t(4) * 4 * 64 * 4;
  // keep: 4 layers' att + the scratch; recompute and offload: one layer's + the scratch.
  for (auto [mode, buffers] : {std::pair{ActivationMode::kKeep, 5},
                               {ActivationMode::kRecompute, 2},
                               {ActivationMode::kOffload, 2}}) {
    SCOPED_TRACE(activation_mode_name(mode));
    const ActivationSizes fused = sizes_of(cfg, mode, true), plain = sizes_of(cfg, mode, false);
    EXPECT_EQ(plain.bytes - fused.bytes, buffers * (probs - lse));
    EXPECT_EQ(plain.host_bytes, fused.host_bytes);
  }
  // Llama's carve the same way (grouped heads: the probabilities are per query head).
  cfg.model.type = "llama";
  cfg.model.num_key_value_heads = 2;
  cfg.model.intermediate_size = 256;
  auto arch = create_llama(cfg.model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  const auto fused = (*arch)->activation_plan(4, 64, DType::kBF16, ActivationMode::kKeep, true);
  const auto plain = (*arch)->activation_plan(4, 64, DType::kBF16, ActivationMode::kKeep, false);
  EXPECT_EQ(plain.bytes - fused.bytes, 5 * (probs - lse));
}

// The fused attention computes the plain one's numbers in another order: GPT and Llama train to
// the same losses within fp32 rounding (the fused path is what the CPU backend runs; the plain
// one is forced through a device whose kernels report the fused op unsupported), and the fused
// path is still bit-identical across keep / recompute.
TEST_F(ActivationsTest, FusedAndPlainAttentionTrainAlike) {
  for (const char* model : {"gpt2", "llama"}) {
    SCOPED_TRACE(model);
    std::vector<std::string> ov = {"bf16.enabled=false", "train.steps=6",
                                   std::string("model.type=\"") + model + "\""};
    if (std::string(model) == "llama") {
      ov.push_back("model.num_key_value_heads=2");
      ov.push_back("model.intermediate_size=256");
    }
    auto dir = temp_dir(std::string("fused_") + model);
    const TrainResult fused = must_train(act_config(dir + "/f", "keep", ov));
    const TrainResult fused_rec = must_train(act_config(dir + "/r", "recompute", ov));
    const TrainResult plain = train_plain_attention(act_config(dir + "/p", "keep", ov));
    fs::remove_all(dir);
    ASSERT_EQ(fused.losses.size(), 6u);
    ASSERT_EQ(plain.losses.size(), 6u);
    EXPECT_EQ(fused_rec.losses, fused.losses);
    EXPECT_EQ(fused_rec.weights_crc, fused.weights_crc);
    for (size_t s = 0; s < 6; ++s) {
      EXPECT_NEAR(fused.losses[s], plain.losses[s], 1e-4 * std::abs(plain.losses[s])) << s;
    }
    EXPECT_LT(fused.losses.back(), fused.losses.front());  // it trained
  }
}

// Recompute re-runs the same deterministic kernels on the same block inputs; offload moves
// those inputs bit for bit. So every loss, eval loss and weight is the same in all three.
TEST_F(ActivationsTest, KeepRecomputeOffloadTrainBitIdentically) {
  const int64_t steps = 12, accum = 2;
  std::vector<TrainResult> r;
  for (const char* mode : {"keep", "recompute", "offload"}) {
    auto dir = temp_dir(std::string("same_") + mode);
    r.push_back(must_train(act_config(dir, mode)));
    fs::remove_all(dir);
  }
  ASSERT_EQ(r[0].losses.size(), size_t(steps));
  for (size_t i = 1; i < r.size(); ++i) {
    ASSERT_EQ(r[i].losses.size(), r[0].losses.size()) << "mode " << i;
    for (size_t s = 0; s < r[0].losses.size(); ++s) {
      EXPECT_EQ(r[i].losses[s], r[0].losses[s]) << "mode " << i << " step " << s;
    }
    EXPECT_EQ(r[i].eval_losses, r[0].eval_losses) << "mode " << i;
    EXPECT_EQ(r[i].weights_crc, r[0].weights_crc) << "mode " << i;
  }
  EXPECT_LT(r[0].losses.back(), r[0].losses.front());  // it trained
  // Offload: every block input but the last leaves after its forward (train and eval) and
  // comes back before its backward (train only): the host tier counts both.
  const Config cfg = act_config("unused", "offload");
  const ActivationSizes off = sizes_of(cfg, ActivationMode::kOffload);
  const uint64_t per_pass = uint64_t(off.stash_layers) * off.stash_bytes;
  const auto& host_keep = tier(r[0], "host");
  const auto& host_rec = tier(r[1], "host");
  const auto& host_off = tier(r[2], "host");
  EXPECT_EQ(host_rec.bytes_in, host_keep.bytes_in);  // recompute moves nothing
  EXPECT_EQ(host_rec.bytes_out, host_keep.bytes_out);
  EXPECT_EQ(host_off.bytes_out - host_keep.bytes_out, uint64_t(steps * accum) * per_pass);
  const uint64_t stashed = host_off.bytes_in - host_keep.bytes_in;
  EXPECT_GE(stashed, uint64_t(steps * accum) * per_pass);
  EXPECT_EQ(stashed % per_pass, 0u);
  // The reserved block buffers are part of the host tier's peak.
  EXPECT_GE(host_off.peak, host_keep.peak + off.host_bytes);
}

// The optimizer schedules (plain, and the one-step-stale delayed update) leave the
// parameters unchanged between a block's forward and its recompute, so the modes still agree.
TEST_F(ActivationsTest, ModesAgreeUnderEveryOptimizerSchedule) {
  const std::vector<std::vector<std::string>> schedules = {
      {"strata.optimizer.overlap=false"},
      {"strata.optimizer.delayed_update=true", "strata.optimizer.delayed_update_warmup=4"}};
  for (const auto& sched : schedules) {
    std::vector<TrainResult> r;
    for (const char* mode : {"keep", "recompute", "offload"}) {
      auto dir = temp_dir(std::string("sched_") + mode);
      std::vector<std::string> ov = sched;
      ov.push_back("train.steps=8");
      r.push_back(must_train(act_config(dir, mode, ov)));
      fs::remove_all(dir);
    }
    ASSERT_EQ(r[0].losses.size(), 8u) << sched[0];
    for (size_t i = 1; i < r.size(); ++i) {
      EXPECT_EQ(r[i].losses, r[0].losses) << sched[0] << " mode " << i;
      EXPECT_EQ(r[i].weights_crc, r[0].weights_crc) << sched[0] << " mode " << i;
    }
  }
}

// A device budget that keep's activations exceed but recompute's and offload's fit.
TEST_F(ActivationsTest, KeepDoesNotFitRecomputeAndOffloadDo) {
  Config probe = act_config("unused", "keep");
  const size_t keep = sizes_of(probe, ActivationMode::kKeep).bytes;
  const size_t rec = sizes_of(probe, ActivationMode::kRecompute).bytes;
  // Room for recompute's activations and the largest module's working set (~1.4 MiB here).
  const size_t limit = rec + (size_t(3) << 20);
  ASSERT_LT(limit, keep) << "the test's model no longer has activations that dominate";
  const std::string lim = "device.memory_limit=" + std::to_string(limit);

  auto dir = temp_dir("nofit_keep");
  TrainOptions o;
  o.progress = false;
  auto k = train(act_config(dir, "keep", {lim}), o);
  ASSERT_FALSE(k.is_ok());
  EXPECT_EQ(k.status().code(), StatusCode::kOutOfMemory);
  const std::string msg = k.status().message();
  EXPECT_NE(msg.find("preflight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("strata.activations = recompute"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(dir + "/latest"));  // refused before the first step
  fs::remove_all(dir);

  std::vector<TrainResult> r;
  for (const char* mode : {"recompute", "offload"}) {
    auto d = temp_dir(std::string("fit_") + mode);
    r.push_back(must_train(act_config(d, mode, {lim, "train.steps=6"})));
    fs::remove_all(d);
    ASSERT_EQ(r.back().losses.size(), 6u) << mode;
    EXPECT_LE(tier(r.back(), "device").peak, limit) << mode;
  }
  // A tight device changes what is cached, never the numbers.
  EXPECT_EQ(r[0].losses, r[1].losses);
  EXPECT_EQ(r[0].weights_crc, r[1].weights_crc);
}

// The tier manager's stash/restore API on its own: a round trip is exact, the bytes are
// counted, and a layer or size outside the reservation is an error naming strata.activations
// that end_backward reports too.
TEST(ActivationStore, RoundTripCountsAndRefusals) {
  set_log_level(LogLevel::kError);
  auto dev = create_cpu_device({.capacity = 64 << 20, .threads = 1});
  ASSERT_TRUE(dev.is_ok());
  const ModelConfig mc = test::gpt_shape(3, 2, 32, 64, 16);
  auto arch = create_gpt2(mc);
  ASSERT_TRUE(arch.is_ok());
  TierOptions to;
  to.placement.params = Tier::kHost;
  to.placement.master = to.placement.moments = Tier::kHost;
  to.host_capacity = 64 << 20;
  to.stash_layers = 2;
  to.stash_bytes = 4000;
  auto tm = TierManager::create(**dev, **arch, DType::kBF16, DType::kF32, to, 0);
  ASSERT_TRUE(tm.is_ok()) << tm.status().to_string();
  Device& d = **dev;
  auto a = d.allocate(4000, "test");
  auto b = d.allocate(4000, "test");
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  std::vector<uint8_t> src(4000), back(4000, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i * 37 + 11);
  std::memcpy(*a, src.data(), src.size());  // the CPU device is host-addressable
  const TierStats before = (*tm)->stats(Tier::kHost);

  // Restoring a block that was never stashed is refused.
  Status never = (*tm)->restore_activation(1, *b);
  EXPECT_FALSE(never.is_ok());
  EXPECT_NE(never.message().find("strata.activations"), std::string::npos) << never.message();
  EXPECT_FALSE((*tm)->end_backward().is_ok());  // kept for the next sync point, then cleared

  ASSERT_TRUE((*tm)->stash_activation(1, *a, 4000).is_ok());
  (*tm)->compute_waits_activation(1);
  // The compute stream overwrites the source only after the stash has read it.
  d.memset_zero(d.compute_stream(), *a, 4000);
  ASSERT_TRUE((*tm)->restore_activation(1, *b).is_ok());
  (*tm)->compute_waits_activation(1);
  ASSERT_TRUE(d.synchronize(d.compute_stream()).is_ok());
  std::memcpy(back.data(), *b, back.size());
  EXPECT_EQ(back, src);
  const TierStats after = (*tm)->stats(Tier::kHost);
  EXPECT_EQ(after.bytes_in - before.bytes_in, 4000u);
  EXPECT_EQ(after.bytes_out - before.bytes_out, 4000u);
  EXPECT_GE(after.current, size_t(2) * 4000);  // both block buffers are reserved up front

  // Outside the reservation: a third block, or more bytes than a block buffer holds.
  Status too_many = (*tm)->stash_activation(2, *a, 4000);
  EXPECT_FALSE(too_many.is_ok());
  EXPECT_NE(too_many.message().find("strata.activations"), std::string::npos);
  EXPECT_FALSE((*tm)->stash_activation(0, *a, 4001).is_ok());
  EXPECT_FALSE((*tm)->end_backward().is_ok());
  EXPECT_TRUE((*tm)->end_backward().is_ok());
  d.release(*a);
  d.release(*b);
}

}  // namespace
}  // namespace strata
