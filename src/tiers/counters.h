// What the tier manager's parts report back, from the host thread and from the device's stream
// threads: byte, fetch and reduction counts and times (TierCounters), and the first error of
// work that ran asynchronously (AsyncError). Each has its own lock; nothing else shares it.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

#include "strata/status.h"

namespace strata {

using TierClock = std::chrono::steady_clock;

inline double seconds_between(TierClock::time_point a, TierClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct TierCounts {
  // Bytes into and out of the device tier and the host tier.
  uint64_t dev_in = 0, dev_out = 0, host_in = 0, host_out = 0;
  uint64_t fetches = 0, prefetches = 0;                      // into the device cache
  uint64_t grad_reductions = 0, grad_shared_reductions = 0;  // sharded reduce-scatters
  // Since the last take_times():
  double compute_wait_s = 0;      // the compute stream blocked on fetches and restores
  double optimizer_s = 0;         // the optimizer pass, its I/O included
  double optimizer_hidden_s = 0;  // of it, the part under backward (or the next step)
  uint64_t rollbacks = 0, modules_redone = 0, modules_stepped_under_backward = 0;
  uint64_t modules_deferred = 0;  // stepped under the next forward (optimizer_step `defer`)
  // Sub-groups of optimizer state whose reads started during backward (Speculation).
  uint64_t sub_groups_read_ahead = 0;
  // Sub-groups whose NVMe gradient accumulator a pass read together with their state, before
  // stepping them (OptimizerPipeline::prepare_grad), rather than when it stepped them.
  uint64_t grad_sub_groups_read_ahead = 0;
  // Of those, the ones read under the rest of backward once their module's gradients were final
  // (OptimizerPipeline::prepare_grads_of).
  uint64_t grad_sub_groups_read_under_backward = 0;
  // Sub-groups of NVMe-homed optimizer state a pass kept in host memory for the next step
  // (OptimizerPipeline Pass::keep): the next pass reads none of them.
  uint64_t sub_groups_kept = 0;
  // Bytes of optimizer state the speculation copied to keep undo state (state in device memory,
  // or on NVMe with full swap files; host-homed and NVMe-homed state keep theirs without copies).
  uint64_t undo_copy_bytes = 0;
};

// Thread-safe: any thread may call any member.
class TierCounters {
 public:
  // Applies `f` to the counts under the lock: counters.update([&](TierCounts& c) { ... }).
  template <class F>
  void update(F&& f) {
    std::lock_guard<std::mutex> l(mu_);
    f(c_);
  }
  TierCounts read() const {
    std::lock_guard<std::mutex> l(mu_);
    return c_;
  }
  // The counts, then zeroes the times and the speculation counts (not the byte counts).
  TierCounts take_times() {
    std::lock_guard<std::mutex> l(mu_);
    TierCounts t = c_;
    c_.compute_wait_s = c_.optimizer_s = c_.optimizer_hidden_s = 0;
    c_.rollbacks = c_.modules_redone = c_.modules_stepped_under_backward = 0;
    c_.modules_deferred = c_.sub_groups_read_ahead = c_.grad_sub_groups_read_ahead = 0;
    c_.grad_sub_groups_read_under_backward = 0;
    c_.sub_groups_kept = c_.undo_copy_bytes = 0;
    return t;
  }

 private:
  mutable std::mutex mu_;
  TierCounts c_;
};

// The first error of asynchronous work (a stream callback, a prefetch, a collective), kept
// until the next sync point takes it. Thread-safe.
class AsyncError {
 public:
  void set(const Status& s) {
    std::lock_guard<std::mutex> l(mu_);
    if (first_.is_ok()) first_ = s;
  }
  // The first error since the last take (OK if none), and clears it.
  Status take() {
    std::lock_guard<std::mutex> l(mu_);
    Status s = first_;
    first_ = Status::ok();
    return s;
  }

 private:
  std::mutex mu_;
  Status first_;
};

}  // namespace strata
