// Files strata writes are never written through a link it did not make (planted links at its
// temporaries, logs and swap files), and a swap file's owner and a killed creation are
// recognised.
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

}  // namespace
}  // namespace strata
