// The optimizer for state that lives in the device's memory (ZeRO's "offload nothing", and the
// first (1 - ratio) of the modules under offload_optimizer.ratio < 1).
//
// A module whose master weights, moments and gradient accumulator are all device-homed
// (steps_on_device) is stepped by the device's own optimizer kernel, Kernels::optimizer_step,
// enqueued on the compute stream after the d2h stream's gradient drains: the CUDA backend runs
// kernels/cuda/adamw.cu, the CPU backend the same fused CPU optimizer the pipeline runs on
// host-resident state, so on the CPU backend this path gives the host path's numbers bit for bit.
// Nothing crosses the host link for such a module: the new low-precision parameters are written
// straight into their device home. When the parameters live elsewhere, they are written into
// the module's resident cached copy (then current: nothing is written through) and copied down:
// into a host home on the d2h stream without the host waiting (a later fetch from the home and
// dropping the copy wait for it; finish_copies_down() before the host reads or writes homes),
// else a sub-group at a time and published like the host path's. Without a resident copy, into
// a device buffer copied down the same way.
//
// The step is asynchronous: it runs in compute-stream order, so the next forward sees the new
// parameters and the next step's drains wait for it; anything that reads the state on the host
// first synchronizes the compute stream (checkpoints, the weights' checksum, Speculation::undo).
//
// On a device the host cannot address (CUDA), the optimizer under backward leaves such modules
// to the pass after backward when it would need undo state (clipping or fp16: the host copy of
// device state would cross the link twice per step), and the delayed update is refused (it
// steps on the host, from its own thread); on a host-addressable device the delayed update
// keeps stepping device-resident state on the host, as before.
//
// OptimizerPipeline::step() calls OptimizerPipeline::step_on_device() (defined in
// device_optimizer.cc) for such modules.
#pragma once

#include "src/tiers/homes.h"

namespace strata {

// Whether module m's optimizer state is stepped on the device: its master weights, moments and
// gradient accumulator are all homed in the device's memory.
inline bool steps_on_device(const Module& m) {
  return m.master.tier == Tier::kDevice && m.mom.tier == Tier::kDevice &&
         m.gacc.tier == Tier::kDevice && m.master.bytes > 0;
}

}  // namespace strata
