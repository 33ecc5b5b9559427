// The checkpoint directory against misuse (docs/RELIABILITY.md): pruning keeps this run's
// checkpoints and never another's, the train.checkpoint_dir preflight (room for the checkpoints a
// run keeps, a full disk), a damaged newest checkpoint or a missing `latest` falls back, stale
// temporaries are removed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/adversarial_util.h"

namespace strata {
namespace {

using namespace adversarial;

// ---- 1. pruning --------------------------------------------------------------------------------

TEST_F(Hardening, PruneKeepsTheCheckpointThisRunWrote) {
  const auto dir = temp_dir("prune");
  must_train(small_config(dir, {"train.steps=30", "train.checkpoint_interval=5"}));
  ASSERT_TRUE(fs::exists(dir + "/" + name_of(30)));
  // A fresh, shorter run into the same directory: its own checkpoints stay, the older run's
  // are not touched, and `latest` names what this run wrote.
  TrainResult r = must_train(small_config(dir, {"train.steps=10", "train.checkpoint_interval=5"}));
  EXPECT_EQ(r.last_checkpoint, dir + "/" + name_of(10));
  EXPECT_TRUE(fs::exists(dir + "/" + name_of(10)));
  EXPECT_TRUE(fs::exists(dir + "/" + name_of(5)));
  EXPECT_TRUE(fs::exists(dir + "/" + name_of(25)));
  EXPECT_TRUE(fs::exists(dir + "/" + name_of(30)));
  EXPECT_EQ(test::read_file(dir + "/latest"), name_of(10) + "\n");
  // --resume continues this run.
  TrainOptions o;
  o.resume = "latest";
  TrainResult next = must_train(small_config(dir, {"train.steps=15"}), o);
  EXPECT_EQ(next.start_step, 10);
  // Pruning keeps this lineage's two newest: 5 goes, 10 and 15 stay; the other run's stay.
  EXPECT_FALSE(fs::exists(dir + "/" + name_of(5)));
  EXPECT_TRUE(fs::exists(dir + "/" + name_of(10)));
  EXPECT_TRUE(fs::exists(dir + "/" + name_of(15)));
  EXPECT_TRUE(fs::exists(dir + "/" + name_of(30)));
  fs::remove_all(dir);
}

TEST_F(Hardening, FreshRunRefusesToOverwriteAnotherRunsCheckpoint) {
  const auto dir = temp_dir("foreign");
  must_train(small_config(dir, {"train.steps=6", "train.checkpoint_interval=3"}));
  const std::string before = test::read_file(dir + "/" + name_of(6));
  Status s = train_status(small_config(dir, {"train.steps=8"}));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(contains(s.message(), name_of(3))) << s.message();  // the first it would replace
  EXPECT_TRUE(contains(s.message(), "--resume")) << s.message();
  EXPECT_EQ(test::read_file(dir + "/" + name_of(6)), before);
  fs::remove_all(dir);
}

// ---- 3. the train.checkpoint_dir preflight ------------------------------------------------------

TEST_F(Hardening, CheckpointDirIsCheckedBeforeTraining) {
  const auto dir = temp_dir("ckdir");
  const std::string file = dir + "/a-file";
  std::ofstream(file) << "x";
  int steps = 0;
  TrainOptions o;
  o.progress = false;
  o.on_step_end = [&](int64_t) { ++steps; };
  Config cfg = small_config(dir, {"train.checkpoint_dir=\"" + file + "\""});
  auto r = train(cfg, o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(steps, 0) << "the run trained before finding out";
  EXPECT_TRUE(contains(r.status().message(), "train.checkpoint_dir")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "not a directory")) << r.status().message();
  // Below a file: the errno text.
  Status s = check_checkpoint_dir(file + "/sub", 1);
  EXPECT_TRUE(contains(s.message(), "train.checkpoint_dir")) << s.message();
  EXPECT_TRUE(contains(s.message(), "Not a directory")) << s.message();
  // Not writable (as root, sysfs refuses new files; otherwise a mode-0555 directory).
  std::string ro = dir + "/ro";
  fs::create_directories(ro);
  if (::geteuid() == 0) {
    ro = "/sys";
  } else {
    ::chmod(ro.c_str(), 0555);
  }
  s = check_checkpoint_dir(ro, 1);
  EXPECT_TRUE(contains(s.message(), "train.checkpoint_dir")) << s.message();
  EXPECT_TRUE(contains(s.message(), "not writable")) << s.message();
  EXPECT_TRUE(contains(s.message(), "errno")) << s.message();
  // Room for one checkpoint, with the byte counts.
  s = check_checkpoint_dir(dir, uint64_t{1} << 62);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "4611686018427387904 bytes")) << s.message();
  // A missing one is created.
  EXPECT_TRUE(check_checkpoint_dir(dir + "/new/deeper", 1).is_ok());
  EXPECT_TRUE(fs::is_directory(dir + "/new/deeper"));
  ::chmod((dir + "/ro").c_str(), 0755);
  fs::remove_all(dir);
}

