// The access trace of a training step, reuse distances, and a replayer that measures eviction
// and prefetch policies against modelled hardware.
//
// A static model touches its state in the same order every step. The first step records that
// order (which object, how many bytes); from then on each position knows when its object is
// used next and how many bytes of other objects are touched before that (its reuse distance).
// The trace is cyclic: after the last access comes the first access of the next step.
//
// The device tier is a cache of parameter objects whose homes are slower tiers. Policies:
//   kLru     evict the least recently used object; fetch on demand.
//   kBelady  evict the object whose next use is furthest in the future (Belady's MIN);
//            fetch on demand. The reference optimum for bytes moved.
//   kStrata  what the tier manager runs: Belady's eviction, plus prefetch within the Belady
//            horizon and release after use beyond max_reuse_distance (DeviceCachePolicy,
//            src/tiers/cache_policy.h).
// replay() runs a policy over `steps` repetitions of the trace on a timeline with one copy
// engine of `bandwidth` bytes/s and per-access compute times, and reports bytes moved and the
// time the compute waited for copies (stall). All three run DeviceCachePolicy, the tier
// manager's own code, with prefetch (and, for kLru, Belady) switched off.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata {

struct Access {
  int object = 0;        // dense object id
  uint64_t bytes = 0;    // object size
  double compute_s = 0;  // compute time of the work that uses it (replayer timeline)
};

class Trace {
 public:
  Trace() = default;
  explicit Trace(std::vector<Access> accesses);

  const std::vector<Access>& accesses() const { return acc_; }
  size_t size() const { return acc_.size(); }
  bool empty() const { return acc_.empty(); }
  // Position (possibly >= size(), meaning in a later step) of the next use of the object
  // accessed at position i.
  uint64_t next_use(size_t i) const { return next_[i]; }
  // Next use at or after absolute position p (cyclic) of `object`; UINT64_MAX if never used.
  uint64_t next_use_of(int object, uint64_t p) const;
  // Bytes of other objects touched strictly between position i and the next use of its object.
  uint64_t reuse_distance(size_t i) const { return reuse_[i]; }

  // JSON lines: {"object":o,"bytes":b,"compute_s":c} per access; a header line first.
  std::string to_jsonl(const std::vector<std::string>& object_names) const;
  static Result<Trace> from_jsonl(const std::string& text);

 private:
  std::vector<Access> acc_;
  std::vector<uint64_t> next_;
  std::vector<uint64_t> reuse_;
  std::vector<std::vector<uint64_t>> positions_;  // per object, sorted positions in one step
};

enum class CachePolicy { kLru, kBelady, kStrata };
const char* cache_policy_name(CachePolicy p);

struct ReplayOptions {
  uint64_t capacity = 0;                     // device bytes available to the cache
  double bandwidth = 1e9;                    // bytes/s of the copy engine (home tier -> device)
  uint64_t prefetch_bytes = 50'000'000;      // most bytes in flight ahead (kStrata)
  uint64_t max_reuse_distance = UINT64_MAX;  // release after use beyond this (kStrata)
  int steps = 3;
};

struct ReplayResult {
  uint64_t bytes_fetched = 0;
  uint64_t fetches = 0;
  double compute_s = 0;
  double stall_s = 0;  // time compute waited for copies
  bool fits = true;    // false if some single access could not fit the capacity
};

ReplayResult replay(const Trace& trace, CachePolicy policy, const ReplayOptions& options);

}  // namespace strata
