// FaultPlan: the faults a fault-injecting Storage backend inserts under the engine.
//
// Set StorageOptions::faults to a FaultPlan and open_storage() puts a wrapper between the
// engine and the real backend. Every piece the engine issues is counted (1-based, reads and
// writes together); the wrapper may then
//   * fail it with an errno (EIO, ENOSPC, ...) without touching the file,
//   * make it transient (EINTR/EAGAIN without touching the file), which the engine must retry,
//   * truncate it: pass on only a leading part (aligned to 4096 under O_DIRECT, to 512 bytes
//     otherwise) and report that short count, which the engine must resubmit,
//   * delay it by `delay_us` before passing it on.
// Faults are picked either for the Nth piece exactly (`fail_nth`) or at random with the given
// probabilities from a seeded generator, so a failing test can be replayed.
//
// Thread safety: the counters are atomics; change the plan fields only while no I/O is in
// flight.
#pragma once

#include <atomic>
#include <cstdint>

namespace strata {

struct FaultPlan {
  // Exactly the Nth piece (1-based; 0 = off) fails with `fail_nth_errno`.
  uint64_t fail_nth = 0;
  int fail_nth_errno = 5;  // EIO
  // Only ops of this kind count for fail_nth: 0 = both, 1 = reads, 2 = writes.
  int fail_nth_kind = 0;

  // Random faults, each checked independently per piece with these probabilities.
  double p_error = 0.0;      // fail with `error_errno`
  int error_errno = 5;       // EIO
  double p_transient = 0.0;  // EINTR or EAGAIN (alternating)
  double p_short = 0.0;      // truncate the transfer
  double p_delay = 0.0;      // sleep delay_us first
  uint32_t delay_us = 200;
  uint64_t seed = 1;

  // Counters (read by tests).
  std::atomic<uint64_t> pieces{0};
  std::atomic<uint64_t> injected_errors{0};
  std::atomic<uint64_t> injected_transient{0};
  std::atomic<uint64_t> injected_short{0};
  std::atomic<uint64_t> injected_delays{0};
};

}  // namespace strata
