// Gradient accumulators on NVMe (strata.placement.grads = nvme): a module's fp32 GACC lives in
// one swap extent per optimizer sub-group (Module::sub_group), never whole in host memory.
//
// accumulate() enqueues on the d2h stream, for each sub-group of a module's gradient buffer: a
// device-to-host copy into the landing buffer, then a callback that stores it to the
// sub-group's extent (the first micro-batch) or reads the extent, adds and writes it back (the
// later ones); the callback waits for its I/O, so the d2h stream's order is the disk's. With
// `last` it also reduces the module's norm² and inf/nan flag over the final values, tile by
// tile (kStatsTileElems; sub-groups are whole tiles when gradients are on NVMe, see
// module_homes) and summed in tile order, exactly as grad_stats() over the whole accumulator,
// so the clipping coefficient and the losses are bit-identical to host-homed gradients.
//
// Host memory: one landing and one staging buffer of the largest sub-group, taken from the
// host tier at the first accumulate and held until destruction (the memory model counts them).
//
// Thread safety: the host thread calls accumulate(); the callbacks run on the d2h stream's
// thread, one at a time, and report failures to the AsyncError.
#pragma once

#include <memory>
#include <vector>

#include "src/tiers/counters.h"
#include "src/tiers/homes.h"
#include "strata/optimizer.h"

namespace strata {

class GradSpill {
 public:
  GradSpill(Homes& homes, TierCounters& counters, AsyncError& errors)
      : homes_(homes), dev_(homes.device()), counters_(counters), errors_(errors) {}

  // Module m's whole gradient (its sn elements at device `src`) into its NVMe accumulator on
  // the d2h stream: copied for micro 0, added for later ones; with `last`, *stats is written
  // once the final values are stored.
  void accumulate(int m, const float* src, int micro, bool last, GradStats* stats);

 private:
  Homes& homes_;
  Device& dev_;
  TierCounters& counters_;
  AsyncError& errors_;
  std::shared_ptr<PinnedBuffer> landing_, stage_;
  std::vector<std::vector<double>> tiles_;  // per module: the last micro-batch's tile sums
};

}  // namespace strata