// A file system of 1 MiB (tmpfs), when this process may mount one; "" otherwise.
std::string tiny_fs(const std::string& dir) {
  fs::create_directories(dir);
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") != 0) return "";
  return dir;
}

TEST_F(Hardening, CheckpointOnAFullDiskSaysHowManyBytes) {
  const auto dir = temp_dir("enospc");
  const std::string mnt = tiny_fs(dir + "/mnt");
  if (mnt.empty()) GTEST_SKIP() << "cannot mount a tmpfs here (not root): " << std::strerror(errno);
  CheckpointMeta meta;
  meta.moment_dtype = "fp32";
  meta.modules = {{"a", 200000}};  // 2.4 MB > 1 MiB
  std::vector<float> a(200000, 1.0f);
  Status s = write_checkpoint(mnt + "/c.bin", meta, {{a.data(), a.data(), a.data(), 4}});
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.to_string();
  EXPECT_TRUE(contains(s.message(), std::to_string(checkpoint_file_bytes(meta)) + " bytes"))
      << s.message();
  EXPECT_FALSE(fs::exists(mnt + "/c.bin.tmp"));
  ::umount(mnt.c_str());
  fs::remove_all(dir);
}

// ---- weak points: damaged newest, missing latest, stale temporaries
// ------------------------------

TEST_F(Hardening, DamagedNewestCheckpointFallsBackToTheIntactOne) {
  const auto dir = temp_dir("fallback");
  const auto full_dir = temp_dir("fallback_full");
  TrainResult full = must_train(small_config(full_dir, {"train.steps=12"}));
  TrainOptions stop;
  stop.stop_at_step = 8;
  must_train(small_config(dir, {"train.steps=12", "train.checkpoint_interval=4"}), stop);
  ASSERT_TRUE(fs::exists(dir + "/" + name_of(4)));
  ASSERT_TRUE(fs::exists(dir + "/" + name_of(8)));
  // Damage the newest one's payload.
  const std::string newest = dir + "/" + name_of(8);
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-50, std::ios::end);
    f.put('\x5a');
  }
  // An explicit path is not replaced: the damage is named.
  Status s = train_status(small_config(dir, {"train.steps=12"}), newest);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_TRUE(contains(s.message(), newest)) << s.message();
  // `latest` falls back to the intact older one, and trains on exactly as if uninterrupted.
  TrainOptions o;
  o.resume = "latest";
  TrainResult r = must_train(small_config(dir, {"train.steps=12"}), o);
  EXPECT_EQ(r.start_step, 4);
  ASSERT_EQ(r.losses.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(r.losses[i], full.losses[4 + i]) << "step " << 5 + i;
  fs::remove_all(dir);
  fs::remove_all(full_dir);
}

TEST_F(Hardening, MissingLatestResumesFromTheNewestCheckpoint) {
  const auto dir = temp_dir("nolatest");
  TrainOptions stop;
  stop.stop_at_step = 6;
  must_train(small_config(dir, {"train.steps=10", "train.checkpoint_interval=3"}), stop);
  fs::remove(dir + "/latest");
  TrainOptions o;
  o.resume = "latest";
  TrainResult r = must_train(small_config(dir, {"train.steps=10"}), o);
  EXPECT_EQ(r.start_step, 6);
  // No checkpoint at all: the message says so, and how to get one.
  const auto empty = temp_dir("nolatest_empty");
  Status s = train_status(small_config(empty), "latest");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(s.message(), "train once")) << s.message();
  fs::remove_all(dir);
  fs::remove_all(empty);
}

