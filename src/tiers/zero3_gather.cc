// ZeRO-3 parameter gathers: the device cache's mode with several ranks (see TierOptions).
//
// A fetch copies this rank's shard to its offset in a whole-group buffer and all-gathers the
// other ranks' shards into it on the h2d stream. Every rank must issue the same gathers in the
// same order, so each decision to gather ahead or to keep a released group is a function of
// the recorded trace (the same on every rank) and the groups' sizes only: the prefetch window
// from a trace position is the positions ahead whose distinct groups' gathered bytes add up to
// at most prefetch_bytes, never past the step's end (the optimizer then updates the shards).
#include <vector>

#include "src/tiers/device_cache.h"

namespace strata {

void DeviceCache::all_gather(int m, void* mine) {
  const Module& mod = homes_.module(m);
  Entry& c = cache_[size_t(m)];
  Status s = opt_.param_comm->all_gather(dev_.h2d_stream(), mine, c.ptr, mod.sn, dt_);
  if (!s.is_ok()) errors_.set(s.with_context("gathering " + mod.name + " parameters"));
}

uint64_t DeviceCache::window_end(uint64_t from) const {
  if (!trace_known() || from >= cur_->size()) return from;
  std::vector<char> seen(cache_.size(), 0);
  uint64_t bytes = 0, j = from;
  for (; j < cur_->size(); ++j) {
    const int m = cur_->accesses()[j].object;
    if (seen[size_t(m)]) continue;
    const uint64_t b = round_up(cache_bytes(homes_.modules()[size_t(m)]), 256);
    if (bytes + b > opt_.prefetch_bytes) break;
    bytes += b;
    seen[size_t(m)] = 1;
  }
  return j;
}

// Gathers every group of the window from the current position that is not cached, in trace
// order. A shortage of device memory blocks (then fails), never skips: a skipped gather would
// leave this rank out of a collective the others issue.
void DeviceCache::gather_window() {
  const uint64_t end = window_end(pos_);
  for (uint64_t j = pos_; j < end; ++j) {
    const int m = cur_->accesses()[j].object;
    if (cache_[size_t(m)].resident) continue;
    bool fetched = false;
    Status s = fetch(m, /*need_before=*/j, /*may_block=*/true, &fetched);
    if (!s.is_ok()) {
      // Remembered for end_backward; the acquire of m fetches (and fails) on demand.
      errors_.set(s.with_context("prefetching " + homes_.module(m).name + " parameters"));
      return;
    }
  }
}

// An unheld gathered group stays cached when its next use lies in the window from here.
bool DeviceCache::keep_gathered(int m) const {
  if (!trace_known()) return false;
  const uint64_t next = cur_->next_use_of(m, pos_);
  return next != UINT64_MAX && next < window_end(pos_);
}

void DeviceCache::drop_unheld() {
  // Gathered groups still cached (prefetched, then a changed order) go before the optimizer
  // step updates the shards.
  for (size_t m = 0; m < cache_.size(); ++m) {
    if (cache_[m].resident && cache_[m].pins == 0) drop(int(m));
  }
  reclaim(true);
}

}  // namespace strata
