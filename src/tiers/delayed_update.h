// The delayed parameter update (strata.optimizer.delayed_update, ZeRO-Offload's DPU).
//
// start() runs the optimizer pass of a step on a background thread, from the second gradient
// accumulator (the accumulators swap first, so the next step's backward fills the other one),
// writing the new parameters to one host shadow per module. finish() joins the thread and
// publishes the shadows to the parameters' homes and cached device copies. Between the two the
// next step's forward and backward run with the parameters before the update: one step stale,
// whatever the thread's timing.
//
// Thread safety: the host thread calls start/finish; while the thread runs it alone uses the
// optimizer pipeline.
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "src/tiers/counters.h"
#include "src/tiers/device_cache.h"
#include "src/tiers/homes.h"
#include "src/tiers/optimizer_pipeline.h"

namespace strata {

class DelayedUpdate {
 public:
  DelayedUpdate(Homes& homes, DeviceCache& cache, OptimizerPipeline& pipeline,
                TierCounters& counters);
  ~DelayedUpdate();  // joins a running update (its result is dropped)

  bool pending() const { return pending_; }
  // Swaps every module's gradient accumulators and steps the modules in `order` on a thread.
  // Call with none pending.
  void start(std::vector<int> order, const OptimizerHyper& hyper, float grad_mult);
  // Waits for the pending update and publishes its parameters; its error, if any.
  Status finish();

 private:
  void run(OptimizerHyper hyper, float grad_mult, std::vector<int> order);

  Homes& homes_;
  Device& dev_;
  DeviceCache& cache_;
  OptimizerPipeline& pipeline_;
  TierCounters& counters_;
  std::thread thread_;
  bool pending_ = false;
  Status status_;                                      // the thread's result
  std::vector<std::shared_ptr<PinnedBuffer>> shadow_;  // [module] new parameters
  double busy_s_ = 0;                                  // the thread's time
};

}  // namespace strata
