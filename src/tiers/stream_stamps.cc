// StreamStamps: timed events dated at the host's next wait for their stream.
#include "src/tiers/stream_stamps.h"

#include <utility>

namespace strata {

StreamStamps::StreamStamps(Device& dev) : dev_(dev) {
  std::unique_ptr<Event> a = dev_.create_timed_event(), b = dev_.create_timed_event();
  dev_.record(*a, dev_.compute_stream());
  dev_.record(*b, dev_.compute_stream());
  if (dev_.synchronize(*b).is_ok()) timed_ = dev_.elapsed_ms(*a, *b).is_ok();
  if (timed_) {
    free_.push_back(std::move(a));
    free_.push_back(std::move(b));
  }
}

std::unique_ptr<Event> StreamStamps::take_event() {
  if (free_.empty()) return dev_.create_timed_event();
  std::unique_ptr<Event> e = std::move(free_.back());
  free_.pop_back();
  return e;
}

StreamStamps::Stamp StreamStamps::stamp(Stream& s) {
  auto out = std::make_shared<std::atomic<int64_t>>(0);
  if (!timed_) {
    dev_.host_fn(s, [out] { out->store(TierClock::now().time_since_epoch().count()); });
    return out;
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<Event> e = take_event();
  dev_.record(*e, s);
  pending_.push_back({&s, std::move(e), out});
  return out;
}

void StreamStamps::hold(Stream& s, std::shared_ptr<const void> object) {
  std::lock_guard<std::mutex> lock(mu_);
  held_.emplace_back(&s, std::move(object));
}

Status StreamStamps::synchronize(Stream& s) {
  // What `s` holds and its stamps are taken out under the lock; the wait runs without it.
  std::vector<Pending> mine;
  std::vector<std::shared_ptr<const void>> held;
  std::unique_ptr<Event> last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->stream != &s) {
        ++it;
        continue;
      }
      mine.push_back(std::move(*it));
      it = pending_.erase(it);
    }
    for (auto it = held_.begin(); it != held_.end();) {
      if (it->first != &s) {
        ++it;
        continue;
      }
      held.push_back(std::move(it->second));
      it = held_.erase(it);
    }
    if (!mine.empty()) {
      last = take_event();
      dev_.record(*last, s);
    }
  }
  const Status waited = dev_.synchronize(s);
  // The host learns of the last event a little after the stream ran it: the stamps come out
  // that much late, never early. A failed wait dates them at its return (the step fails).
  const int64_t now = TierClock::now().time_since_epoch().count();
  for (Pending& p : mine) {
    Result<double> ms = waited.is_ok() ? dev_.elapsed_ms(*p.event, *last) : Result<double>(waited);
    const double ahead_ms = ms.is_ok() && *ms > 0 ? *ms : 0.0;
    const auto ahead = std::chrono::duration_cast<TierClock::duration>(
        std::chrono::duration<double, std::milli>(ahead_ms));
    p.out->store(now - ahead.count());
  }
  if (waited.is_ok()) {  // events of a failed wait may still be pending: not reused
    std::lock_guard<std::mutex> lock(mu_);
    for (Pending& p : mine) free_.push_back(std::move(p.event));
    if (last) free_.push_back(std::move(last));
  } else {
    // Kept alive until the device is done with them (the device's own teardown waits).
    std::lock_guard<std::mutex> lock(mu_);
    for (Pending& p : mine) held_.emplace_back(&s, std::shared_ptr<const void>(std::move(p.event)));
    if (last) held_.emplace_back(&s, std::shared_ptr<const void>(std::move(last)));
    for (auto& h : held) held_.emplace_back(&s, std::move(h));
  }
  return waited;
}

}  // namespace strata
