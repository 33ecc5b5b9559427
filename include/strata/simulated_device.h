// The simulated fast device's rules that other layers share (strata/device.h declares the
// device itself: SimulatedDeviceOptions, its presets, create_simulated_device): the options a
// config's device section asks for, the time its kernels charge for attention, and its kernels
// as a tally. The trainer creates its device from the first; the planner (src/plan) times
// compute with the tally, so that a plan of a simulated run adds up the numbers the kernels
// charge, not a copy of them.
#pragma once

#include <cstdint>
#include <memory>

#include "strata/device.h"
#include "strata/status.h"

namespace strata {

struct DeviceConfig;  // strata/config.h

// The device a config's device section simulates: device.simulate's preset with each
// device.simulate_* rate that is set (> 0; launch_us >= 0) in place of the preset's, and its
// memory capped at device.memory_limit when that is set. kInvalidArgument for an unknown preset
// (naming device.simulate).
Result<SimulatedDeviceOptions> simulated_device_options(const DeviceConfig& device);

// The compute part of the simulated fused attention's time (the kernels also charge their bytes
// over hbm_gbps and a launch; the plain kernels kPlainSlowdown times it): `square_flops` are the
// multiply-adds of QK^T and AV over the whole T x T square (4 B NH T^2 hs forward); causal
// attention does half of them, and the backward 2.5 times the forward's, at the attention rates.
double simulated_attention_seconds(const SimulatedDeviceOptions& p, double square_flops,
                                   bool backward);

// What a sequence of the simulated device's kernels costs: the sum of their modeled times
// (launch included), how many ran, and the work the model charges them for: floating-point
// operations (GEMMs: 2 per multiply-add; attention: the causal half of the T x T square,
// the backward 2.5 times the forward's) and bytes read and written.
struct SimTally {
  double seconds = 0;
  uint64_t kernels = 0;
  double flops = 0;
  double bytes = 0;
};
// The simulated device's kernels (`p`'s rates) that write nothing and enqueue nothing: each
// call adds its modeled time to `tally` (which must outlive them); their streams are ignored.
// The planner runs a model's program through them (src/plan/plan_sim.cc), so that it times a
// simulated step by the numbers the kernels charge.
std::unique_ptr<Kernels> create_simulated_kernel_tally(const SimulatedDeviceOptions& p,
                                                       SimTally* tally);

}  // namespace strata
