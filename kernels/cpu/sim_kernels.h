// The simulated device's kernel table (internal to kernels/cpu): every op does no arithmetic
// and costs its modeled time on its stream (sim_device.cc).
//
// The time of an op is   launch_us + max(flops / rate, bytes / hbm)   where `rate` is the GEMM
// rate for matmuls, the attention rates for attention (the fused kernel's forward and
// backward; the plain kernels at a fiftieth of them, as measured on an H200), and bytes are the
// op's reads and writes at its dtype. The clock is per stream (SimClock): an op starts when
// the stream has finished the ops before it, or when it was launched (enqueued by the host) if
// the stream is idle then, as a GPU's kernel does; a wait for another stream's event moves the
// clock to the event's time on the stream that recorded it (SimDevice::wait). The stream's
// thread sleeps only when it is more than kSleepAheadUs ahead of the clock, so an event may
// complete up to that much early, and a thread that wakes late (a loaded host) does not delay
// the ops after it: every op starts at its launch or its stream's or event's clock, never at
// the moment its thread got to it.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>

#include "strata/device.h"
#include "strata/kernels.h"

namespace strata {

// A stream's modeled time: when the work enqueued so far on it ends.
class SimClock {
 public:
  using Clock = std::chrono::steady_clock;
  // The stream's thread runs work that takes `seconds` and starts at `start` (when it was
  // launched, or the event it waits for completed, in this clock's time) or when the work before
  // it ends, whichever is later; it sleeps while the clock is more than kSleepAheadUs ahead of
  // now.
  void run(double seconds, Clock::time_point start);
  // When the work run so far ends.
  Clock::time_point end();
  static constexpr double kSleepAheadUs = 100.0;

 private:
  std::mutex mu_;
  Clock::time_point busy_until_{};
};

// The three streams' clocks of one simulated device.
struct SimClocks {
  SimClock compute, h2d, d2h;
  SimClock& of(Device& dev, Stream& s) {
    if (&s == &dev.h2d_stream()) return h2d;
    if (&s == &dev.d2h_stream()) return d2h;
    return compute;
  }
};

// Kernels whose every op enqueues its modeled time (from `peaks`) on `device`'s streams through
// host_fn; the only memory they write is crossentropy_forward_backward's losses (each
// ln(V): finite values, as a model that knows nothing would have), which they report to
// `wrote` (on the stream's thread, after writing). `device` and `clocks` must outlive the table.
using SimWroteFn = std::function<void(void* dst, size_t bytes)>;
std::unique_ptr<Kernels> create_sim_kernels(Device& device, SimClocks& clocks,
                                            const SimulatedDeviceOptions& peaks, SimWroteFn wrote);

}  // namespace strata
