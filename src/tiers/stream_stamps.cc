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
  std::lock_guard<std::mutex> lock(mu_);
  bool any = false;
  for (const Pending& p : pending_) any = any || p.stream == &s;
  if (!any) {
    STRATA_RETURN_IF_ERROR(dev_.synchronize(s), "");
    std::erase_if(held_, [&](const auto& h) { return h.first == &s; });
    return Status::ok();
  }
  std::unique_ptr<Event> last = take_event();
  dev_.record(*last, s);
  STRATA_RETURN_IF_ERROR(dev_.synchronize(s), "");
  std::erase_if(held_, [&](const auto& h) { return h.first == &s; });
  // The host learns of the last event a little after the stream ran it: the stamps come out
  // that much late, never early.
  const int64_t now = TierClock::now().time_since_epoch().count();
  std::erase_if(pending_, [&](Pending& p) {
    if (p.stream != &s) return false;
    Result<double> ms = dev_.elapsed_ms(*p.event, *last);
    const double ahead_ms = ms.is_ok() && *ms > 0 ? *ms : 0.0;
    const auto ahead = std::chrono::duration_cast<TierClock::duration>(
        std::chrono::duration<double, std::milli>(ahead_ms));
    p.out->store(now - ahead.count());
    free_.push_back(std::move(p.event));
    return true;
  });
  free_.push_back(std::move(last));
  return Status::ok();
}

}  // namespace strata
