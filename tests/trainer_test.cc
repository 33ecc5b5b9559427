// End-to-end training on the CPU backend: the loss falls, checkpoints round-trip, a stopped and
// resumed run equals the uninterrupted one bit for bit, corrupt checkpoints are refused, and a
// run that cannot fit is refused before it starts.
#include "src/train/trainer.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "src/checkpoint/checkpoint.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) { return test::temp_dir("strata_test", name); }

// A small but real GPT on the synthetic corpus.
Config small_config(const std::string& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {
      "train.checkpoint_dir=\"" + dir + "\"",
  };
  ov.insert(ov.end(), extra.begin(), extra.end());
  const char* json = R"({
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 1000, "gradient_clipping": 1.0,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64, "context": 32},
    "data": {"synthetic_tokens": 65536, "eval_batches": 2},
    "device": {"backend": "cpu", "memory_limit": "256MiB", "cpu_threads": 2},
    "train": {"steps": 20, "eval_interval": 10, "seed": 42}
  })";
  auto cfg = parse_config(json, "<test>", ov);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  return *cfg;
}

using test::must_train;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }
};

TEST_F(TrainerTest, LossFallsOnSyntheticCorpus) {
  auto dir = temp_dir("falls");
  Config cfg = small_config(dir, {"train.steps=60", "train.eval_interval=60"});
  TrainResult r = must_train(cfg);
  ASSERT_EQ(r.eval_losses.size(), 2u);
  const double first = r.eval_losses.front().second, last = r.eval_losses.back().second;
  EXPECT_NEAR(first, std::log(64.0), 0.3);  // untrained: about uniform over the vocabulary
  EXPECT_LT(last, first - 0.7) << "eval loss did not fall: " << first << " -> " << last;
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
  fs::remove_all(dir);
}

void expect_resume_bit_identical(const std::vector<std::string>& extra) {
  auto dir_a = temp_dir("full"), dir_b = temp_dir("resumed");
  TrainResult full = must_train(small_config(dir_a, extra));
  TrainOptions stop;
  stop.stop_at_step = 8;
  TrainResult first = must_train(small_config(dir_b, extra), stop);
  ASSERT_TRUE(first.stopped_early);
  ASSERT_EQ(first.end_step, 8);
  TrainOptions resume;
  resume.resume = "latest";
  TrainResult second = must_train(small_config(dir_b, extra), resume);
  EXPECT_EQ(second.start_step, 8);
  ASSERT_EQ(full.losses.size(), 20u);
  std::vector<double> stitched = first.losses;
  stitched.insert(stitched.end(), second.losses.begin(), second.losses.end());
  ASSERT_EQ(stitched.size(), full.losses.size());
  for (size_t i = 0; i < stitched.size(); ++i) {
    EXPECT_EQ(stitched[i], full.losses[i]) << "step " << i + 1;  // bit for bit
  }
  EXPECT_EQ(second.weights_crc, full.weights_crc);
  EXPECT_EQ(second.skipped_steps + first.skipped_steps, full.skipped_steps);
  fs::remove_all(dir_a);
  fs::remove_all(dir_b);
}

TEST_F(TrainerTest, ResumeIsBitIdenticalBf16) { expect_resume_bit_identical({}); }

TEST_F(TrainerTest, ResumeIsBitIdenticalFp16WithLossScalingAndSchedule) {
  expect_resume_bit_identical(
      {"bf16.enabled=false", "fp16.enabled=true", "fp16.initial_scale_power=30",
       "fp16.loss_scale_window=3", "scheduler.type=\"WarmupCosineLR\"",
       "scheduler.params.warmup_num_steps=5", "scheduler.params.total_num_steps=20"});
}

TEST_F(TrainerTest, Fp16OverflowSkipsStepsAndLowersTheScale) {
  auto dir = temp_dir("fp16");
  // 2^40 overflows fp16 gradients at once: DeepSpeed's scaler must skip and halve until it fits.
  Config cfg =
      small_config(dir, {"bf16.enabled=false", "fp16.enabled=true", "fp16.initial_scale_power=40",
                         "fp16.hysteresis=1", "train.steps=30", "train.eval_interval=30"});
  TrainResult r = must_train(cfg);
  EXPECT_GT(r.skipped_steps, 0);
  EXPECT_LT(r.skipped_steps, 30);
  EXPECT_LT(r.eval_losses.back().second, r.eval_losses.front().second);
  fs::remove_all(dir);
}

