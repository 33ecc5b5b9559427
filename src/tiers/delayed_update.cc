#include "src/tiers/delayed_update.h"

#include <pthread.h>

#include <algorithm>

namespace strata {

DelayedUpdate::DelayedUpdate(Homes& homes, DeviceCache& cache, OptimizerPipeline& pipeline,
                             TierCounters& counters)
    : homes_(homes),
      dev_(homes.device()),
      cache_(cache),
      pipeline_(pipeline),
      counters_(counters) {}

DelayedUpdate::~DelayedUpdate() {
  if (pending_) thread_.join();
}

void DelayedUpdate::start(std::vector<int> order, const OptimizerHyper& hyper, float grad_mult) {
  STRATA_CHECK(!pending_, "a delayed update is already running");
  for (auto& m : homes_.modules()) std::swap(m.gacc, m.gacc2);  // the thread reads gacc2
  shadow_.assign(homes_.modules().size(), nullptr);
  status_ = Status::ok();
  pending_ = true;
  thread_ = std::thread(&DelayedUpdate::run, this, hyper, grad_mult, std::move(order));
  pthread_setname_np(thread_.native_handle(), "strata-delayed");
}

// The thread: the optimizer pass over gacc2, into the parameter shadows.
void DelayedUpdate::run(OptimizerHyper hyper, float grad_mult, std::vector<int> order) {
  const auto t0 = TierClock::now();
  Status st = pipeline_.run(order, hyper, grad_mult, &shadow_);
  pipeline_.drain_prepared();
  status_ = st.with_context("delayed optimizer update");
  busy_s_ = seconds_between(t0, TierClock::now());
  counters_.update([this](TierCounts& n) { n.schedule.optimizer_s += busy_s_; });
}

Status DelayedUpdate::finish() {
  if (!pending_) return Status::ok();
  const auto t0 = TierClock::now();
  thread_.join();
  pending_ = false;
  const double waited = seconds_between(t0, TierClock::now());
  Status st = status_;
  for (size_t k = 0; k < shadow_.size() && st.is_ok(); ++k) {
    auto& sh = shadow_[k];
    if (!sh) continue;
    // A prefetch may be reading the home.
    st = cache_.wait_fetch(int(k));
    if (st.is_ok()) st = pipeline_.publish(int(k), sh->data(), sh, /*wait=*/false);
    sh.reset();
  }
  Status hs = dev_.synchronize(dev_.h2d_stream());
  pipeline_.release_copied();  // the shadows: every copy from them has run
  if (st.is_ok()) st = hs.with_context("publishing the delayed update's parameters");
  shadow_.clear();
  const double busy = busy_s_;
  counters_.update([&](TierCounts& n) {
    n.schedule.optimizer_s += seconds_between(t0, TierClock::now()) - waited;
    n.schedule.optimizer_hidden_s += std::max(0.0, busy - waited);
  });
  return st;
}

}  // namespace strata
