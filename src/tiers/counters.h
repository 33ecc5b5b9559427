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

// How the optimizer's schedule ran over some steps: its times and what it did ahead, under
// backward, or again. Declared once; the tier counters (TierCounts), a step's take
// (TierTimes) and a run's totals (TrainResult) embed it. A new count is a field here and its
// line in operator+=.
struct ScheduleCounts {
  double compute_wait_s = 0;  // the compute stream blocked on fetches and restores
  double optimizer_s = 0;     // the optimizer pass, its I/O included (also under backward)
  // Of optimizer_s, the part that ran while the compute stream was still in backward (or, the
  // step deferred or delayed, under the next step).
  double optimizer_hidden_s = 0;
  uint64_t rollbacks = 0;       // steps whose speculative updates were undone
  uint64_t modules_redone = 0;  // modules restored from undo state (and redone or skipped)
  uint64_t modules_stepped_under_backward = 0;  // by the speculation, as their gradients were final
  // Modules whose step after backward was deferred to the next forward (optimizer_step with
  // `defer`), counted when deferred.
  uint64_t modules_deferred = 0;
  // Sub-groups of optimizer state whose reads started during backward (Speculation; the buffer
  // count and strata.optimizer.read_ahead), counted when started.
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
  // Times the speculation stopped at a module whose undo buffers' regions were not ready
  // (Homes::undo_ready: being made ready off the step's thread for a later step).
  uint64_t undo_not_ready = 0;
  // The CPU optimizer's kernel alone (strata::optimizer_step over each host-stepped sub-group):
  // its wall time, all its threads together, and the parameters it stepped. Their quotient is
  // the rate it ran at beside whatever else the step ran (on a GPU: the launcher thread and
  // the copies), the rate `strata plan --cpu-optimizer-rate` takes.
  double cpu_optimizer_s = 0;
  uint64_t cpu_optimizer_params = 0;
  // Their quotient, parameters per second (0 where the kernel stepped none).
  double cpu_optimizer_rate() const {
    return cpu_optimizer_s > 0 ? double(cpu_optimizer_params) / cpu_optimizer_s : 0.0;
  }

  ScheduleCounts& operator+=(const ScheduleCounts& o) {
    compute_wait_s += o.compute_wait_s;
    optimizer_s += o.optimizer_s;
    optimizer_hidden_s += o.optimizer_hidden_s;
    rollbacks += o.rollbacks;
    modules_redone += o.modules_redone;
    modules_stepped_under_backward += o.modules_stepped_under_backward;
    modules_deferred += o.modules_deferred;
    sub_groups_read_ahead += o.sub_groups_read_ahead;
    grad_sub_groups_read_ahead += o.grad_sub_groups_read_ahead;
    grad_sub_groups_read_under_backward += o.grad_sub_groups_read_under_backward;
    sub_groups_kept += o.sub_groups_kept;
    undo_copy_bytes += o.undo_copy_bytes;
    undo_not_ready += o.undo_not_ready;
    cpu_optimizer_s += o.cpu_optimizer_s;
    cpu_optimizer_params += o.cpu_optimizer_params;
    return *this;
  }
  // All zero.
  void reset() { *this = ScheduleCounts{}; }
};
// A field added above without its line in operator+= would be dropped from every total: keep
// the count here with the fields.
static_assert(sizeof(ScheduleCounts) == 4 * sizeof(double) + 11 * sizeof(uint64_t),
              "a ScheduleCounts field needs its line in operator+=");

struct TierCounts {
  // Bytes into and out of the device tier and the host tier.
  uint64_t dev_in = 0, dev_out = 0, host_in = 0, host_out = 0;
  uint64_t fetches = 0, prefetches = 0;                      // into the device cache
  uint64_t grad_reductions = 0, grad_shared_reductions = 0;  // sharded reduce-scatters
  ScheduleCounts schedule;                                   // since the last take_times()
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
  // The counts, then zeroes the schedule's (not the byte counts).
  TierCounts take_times() {
    std::lock_guard<std::mutex> l(mu_);
    TierCounts t = c_;
    c_.schedule.reset();
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
