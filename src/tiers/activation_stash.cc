#include "src/tiers/activation_stash.h"

#include <fmt/format.h>

#include "strata/log.h"

namespace strata {

ActivationStash::ActivationStash(Homes& homes, DeviceCache& cache, TierCounters& counters,
                                 AsyncError& errors)
    : homes_(homes), dev_(homes.device()), cache_(cache), counters_(counters), errors_(errors) {}

Status ActivationStash::reserve(int layers, size_t bytes) {
  reserved_bytes_ = bytes;
  for (int l = 0; l < layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, homes_.pool().acquire(bytes),
                            fmt::format("host tier: activations of block {} "
                                        "(strata.activations = offload)",
                                        l));
    host_.push_back(std::move(b));
  }
  len_.assign(host_.size(), 0);
  ev_.resize(host_.size());
  return Status::ok();
}

void ActivationStash::release_all() {
  host_.clear();
  ev_.clear();
  last_stash_.reset();
}

Status ActivationStash::stash(int layer, const void* dev, size_t bytes) {
  if (layer < 0 || size_t(layer) >= host_.size() || bytes > host_[size_t(layer)].size()) {
    Status s = invalid_argument(fmt::format(
        "host tier: no room to stash {} of block {}'s activations ({} block buffers of {} "
        "reserved); strata.activations = offload reserves them from the model's shape",
        format_bytes(double(bytes)), layer, host_.size(), format_bytes(double(reserved_bytes_))));
    errors_.set(s);
    return s;
  }
  Stream& d2h = dev_.d2h_stream();
  std::shared_ptr<Event> after(dev_.create_event());
  dev_.record(*after, dev_.compute_stream());
  dev_.wait(d2h, *after);
  dev_.copy_d2h(d2h, host_[size_t(layer)].data(), dev, bytes);
  auto done = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*done, d2h);
  ev_[size_t(layer)] = done;
  last_stash_ = done;
  len_[size_t(layer)] = bytes;
  counters_.update([bytes](TierCounts& n) {
    n.dev_out += bytes;
    n.host_in += bytes;
  });
  return Status::ok();
}

Status ActivationStash::restore(int layer, void* dev) {
  if (layer < 0 || size_t(layer) >= host_.size() || len_[size_t(layer)] == 0) {
    Status s = invalid_argument(
        fmt::format("host tier: block {}'s activations were never stashed (strata.activations "
                    "= offload restores a block's input only after its forward)",
                    layer));
    errors_.set(s);
    return s;
  }
  Stream& h2d = dev_.h2d_stream();
  std::shared_ptr<Event> after(dev_.create_event());
  dev_.record(*after, dev_.compute_stream());
  dev_.wait(h2d, *after);
  if (last_stash_) dev_.wait(h2d, *last_stash_);
  const size_t bytes = len_[size_t(layer)];
  dev_.copy_h2d(h2d, dev, host_[size_t(layer)].data(), bytes);
  auto done = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*done, h2d);
  ev_[size_t(layer)] = done;
  counters_.update([bytes](TierCounts& n) {
    n.dev_in += bytes;
    n.host_out += bytes;
  });
  return Status::ok();
}

void ActivationStash::compute_waits(int layer) {
  if (layer < 0 || size_t(layer) >= ev_.size()) return;
  cache_.compute_waits_for(ev_[size_t(layer)]);
}

}  // namespace strata
