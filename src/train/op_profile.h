// The op profile (flops_profiler.enabled, DeepSpeed's key): every kernel and copy that one
// training step enqueues, timed on the device by its stream's own clock (timed events:
// Device::create_timed_event, elapsed_ms), summed by op and stream, with the work the
// simulated device's cost model charges each call (its FLOPs and bytes: SimTally) and the
// rates that gives. Beside each row, the time the simulated device would take for those calls
// (the rates of device.simulate, or the preset named by the GPU: "h200", "h100", "a100"), so a
// GPU's profile says op by op where it is slower or faster than the model the planner and the
// simulation use.
//
// Host functions on a stream are rows too ("host_fn": on a GPU each holds its stream until a
// host thread has run it). It also counts the host's waits for the device during the step
// (Device::synchronize) and the time they blocked. What it does not see: collectives on a
// communicator's own stream, and the gaps between ops (a stream's busy time against its span
// and the step's host time says how much of the step it sat idle).
//
// Timing costs two event records per op, and the launches of the profiled step are serialized
// across threads: the profiled step is somewhat slower than the others. The default (off)
// wraps nothing.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/device_wrapper.h"
#include "strata/simulated_device.h"

namespace strata {

// One op on one stream over the profiled step.
struct OpProfileRow {
  std::string op;      // "matmul_forward", "copy_h2d", ...
  std::string stream;  // compute | h2d | d2h | other
  int64_t calls = 0;
  double ms = 0;         // the calls' device time, summed
  double flops = 0;      // the cost model's floating-point operations (0: a memory op)
  double bytes = 0;      // and bytes read and written
  double model_ms = -1;  // the simulated device's time for the same calls; < 0: no model
};

struct OpProfile {
  int64_t step = 0;    // the step profiled (1-based)
  double host_ms = 0;  // the step's time on the host, from its first launch to its end
  std::string device;  // the device's name
  std::string model;   // the rates model_ms uses ("h200", "simulated device"); "" = none
  std::vector<OpProfileRow> rows;  // by time, longest first
  // Per stream (compute, h2d, d2h): the ops' summed time, and the span from the first op's
  // start to the last one's end.
  double busy_ms[3] = {0, 0, 0};
  double span_ms[3] = {0, 0, 0};
  // The host's waits for the device during the step (Device::synchronize of an event or a
  // stream): how many, and the time the calling threads were blocked in them. A wait in the
  // middle of a step lets the device's queue run dry.
  int64_t host_waits = 0;
  double host_wait_ms = 0;
};

// How the table starts ("op profile of step N on ..."): a file that starts so is a profile.
inline constexpr const char* kOpProfileTitle = "op profile of step ";

// The profile as a table: a header line with the step, the device and each stream's busy time
// against the step's, then a row per op and stream (calls, ms, share of all ops' time, TFLOP/s,
// GB/s, model ms and measured / model), then the totals.
std::string format_op_profile(const OpProfile& p);

// A device whose kernels and copies are timed between start() and stop(); outside that window
// every call goes straight to the wrapped device (one branch). start() and stop() are called
// by one thread (the trainer's); ops may be enqueued from any thread.
class ProfiledDevice final : public DeviceWrapper {
 public:
  // `model`: the rates that price each op's model_ms; nullopt: no model column.
  ProfiledDevice(std::unique_ptr<Device> inner, std::optional<SimulatedDeviceOptions> model);
  ~ProfiledDevice() override;

  Kernels& kernels() override;
  void copy_h2d(Stream& s, void* dst, const void* src, size_t bytes) override;
  void copy_d2h(Stream& s, void* dst, const void* src, size_t bytes) override;
  void copy_d2d(Stream& s, void* dst, const void* src, size_t bytes) override;
  void memset_zero(Stream& s, void* dst, size_t bytes) override;
  void host_fn(Stream& s, std::function<void()> fn) override;
  Status synchronize(Event& event) override;
  Status synchronize(Stream& stream) override;

  // Times every op enqueued from now on.
  void start(int64_t step);
  // Stops timing, waits for the timed ops to finish (the three streams) and sums them. An
  // error when the device does not time its streams (Device::elapsed_ms) or a wait fails.
  Result<OpProfile> stop();

  class Timer;  // the kernels' wrapper (op_profile.cc)

 private:
  struct Call {
    const char* op;
    int stream;  // 0 compute, 1 h2d, 2 d2h, 3 other
    Event* begin;
    Event* end;
    double flops, bytes, model_s;
  };
  int stream_index(Stream& s);
  Event* take_event();
  // Runs `launch` between two timed events on `s`, counted as `op` with the cost model's
  // work and time (a negative model_s: none).
  template <typename F>
  void timed(Stream& s, const char* op, double flops, double bytes, double model_s, F&& launch);
  // The model's time for a copy or memset of `bytes`: over the link (h2d, d2h) or the HBM
  // (within the device: read and written); < 0 without a model.
  double copy_model_s(size_t bytes, bool over_link, bool twice) const;
  // Runs `wait` (a synchronize of the wrapped device), counted as a host wait while timing.
  template <typename F>
  Status waited(F&& wait);

  const std::optional<SimulatedDeviceOptions> model_;
  std::unique_ptr<Timer> timer_;
  std::recursive_mutex mu_;
  std::atomic<bool> on_{false};
  int64_t step_ = 0;
  std::chrono::steady_clock::time_point t0_;
  std::vector<Call> calls_;
  int64_t waits_ = 0;
  double wait_ms_ = 0;
  std::vector<std::unique_ptr<Event>> events_;  // the pool; calls_ use the first 2 x size()
  size_t used_ = 0;
};

}  // namespace strata
