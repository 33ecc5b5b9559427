// Adversarial use (docs/RELIABILITY.md): each case found by trying to break strata has a test
// here that failed before the fix. Checkpoint pruning and lineages, the train.checkpoint_dir
// preflight, links planted where strata writes, metrics on a full disk, inputs that crashed
// (deep JSON, 1e400, a directory as data, bad checkpoint metadata), metadata checked against
// the run, a damaged newest checkpoint, and the stop-signal protocol under mpirun.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "src/base/safe_file.h"
#include "src/checkpoint/checkpoint.h"
#include "src/plan/plan.h"
#include "src/train/checkpoint_dir.h"
#include "src/train/data.h"
#include "src/train/metrics_log.h"
#include "src/train/resume_check.h"
#include "src/train/stop_signals.h"
#include "src/train/trainer.h"
#include "strata/checksum.h"
#include "strata/config.h"
#include "strata/log.h"
#include "strata/swap_space.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using test::must_train;

std::string temp_dir(const std::string& name) { return test::temp_dir("strata_hard", name); }

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

using test::name_of;
using test::small_config;
using test::train_status;

// Rewrites a checkpoint's metadata JSON with `edit` and recomputes its length and CRC, as a
// tool (or an attacker) would: the checksum then says nothing, the values must be checked.
void edit_meta(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  std::string bytes = test::read_file(path);
  ASSERT_GE(bytes.size(), 32u);
  uint32_t jlen;
  std::memcpy(&jlen, bytes.data() + 12, 4);
  nlohmann::json j = nlohmann::json::parse(bytes.substr(32, jlen));
  edit(j);
  const std::string js = j.dump();
  std::string out = bytes.substr(0, 32) + js + bytes.substr(32 + jlen);
  const uint32_t len = uint32_t(js.size()), crc = crc32c(0, js.data(), js.size());
  std::memcpy(out.data() + 12, &len, 4);
  std::memcpy(out.data() + 16, &crc, 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
}

class Hardening : public ::testing::Test {
 protected:
  void SetUp() override { set_log_level(LogLevel::kError); }
};

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

// ---- 2. stop signals (the mpirun protocol; the real mpirun run is in hardening_cli_test.sh) ---

// Runs `child` in a forked process whose stop handlers watch this (the parent) process as the
// launcher; `parent(pid)` then signals it. Returns the child's wait status.
int run_child(const std::function<int(std::atomic<int>*)>& child,
              const std::function<void(pid_t)>& parent) {
  int ready[2];
  EXPECT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Its own process group, whose parent (this test) is in another group of the session: a
    // group with no such parent is orphaned, and the kernel discards SIGTSTP's stop there (as it
    // would be under ctest started from a background job), so Ctrl-Z could never stop the child.
    ::setpgid(0, 0);
    static std::atomic<int> flag{0};
    install_stop_handlers(&flag, ::getppid());
    char c = 1;
    (void)!::write(ready[1], &c, 1);
    ::_exit(child(&flag));
  }
  char c;
  EXPECT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  parent(pid);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// The child waits up to 5 s for a stop request and exits with the flag's value (0: none).
int wait_for_stop(std::atomic<int>* flag, double seconds = 5) {
  for (int i = 0; i < int(seconds * 100) && flag->load() == 0; ++i) ::usleep(10000);
  ::usleep(100000);  // what else arrives (a second signal) must not kill us
  return flag->load();
}

TEST(StopSignals, LaunchersSigcontStartsTheStop) {
  // Open MPI's mpirun answers Ctrl-C by sending each rank SIGCONT, then SIGTERM 1 s later.
  const int st = run_child([](std::atomic<int>* f) { return wait_for_stop(f); },
                           [](pid_t pid) { ::kill(pid, SIGCONT); });
  ASSERT_TRUE(WIFEXITED(st)) << "killed by signal " << WTERMSIG(st);
  EXPECT_EQ(WEXITSTATUS(st), SIGTERM);
}

TEST(StopSignals, LaunchersSequenceIsOneRequest) {
  const int st = run_child([](std::atomic<int>* f) { return wait_for_stop(f); },
                           [](pid_t pid) {
                             ::kill(pid, SIGCONT);
                             ::usleep(50000);
                             ::kill(pid, SIGTERM);  // not a "second signal": no exit at once
                           });
  ASSERT_TRUE(WIFEXITED(st)) << "killed by signal " << WTERMSIG(st);
  EXPECT_EQ(WEXITSTATUS(st), SIGTERM);
}

TEST(StopSignals, ResumeAfterCtrlZIsNotAStop) {
  // The child blocks until the parent's Ctrl-Z + fg sequence is over (a pipe, not a timer: on a
  // loaded machine a timed wait could end before the parent's signals arrive).
  int done[2];
  ASSERT_EQ(::pipe(done), 0);
  const int st = run_child(
      [done](std::atomic<int>* f) {
        char c = 0;
        while (::read(done[0], &c, 1) < 0 && errno == EINTR) {
        }
        wait_for_stop(f, 0.2);
        return f->load() == 0 ? 7 : f->load();
      },
      [done](pid_t pid) {
        ::kill(pid, SIGTSTP);  // mpirun forwards Ctrl-Z
        int s = 0;
        ::waitpid(pid, &s, WUNTRACED);
        EXPECT_TRUE(WIFSTOPPED(s));
        ::kill(pid, SIGCONT);  // fg
        char c = 1;
        EXPECT_EQ(::write(done[1], &c, 1), 1);
      });
  ::close(done[0]);
  ::close(done[1]);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 7);
}

