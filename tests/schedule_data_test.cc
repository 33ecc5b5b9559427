// LR schedules and the loss scaler against hand-computed values; data formats and batches.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "src/model/gpt2.h"
#include "src/train/data.h"
#include "src/train/schedule.h"
#include "tests/test_util.h"

namespace strata {
namespace {

Config with_scheduler(const std::string& type) {
  Config c;
  c.optimizer.lr = 1e-3;
  c.scheduler.type = type;
  c.scheduler.warmup_min_lr = 1e-4;
  c.scheduler.warmup_max_lr = 1e-3;
  c.scheduler.warmup_num_steps = 10;
  c.scheduler.total_num_steps = 110;
  return c;
}

TEST(Schedule, MatchesDeepSpeedFormulas) {
  Config none;
  none.optimizer.lr = 5e-4;
  EXPECT_DOUBLE_EQ(learning_rate(none, 123), 5e-4);

  Config w = with_scheduler("WarmupLR");
  EXPECT_DOUBLE_EQ(learning_rate(w, 0), 1e-4);  // log(1) = 0
  EXPECT_NEAR(learning_rate(w, 4), 1e-4 + 9e-4 * std::log(5.0) / std::log(10.0), 1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(w, 50), 1e-3);
  w.scheduler.warmup_type = "linear";
  EXPECT_NEAR(learning_rate(w, 5), 1e-4 + 9e-4 * 0.5, 1e-15);

  Config d = with_scheduler("WarmupDecayLR");
  d.scheduler.warmup_type = "linear";
  EXPECT_NEAR(learning_rate(d, 60), 1e-4 + 9e-4 * (50.0 / 100.0), 1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(d, 200), 1e-4);

  // DeepSpeed warms up over at least 2 steps: warmup_num_steps 0 or 1 acts as 2 (log warm-up:
  // min at step 0, max at step 1), and the decay never starts above warmup_max_lr.
  for (int64_t warm : {0, 1}) {
    Config z = with_scheduler("WarmupDecayLR");
    z.scheduler.warmup_num_steps = warm;
    z.scheduler.total_num_steps = 6;
    EXPECT_DOUBLE_EQ(learning_rate(z, 0), 1e-4) << warm;
    EXPECT_DOUBLE_EQ(learning_rate(z, 1), 1e-3) << warm;
    EXPECT_DOUBLE_EQ(learning_rate(z, 2), 1e-3) << warm;  // (6 - 2) / (6 - 2)
    EXPECT_NEAR(learning_rate(z, 4), 1e-4 + 9e-4 * 0.5, 1e-15) << warm;
    for (int64_t t = 0; t < 8; ++t) EXPECT_LE(learning_rate(z, t), 1e-3) << warm << " " << t;
  }

  Config c = with_scheduler("WarmupCosineLR");
  c.scheduler.warmup_type = "linear";
  c.scheduler.cos_min_ratio = 0.1;
  EXPECT_NEAR(learning_rate(c, 5), 1e-3 * 0.5, 1e-15);
  EXPECT_NEAR(learning_rate(c, 10), 1e-3, 1e-15);
  EXPECT_NEAR(learning_rate(c, 60), 1e-3 * (0.1 + 0.9 * 0.5), 1e-15);  // halfway: cos = 0
  EXPECT_NEAR(learning_rate(c, 110), 1e-4, 1e-15);
  // One step without warm-up: a finite rate (was NaN, and the optimizer aborted on it).
  c.scheduler.warmup_num_steps = 0;
  c.scheduler.total_num_steps = 1;
  EXPECT_DOUBLE_EQ(learning_rate(c, 0), 1e-3);
  EXPECT_TRUE(std::isfinite(learning_rate(c, 1)));
}

// An fp16 config with the dynamic scaler starting at 2^power and `hysteresis`.
Config fp16_config(int power, int hysteresis) {
  Config c;
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = power;
  c.fp16.hysteresis = hysteresis;
  return c;
}

TEST(LossScaler, DeepSpeedHysteresisAndWindow) {
  Config c = fp16_config(16, 2);
  c.fp16.loss_scale_window = 4;
  LossScaler s = LossScaler::from_config(c);
  EXPECT_EQ(s.scale, 65536.0);
  EXPECT_TRUE(s.update(c, true));  // first overflow absorbed by hysteresis
  EXPECT_EQ(s.scale, 65536.0);
  EXPECT_TRUE(s.update(c, true));  // second halves
  EXPECT_EQ(s.scale, 32768.0);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(s.update(c, false));
  EXPECT_EQ(s.scale, 32768.0);
  EXPECT_FALSE(s.update(c, false));  // 4 clean steps since the overflow: doubles
  EXPECT_EQ(s.scale, 65536.0);
  c.fp16.min_loss_scale = 65536.0;
  c.fp16.hysteresis = 1;
  EXPECT_TRUE(s.update(c, true));
  EXPECT_EQ(s.scale, 65536.0);  // not below min_loss_scale
  Config bf;
  EXPECT_EQ(LossScaler::from_config(bf).scale, 1.0);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(LossScaler, OverflowAtTheMinimumScaleStopsTheRunOnceHysteresisIsUsedUp) {
  Config c = fp16_config(2, 2);
  c.fp16.min_loss_scale = 2.0;
  LossScaler s = LossScaler::from_config(c);
  EXPECT_TRUE(s.update(c, true));  // absorbed by hysteresis: 4
  EXPECT_TRUE(s.check(c).is_ok());
  EXPECT_TRUE(s.update(c, true));  // halves to the floor: 2
  EXPECT_EQ(s.scale, 2.0);
  EXPECT_TRUE(s.check(c).is_ok());
  // At the floor, with hysteresis used up (it refills only when the scale doubles): the next
  // overflow would halve, and there is nothing below.
  EXPECT_FALSE(s.update(c, false));
  EXPECT_TRUE(s.check(c).is_ok());
  EXPECT_TRUE(s.update(c, true));
  EXPECT_EQ(s.scale, 2.0);
  const Status st = s.check(c);
  ASSERT_FALSE(st.is_ok());
  for (const char* part : {"minimum loss scale 2", "fp16.min_loss_scale", "optimizer.params.lr",
                           "gradient_clipping", "bf16"}) {
    EXPECT_TRUE(contains(st.message(), part)) << part << " in: " << st.message();
  }
}

TEST(LossScaler, HysteresisIsSpentAtTheMinimumScaleBeforeTheRunStops) {
  Config c = fp16_config(0, 3);       // starts at the floor, 1
  c.fp16.consecutive_hysteresis = 1;  // a clean step refills it
  LossScaler s = LossScaler::from_config(c);
  for (int round = 0; round < 2; ++round) {
    EXPECT_TRUE(s.update(c, true));
    EXPECT_TRUE(s.update(c, true));
    EXPECT_TRUE(s.check(c).is_ok()) << "two overflows of three tolerated, round " << round;
    EXPECT_FALSE(s.update(c, false));  // refills the hysteresis
    EXPECT_TRUE(s.check(c).is_ok());
  }
  EXPECT_TRUE(s.update(c, true));
  EXPECT_TRUE(s.update(c, true));
  EXPECT_TRUE(s.update(c, true));
  EXPECT_FALSE(s.check(c).is_ok());
  EXPECT_EQ(s.scale, 1.0);
}

TEST(LossScaler, StaticScaleStopsAfterTwentyOverflowsInARowAndACleanStepResetsTheCount) {
  Config c;
  c.fp16.enabled = true;
  c.fp16.loss_scale = 1024;
  LossScaler s = LossScaler::from_config(c);
  for (int64_t i = 0; i < kStaticScaleOverflowLimit - 1; ++i) EXPECT_TRUE(s.update(c, true));
  EXPECT_TRUE(s.check(c).is_ok());
  EXPECT_FALSE(s.update(c, false));  // a clean step: the count starts over
  for (int64_t i = 0; i < kStaticScaleOverflowLimit - 1; ++i) EXPECT_TRUE(s.update(c, true));
  EXPECT_TRUE(s.check(c).is_ok());
  EXPECT_TRUE(s.update(c, true));
  EXPECT_EQ(s.scale, 1024.0);  // a static scale never changes
  const Status st = s.check(c);
  ASSERT_FALSE(st.is_ok());
  for (const char* part : {"static loss scale 1024", "fp16.loss_scale", "20 steps in a row",
                           "set it to 0 for the dynamic scaler"}) {
    EXPECT_TRUE(contains(st.message(), part)) << part << " in: " << st.message();
  }
  // bf16 and fp32 have nothing to stop for.
  Config bf;
  LossScaler b = LossScaler::from_config(bf);
  for (int i = 0; i < 30; ++i) b.update(bf, true);
  EXPECT_TRUE(b.check(bf).is_ok());
}

// A file of this process's temp directory (removed at its exit: tests/test_util.h).
std::string write_file(const std::string& name, const void* data, size_t n) {
  static const std::string dir = test::temp_dir("strata_schedule_data", "files");
  auto p = std::filesystem::path(dir) / name;
  std::ofstream(p, std::ios::binary).write(static_cast<const char*>(data), std::streamsize(n));
  return p.string();
}

TEST(Data, ReadsLlmcRawAndTextAndChecksVocab) {
  std::vector<uint16_t> toks(5000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = uint16_t((i * 37) % 300);
  std::vector<char> llmc(1024 + toks.size() * 2);
  int32_t header[256] = {20240520, 1, int32_t(toks.size())};
  std::memcpy(llmc.data(), header, sizeof(header));
  std::memcpy(llmc.data() + 1024, toks.data(), toks.size() * 2);
  DataConfig dc;
  dc.source = write_file("strata_data.bin", llmc.data(), llmc.size());
  auto d = Dataset::load(dc, 300, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->train_tokens() + d->eval_tokens(), toks.size());
  std::vector<int32_t> x(64), y(64);
  d->train_batch(1, 3, 0, 0, 2, 32, x.data(), y.data());
  for (int i = 0; i < 31; ++i) EXPECT_EQ(y[i], x[i + 1]);
  // Deterministic: same (seed, step, micro, rank) gives the same batch; another step differs.
  std::vector<int32_t> x2(64), y2(64);
  d->train_batch(1, 3, 0, 0, 2, 32, x2.data(), y2.data());
  EXPECT_EQ(x, x2);
  d->train_batch(1, 4, 0, 0, 2, 32, x2.data(), y2.data());
  EXPECT_NE(x, x2);

  auto small = Dataset::load(dc, 200, 1);  // token 299 does not fit a vocabulary of 200
  ASSERT_FALSE(small.is_ok());
  EXPECT_NE(small.status().message().find("vocab_size"), std::string::npos);

  dc.source = write_file("strata_data.u16", toks.data(), toks.size() * 2);
  auto raw = Dataset::load(dc, 300, 1);
  ASSERT_TRUE(raw.is_ok());
  EXPECT_EQ(raw->train_tokens() + raw->eval_tokens(), toks.size());

  const std::string text(4000, 'a');
  dc.source = write_file("strata_data.txt", text.data(), text.size());
  auto t = Dataset::load(dc, 256, 1);
  ASSERT_TRUE(t.is_ok());
  dc.source = "/nonexistent/corpus.bin";
  EXPECT_EQ(Dataset::load(dc, 256, 1).status().code(), StatusCode::kNotFound);
}

TEST(Model, LayoutIsFlatPerModule) {
  ModelConfig mc = test::gpt_shape(3, 4, 64, 100, 16);
  auto a = create_gpt2(mc);
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ((*a)->shape().padded_vocab_size, 128);
  const ModelLayout& l = (*a)->layout();
  EXPECT_EQ(l.modules.size(), 5u);  // embedding, 3 blocks, final norm (tied head)
  const size_t C = 64;
  EXPECT_EQ(l.modules[1].numel, 12 * C * C + 13 * C);
  EXPECT_EQ(l.num_params(), 128 * C + 16 * C + 3 * (12 * C * C + 13 * C) + 2 * C);
  mc.n_head = 5;
  EXPECT_FALSE(create_gpt2(mc).is_ok());
}

}  // namespace
}  // namespace strata
