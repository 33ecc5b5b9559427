// Checkpoint metadata checked against the run (check_resume): edited whole-model files (their
// checksums recomputed), deep JSON, and a two-rank save whose files disagree.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "src/train/resume_check.h"
#include "tests/adversarial_util.h"

namespace strata {
namespace {

using namespace adversarial;

// ---- 7. checkpoint metadata checked against the run ---------------------------------------------

class MetaEdits : public Hardening {
 protected:
  void SetUp() override {
    Hardening::SetUp();
    dir_ = temp_dir("meta");
    cfg_ = small_config(dir_, {"train.steps=4"});
    TrainResult r = must_train(cfg_);
    ckpt_ = r.last_checkpoint;
    pristine_ = test::read_file(ckpt_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Resumes after `edit`; expects a refusal mentioning every `words`.
  void expect_refused(const std::function<void(nlohmann::json&)>& edit,
                      std::vector<std::string> words) {
    std::ofstream(ckpt_, std::ios::binary | std::ios::trunc) << pristine_;
    edit_meta(ckpt_, edit);
    Status s = train_status(cfg_, ckpt_);
    ASSERT_FALSE(s.is_ok()) << "resumed from edited metadata";
    for (const auto& w : words) EXPECT_TRUE(contains(s.message(), w)) << s.message();
  }
  std::string dir_, ckpt_, pristine_;
  Config cfg_;
};

TEST_F(MetaEdits, NegativeOptStepsIsAnErrorNotAnAbort) {
  expect_refused([](auto& j) { j["opt_steps"] = -100; }, {"opt_steps", "-100"});
}

TEST_F(MetaEdits, NegativeStep) {
  expect_refused([](auto& j) { j["step"] = -5; }, {"step", "-5"});
}

TEST_F(MetaEdits, SwappedModuleSizes) {
  expect_refused(
      [](auto& j) {
        auto& m = j["modules"];
        std::swap(m[0]["numel"], m[1]["numel"]);
      },
      {"module", "elements"});
}

TEST_F(MetaEdits, RenamedModule) {
  expect_refused([](auto& j) { j["modules"][1]["name"] = "block.9"; }, {"block.9"});
}

TEST_F(MetaEdits, WorldSizeOfAShardFile) {
  expect_refused(
      [](auto& j) {
        j["world_size"] = 2;
        j["rank"] = 1;
      },
      {"rank 1 of 2"});
}

TEST_F(MetaEdits, WrongTypes) {
  expect_refused([](auto& j) { j["step"] = "four"; }, {"step"});
  expect_refused([](auto& j) { j["loss_scale"] = -1.0; }, {"loss_scale"});
  expect_refused([](auto& j) { j["modules"][0]["numel"] = -1; }, {"numel"});
  expect_refused([](auto& j) { j["moment_dtype"] = "int8"; }, {"moment_dtype"});
}

// The metadata JSON of checkpoint `path`, as written.
nlohmann::json meta_of(const std::string& path) {
  const std::string bytes = test::read_file(path);
  uint32_t jlen = 0;
  if (bytes.size() >= 32) std::memcpy(&jlen, bytes.data() + 12, 4);
  return nlohmann::json::parse(bytes.substr(32, jlen));
}

TEST_F(MetaEdits, AnotherOptimizersStateIsRefused) {
  // AdamW's moments would be stepped as Lion's momentum or Adagrad's sums of squares.
  EXPECT_EQ(meta_of(ckpt_).value("optimizer_state", ""), "adam");
  for (const char* type : {"Lion", "Adagrad"}) {
    SCOPED_TRACE(type);
    Config other =
        small_config(dir_, {"train.steps=6", fmt::format("optimizer.type=\"{}\"", type)});
    Status s = train_status(other, ckpt_);
    ASSERT_FALSE(s.is_ok()) << "resumed AdamW's state with optimizer.type " << type;
    for (const std::string w :
         {ckpt_, std::string("optimizer state of AdamW or Adam (first and second moments)"),
          fmt::format("optimizer.type is {}", type),
          std::string("resume with optimizer.type AdamW"), std::string("without --resume")}) {
      EXPECT_TRUE(contains(s.message(), w)) << "'" << w << "' not in " << s.message();
    }
  }
}

TEST_F(MetaEdits, AdamAndAdamWResumeEachOther) {
  // Adam (L2 decay, adam_w_mode off) takes over AdamW's moments, and AdamW Adam's: one state.
  Config adam = small_config(
      dir_, {"train.steps=6", "optimizer.type=\"Adam\"", "optimizer.params.adam_w_mode=false"});
  TrainOptions o;
  o.progress = false;
  o.resume = ckpt_;
  auto r = train(adam, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(meta_of(r->last_checkpoint).value("optimizer_state", ""), "adam");
  Config adamw = small_config(dir_, {"train.steps=8"});
  o.resume = r->last_checkpoint;
  auto back = train(adamw, o);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(meta_of(back->last_checkpoint).value("optimizer_state", ""), "adam");
}

TEST_F(MetaEdits, MetadataWithoutTheOptimizerStateIsAccepted) {
  // A file written before the state was recorded: any optimizer.type resumes it, as before.
  ASSERT_TRUE(meta_of(ckpt_).contains("optimizer_state"));
  edit_meta(ckpt_, [](auto& j) { j.erase("optimizer_state"); });
  auto meta = read_checkpoint_meta(ckpt_);
  ASSERT_TRUE(meta.is_ok()) << meta.status().to_string();
  EXPECT_EQ(meta->optimizer_state, "");
  Config lion = small_config(dir_, {"train.steps=6", "optimizer.type=\"Lion\""});
  Status s = train_status(lion, ckpt_);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST_F(MetaEdits, OptimizerStateOfTheWrongTypeOrName) {
  expect_refused([](auto& j) { j["optimizer_state"] = 3; }, {"optimizer_state", "a string"});
  expect_refused([](auto& j) { j["optimizer_state"] = "sgd"; },
                 {"optimizer_state", "\"sgd\"", "adam, adagrad, lion"});
  expect_refused([](auto& j) { j["optimizer_state"] = ""; }, {"optimizer_state"});
}

TEST_F(MetaEdits, ChangedSeedIsRefused) {
  std::ofstream(ckpt_, std::ios::binary | std::ios::trunc) << pristine_;
  Config other = small_config(dir_, {"train.steps=6", "train.seed=7"});
  Status s = train_status(other, ckpt_);
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "train.seed=42")) << s.message();
}

TEST_F(MetaEdits, StepsBelowTheCheckpointIsRefused) {
  Config fewer = small_config(dir_, {"train.steps=2"});
  Status s = train_status(fewer, ckpt_);
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "past train.steps 2")) << s.message();
}

// The checkpoint records the batch it was trained with; a resume that would step through other
// samples (another accumulation, or another micro-batch x ranks) is told so, and one that
// reshards the same samples (2 ranks of 1 -> 1 rank of 2) or an old file without the record is
// not. The record is read back as written, and a value outside its range is refused.
TEST_F(MetaEdits, AResumeThatChangesTheSamplesIsNamed) {
  auto meta = read_checkpoint_meta(ckpt_);
  ASSERT_TRUE(meta.is_ok()) << meta.status().to_string();
  EXPECT_EQ(meta->micro_batch, cfg_.train_micro_batch_size_per_gpu);
  EXPECT_EQ(meta->accumulation, cfg_.gradient_accumulation_steps);
  CheckpointMeta then;
  then.micro_batch = 1;
  then.accumulation = 2;
  then.world_size = 2;
  CheckpointMeta now = then;
  EXPECT_EQ(resume_batch_note(then, now), "");
  now.world_size = 1;
  now.micro_batch = 2;
  EXPECT_EQ(resume_batch_note(then, now), "") << "the same samples, resharded";
  now.accumulation = 1;
  now.micro_batch = 4;
  const std::string note = resume_batch_note(then, now);
  EXPECT_TRUE(contains(note, "gradient_accumulation_steps 2; this run takes 4 on 1 and 1")) << note;
  now = then;
  now.micro_batch = 2;
  EXPECT_NE(resume_batch_note(then, now), "") << "a larger global batch";
  CheckpointMeta old = then;
  old.micro_batch = old.accumulation = 0;
  EXPECT_EQ(resume_batch_note(old, now), "") << "a file written before the record";
  expect_refused([](nlohmann::json& j) { j["gradient_accumulation_steps"] = 0; },
                 {"gradient_accumulation_steps"});
}

// The checkpoint records the steps its learning-rate schedule decays over (a cosine with
// total_num_steps unset: train.steps; a constant rate: none); a resume whose schedule decays over
// others (a raised train.steps) is told so and how to keep the rate; one with the same schedule,
// a schedule that does not decay, or an old file without the record is not.
TEST_F(MetaEdits, AResumeThatChangesTheScheduleIsNamed) {
  auto constant = read_checkpoint_meta(ckpt_);
  ASSERT_TRUE(constant.is_ok()) << constant.status().to_string();
  EXPECT_EQ(constant->schedule_steps, 0);
  const TrainResult cosine = must_train(
      small_config(dir_ + "/cosine", {"train.steps=3", "scheduler.type=\"WarmupCosineLR\"",
                                      "scheduler.params.warmup_num_steps=1"}));
  auto meta = read_checkpoint_meta(cosine.last_checkpoint);
  ASSERT_TRUE(meta.is_ok()) << meta.status().to_string();
  EXPECT_EQ(meta->schedule_steps, 3);
  CheckpointMeta then, now;
  then.schedule_steps = now.schedule_steps = 4;
  EXPECT_EQ(resume_schedule_note(then, now), "");
  now.schedule_steps = 10;
  const std::string note = resume_schedule_note(then, now);
  EXPECT_TRUE(contains(note, "decays over 4 steps, this run's over 10")) << note;
  EXPECT_TRUE(contains(note, "--set scheduler.params.total_num_steps=4")) << note;
  now.schedule_steps = 0;  // a schedule that does not decay
  EXPECT_EQ(resume_schedule_note(then, now), "");
  then.schedule_steps = 0;  // not recorded
  now.schedule_steps = 10;
  EXPECT_EQ(resume_schedule_note(then, now), "");
  expect_refused([](nlohmann::json& j) { j["schedule_steps"] = -3; }, {"schedule_steps"});
}

// A resume under another model.pad_token_id (the embedding row that takes no gradient) is named,
// with the setting that keeps the checkpoint's; a checkpoint from before it was recorded is not.
TEST_F(MetaEdits, AResumeThatChangesThePadTokenIsNamed) {
  auto none = read_checkpoint_meta(ckpt_);
  ASSERT_TRUE(none.is_ok()) << none.status().to_string();
  EXPECT_EQ(none->pad_token_id, -1);
  CheckpointMeta then, now;
  then.pad_token_id = now.pad_token_id = 7;
  EXPECT_EQ(resume_pad_note(then, now), "");
  now.pad_token_id = -1;
  const std::string note = resume_pad_note(then, now);
  EXPECT_TRUE(contains(note, "pad token 7 from training, this run keeps none's")) << note;
  EXPECT_TRUE(contains(note, "--set model.pad_token_id=7")) << note;
  EXPECT_EQ(resume_notes(then, now), std::vector<std::string>{note});  // what --resume logs
  then.pad_token_id = -2;                                              // not recorded
  EXPECT_EQ(resume_pad_note(then, now), "");
  edit_meta(ckpt_, [](nlohmann::json& j) { j.erase("pad_token_id"); });
  auto old = read_checkpoint_meta(ckpt_);
  ASSERT_TRUE(old.is_ok()) << old.status().to_string();
  EXPECT_EQ(old->pad_token_id, -2);
  expect_refused([](nlohmann::json& j) { j["pad_token_id"] = -5; }, {"pad_token_id"});
}

TEST_F(Hardening, DeepCheckpointMetadataIsCorruptNotACrash) {
  const auto dir = temp_dir("deepmeta");
  CheckpointMeta meta;
  meta.moment_dtype = "fp32";
  meta.modules = {{"a", 4}};
  std::vector<float> a(4, 1.0f);
  const std::string path = dir + "/c.bin";
  ASSERT_TRUE(write_checkpoint(path, meta, {{a.data(), a.data(), a.data(), 4}}).is_ok());
  std::string deep(100000, '[');
  deep += std::string(100000, ']');
  edit_meta(path, [&](nlohmann::json& j) { j["model_shape"] = "x"; });
  // Replace the metadata with the deep array by hand (nlohmann could not dump it).
  std::string bytes = test::read_file(path);
  uint32_t jlen;
  std::memcpy(&jlen, bytes.data() + 12, 4);
  std::string out = bytes.substr(0, 32) + deep + bytes.substr(32 + jlen);
  const uint32_t len = uint32_t(deep.size()), crc = crc32c(0, deep.data(), deep.size());
  std::memcpy(out.data() + 12, &len, 4);
  std::memcpy(out.data() + 16, &crc, 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
  auto m = read_checkpoint_meta(path);
  ASSERT_FALSE(m.is_ok());
  EXPECT_EQ(m.status().code(), StatusCode::kCorrupt) << m.status().to_string();
  fs::remove_all(dir);
}

// A two-rank checkpoint (manifest + one shard file per rank) written by hand, then each way its
// files can disagree with each other or with the manifest: check_resume must refuse every one,
// naming the file. (MetaEdits above covers whole-model files; the crash test resumes only
// consistent two-rank saves.)
class ShardedMeta : public Hardening {
 protected:
  void SetUp() override {
    Hardening::SetUp();
    dir_ = temp_dir("sharded");
    mine_.model_shape = "L=1 NH=1 C=4 V=8 Vp=8 T=4 tied=1";
    mine_.moment_dtype = "fp32";
    mine_.optimizer_state = "adam";
    mine_.seed = 42;
    mine_.modules = {{"embedding", 6}, {"final_norm", 3}};
    manifest_ = dir_ + "/ckpt-00000004.bin";
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Rank r's metadata of a consistent save: module i split [0, n/2) and [n/2, n).
  CheckpointMeta shard(int r) const {
    CheckpointMeta m = mine_;
    m.step = 4;
    m.opt_steps = 4;
    m.run_id = "run-a";
    m.world_size = 2;
    m.rank = r;
    for (CheckpointModule& mod : m.modules) {
      const size_t half = mod.numel / 2;
      mod.offset = r == 0 ? 0 : half;
      mod.numel = r == 0 ? half : mod.numel - half;
    }
    return m;
  }
  // Writes the manifest (step `manifest_step`) and shard files r0, r1 (which may be edited).
  void write(const CheckpointMeta& r0, const CheckpointMeta& r1, int64_t manifest_step = 4) {
    for (const CheckpointMeta* m : {&r0, &r1}) {
      std::vector<CheckpointBuffers> bufs;
      store_.clear();
      store_.reserve(m->modules.size());
      for (const CheckpointModule& mod : m->modules) {
        store_.emplace_back(mod.numel + 1, 0.5f);
        bufs.push_back({store_.back().data(), store_.back().data(), store_.back().data(), 4});
      }
      const int rank = m == &r0 ? 0 : 1;
      ASSERT_TRUE(write_checkpoint(shard_file_path(manifest_, rank, 2), *m, bufs).is_ok());
    }
    ASSERT_TRUE(write_shard_manifest(manifest_, manifest_step, 2, "run-a").is_ok());
  }
  void expect_refused(const std::vector<std::string>& words) {
    auto r = check_resume(manifest_, mine_, 100);
    ASSERT_FALSE(r.is_ok()) << "a disagreeing sharded checkpoint was accepted";
    for (const auto& w : words) {
      EXPECT_TRUE(contains(r.status().message(), w))
          << "'" << w << "' not in " << r.status().message();
    }
  }
  std::string dir_, manifest_;
  CheckpointMeta mine_;
  std::vector<std::vector<float>> store_;
};

TEST_F(ShardedMeta, ConsistentSaveIsAccepted) {
  write(shard(0), shard(1));
  auto r = check_resume(manifest_, mine_, 100);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_FALSE(r->whole);
  ASSERT_EQ(r->files.size(), 2u);
  EXPECT_EQ(r->meta.step, 4);
}

TEST_F(ShardedMeta, ShardFilesInTheWrongRankOrder) {
  write(shard(1), shard(0));  // rank 1's file where rank 0's belongs
  expect_refused({".rank0-of-2", "says rank 1 of 2", "lists it as rank 0 of 2"});
}

TEST_F(ShardedMeta, ShardFileOfAnotherWorldSize) {
  CheckpointMeta r1 = shard(1);
  r1.world_size = 3;
  write(shard(0), r1);
  expect_refused({".rank1-of-2", "says rank 1 of 3"});
}

TEST_F(ShardedMeta, ShardFilesFromDifferentSaves) {
  CheckpointMeta later = shard(1);
  later.step = 8;
  later.opt_steps = 8;
  write(shard(0), later);
  expect_refused({".rank1-of-2", "step 8", "different saves"});
  CheckpointMeta other_run = shard(1);
  other_run.run_id = "run-b";
  write(shard(0), other_run);
  expect_refused({"run run-b", "different saves"});
}

TEST_F(ShardedMeta, EveryShardFilesOptimizerStateIsChecked) {
  CheckpointMeta lion = shard(1);
  lion.optimizer_state = "lion";
  write(shard(0), lion);
  expect_refused(
      {".rank1-of-2", "optimizer state of Lion (a momentum)", "optimizer.type is AdamW or Adam"});
  // A caller that steps no optimizer (evaluation) takes any state.
  mine_.optimizer_state.clear();
  auto r = check_resume(manifest_, mine_, 100);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
}

TEST_F(ShardedMeta, ManifestStepDisagreesWithItsShards) {
  write(shard(0), shard(1), /*manifest_step=*/6);
  expect_refused({manifest_, "the manifest says step 6", "shard files step 4"});
}

TEST_F(ShardedMeta, RangesCoveredTwiceOrNotAtAll) {
  CheckpointMeta twice = shard(1);
  twice.modules[0].offset = 2;  // [2, 5): overlaps rank 0's [0, 3), leaves [5, 6) uncovered
  write(shard(0), twice);
  expect_refused({"'embedding'", "covered twice"});
  CheckpointMeta gap = shard(1);
  gap.modules[1].numel = 1;  // [1, 2) of final_norm's 3: [2, 3) uncovered
  write(shard(0), gap);
  expect_refused({"'final_norm'", "[2, 3) are not covered"});
  CheckpointMeta outside = shard(1);
  outside.modules[1].offset = 2;  // [2, 4) of 3 elements
  write(shard(0), outside);
  expect_refused({"'final_norm'", "lie outside its 3 elements"});
}

TEST_F(ShardedMeta, AShardFileGivenAsTheCheckpoint) {
  write(shard(0), shard(1));
  auto r = check_resume(shard_file_path(manifest_, 1, 2), mine_, 100);
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status().message(), "a shard file (rank 1 of 2) given as a checkpoint"))
      << r.status().message();
}

}  // namespace
}  // namespace strata
