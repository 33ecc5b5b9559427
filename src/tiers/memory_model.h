// The memory model: how many bytes each tier needs for a model, a placement and the tier
// options, and of what. A pure function of sizes: no Device, no Communicator, no file system.
//
// TierManager::create's preflight calls tier_needs() and checks the result against each tier's
// capacity before anything is allocated; what the manager then allocates comes from the same
// ModuleHomes, so the preflight and the allocation cannot drift. The planner calls the same
// function for the placements it evaluates.
//
// Sizes are per rank: with world_size > 1 every module's flat group is padded and split by
// ShardLayout (4 KiB shards), and a rank's homes hold one shard. A shard's size is the same on
// every rank (only which elements are real differs), so nothing here depends on the rank.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "src/comm/zeropp.h"
#include "src/model/architecture.h"
#include "src/tiers/placement.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata {

// Device allocations are counted in 256-byte units, host-tier buffers and swap extents in
// 4096-byte ones: what their allocators round to.
inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// One module's state on one rank: where each object lives and its bytes (its shard's).
struct ModuleHomes {
  struct Object {
    Tier tier = Tier::kHost;
    size_t bytes = 0;  // 0: the object does not exist (grads2 without the delayed update)
  };
  std::string name;
  size_t numel = 0;         // the module's real elements (a quantized module's: its stored
                            // bytes as model-dtype elements, ModuleSpec::stored_bytes)
  size_t shard_numel = 0;   // elements per rank, padding included (numel when unsharded)
  size_t padded_numel = 0;  // world_size * shard_numel (numel when unsharded)
  Object params;            // low-precision parameters, model dtype
  Object master;            // fp32 master weights
  Object moments;           // first and second moments, moment dtype, contiguous
  Object grads;             // fp32 gradient accumulator
  Object grads2;            // the delayed update's second accumulator
  // The optimizer's sub-groups: elements [j * sub_group, min((j + 1) * sub_group,
  // shard_numel)) of the shard, j < sub_groups(). NVMe-homed master weights and moments have
  // one swap extent per sub-group (its moments: first then second, contiguous), and so do
  // NVMe-homed gradient accumulators and parameters.
  size_t sub_group = 0;
  size_t sub_groups() const { return sub_group ? (shard_numel + sub_group - 1) / sub_group : 1; }
  size_t sub_group_len(size_t j) const { return std::min(sub_group, shard_numel - j * sub_group); }
  // f(sub_group_len(j)) summed over the sub-groups, in constant time (all but the last have the
  // first one's length): a model of a billion sub-groups is sized without a billion steps.
  template <typename F>
  uint64_t sum_over_sub_groups(F f) const {
    const size_t n = sub_groups();
    if (n == 0) return 0;
    return uint64_t(n - 1) * uint64_t(f(sub_group_len(0))) + uint64_t(f(sub_group_len(n - 1)));
  }
};

// Parameters move in pieces, one per sub-group of the shard: NVMe-homed parameters have one
// swap extent per sub-group; a fetch from NVMe reads them through a ring of
// kFetchStagingPieces host buffers that every fetch shares (DeviceCache), and new parameters
// that are not written in place (NVMe homes, device memory the host cannot address) are
// staged a piece at a time, at most publish_staging_pieces() pieces at once (the optimizer
// pipeline). So the host staging for parameters is a few sub-groups whatever a module's size.
// The ring: one piece being copied to the device while the next two are read.
inline constexpr size_t kFetchStagingPieces = 3;
// NVMe-homed parameters: buffer_count pieces being written behind (as deep as the optimizer
// state's writes) and one being stepped, plus one per sub-group of the optimizer's read-ahead
// (OptimizerPipeline::piece; its room is in HostNeed::optimizer_sub_group); else (copies to the
// device) one being copied and one being stepped.
inline size_t publish_staging_pieces(int buffer_count, bool nvme_params) {
  return nvme_params ? size_t(std::max(1, buffer_count)) + 1 : 2;
}
// The optimizer pipeline's sub-groups of NVMe-homed master weights and moments in host memory
// at once while a pass runs (OptimizerPipeline::advance): buffer_count read ahead (the next to
// step among them), and every sub-group with a write still in flight. After each step at most
// 2 * buffer_count writes stay queued (max_writes): the stepped sub-group's `state_writes`
// (master weights, moments: those NVMe-homed) and, before them, earlier sub-groups' state
// writes plus, with `nvme_params`, their new parameters' write (queued after that bound is
// applied). With both master weights and moments on NVMe it is at most the reservation's
// 2 * buffer_count + 1 sub-groups.
inline size_t pipeline_sub_groups_held(int buffer_count, size_t state_writes, bool nvme_params) {
  if (state_writes == 0) return 0;
  const size_t depth = size_t(std::max(1, buffer_count));
  const size_t per = state_writes + (nvme_params ? 1 : 0);
  const size_t earlier = 2 * depth > state_writes ? 2 * depth - state_writes : 0;
  return depth + 1 + (earlier + per - 1) / per;
}
// Host bytes of one staging piece for sub-groups of `elems` elements of `elem_bytes` each (a
// host-tier buffer, whole pages).
inline size_t piece_bytes(size_t elems, size_t elem_bytes) {
  return (elems * elem_bytes + 4095) / 4096 * 4096;
}
// Bytes of a module's NVMe extents of an object of `elem_bytes` per element: one extent per
// sub-group, in whole 4 KiB blocks (O_DIRECT) — what the swap file holds and a pass moves.
inline uint64_t extent_bytes(const ModuleHomes& m, size_t elem_bytes) {
  return m.sum_over_sub_groups([&](size_t len) { return piece_bytes(len, elem_bytes); });
}