TEST_F(Hardening, StaleTemporariesAreRemoved) {
  const auto dir = temp_dir("stale");
  std::ofstream(dir + "/" + name_of(3) + ".tmp") << "half";
  std::ofstream(dir + "/" + name_of(3) + ".rank0-of-2.tmp") << "half";
  std::ofstream(dir + "/latest.tmp") << "half";
  std::ofstream(dir + "/notes.tmp") << "mine";  // not strata's: kept
  must_train(small_config(dir, {"train.steps=1"}));
  EXPECT_FALSE(fs::exists(dir + "/" + name_of(3) + ".tmp"));
  EXPECT_FALSE(fs::exists(dir + "/" + name_of(3) + ".rank0-of-2.tmp"));
  EXPECT_FALSE(fs::exists(dir + "/latest.tmp"));
  EXPECT_TRUE(fs::exists(dir + "/notes.tmp"));
  fs::remove_all(dir);
}

// ---- WEAK: every kind of damage to the newest checkpoint falls back -----------------------------

TEST_F(Hardening2, EveryDamageOfTheNewestCheckpointFallsBack) {
  struct Damage {
    const char* name;
    std::function<void(const std::string&)> apply;
  };
  const std::vector<Damage> kinds = {
      {"truncated", [](const std::string& p) { fs::resize_file(p, fs::file_size(p) / 2); }},
      {"zero-filled",
       [](const std::string& p) {
         const auto n = fs::file_size(p);
         std::ofstream(p, std::ios::binary | std::ios::trunc) << std::string(n, '\0');
       }},
      {"empty", [](const std::string& p) { fs::resize_file(p, 0); }},
      {"header",
       [](const std::string& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(0);
         f.write("XXXXXXXX", 8);
       }},
  };
  for (const Damage& d : kinds) {
    const auto dir = temp_dir(std::string("damage_") + d.name);
    TrainOptions stop;
    stop.stop_at_step = 8;
    must_train(small_config(dir, {"train.steps=12", "train.checkpoint_interval=4"}), stop);
    d.apply(dir + "/" + name_of(8));
    TrainOptions o;
    o.resume = "latest";
    TrainResult r =
        must_train(small_config(dir, {"train.steps=12", "train.checkpoint_interval=4"}), o);
    EXPECT_EQ(r.start_step, 4) << d.name;
    EXPECT_EQ(r.end_step, 12) << d.name;
    fs::remove_all(dir);
  }
}

// ---- WEAK: room for the checkpoints a run keeps, plus the one it writes next ------------------

TEST_F(Hardening2, CheckpointSpaceCountsTheCheckpointsARunKeeps) {
  const auto dir = temp_dir("keep");
  EXPECT_EQ(checkpoints_to_come(dir, ""), kKeepCheckpoints + 1);
  TrainOptions stop;
  stop.stop_at_step = 4;
  must_train(small_config(dir, {"train.steps=8", "train.checkpoint_interval=2"}), stop);
  // Two of its lineage are there already: one more at the peak.
  EXPECT_EQ(checkpoints_to_come(dir, "latest"), 1);
  Status s = check_checkpoint_dir(dir, uint64_t{1} << 60, 3);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_TRUE(contains(s.message(), std::to_string(uint64_t{3} << 60) + " bytes")) << s.message();
  EXPECT_TRUE(contains(s.message(), "3 more checkpoints")) << s.message();
  // On a file system with room for one checkpoint but not three: refused before step 1.
  const std::string mnt = dir + "/mnt";
  fs::create_directories(mnt);
  const std::string one = dir + "/" + name_of(4);
  const uint64_t bytes = fs::file_size(one);
  const std::string opts = "size=" + std::to_string(bytes * 2 + 65536);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
    fs::remove_all(dir);
    GTEST_SKIP() << "cannot mount a tmpfs here (not root): " << std::strerror(errno);
  }
  int steps = 0;
  TrainOptions o;
  o.progress = false;
  o.on_step_end = [&](int64_t) { ++steps; };
  auto r = train(
      small_config(mnt, {"train.steps=8", "train.checkpoint_interval=2",
                         "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\""}),
      o);
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace) << r.status().to_string();
  EXPECT_EQ(steps, 0) << "the run trained, to fail at its third checkpoint";
  ::umount(mnt.c_str());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
