// TierManager's parts, for the files that implement its public functions (tier_manager.cc,
// tier_checkpoint.cc). Not a public header.
//
// Each part is an object with its own file (see tier_manager.h); they share the Homes and
// report through the counters and the async error. Declaration order is construction order:
// every part borrows from those above it, and is destroyed before them.
#pragma once

#include <memory>

#include "src/tiers/activation_stash.h"
#include "src/tiers/counters.h"
#include "src/tiers/delayed_update.h"
#include "src/tiers/device_cache.h"
#include "src/tiers/grad_buckets.h"
#include "src/tiers/homes.h"
#include "src/tiers/optimizer_pipeline.h"
#include "src/tiers/speculation.h"
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
  std::unique_ptr<Homes> homes;
  std::unique_ptr<DeviceCache> cache;
  std::unique_ptr<OptimizerPipeline> pipeline;
  std::unique_ptr<Speculation> spec;
  std::unique_ptr<GradBuckets> grads;
  std::unique_ptr<DelayedUpdate> dpu;
  std::unique_ptr<ActivationStash> acts;
  double io_wait_base = 0;  // the IoWorker's wait seconds at the last take_times()
};

}  // namespace strata
