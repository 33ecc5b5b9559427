// The device cache: copies of module parameters in device memory while they are needed, and
// the device allocations of the tier manager's other transient buffers.
//
// acquire(m) returns a device pointer to module m's parameters: the home itself when it is on
// the device (unsharded), else a cached copy, fetched on demand from the host or NVMe home on
// the h2d stream, or, with several ranks, this rank's shard gathered with the others' into the
// whole group (zero3_gather.cc). The compute stream waits on the fetch's event; memory is freed
// only after the last use's event.
//
// What stays, what is evicted and what is fetched ahead is DeviceCachePolicy's decision
// (src/tiers/cache_policy.h), the same code `strata trace replay` runs. The first step of each
// phase ("train", "eval") records the order of acquires; later steps give the policy that
// trace. A changed order is logged, served on demand and re-recorded. Modules under
// persistence_threshold elements stay once fetched (unsharded).
//
// An NVMe fetch moves the module's parameters a sub-group (one swap extent) at a time through
// a ring of kFetchStagingPieces host-tier buffers that every fetch shares, taken from the host
// tier at the first NVMe fetch: piece g (counting every fetch's pieces in the order they are
// enqueued) is read into buffer g % kFetchStagingPieces as soon as the h2d stream has copied
// piece g - kFetchStagingPieces out of it, then the h2d stream waits for its read and copies
// it into the cached copy. So the host staging for fetches is kFetchStagingPieces sub-groups
// (the memory model's param_fetch_staging) whatever the modules' size or the prefetch depth,
// and the host thread never waits for a buffer.
//
// Thread safety: the host thread calls everything; stream callbacks only touch the counters
// and the async error.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "src/tiers/cache_policy.h"
#include "src/tiers/counters.h"
#include "src/tiers/homes.h"
#include "src/tiers/trace.h"

namespace strata {

class DeviceCache final : public CacheState {
 public:
  DeviceCache(Homes& homes, const TierOptions& options, DType dt, bool sharded,
              TierCounters& counters, AsyncError& errors);

  // ---- phases and their traces ---------------------------------------------------------
  void begin_phase(const std::string& phase);
  // Device bytes a prefetch leaves free for the gradient buffers the coming backward allocates
  // (GradBuckets::device_reserve: set by the TierManager).
  void set_prefetch_reserve(size_t bytes) { prefetch_reserve_ = bytes; }
  // Keeps this step's order as the phase's trace when it had none or the order changed.
  void end_phase();
  const Trace* trace(const std::string& phase) const;

  // ---- parameters ----------------------------------------------------------------------
  // Device pointer to module m's parameters, valid for work enqueued on the compute stream
  // until release(m). Records the access; then prefetches what the policy asks for.
  Result<const void*> acquire(int m);
  void release(int m);

  // ---- device memory -------------------------------------------------------------------
  // Device memory for a manager-owned buffer, evicting cached copies as the policy chooses
  // (never `keep`; for a prefetch, nothing used at or before need_before). With `may_block`,
  // waits for pending frees and gradient drains before failing with an error that names the
  // tier, the bytes and the config keys; without, fails at once.
  Result<void*> allocate(size_t bytes, const std::string& tag, int keep, uint64_t need_before,
                         bool may_block);
  // Frees the cached copies whose last use has run; with `block_oldest`, waits for the oldest.
  void reclaim(bool block_oldest);
  // Frees `ptr` (`bytes` of device memory) once `after` has run: a gradient buffer draining on
  // the d2h stream. Until then it counts as room on its way, so an allocation that needs it
  // waits for the drain instead of evicting a cached copy that would be fetched again.
  void release_after(void* ptr, size_t bytes, std::shared_ptr<Event> after);
  // The compute stream waits for `ev` (timed into ScheduleCounts::compute_wait_s on a
  // host-addressable device). A null event is no wait.
  void compute_waits_for(const std::shared_ptr<Event>& ev);