TEST(StopSignals, UsersSecondSignalStillExitsAtOnce) {
  const int st = run_child(
      [](std::atomic<int>* f) {
        for (int i = 0; i < 500 && f->load() == 0; ++i) ::usleep(10000);
        ::kill(::getpid(), SIGINT);  // not from the launcher: the user insists
        ::usleep(500000);
        return 0;
      },
      [](pid_t pid) { ::kill(pid, SIGINT); });
  ASSERT_TRUE(WIFSIGNALED(st));
  EXPECT_EQ(WTERMSIG(st), SIGINT);
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

// ---- 4. links are never followed ----------------------------------------------------------------

TEST_F(Hardening, PlantedLinksAreNotFollowed) {
  const auto dir = temp_dir("links");
  const std::string victim = dir + "/victim.txt";
  std::ofstream(victim) << "precious";
  // Planted after the start (the preflight removes stale temporaries): the writes must not
  // follow them.
  TrainOptions o;
  o.on_step_end = [&](int64_t step) {
    if (step != 2) return;
    fs::create_symlink(victim, dir + "/" + name_of(4) + ".tmp");
    fs::create_symlink(victim, dir + "/latest.tmp");
  };
  must_train(small_config(dir, {"train.steps=4"}), o);
  EXPECT_EQ(test::read_file(victim), "precious");
  EXPECT_EQ(test::read_file(dir + "/latest"), name_of(4) + "\n");
  // create_temp_file replaces a link at its name; open_for_writing refuses one.
  fs::create_symlink(victim, dir + "/x.tmp");
  auto fd = create_temp_file(dir + "/x.tmp", 0600);
  ASSERT_TRUE(fd.is_ok()) << fd.status().to_string();
  ::close(*fd);
  EXPECT_FALSE(fs::is_symlink(dir + "/x.tmp"));
  fs::create_symlink(victim, dir + "/log.jsonl");
  auto w = open_for_writing(dir + "/log.jsonl", false, 0644);
  EXPECT_FALSE(w.is_ok());
  EXPECT_TRUE(contains(w.status().message(), "symbolic link")) << w.status().message();
  EXPECT_EQ(test::read_file(victim), "precious");
  fs::remove_all(dir);
}

TEST_F(Hardening, SwapFileLinkIsRefusedNotFollowed) {
  const auto dir = temp_dir("swaplink");
  const std::string target = dir + "/elsewhere.bin";  // dangling: would be created
  fs::create_directories(dir + "/swap");
  fs::create_symlink(target, swap_file_path(dir + "/swap", 0));
  Status s = train_status(small_config(dir, {"train.steps=2"}));
  EXPECT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "symbolic link")) << s.message();
  EXPECT_FALSE(fs::exists(target)) << "strata created a file at the link's target";
  fs::remove_all(dir);
}

