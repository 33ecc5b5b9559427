#include "src/tiers/cache_policy.h"

#include <algorithm>

namespace strata {

int DeviceCachePolicy::victim(const CacheState& cache, uint64_t from, int keep,
                              uint64_t need_before) const {
  const bool belady = opt_.belady && trace_;
  int victim = -1;
  uint64_t best = 0;
  for (int o = 0; o < cache.object_count(); ++o) {
    if (o == keep || !cache.evictable(o)) continue;
    uint64_t key;
    if (belady) {
      key = trace_->next_use_of(o, from);
      if (need_before != UINT64_MAX && key <= need_before) continue;
    } else {
      if (need_before != UINT64_MAX) continue;  // no prefetch without a trace
      key = UINT64_MAX - cache.last_access(o);  // oldest use first
    }
    if (victim < 0 || key > best) {
      victim = o;
      best = key;
    }
  }
  return victim;
}

void DeviceCachePolicy::prefetch(CacheState& cache, uint64_t pos, uint64_t in_flight) const {
  if (!opt_.prefetch || !trace_ || trace_->empty()) return;
  const uint64_t n = trace_->size();
  for (uint64_t j = pos + 1; j < pos + n; ++j) {
    const Access& a = trace_->accesses()[j % n];
    if (!cache.fetchable(a.object)) continue;
    if (in_flight + a.bytes > opt_.prefetch_bytes) break;
    if (!cache.prefetch(a.object, a.bytes, prefetch_horizon(*trace_, pos, j))) break;
    in_flight += a.bytes;
  }
}

bool DeviceCachePolicy::drop_after_use(uint64_t pos) const {
  return opt_.prefetch && trace_ && pos < trace_->size() &&
         trace_->reuse_distance(pos) > opt_.max_reuse_distance;
}

bool DeviceCachePolicy::last_in_step(uint64_t pos) const {
  return trace_ && pos < trace_->size() && trace_->next_use(pos) >= trace_->size();
}

uint64_t prefetch_horizon(const Trace& t, uint64_t pos, uint64_t j) {
  const size_t n = t.size();
  uint64_t h = j;
  for (uint64_t q = pos; q < j; ++q) {
    h = std::max(h, t.next_use_of(t.accesses()[q % n].object, j + 1));
  }
  return h;
}

}  // namespace strata
