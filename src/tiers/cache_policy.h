// The device cache policy: which cached parameter object to evict, what to prefetch, and what
// to drop after use, decided from the recorded access trace (src/tiers/trace.h).
//
// One implementation, run by two caches: the tier manager's device cache
// (src/tiers/device_cache.h), and the replayer behind `strata trace replay` and the policy
// tests (replay() in src/tiers/trace.h), which runs it on a modelled copy engine. Each cache
// implements CacheState; the policy reads it and calls back to prefetch.
//
//   victim()          Belady: the evictable object whose next use is furthest ahead; without a
//                     trace (the first step of a phase, or a changed order), or when
//                     options.belady is false, the least recently used.
//   prefetch()        after an access, walk the trace ahead and fetch upcoming objects while
//                     the bytes in flight stay within prefetch_bytes, evicting only objects
//                     beyond prefetch_horizon() (so the victims are Belady's own and prefetch
//                     never moves more bytes than on-demand Belady). Stops at the first object
//                     that finds no room.
//   drop_after_use()  an object whose reuse distance exceeds max_reuse_distance is released
//                     after its use.
// Prefetch and drops need the trace and options.prefetch.
//
// Thread safety: none; the cache's owner calls it from one thread.
#pragma once

#include <cstdint>

#include "src/tiers/trace.h"

namespace strata {

// A device cache as the policy sees it. Objects are the trace's dense ids [0, object_count()).
class CacheState {
 public:
  virtual ~CacheState() = default;
  virtual int object_count() const = 0;
  // Resident and evictable now: not in use, not persistent.
  virtual bool evictable(int object) const = 0;
  // Absolute trace position of the object's last access (LRU's key).
  virtual uint64_t last_access(int object) const = 0;
  // Worth prefetching: not resident, and not used in place from its home.
  virtual bool fetchable(int object) const = 0;
  // Starts fetching `object` (`bytes`) ahead of its use, evicting through
  // DeviceCachePolicy::victim() with `horizon` as need_before. False when it found no room.
  virtual bool prefetch(int object, uint64_t bytes, uint64_t horizon) = 0;
};

struct CachePolicyOptions {
  bool belady = true;                        // evict by next use when the trace is known (else LRU)
  bool prefetch = true;                      // prefetch and drop after use when the trace is known
  uint64_t prefetch_bytes = 50'000'000;      // most bytes in flight ahead
  uint64_t max_reuse_distance = UINT64_MAX;  // bytes
};

class DeviceCachePolicy {
 public:
  explicit DeviceCachePolicy(const CachePolicyOptions& options) : opt_(options) {}

  // The trace of the step under way, or null while a step is being recorded or after its order
  // changed (then: LRU, fetch on demand, nothing dropped). Must outlive its use.
  void set_trace(const Trace* trace) { trace_ = trace; }
  const Trace* trace() const { return trace_; }

  // The object to evict when an access at absolute position `from` or later needs room: never
  // `keep`, never one that is not evictable, and with need_before != UINT64_MAX (a prefetch)
  // none next used at or before need_before. -1 if none qualifies. Ties go to the lowest id.
  int victim(const CacheState& cache, uint64_t from, int keep, uint64_t need_before) const;

  // After the access at absolute position `pos`, with `in_flight` bytes of fetches still
  // copying: prefetches the objects of the positions after it, in trace order.
  void prefetch(CacheState& cache, uint64_t pos, uint64_t in_flight) const;

  // Whether the object accessed at position `pos` (within a step) is dropped after its use.
  bool drop_after_use(uint64_t pos) const;
  // Whether the access at position `pos` is its object's last of the step (its next is the next
  // step's); false without a trace.
  bool last_in_step(uint64_t pos) const;

 private:
  CachePolicyOptions opt_;
  const Trace* trace_ = nullptr;
};

// The eviction horizon for prefetching the access at absolute position j while at position
// pos: a prefetch may only evict objects next used after this. It is the latest first use after
// j of any object touched in [pos, j): on-demand Belady at j could evict any of those, so
// evicting only objects beyond all of them picks exactly the victims Belady would pick at j,
// and prefetching never moves more bytes than Belady's on-demand schedule.
uint64_t prefetch_horizon(const Trace& trace, uint64_t pos, uint64_t j);

}  // namespace strata