// Elements per sub-group of a shard of `shard_numel` elements under
// TierOptions::sub_group_elems (0: one sub-group), a multiple of `align` (kSubGroupAlign; with
// gradients on NVMe kStatsTileElems, so each sub-group's gradient norm is whole tiles).
size_t sub_group_elems(size_t shard_numel, uint64_t option, uint64_t align = kSubGroupAlign);

// Every module's homes under `placement`: params, master, moments and grads where the
// placement puts them, except that optimizer_ratio < 1 keeps the first (1 - ratio) of the
// optimizer bytes (in module order) on the device, with their gradient accumulators; each cut
// in sub-groups of `sub_group_elems` (TierOptions::sub_group_elems). Fails only if a module
// cannot be sharded (ShardLayout).
Result<std::vector<ModuleHomes>> module_homes(const ModelLayout& layout, const Placement& placement,
                                              int world_size, DType dt, DType moment_dt,
                                              bool delayed_update, uint64_t sub_group_elems);

// Whether a cached parameter copy of a module of `numel` elements (ModuleHomes::numel) stays on
// the device once fetched, never evicted: unsharded, under options.persistence_threshold
// elements (stage3_param_persistence_threshold). DeviceCache decides with it, and the memory
// model counts such copies as held for the whole run (TierNeeds::DeviceNeed::persistent).
inline bool persistent_copy(size_t numel, const TierOptions& options, bool sharded) {
  return !sharded && numel < options.persistence_threshold;
}

// The device working set: the most parameter-cache and gradient bytes that `program` holds
// at once (program_peak_bytes), with each module's cached parameter copy and gradient buffer
// costing param_cache_bytes[m] and grad_bytes[m] (what the device cache and the gradient
// buffers allocate).
size_t working_set_bytes(const std::vector<size_t>& param_cache_bytes,
                         const std::vector<size_t>& grad_bytes, const Program& program);

