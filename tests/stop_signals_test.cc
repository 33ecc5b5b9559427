// The stop-signal protocol under a launcher (src/train/stop_signals.h): mpirun's SIGCONT
// sequences, Ctrl-Z and resume, a user's second signal (the real mpirun run is in
// hardening_cli_test.sh).
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

// Open MPI's mpirun sleeps through both kill delays even when the ranks have exited: with the
// timeout raised, a stop (or an error) returns to the shell 2 x T s later. Rank 0 says so at
// start, where the warning about a short timeout is silent.
TEST(StopSignals, RaisedTimeoutNotesHowLongMpirunWaits) {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* timeout = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  const std::string saved_size = size ? size : "", saved_timeout = timeout ? timeout : "";
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::setenv("OMPI_MCA_odls_base_sigkill_timeout", "60", 1);
  EXPECT_EQ(mpi_stop_wait_note(), "");  // not under mpirun
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  const std::string note = mpi_stop_wait_note();
  EXPECT_NE(note.find("odls_base_sigkill_timeout 60"), std::string::npos) << note;
  EXPECT_NE(note.find("about 120 s later"), std::string::npos) << note;
  EXPECT_EQ(mpi_stop_window_warning(), "");
  ::setenv("OMPI_MCA_odls_base_sigkill_timeout", "1", 1);
  EXPECT_EQ(mpi_stop_wait_note(), "");  // the warning speaks instead
  EXPECT_NE(mpi_stop_window_warning(), "");
  ::unsetenv("OMPI_MCA_odls_base_sigkill_timeout");
  EXPECT_EQ(mpi_stop_wait_note(), "");
  if (size)
    ::setenv("OMPI_COMM_WORLD_SIZE", saved_size.c_str(), 1);
  else
    ::unsetenv("OMPI_COMM_WORLD_SIZE");
  if (timeout) ::setenv("OMPI_MCA_odls_base_sigkill_timeout", saved_timeout.c_str(), 1);
}

}  // namespace
}  // namespace strata
