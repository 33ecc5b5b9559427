#include "src/train/stop_signals.h"

#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace strata {
namespace {

std::atomic<int>* g_flag = nullptr;
std::atomic<pid_t> g_launcher{0};
std::atomic<bool> g_tstp_stopped{false};  // stopped by a (forwarded) SIGTSTP: SIGCONT resumes

void on_stop_request(int sig, siginfo_t* info, void*) {
  const pid_t launcher = g_launcher.load();
  const bool by_launcher = launcher > 0 && info && info->si_pid == launcher;
  if (sig == SIGCONT) {
    if (!by_launcher) return;
    // A resume after Ctrl-Z (SIGTSTP, forwarded by mpirun) is not a stop request.
    if (g_tstp_stopped.exchange(false)) return;
    sig = SIGTERM;
  }
  if (g_flag->load() != 0) {
    // The launcher's sequence (SIGCONT, SIGTERM, then SIGKILL anyway) never cuts a stop short.
    if (by_launcher) return;
    // Second request from the user: leave at once, without the checkpoint.
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_flag->store(sig);
}

void on_tstp(int) {
  const int saved = errno;
  g_tstp_stopped.store(true);
  // Stop as the default action would (SIGTSTP is blocked in its own handler: unblock it), and
  // take the handler back once SIGCONT resumes us (its handler clears the mark).
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGTSTP, &dfl, nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTSTP);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(SIGTSTP);
  struct sigaction mine = {};
  mine.sa_handler = on_tstp;
  mine.sa_flags = SA_RESTART;
  sigemptyset(&mine.sa_mask);
  sigaction(SIGTSTP, &mine, nullptr);
  errno = saved;
}

}  // namespace

void install_stop_handlers(std::atomic<int>* flag, pid_t launcher_pid) {
  g_flag = flag;
  g_launcher.store(launcher_pid);
  struct sigaction sa = {};
  sa.sa_sigaction = on_stop_request;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  if (launcher_pid > 0) {
    sigaction(SIGCONT, &sa, nullptr);
    struct sigaction st = {};
    st.sa_handler = on_tstp;
    st.sa_flags = SA_RESTART;
    sigemptyset(&st.sa_mask);
    sigaction(SIGTSTP, &st, nullptr);
  }
}

pid_t open_mpi_launcher_pid() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ? ::getppid() : 0;
}

std::string mpi_stop_window_warning(int needed_s) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) return "";
  const char* v = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  const int timeout = v ? std::atoi(v) : 1;
  if (timeout >= needed_s) return "";
  return fmt::format(
      "under mpirun, Ctrl-C (or SIGINT/SIGTERM to mpirun) gives each rank {} s "
      "(odls_base_sigkill_timeout{}) before SIGTERM and as long again before SIGKILL, which may "
      "be too little to finish the step and write the checkpoint; launch with `mpirun --mca "
      "odls_base_sigkill_timeout {} ...` (or export OMPI_MCA_odls_base_sigkill_timeout={}) so a "
      "stop always saves",
      timeout, v ? "" : ", Open MPI's default", needed_s * 2, needed_s * 2);
}

std::string mpi_stop_wait_note(int needed_s) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) return "";
  const char* v = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  const int timeout = v ? std::atoi(v) : 1;
  if (timeout < needed_s) return "";
  return fmt::format(
      "under mpirun with odls_base_sigkill_timeout {}: after Ctrl-C (or SIGINT/SIGTERM to "
      "mpirun) the ranks finish the step, write the checkpoint and exit, but mpirun returns only "
      "about {} s later (it waits out its SIGTERM and SIGKILL delays whether or not the ranks "
      "still run), shows their last lines then and exits 1; a rank's error exit is followed by "
      "the same wait. The checkpoint in train.checkpoint_dir is complete once the ranks have "
      "exited",
      timeout, 2 * timeout);
}

}  // namespace strata