// Each tier's need, with its parts.
struct TierNeeds {
  struct DeviceNeed {
    size_t activations = 0;     // the model's activation arena (activation_bytes)
    size_t resident_state = 0;  // device-homed P, MASTER, MOM, GACC
    size_t working_set = 0;     // working_set_bytes over the training program
    // Parameter copies of the modules that stay cached once fetched (persistent_copy): held
    // from their first fetch to the end of the run, so beside the working set, never within it.
    size_t persistent = 0;
    size_t bucket = 0;           // sharded: the gradient reduce bucket
    size_t prefetch_window = 0;  // sharded: the gathered groups of the prefetch window
    // The optimizer on the device (device_optimizer.h), when some module's state is there: the
    // gradient statistics (8 bytes per module), and the new parameters of one module whose
    // parameters are not device-homed.
    size_t optimizer = 0;
    // ZeRO++ (ZeroPPShape), sharded: qwZ's gather buffer (the largest group's P packed units:
    // one gather's at a time, a later one waits for the earlier one's free), hpZ's secondary
    // chunks (every module's: each is kept from the module's first gather in a phase to the
    // phase's end), and qgZ's reduce-scatter scratch (one bucket's, allocated once).
    size_t qwz_buffer = 0;
    size_t hpz_secondary = 0;
    size_t qgz_scratch = 0;
    // A backward group (TierOptions::grouped_backward, forward_group > 1, one rank): its
    // further micro-batches' gradient parts (grad_part_bytes).
    size_t grad_parts = 0;
    size_t zeropp() const { return qwz_buffer + hpz_secondary + qgz_scratch; }
    // working_set + persistent + grad_parts + bucket + prefetch_window + optimizer + zeropp():
    // what the preflight reports as the working set.
    size_t transient() const {
      return working_set + persistent + grad_parts + bucket + prefetch_window + optimizer +
             zeropp();
    }
    size_t total() const { return activations + resident_state + transient(); }
  };
  struct HostNeed {
    size_t state = 0;              // host-homed P, MASTER, MOM, GACC
    size_t staging = 0;            // NVMe fetch staging, optimizer pipeline, gradient landing
    size_t optimizer_staging = 0;  // of staging: the optimizer pipeline's sub-groups
    size_t grad_staging = 0;       // of staging: gradients on NVMe (GradSpill's slots, optimizer)
    // Of staging: the 2 landing buffers (the largest module's gradients not homed on NVMe) that
    // a micro-batch after the first lands its gradients through before adding them (held
    // during backward only); none where no such micro-batch drains its own (TierOptions::
    // micro_batches: one, or all in one backward group).
    size_t grad_landing = 0;
    // Of staging: parameter pieces, the NVMe fetch ring (kFetchStagingPieces pieces, with
    // NVMe-homed parameters) and the new parameters' staging (publish_staging_pieces(), for
    // parameters the optimizer cannot write in place: NVMe-homed, or device-homed and stepped
    // on the host, or off the device and stepped by the device's optimizer).
    size_t param_fetch_staging = 0;
    size_t param_publish_staging = 0;
    // Of staging: state moving in and out of its homes (init, checkpoint save and load,
    // resharding, the weights' checksum) a sub-group at a time through one host piece: master
    // weights not homed in host memory (NVMe, or device memory the host may not address: a
    // GPU's; the CPU backend's needs none), moments on NVMe, and beside a sub-group of master
    // weights the piece its parameters are derived through where no other staging counts one
    // (parameters on the device, stepped there by its optimizer); a frozen module's init, a
    // sub-group of fp32 values and, for parameters not in host memory, the piece they go home
    // through. These run while the optimizer pipeline is idle and share its room: staging
    // counts the larger of optimizer_staging and this.
    size_t state_io_staging = 0;
    size_t param_shadows = 0;  // delayed update: one parameter copy per module
    size_t stash = 0;          // strata.activations = offload: the block-input buffers
    // Not in total(): undo copies of every module's master weights and moments (the optimizer
    // under backward), of which `undo_nvme` is NVMe-homed state (shadow extents when the swap
    // files have room). The arena is sized for them when the budget allows; without room,
    // speculation stops early.
    size_t undo = 0;
    size_t undo_nvme = 0;
    // One sub-group of NVMe-homed master weights and moments in the optimizer pipeline's
    // staging (the largest; with NVMe-homed parameters, plus its new parameters' staging piece,
    // which drains behind with the state's writes; with gradients on NVMe, plus its gradients',
    // which a pass reads with the state), and how many sub-groups of them there are:
    // the unit and the most of the optimizer's read-ahead beyond buffer_count
    // (read_ahead_sub_groups()).
    size_t optimizer_sub_group = 0;
    size_t optimizer_sub_groups = 0;
    size_t total() const { return state + staging + param_shadows + stash; }
  };
  struct NvmeNeed {
    size_t state = 0;             // NVMe-homed P, MASTER, MOM
    size_t objects = 0;           // NVMe-homed objects striped over paths (each may waste a stripe)
    size_t paths = 0;             // swap directories the state is spread over
    uint64_t bytes_per_path = 0;  // each swap file's data area (0 without NVMe state)
    size_t shadows = 0;           // undo_copies: shadow extents of NVMe-homed MASTER and MOM
    size_t shadow_objects = 0;    // of them striped
    uint64_t bytes_per_path_with_shadows = 0;  // each swap file's data area with them
  };
  DeviceNeed device;
  HostNeed host;
  NvmeNeed nvme;
  size_t bucket_shard_elems = 0;  // sharded: a gradient bucket's elements per rank
};

// Each tier's need for `homes` (module_homes()) under `options` (its placement, pipeline
// depth, prefetch bytes, bucket size, undo copies, stash, nvme paths; not its communicators or
// capacities), `world_size` ranks, an activation arena of `activation_bytes`, the model's
// training program (its working set), and ZeRO++'s switches on the ranks' grid (`zeropp`:
// ZeroPP::shape() of TierOptions::zeropp, or a default ZeroPPShape without ZeRO++; counted only
// with world_size > 1).
TierNeeds tier_needs(const std::vector<ModuleHomes>& homes, const TierOptions& options,
                     int world_size, DType dt, size_t activation_bytes,
                     const Program& train_program, const ZeroPPShape& zeropp);