// The swap-file owner: a pid reused by a later process, a zombie, or another boot is gone;
// another host is unknown (refused, naming it); a creation killed midway is cleaned up.
TEST(SwapOwner, PidStartTimeZombieAndHost) {
  SwapOwner me = current_swap_owner();
  EXPECT_EQ(swap_owner_state(me), SwapOwnerState::kRunning);
  if (me.start_ticks == 0) GTEST_SKIP() << "no /proc/self/stat: start times unknown";
  SwapOwner reused = me;
  reused.start_ticks += 1;
  EXPECT_EQ(swap_owner_state(reused), SwapOwnerState::kGone);
  SwapOwner rebooted = me;
  rebooted.boot_id = "00000000-0000-0000-0000-000000000000";
  EXPECT_EQ(swap_owner_state(rebooted), SwapOwnerState::kGone);
  SwapOwner elsewhere = me;
  elsewhere.host = me.host + "-other";
  EXPECT_EQ(swap_owner_state(elsewhere), SwapOwnerState::kUnknown);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::usleep(200000);  // exited, not reaped: a zombie
  SwapOwner zombie = me;
  zombie.pid = child;
  zombie.start_ticks = 0;
  EXPECT_EQ(swap_owner_state(zombie), SwapOwnerState::kGone);
  ::waitpid(child, nullptr, 0);
}

TEST_F(Hardening, KilledSwapCreationIsRecognisedNextTime) {
  const auto dir = temp_dir("swapkill");
  fs::create_directories(dir + "/swap");
  const std::string file = swap_file_path(dir + "/swap", 0);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  // What a creation killed before its header was in place leaves: a temporary, never the file.
  std::ofstream(file + ".tmp" + std::to_string(child)) << std::string(100, '\0');
  must_train(small_config(dir, {"train.steps=1"}));
  EXPECT_FALSE(fs::exists(file + ".tmp" + std::to_string(child)));
  EXPECT_FALSE(fs::exists(file));
  fs::remove_all(dir);
}

// ---- 5. metrics
// ----------------------------------------------------------------------------------

TEST_F(Hardening, MetricsWriteFailureIsReportedNotSilent) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const auto dir = temp_dir("devfull");
  TrainResult r = must_train(small_config(dir, {"train.steps=3", "train.log_file=\"/dev/full\""}));
  EXPECT_TRUE(contains(r.metrics_error, "train.log_file")) << r.metrics_error;
  EXPECT_TRUE(contains(r.metrics_error, "No space left on device")) << r.metrics_error;
  EXPECT_EQ(r.end_step, 3);  // training went on and saved
  EXPECT_TRUE(fs::exists(r.last_checkpoint));
  MetricsLog log;
  ASSERT_TRUE(log.open("/dev/full", /*append=*/true).is_ok());
  EXPECT_EQ(log.write_line("{}").code(), StatusCode::kNoSpace);
  EXPECT_FALSE(log.error().is_ok());
  fs::remove_all(dir);
}

// A monitor file that cannot be written (a link planted at the CSV's name: refused, never
// followed) is reported like the JSONL log's failure: training goes on, the CLI exits 1.
TEST_F(Hardening, MonitorWriteFailureIsReportedNotSilent) {
  const auto dir = temp_dir("monitor");
  fs::create_directories(dir + "/mon/j");
  fs::create_symlink("/dev/null", dir + "/mon/j/loss.csv");
  TrainResult r = must_train(small_config(
      dir, {"train.steps=3", "csv_monitor.enabled=true",
            "csv_monitor.output_path=\"" + dir + "/mon\"", "csv_monitor.job_name=\"j\"",
            "tensorboard.enabled=true", "tensorboard.output_path=\"" + dir + "/mon\""}));
  EXPECT_TRUE(contains(r.metrics_error, "csv_monitor.output_path")) << r.metrics_error;
  EXPECT_EQ(r.end_step, 3);
  EXPECT_TRUE(fs::is_symlink(dir + "/mon/j/loss.csv"));
  EXPECT_TRUE(fs::exists(dir + "/mon/j/lr.csv"));             // the other metrics still written
  EXPECT_FALSE(fs::is_empty(dir + "/mon/DeepSpeedJobName"));  // tensorboard's event file
  fs::remove_all(dir);
}