  // ---- new parameters from the optimizer ----------------------------------------------
  bool resident(int m) const { return cache_[size_t(m)].resident; }
  // Waits until a fetch of module m's cached copy (which reads its home) has landed, so the
  // home may be overwritten.
  Status wait_fetch(int m);
  // Write-through: copies `bytes` of new parameters at host `lp` to module m's cached copy at
  // byte `offset` on the h2d stream; the copy is not freed before that ran.
  void write_through(int m, size_t offset, const void* lp, size_t bytes);
  // The device optimizer's target for module m's new parameters: its cached copy when one is
  // resident and not a gathered group (sharded), else null; the compute stream waits for the
  // copy's fetch first. Once the step has run the copy is current: nothing writes it through.
  void* step_in_place(int m);
  // The copy step_in_place(m) returned is copied down into module m's home until `down` has
  // run: dropping the copy waits for it, and a later fetch from the home waits for it.
  void copied_down(int m, std::shared_ptr<Event> down);
  // Forgets module m's cached copy; its memory is freed after its last use.
  void drop(int m);
  // Called with module m before any fetch of its parameters (demand or prefetch): the deferred
  // optimizer step publishes them first. Its failure fails a demand fetch; a prefetch's is
  // kept for end_backward and the prefetch skipped.
  void set_before_fetch(std::function<Status(int)> f) { before_fetch_ = std::move(f); }

  // ---- ZeRO-3 (zero3_gather.cc) --------------------------------------------------------
  // At the end of backward: every gathered group nobody holds is dropped (the optimizer is
  // about to update the shards) and its memory reclaimed.
  void drop_unheld();

  // Frees every cached copy; call after the device's streams have been synchronized.
  void release_all();

  // ---- CacheState: what the policy sees ------------------------------------------------
  int object_count() const override { return int(cache_.size()); }
  bool evictable(int m) const override;
  uint64_t last_access(int m) const override { return cache_[size_t(m)].last_pos; }
  bool fetchable(int m) const override;
  bool prefetch(int m, uint64_t bytes, uint64_t horizon) override;

 private:
  struct Entry {
    void* ptr = nullptr;
    bool resident = false;
    bool persistent = false;
    int pins = 0;
    uint64_t acq_pos = 0;   // trace position of the current/last acquire
    uint64_t last_pos = 0;  // LRU key
    std::shared_ptr<Event> ready, last_use;
    std::shared_ptr<Event> home_written;  // the last copy down into the home (copied_down)
  };
  struct PendingFree {
    void* ptr;
    size_t bytes;
    std::shared_ptr<Event> after;
  };
  // The NVMe fetch ring (see above), shared with the h2d stream's callbacks.
  struct FetchRing;
  // Enqueues the NVMe read of module m's shard, piece by piece, into `mine` on the h2d stream.
  Status fetch_from_nvme(Module& mod, char* mine);
  // Device bytes of a gathered (cached) parameter group.
  size_t cache_bytes(const Module& m) const { return m.padded * dtype_size(dt_); }
  bool trace_known() const { return cur_ && !mismatch_; }
  // Fetches (gathers, when sharded) module m's parameters into the cache. need_before is
  // UINT64_MAX for a fetch on demand, else the prefetch's eviction horizon.
  Status fetch(int m, uint64_t need_before, bool may_block, bool* fetched);
  void prefetch_after_acquire();

  // zero3_gather.cc
  void all_gather(int m, void* mine);
  // ZeRO++ (qwZ, hpZ; src/comm/zeropp.h): module m's gather, quantized and/or from the
  // secondary partition.
  Status gather_zeropp(int m, void* mine);
  // hpZ: frees every secondary shard after the gathers enqueued so far (the phase ended, or
  // the optimizer is about to update the shards).
  void drop_secondaries();
  uint64_t window_end(uint64_t from) const;
  void gather_window();
  bool keep_gathered(int m) const;

  Homes& homes_;
  Device& dev_;
  const TierOptions& opt_;
  DType dt_;
  bool sharded_;
  TierCounters& counters_;
  AsyncError& errors_;
  DeviceCachePolicy policy_;
  std::vector<Entry> cache_;
  std::deque<PendingFree> pending_;
  // Device bytes a prefetch leaves free for the gradient buffer backward allocates next.
  size_t prefetch_reserve_ = 0;
  std::shared_ptr<FetchRing> ring_;  // null until the first NVMe fetch
  // hpZ: module m's secondary shard (device memory) while this phase holds one, else null.
  std::vector<void*> secondary_;
  // The trace of each phase; the current phase's recording and position.
  std::map<std::string, Trace> traces_;
  std::string phase_;
  std::function<Status(int)> before_fetch_;
  std::vector<Access> rec_;
  bool mismatch_ = false;
  uint64_t pos_ = 0;
  const Trace* cur_ = nullptr;
};

}  // namespace strata
