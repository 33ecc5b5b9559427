// When a stream reached a point of its work, in host time, without stopping the stream there.
//
// The tier manager times its schedule by where the compute stream was when the host did
// something (how much of the optimizer's host time the stream's work hid, when backward ended).
// A host function enqueued for that (cudaLaunchHostFunc) holds its stream, and on some GPUs
// every stream, until the driver's thread has run it: tens of microseconds of idle device a
// time, dozens of times a step. A stamp is a timed event instead, which costs the stream
// nothing; synchronize() records one more, waits for the stream, and dates every stamp on it by
// the device's time between the stamp and that last event. A device that does not time its
// streams (Device::elapsed_ms unavailable) is stamped by a host function, as before.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "src/tiers/counters.h"
#include "strata/device.h"

namespace strata {

class StreamStamps {
 public:
  // TierClock ticks since its epoch when the stream reached the stamp; 0 until dated.
  using Stamp = std::shared_ptr<std::atomic<int64_t>>;

  // Probes whether `dev` times its streams (one timed event recorded and waited for on the
  // compute stream).
  explicit StreamStamps(Device& dev);
  StreamStamps(const StreamStamps&) = delete;
  StreamStamps& operator=(const StreamStamps&) = delete;

  // A stamp at the end of what `s` has been given so far. Dated by the next synchronize(s), or
  // (host-function stamps) as soon as the stream reaches it.
  Stamp stamp(Stream& s);
  // Keeps `object` (an event a stream waits for, a buffer a copy reads) alive until the next
  // synchronize(s) -- where a host function enqueued for nothing else would have.
  void hold(Stream& s, std::shared_ptr<const void> object);
  // Waits for `s` (Device::synchronize), dates its stamps and lets go of what it held.
  Status synchronize(Stream& s);
  // Stamps by timed events (false: by host functions).
  bool timed() const { return timed_; }

 private:
  struct Pending {
    Stream* stream;
    std::unique_ptr<Event> event;
    Stamp out;
  };

  std::unique_ptr<Event> take_event();

  Device& dev_;
  bool timed_ = false;
  std::mutex mu_;
  std::vector<Pending> pending_;
  std::vector<std::pair<Stream*, std::shared_ptr<const void>>> held_;
  std::vector<std::unique_ptr<Event>> free_;  // timed events dated and ready for reuse
};

}  // namespace strata