// ---- 6. crashes become errors
// --------------------------------------------------------------------

TEST_F(Hardening, DeepJsonIsRefused) {
  for (const char* open_close : {"[]", "{}"}) {
    std::string deep;
    for (int i = 0; i < 100000; ++i) deep += open_close[0] == '[' ? "[" : "{\"a\":";
    deep += open_close[0] == '[' ? "1" : "1";
    for (int i = 0; i < 100000; ++i) deep += open_close[1];
    auto r = parse_config("{\"model\": " + deep + "}", "deep.json");
    ASSERT_FALSE(r.is_ok());
    EXPECT_TRUE(contains(r.status().message(), "nested deeper than")) << r.status().message();
    auto o = parse_config("{}", "x.json", {"model=" + deep});
    ASSERT_FALSE(o.is_ok());
    EXPECT_TRUE(contains(o.status().message(), "nested deeper than")) << o.status().message();
  }
}

// Found by fuzz_config: an override value that is not JSON is taken as a string; invalid UTF-8
// in it made the "got ..." message throw (nlohmann type_error 316) and abort.
TEST_F(Hardening, OverrideWithInvalidUtf8IsAnErrorNotAnAbort) {
  auto r = parse_config("{}", "x.json", {"zero_optimization.stage=ac\xb4\xff"});
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status().message(), "zero_optimization.stage")) << r.status().message();
}

TEST_F(Hardening, ProfileFieldOfTheWrongTypeIsAnErrorNotAnAbort) {
  const char* text = R"({"magic": "strata-machine-profile", "version": 1,
    "device": {"backend": "cpu", "gemm_flops": 1e11, "gemm_by_width": [{"C": "x", "gemm_flops": 1}]},
    "host": {"copy_gbps": 10}, "cpu_optimizer": {"params_per_s": 1e8}})";
  auto p = parse_machine_profile(text, "p.json");
  ASSERT_FALSE(p.is_ok());
  EXPECT_TRUE(contains(p.status().message(), "p.json")) << p.status().message();
  EXPECT_TRUE(contains(p.status().message(), "strata probe")) << p.status().message();
}

TEST_F(Hardening, NumberOverflowIsRefused) {
  auto r = parse_config(R"({"optimizer": {"params": {"lr": 1e400}}})", "x.json");
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status().message(), "1e400")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "x.json")) << r.status().message();
  auto o = parse_config("{}", "x.json", {"optimizer.params.lr=1e400"});
  ASSERT_FALSE(o.is_ok());
  auto big = parse_config(R"({"aio": {"block_size": 2e19}})", "x.json");
  ASSERT_FALSE(big.is_ok());
  EXPECT_TRUE(contains(big.status().message(), "too large")) << big.status().message();
  EXPECT_FALSE(contains(big.status().message(), "out of range [0, inf)"));
}

TEST_F(Hardening, DataSourceDirectoryIsRefused) {
  const auto dir = temp_dir("datadir");
  DataConfig dc;
  dc.source = dir;
  auto d = Dataset::load(dc, 256, 1);
  ASSERT_FALSE(d.is_ok());
  EXPECT_TRUE(contains(d.status().message(), "is a directory")) << d.status().message();
  fs::remove_all(dir);
}

TEST_F(Hardening, LlmcHeaderMustCountEveryToken) {
  const auto dir = temp_dir("llmc");
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = 100;  // but 150 tokens follow
  std::vector<uint16_t> tokens(150, 3);
  {
    std::ofstream f(dir + "/t.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(header.data()), 1024);
    f.write(reinterpret_cast<const char*>(tokens.data()), 300);
  }
  DataConfig dc;
  dc.source = dir + "/t.bin";
  auto d = Dataset::load(dc, 256, 1);
  ASSERT_FALSE(d.is_ok());
  EXPECT_TRUE(contains(d.status().message(), "header says 100 tokens")) << d.status().message();
  EXPECT_TRUE(contains(d.status().message(), "150 tokens")) << d.status().message();
  fs::remove_all(dir);
}

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

}  // namespace
}  // namespace strata
