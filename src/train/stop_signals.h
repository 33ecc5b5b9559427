// How `strata train` is asked to stop: SIGINT / SIGTERM (Ctrl-C, kill), alone or under mpirun.
//
// The first request sets a flag the trainer polls after each step; every rank then finishes
// the step, agrees on stopping (a max-reduction), writes a checkpoint, removes its swap files
// and exits 128+N. A second request from the user (not from the launcher) exits at once.
//
// Under Open MPI 4.x, mpirun does not forward SIGINT or SIGTERM: it answers either (and Ctrl-C
// at the terminal, which reaches only mpirun's process group: every rank has its own) by
// killing the job. Each rank receives SIGCONT at once, SIGTERM `odls_base_sigkill_timeout`
// seconds later (default 1) and SIGKILL as long again after that. So:
//   - a SIGCONT sent by the launcher (the rank's parent: mpirun or orted) that does not resume
//     a SIGTSTP-stopped rank is taken as the stop request, and the launcher's SIGTERM that
//     follows is not a second request; this gives the rank 2 x the timeout, not 1 x;
//   - that is still too little for a large model's step and checkpoint, so
//     mpi_stop_window_warning() says to launch with `--mca odls_base_sigkill_timeout 60`
//     (or OMPI_MCA_odls_base_sigkill_timeout=60) when it is not set;
//   - mpirun sleeps through both delays whether or not the ranks have exited, and forwards
//     none of their output meanwhile: with the timeout raised to T, the shell gets mpirun back
//     (exit status 1, whatever the ranks' 128+N) about 2 x T s after Ctrl-C, and as long after
//     a rank's error exit; mpi_stop_wait_note() says so at start, so that the wait does not
//     read as a hang.
// Handlers are async-signal-safe (they store to lock-free atomics, and re-raise with the
// default action for the second request).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <string>

namespace strata {

// Installs the handlers for SIGINT, SIGTERM and, when `launcher_pid` > 0, SIGCONT and
// SIGTSTP. `flag` gets the signal number of the first request (SIGTERM for the launcher's
// SIGCONT). Process-wide; call once, from the main thread, before training.
void install_stop_handlers(std::atomic<int>* flag, pid_t launcher_pid);

// The launcher to watch: the parent process when this one runs under Open MPI
// (OMPI_COMM_WORLD_SIZE is set), else 0.
pid_t open_mpi_launcher_pid();

// Under Open MPI with odls_base_sigkill_timeout not raised to at least `needed_s` through the
// environment (mpirun --mca ... puts it there): a one-paragraph warning saying what Ctrl-C
// will do and how to launch instead; "" otherwise.
std::string mpi_stop_window_warning(int needed_s = 30);

// Under Open MPI with odls_base_sigkill_timeout raised to T >= `needed_s` (the case the warning
// above is silent in): a one-paragraph note that after a stop or a rank's error exit mpirun
// returns about 2 x T s later, with the ranks' last lines only then, though the checkpoint is
// written within the step; "" otherwise.
std::string mpi_stop_wait_note(int needed_s = 30);

}  // namespace strata
