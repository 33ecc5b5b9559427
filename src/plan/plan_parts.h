// The parts evaluate_placement (src/plan/plan.h) composes for one placement, each a function
// of values with its own inputs and outputs:
//
//   plan_memory  the memory model's reservations: the architecture, the engine's TierOptions
//                for the request, module_homes, the forward group and tier_needs at it, the
//                bytes per tier and the preflight's verdict (tier_shortfall) — plus the sizes
//                per module that the peaks and the time model read (StateBytes).
//   plan_peaks   the peaks the run is expected to reach beside those reservations: the gradient
//                buffers and parameter cache on the device, the host pipeline's staging, the
//                undo state of the optimizer under backward, the read-ahead.
//   plan_time    the time terms (bytes or FLOPs over the profile's rates) and how the schedules
//                combine them: steady state, a step after one that clipped deferred into the
//                next forward or stepped after backward.
//
// docs/PLANNER.md states every rule. Plain functions; no global state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "src/plan/plan.h"
#include "src/tiers/memory_model.h"
#include "strata/simulated_device.h"

namespace strata {

// Sizes of this rank's state per kind and tier, summed over module_homes (each module's shard),
// for the peaks and the time model. Elements unless named bytes.
struct StateBytes {
  uint64_t max_params = 0, max_grads = 0;  // the largest module's params and gradients, bytes
  uint64_t trained = 0;   // elements with gradients and an optimizer step (no frozen base)
  uint64_t opt_host = 0;  // elements whose optimizer step runs on the CPU
  // The largest piece of new parameters the CPU's optimizer publishes (a module's sub-group
  // of them), bytes.
  uint64_t max_host_piece = 0;
  uint64_t opt_device = 0;        // elements stepped by the device's optimizer
  uint64_t grads_off_device = 0;  // elements whose gradients land in the host tier
  uint64_t grads_nvme = 0;        // ... of them accumulated on NVMe
  uint64_t grads_nvme_bytes = 0;  // their fp32 accumulators' NVMe extents, bytes
  // NVMe-homed parameters: their bytes, and their extents' (one per sub-group, whole 4 KiB
  // blocks; a quantized base's as stored), all and the trained ones'.
  uint64_t params_nvme_raw = 0, params_nvme_extents = 0, trained_params_nvme_extents = 0;
  uint64_t opt_nvme = 0;       // NVMe-homed master + moments, bytes (what the optimizer moves)
  size_t opt_nvme_writes = 0;  // NVMe writes of master + moments per sub-group (0, 1 or 2)
  std::vector<uint64_t> opt_nvme_of;        // opt_nvme per module
  std::vector<uint64_t> opt_nvme_sub_full;  // ... of one of its whole sub-groups
  // Per sub-group, in 4 KiB host buffers: (bytes, how many sub-groups have them), two entries
  // per module (its full sub-groups and its last), largest first.
  std::vector<std::pair<uint64_t, uint64_t>> opt_nvme_extents;
  // The whole model's trained elements (unsharded) and its parameters' bytes as the tiers hold
  // them (a quantized base: its stored bytes).
  uint64_t full_trained = 0;
  uint64_t param_bytes = 0;

  // The bytes of the k largest sub-groups' NVMe master + moments.
  uint64_t largest_extents(uint64_t k) const;
  // NVMe-homed master + moments of the first `count` sub-groups with such state, in module
  // order or (backward) from the last module; within a module its first sub-groups, as the
  // pipeline keeps and reads them ahead: whole sub-groups unless the module's last, shorter one
  // is taken too.
  double first_sub_groups(const std::vector<ModuleHomes>& homes, size_t count, bool backward) const;
};
StateBytes state_bytes_of(const std::vector<ModuleHomes>& homes, const ModelLayout& layout,
                          DType dtype);

// ---- memory ----------------------------------------------------------------------------------

// The memory model of one placement for one rank, and the node's bytes per tier it reserves.
struct PlanMemory {
  std::shared_ptr<const Architecture> arch;
  ActivationSizes acts;            // the micro-batch's activations under request.activations()
  TierOptions options;             // tier_options_of, its forward_group resolved
  std::vector<ModuleHomes> homes;  // module_homes of the placement
  ZeroPPShape zeropp;              // ZeRO++'s buffers on the planner's grid (one node)
  TierNeeds needs;                 // tier_needs at the forward group
  int forward_group = 1;           // K >= 1: strata.grouped_forwards as the run resolves it
  TierBytes device, host, nvme;    // the reservations (state, buffers, activations, capacity)
  std::vector<std::string> why;    // each shortfall, with needed vs available
  StateBytes state;                // sizes per kind and tier, for the peaks and the time
};
// `arch` is create_architecture of request.config.model. Fails on a placement module_homes
// refuses (naming the model).
Result<PlanMemory> plan_memory(const PlanRequest& request, const Placement& where,
                               std::shared_ptr<const Architecture> arch);

// ---- peaks -----------------------------------------------------------------------------------

struct PlanPeaks {
  // Per tier (per node): the expected peak, the peak with every step deferred, the undo state,
  // the read-ahead (TierBytes' fields of the same names).
  struct Tier {
    uint64_t peak = 0, peak_deferred = 0, undo = 0, read_ahead = 0;
  } device, host, nvme;
  // The host undo copies the optimizer under backward would take with room for all of them
  // (host.undo is what the budget leaves room for).
  uint64_t undo_wanted = 0;
  // Of undo_wanted, the bytes the optimizer copies (state in a host-addressable device's memory,
  // NVMe state without room for shadow extents); host-tier state is stepped into a shadow
  // buffer swapped in, with no copy (Speculation).
  uint64_t undo_copied = 0;
  size_t read_ahead_sub_groups = 0;  // strata.optimizer.read_ahead's sub-groups (per rank)
};
PlanPeaks plan_peaks(const PlanRequest& request, const Placement& where, const PlanMemory& mem);

// ---- time ------------------------------------------------------------------------------------

struct PlanTime {
  TimeTerms time;
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0, link_bytes = 0, flops = 0;
  PlanOption::PassBytes deferred_pass, after_backward_pass;
  double first_forward_share = 0;
  bool backward_grouped = false;
};
PlanTime plan_time(const PlanRequest& request, const Placement& where, const PlanMemory& mem,
                   const PlanPeaks& peaks);

// The compute stream's time of one micro-batch's training program (B x T tokens, `mode`'s
// activations) on the simulated device `sim`, and its kernels: the architecture's runner driven
// through the simulated kernels' tally (create_simulated_kernel_tally) over a device that holds
// nothing (plan_sim.cc). A mixture's routing runs on zeros. Fails as create_runner does.
Result<SimTally> simulated_program_time(const Architecture& arch, const SimulatedDeviceOptions& sim,
                                        int B, int T, DType dt, ActivationMode mode);

}  // namespace strata