TEST_F(TrainerTest, CorruptOrTruncatedCheckpointIsRefused) {
  auto dir = temp_dir("corrupt");
  Config cfg = small_config(dir, {"train.steps=2", "train.eval_interval=0"});
  TrainResult r = must_train(cfg);
  ASSERT_FALSE(r.last_checkpoint.empty());
  const std::string ckpt = r.last_checkpoint;
  const auto size = fs::file_size(ckpt);

  auto resume_status = [&]() {
    TrainOptions o;
    o.progress = false;
    o.resume = ckpt;
    return train(cfg, o).status();
  };
  // Flip one payload byte.
  {
    std::fstream f(ckpt, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 100));
    char c;
    f.seekg(static_cast<std::streamoff>(size - 100));
    f.get(c);
    f.seekp(static_cast<std::streamoff>(size - 100));
    f.put(static_cast<char>(c ^ 0x40));
  }
  Status s = resume_status();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_NE(s.message().find("checksum"), std::string::npos) << s.message();
  // Truncate.
  fs::resize_file(ckpt, size - 10);
  s = resume_status();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
  // Not a checkpoint at all.
  { std::ofstream(ckpt, std::ios::trunc) << "hello, this is not a checkpoint at all........"; }
  s = resume_status();
  EXPECT_NE(s.message().find("not a strata checkpoint"), std::string::npos) << s.message();
  fs::remove_all(dir);
}

TEST_F(TrainerTest, CheckpointRoundTripAndFailedWriteLeavesNothing) {
  auto dir = temp_dir("roundtrip");
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  CheckpointMeta meta;
  meta.step = 7;
  meta.moment_dtype = "fp32";
  meta.modules = {{"a", 1000}, {"b", 37}};
  std::vector<std::vector<float>> data(6);
  for (size_t i = 0; i < 6; ++i) {
    data[i].resize(meta.modules[i / 3].numel);
    for (auto& x : data[i]) x = u(rng);
  }
  std::vector<CheckpointBuffers> bufs = {{data[0].data(), data[1].data(), data[2].data(), 4},
                                         {data[3].data(), data[4].data(), data[5].data(), 4}};
  const std::string path = dir + "/c.bin";
  ASSERT_TRUE(write_checkpoint(path, meta, bufs).is_ok());
  auto got_meta = read_checkpoint_meta(path);
  ASSERT_TRUE(got_meta.is_ok());
  EXPECT_EQ(got_meta->step, 7);
  std::vector<std::vector<float>> back(6);
  for (size_t i = 0; i < 6; ++i) back[i].assign(data[i].size(), 0.0f);
  std::vector<CheckpointBuffers> in = {{back[0].data(), back[1].data(), back[2].data(), 4},
                                       {back[3].data(), back[4].data(), back[5].data(), 4}};
  ASSERT_TRUE(read_checkpoint(path, in).is_ok());
  EXPECT_EQ(back, data);
  // A write into a missing directory fails and leaves no file that looks valid.
  Status s = write_checkpoint(dir + "/missing/c.bin", meta, bufs);
  EXPECT_FALSE(s.is_ok());
  EXPECT_FALSE(fs::exists(dir + "/missing/c.bin"));
  EXPECT_FALSE(fs::exists(dir + "/missing/c.bin.tmp"));
  fs::remove_all(dir);
}

TEST_F(TrainerTest, RunThatCannotFitFailsBeforeItStarts) {
  auto dir = temp_dir("nofit");
  Config cfg = small_config(dir, {"device.memory_limit=\"64KiB\""});
  TrainOptions o;
  o.progress = false;
  auto r = train(cfg, o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(r.status().message().find("preflight"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("device.memory_limit"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir + "/latest"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