// The same from the architecture: module_homes of its layout under options.placement, and its
// Pass::kTrain program.
Result<TierNeeds> tier_needs(const Architecture& arch, const TierOptions& options, int world_size,
                             DType dt, DType moment_dt, size_t activation_bytes,
                             const ZeroPPShape& zeropp = {});

// Which tiers a need does not fit: the device over `device_capacity` bytes, the host tier over
// options.host_capacity, state placed on NVMe without a swap path. TierManager::create's
// preflight and the planner decide "fits" with it (the preflight then also checks the swap
// paths on disk; the planner the free bytes it was told).
struct TierShortfall {
  bool device = false;
  bool host = false;
  bool nvme_paths = false;  // state on nvme but options.nvme_paths is empty
  bool any() const { return device || host || nvme_paths; }
};
TierShortfall tier_shortfall(const TierNeeds& need, const TierOptions& options,
                             size_t device_capacity);

// strata.grouped_forwards = auto: `max` activation sets (one per micro-batch of a forward group;
// `max` = the accumulation steps, TierOptions::forward_group_max) when the device holds the
// max - 1 more sets of `set_bytes` beside `one` (the need with one set) and, by the planner's
// cache model, they cost no parameter fetches: of the `param_cache_bytes` not homed on the
// device, the share min(1, free / param_cache_bytes) stays cached (none when `sharded`: every
// gathered group is dropped after its use), and the rest is fetched A / K + A times a step for
// A micro-batches in groups of K (once per group's forward, once per backward: once per group's
// where the group's backwards run together, strata.grouped_backwards, which adds `part_bytes`,
// the group's gradient parts, to the device's need; 0: backwards one at a time). Else 1.
int auto_forward_group(int max, const TierNeeds& one, size_t set_bytes, size_t part_bytes,
                       size_t device_capacity, uint64_t param_cache_bytes, bool sharded);

// strata.grouped_forwards as a run resolves it: TierManager::create and the planner both call
// this, so the group the planner predicts is the one the engine runs. Returns
// options.forward_group when it is set (> 0); for 0 (auto), auto_forward_group over
// options.forward_group_max with `need` (in: tier_needs of `homes` at one activation set of
// `activation_bytes`), each further set options.activation_slot_bytes (activation_bytes when 0),
// the gradient parts a group of forward_group_max adds (tier_needs' device.grad_parts), the
// parameters not homed on the device as the cache, against `device_capacity`. When the group K
// is above 1, `need` becomes tier_needs with its K - 1 more sets. The other arguments are
// tier_needs'.
int resolve_forward_group(const std::vector<ModuleHomes>& homes, const TierOptions& options,
                          int world_size, DType dt, size_t activation_bytes,
                          const Program& train_program, const ZeroPPShape& zeropp,
                          size_t device_capacity, bool sharded, TierNeeds* need);

// The gradient accumulators' home TierManager::create gives `options` (and the planner a
// config's placement with strata.placement.grads unset): auto_grads_placement of the host need
// with them on the host and on NVMe (each tier_needs of the architecture, ZeRO++ aside: its
// buffers are device memory) against options.host_capacity, when options.grads_auto and they
// are on the host; else options.placement.grads. `with_host` and `with_nvme` receive the two
// needs (with_nvme 0 when not weighed).
Tier default_grads_tier(const Architecture& arch, const TierOptions& options, int world_size,
                        DType dt, DType moment_dt, size_t activation_bytes,
                        size_t* with_host = nullptr, size_t* with_nvme = nullptr);

// The host tier's arena: the host need plus slack for fragmentation, plus the optimizer's
// read-ahead (read_ahead_sub_groups()); at most options.host_capacity less the undo room.
size_t host_arena_bytes(const TierNeeds& needs, const TierOptions& options, bool shadow_extents);

// The host tier's undo room: when options.undo_copies, room for the undo copies (less the
// NVMe-homed ones when the swap files hold shadow extents) and their slack, within what
// options.host_capacity leaves beside the arena. Pinned regions of their own, allocated as
// speculated steps take undo buffers (Homes::undo_buf): a run none of whose steps is
// speculated (clipping on every step) never holds any, and one whose optimizer steps only part
// of the modules under backward holds only theirs.
size_t host_undo_bytes(const TierNeeds& needs, const TierOptions& options, bool shadow_extents);
// Sub-groups of NVMe-homed optimizer state read ahead during backward beyond buffer_count
// (strata.optimizer.read_ahead): options.read_ahead_bytes (auto: all) of what the
// budget leaves after the arena's other parts, in whole sub-groups, at most all but
// buffer_count of them.
size_t read_ahead_sub_groups(const TierNeeds& needs, const TierOptions& options,
                             bool shadow_extents);

}  // namespace strata
