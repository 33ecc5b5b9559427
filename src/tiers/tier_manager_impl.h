// TierManager's parts, for the files that implement its public functions (tier_manager.cc,
// tier_checkpoint.cc). Not a public header.
//
// Each part is an object with its own file (see tier_manager.h); they share the Homes and
// report through the counters and the async error. Declaration order is construction order:
// every part borrows from those above it, and is destroyed before them.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "src/model/architecture.h"
#include "src/tiers/activation_stash.h"
#include "src/tiers/counters.h"
#include "src/tiers/delayed_update.h"
#include "src/tiers/device_cache.h"
#include "src/tiers/grad_buckets.h"
#include "src/tiers/homes.h"
#include "src/tiers/optimizer_pipeline.h"
#include "src/tiers/speculation.h"
#include "src/tiers/stream_stamps.h"
#include "src/tiers/tier_manager.h"

namespace strata {

struct TierManager::Impl {
  Impl(Device& d, const TierOptions& o, DType dt_, DType mdt_)
      : dev(d), opt(o), dt(dt_), mdt(mdt_) {}

  Device& dev;
  TierOptions opt;
  DType dt, mdt;
  bool sharded = false;  // world size > 1
  TierCounters counters;
  AsyncError errors;
  // The compute stream's stamps (timing the deferred optimizer step and the speculation);
  // dated by end_backward's wait for the stream.
  std::unique_ptr<StreamStamps> stamps;
  // Per module: the fill of its stored bytes when it is not stored as model-dtype elements
  // (Architecture::stored_fill; nullptr: model dtype).
  std::vector<Architecture::StoredFillFn> stored_fill;
  std::unique_ptr<Homes> homes;
  size_t undo_room = 0;  // host_undo_bytes: the host tier's undo room, allocated on first use
  std::unique_ptr<DeviceCache> cache;
  std::unique_ptr<OptimizerPipeline> pipeline;
  std::unique_ptr<Speculation> spec;
  std::unique_ptr<GradBuckets> grads;
  std::unique_ptr<DelayedUpdate> dpu;
  std::unique_ptr<ActivationStash> acts;
  double io_wait_base = 0;  // the IoWorker's wait seconds at the last take_times()

  // The deferred optimizer step (optimizer_step with `defer`): its pass, advanced module by
  // module just before each module's parameters are next acquired or fetched; empty when none
  // is pending.
  std::optional<OptimizerPipeline::Pass> deferred;
  // A speculation asked for while a deferred step was pending: begun when that step completes.
  struct SpecArgs {
    OptimizerHyper hyper;
    float grad_mult;
    bool keep_undo, step_modules;
  };
  std::optional<SpecArgs> spec_pending;
  // The deferred step's intervals on the host thread, each with when the compute stream ran
  // out of the work enqueued before it (a stamp; zero until dated): the part of an interval
  // before that is hidden under the compute stream's work.
  struct Interval {
    TierClock::time_point t0, t1;
    StreamStamps::Stamp compute_caught_up;
  };
  std::vector<Interval> deferred_intervals;

  // Steps the deferred pass through module m (m < 0: to its end), then completes the step
  // when the pass is done (its bookkeeping, a speculation asked for meanwhile).
  Status step_deferred(int m);
};

}  // namespace strata
