#include "src/tiers/memory_model.h"

#include <algorithm>

#include "src/tiers/grad_spill.h"
#include "strata/comm.h"
#include "strata/cpu_optim.h"
#include "strata/swap_space.h"

namespace strata {

size_t sub_group_elems(size_t shard_numel, uint64_t option, uint64_t align) {
  if (option == 0 || option >= shard_numel) return shard_numel;
  const size_t g = size_t(std::max(align, option / align * align));
  return std::min(g, shard_numel);
}

Result<std::vector<ModuleHomes>> module_homes(const ModelLayout& layout, const Placement& placement,
                                              int world_size, DType dt, DType moment_dt,
                                              bool delayed_update, uint64_t sub_group_elems) {
  const size_t es = dtype_size(dt), mb = dtype_size(moment_dt);
  const size_t world = size_t(std::max(1, world_size));
  // The optimizer ratio keeps the first (1 - ratio) of the optimizer bytes on the device.
  size_t total_opt = 0;
  for (const auto& m : layout.modules)
    total_opt += m.trainable ? m.numel * (4 + 2 * mb) / world : 0;
  const double keep_on_device = (1.0 - placement.optimizer_ratio) * double(total_opt);
  double acc_opt = 0;
  std::vector<ModuleHomes> homes(layout.modules.size());
  for (size_t i = 0; i < homes.size(); ++i) {
    ModuleHomes& m = homes[i];
    m.name = layout.modules[i].name;
    // A quantized frozen module (ModuleSpec::stored_bytes) is held as model-dtype elements
    // enough for its bytes: every tier, shard and sub-group moves those.
    const size_t stored = layout.modules[i].stored_bytes;
    m.numel = stored ? (stored + es - 1) / es : layout.modules[i].numel;
    m.shard_numel = m.padded_numel = m.numel;
    if (world > 1) {
      STRATA_ASSIGN_OR_RETURN(ShardLayout sl, ShardLayout::make(m.numel, int(world), 4096, dt),
                              "sharding " + m.name);
      m.shard_numel = sl.shard_numel;
      m.padded_numel = sl.padded_numel;
    }
    const size_t sn = m.shard_numel;
    // A frozen module (ModuleSpec::trainable false) has parameters only: its other objects
    // exist with 0 bytes, where the placement would put them.
    const size_t t = layout.modules[i].trainable ? sn : 0;
    const bool opt_on_device = t > 0 && acc_opt < keep_on_device;
    acc_opt += double(t * (4 + 2 * mb));
    m.params = {placement.params, sn * es};
    m.master = {opt_on_device ? Tier::kDevice : placement.master, t * 4};
    m.moments = {opt_on_device ? Tier::kDevice : placement.moments, t * 2 * mb};
    m.grads = {opt_on_device ? Tier::kDevice : placement.grads, t * 4};
    if (delayed_update) m.grads2 = m.grads;
    m.sub_group = strata::sub_group_elems(
        sn, sub_group_elems, m.grads.tier == Tier::kNvme ? kStatsTileElems : kSubGroupAlign);
  }
  return homes;
}

size_t working_set_bytes(const std::vector<size_t>& param_cache_bytes,
                         const std::vector<size_t>& grad_bytes, const Program& program) {
  return program_peak_bytes(
      program, [&](int m) { return param_cache_bytes[size_t(m)]; },
      [&](int m) { return grad_bytes[size_t(m)]; });
}

namespace {

// An extent larger than a stripe is dealt over the paths in whole stripes (SwapSpace), so it
// may waste up to one (1); a smaller one, or any on one path, lives whole in one file (0).
size_t striped(const TierOptions& options, size_t bytes) {
  const uint64_t stripe_bytes = SwapOptions{}.stripe_size;
  return options.nvme_paths.size() > 1 && round_up(bytes, 4096) > stripe_bytes ? 1 : 0;
}

// The largest per-module pieces the host's staging is sized by.
struct StagingMaxima {
  size_t max_opt = 0, max_g = 0, max_gsub = 0;
  size_t max_nvme_piece = 0, max_staged_piece = 0;  // parameter pieces (piece_bytes)
};

// Per module: the state each tier holds, the undo copies, the NVMe extents; returns the
// largest pieces.
StagingMaxima add_state_needs(const std::vector<ModuleHomes>& homes, const TierOptions& options,
                              size_t es, TierNeeds* needs) {
  TierNeeds& n = *needs;
  size_t max_opt = 0, max_g = 0, max_gsub = 0;
  size_t max_nvme_piece = 0, max_staged_piece = 0;  // parameter pieces (piece_bytes)
  for (const auto& m : homes) {
    if (options.delayed_update) n.host.param_shadows += round_up(m.params.bytes, 4096);
    n.host.undo += round_up(m.master.bytes, 4096) + round_up(m.moments.bytes, 4096);
    for (const auto* h : {&m.master, &m.moments}) {
      if (h->tier == Tier::kNvme) n.host.undo_nvme += round_up(h->bytes, 4096);
    }
    for (const auto* h : {&m.params, &m.master, &m.moments, &m.grads, &m.grads2}) {
      if (h->bytes == 0) continue;
      if (h->tier == Tier::kDevice) n.device.resident_state += round_up(h->bytes, 256);
      if (h->tier == Tier::kHost) n.host.state += round_up(h->bytes, 4096);
    }
    // NVMe-homed parameters, master weights, moments and gradients: one extent per sub-group;
    // the pipeline stages the largest sub-group's.
    const size_t mst_e = m.shard_numel ? m.master.bytes / m.shard_numel : 0;
    const size_t mom_e = m.shard_numel ? m.moments.bytes / m.shard_numel : 0;
    for (auto [h, e] :
         {std::pair{&m.params, es}, std::pair{&m.master, mst_e}, std::pair{&m.moments, mom_e},
          std::pair{&m.grads, size_t{4}}, std::pair{&m.grads2, size_t{4}}}) {
      if (h->tier != Tier::kNvme || h->bytes == 0) continue;
      n.nvme.state += extent_bytes(m, e);
      n.nvme.objects +=
          m.sum_over_sub_groups([&, e = e](size_t len) { return striped(options, len * e); });
    }
    if (m.grads.tier == Tier::kNvme && m.grads.bytes > 0)
      max_gsub = std::max(max_gsub, round_up(m.sub_group_len(0) * 4, 4096));
    const size_t p_piece = piece_bytes(m.sub_group_len(0), es);  // the first is the largest
    if (m.params.tier == Tier::kNvme) max_nvme_piece = std::max(max_nvme_piece, p_piece);
    // New parameters staged: the device's optimizer writes device-homed ones in place, the
    // host's host-homed ones (and device-homed ones on a host-addressable device).
    const bool dev_opt_m = m.master.tier == Tier::kDevice && m.moments.tier == Tier::kDevice &&
                           m.grads.tier == Tier::kDevice && m.master.bytes > 0;
    if (m.master.bytes > 0 &&
        (dev_opt_m ? m.params.tier != Tier::kDevice : m.params.tier != Tier::kHost)) {
      max_staged_piece = std::max(max_staged_piece, p_piece);
    }
    if (m.grads.tier != Tier::kNvme) max_g = std::max(max_g, m.grads.bytes);
    if (m.master.tier == Tier::kNvme || m.moments.tier == Tier::kNvme) {
      const size_t len = m.sub_group_len(0);  // the first sub-group is the largest
      max_opt = std::max(max_opt, round_up(len * mst_e, 4096) + round_up(len * mom_e, 4096));
      if (m.master.bytes > 0) n.host.optimizer_sub_groups += m.sub_groups();
    }
    if (m.master.tier != Tier::kHost && m.master.bytes > 0) {
      // Its parameters are derived from each staged sub-group of master weights through a
      // piece of their own, held beside it, which the publish staging does not count where the
      // device's optimizer steps device-homed parameters in place.
      const bool derived_beside = dev_opt_m && m.params.tier == Tier::kDevice;
      n.host.state_io_staging =
          std::max(n.host.state_io_staging,
                   piece_bytes(m.sub_group_len(0), mst_e) + (derived_beside ? p_piece : 0));
    }
    if (m.moments.tier == Tier::kNvme && m.moments.bytes > 0) {
      n.host.state_io_staging =
          std::max(n.host.state_io_staging, piece_bytes(m.sub_group_len(0), mom_e));
    }
    if (m.master.bytes == 0 && m.params.bytes > 0) {
      // A frozen module is initialized from fp32 values a sub-group at a time through a piece
      // of its own (init_frozen), wherever its parameters live, and those not in host memory
      // go to their home through one parameter piece beside it (written before the next).
      n.host.state_io_staging =
          std::max(n.host.state_io_staging, piece_bytes(m.sub_group_len(0), 4) +
                                                (m.params.tier != Tier::kHost ? p_piece : 0));
    }
  }
  return {max_opt, max_g, max_gsub, max_nvme_piece, max_staged_piece};
}

// Device: the working set, the optimizer's, the activations and, sharded, the bucket and the
// prefetch window.
void add_device_needs(const std::vector<ModuleHomes>& homes, const TierOptions& options,
                      int world_size, DType dt, size_t activation_bytes,
                      const Program& train_program, const ZeroPPShape& zeropp, TierNeeds* needs) {
  const Placement& pl = options.placement;
  const size_t es = dtype_size(dt);
  const bool sharded = world_size > 1;
  TierNeeds& n = *needs;
  // The most parameter-cache copies (none for device-homed parameters unsharded: they are
  // used in place) and gradient buffers, whole padded groups. A module under
  // stage3_param_persistence_threshold elements stays cached once fetched (DeviceCache, unsharded:
  // never evicted), so from the second step on it is held all through the program: its copy is
  // counted beside the program's peak, not within it (none is cached for device-homed ones).
  std::vector<size_t> pc(homes.size()), g(homes.size());
  for (size_t i = 0; i < homes.size(); ++i) {
    pc[i] = pl.params == Tier::kDevice && !sharded ? 0 : round_up(homes[i].padded_numel * es, 256);
    g[i] = round_up(homes[i].padded_numel * 4, 256);
    if (pc[i] > 0 && persistent_copy(homes[i].numel, options, sharded)) {
      n.device.persistent += pc[i];
      pc[i] = 0;
    }
  }
  // The optimizer on the device: gradient statistics, and new parameters not homed there.
  size_t max_dev_opt_p = 0;
  bool dev_opt = false;
  for (const auto& m : homes) {
    if (m.master.tier != Tier::kDevice || m.moments.tier != Tier::kDevice ||
        m.grads.tier != Tier::kDevice || m.master.bytes == 0) {
      continue;
    }
    dev_opt = true;
    if (m.params.tier != Tier::kDevice) max_dev_opt_p = std::max(max_dev_opt_p, m.params.bytes);
  }
  if (dev_opt) n.device.optimizer = round_up(homes.size() * 8, 256) + round_up(max_dev_opt_p, 256);
  n.device.activations = activation_bytes;
  n.device.working_set = working_set_bytes(pc, g, train_program);
  if (options.forward_group > 1 && options.grouped_backward && !sharded) {
    n.device.grad_parts = grad_part_bytes(
        train_program, [&](int m) { return g[size_t(m)]; }, options.forward_group);
  }
  // Sharded: the gradient bucket (reduce_bucket_size over the padded groups, capped at the
  // largest group), and the prefetch window's gathered groups (nothing is evicted for room).
  if (sharded) {
    size_t max_sn = 0, all_gathered = 0;
    for (const auto& m : homes) {
      max_sn = std::max(max_sn, m.shard_numel);
      all_gathered += round_up(m.padded_numel * es, 256);
    }
    n.bucket_shard_elems =
        std::clamp<size_t>(options.reduce_bucket_elems / size_t(world_size), 1, max_sn);
    n.device.bucket = round_up(n.bucket_shard_elems * size_t(world_size) * 4, 256);
    n.device.prefetch_window = std::min<size_t>(options.prefetch_bytes, all_gathered);
    // ZeRO++: the sizes DeviceCache::gather_zeropp and GradBuckets allocate (ZeroPPShape).
    for (const auto& m : homes) {
      n.device.qwz_buffer =
          std::max(n.device.qwz_buffer, round_up(zeropp.qwz_buffer_bytes(m.shard_numel, dt), 256));
      n.device.hpz_secondary += round_up(zeropp.secondary_bytes(m.shard_numel, dt), 256);
    }
    n.device.qgz_scratch = round_up(zeropp.qgz_scratch_bytes(n.bucket_shard_elems, true), 256);
  }
}

// Whether a micro-batch after a step's first drains its own gradients into the accumulator
// (GradBuckets::accumulate through a landing buffer): not where the step has one micro-batch, or
// where all of them run their backwards as one group (Run::forward_backward: the first group
// only; its parts are added on the device and drained once).
bool later_micro_batches_drain(const TierOptions& options, bool sharded) {
  if (options.micro_batches == 1) return false;
  const bool one_group =
      options.micro_batches > 0 && options.forward_group >= options.micro_batches;
  return !(one_group && options.forward_group > 1 && options.grouped_backward && !sharded);
}

// Host: parameter pieces (the NVMe fetch ring, the new parameters' staging); the optimizer
// pipeline holds `buffer_count` sub-groups being read and as many being written, one being
// stepped (or, while it is idle, state moving in or out holds one piece); gradient landing
// buffers.
void add_host_staging(const TierOptions& options, const StagingMaxima& mx, bool sharded,
                      TierNeeds* needs) {
  const auto [max_opt, max_g, max_gsub, max_nvme_piece, max_staged_piece] = mx;
  TierNeeds& n = *needs;
  n.host.param_fetch_staging = kFetchStagingPieces * max_nvme_piece;
  n.host.param_publish_staging =
      publish_staging_pieces(options.buffer_count, max_nvme_piece > 0) * max_staged_piece;
  n.host.staging += n.host.param_fetch_staging + n.host.param_publish_staging;
  n.host.optimizer_staging = pipeline_staging_sub_groups(options.buffer_count) * max_opt;
  // A read-ahead sub-group, once stepped, drains behind with its new parameters' piece when
  // they are NVMe-homed (OptimizerPipeline::piece), and holds its gradients' while read ahead
  // in a pass when they are on NVMe: the unit holds all three.
  n.host.optimizer_sub_group = max_opt > 0 ? max_opt + max_nvme_piece + max_gsub : 0;
  n.host.staging += std::max(n.host.optimizer_staging, n.host.state_io_staging);
  // Gradients on NVMe: GradSpill's staging buffers (one per slot) and its landing buffer, and
  // the sub-group the optimizer steps (a module with host gradients still lands through 2
  // buffers of its size: max_g).
  n.host.grad_staging = (size_t(GradSpill::kSlots) + 2) * max_gsub;
  n.host.staging += n.host.grad_staging;
  if (later_micro_batches_drain(options, sharded)) n.host.grad_landing = 2 * round_up(max_g, 4096);
  n.host.staging += n.host.grad_landing;
  n.host.stash = size_t(std::max(0, options.stash_layers)) * round_up(options.stash_bytes, 4096);
}

// NVMe: the state spread over the paths, each object possibly wasting a stripe, plus slack;
// with undo copies, the shadow extents the optimizer under backward writes its steps to.
void add_nvme_layout(const std::vector<ModuleHomes>& homes, const TierOptions& options,
                     TierNeeds* needs) {
  TierNeeds& n = *needs;
  n.nvme.paths = options.nvme_paths.size();
  const uint64_t stripe = SwapOptions{}.stripe_size;
  if (n.nvme.state > 0 && n.nvme.paths > 0) {
    n.nvme.bytes_per_path =
        round_up(n.nvme.state / n.nvme.paths + n.nvme.objects * stripe + (size_t{16} << 20), 4096);
  }
  for (const auto& m : homes) {
    const size_t mst_e = m.shard_numel ? m.master.bytes / m.shard_numel : 0;
    const size_t mom_e = m.shard_numel ? m.moments.bytes / m.shard_numel : 0;
    for (auto [h, e] : {std::pair{&m.master, mst_e}, std::pair{&m.moments, mom_e}}) {
      if (!options.undo_copies || h->tier != Tier::kNvme || h->bytes == 0) continue;
      n.nvme.shadows +=
          m.sum_over_sub_groups([e = e](size_t len) { return round_up(len * e, 4096); });
      n.nvme.shadow_objects +=
          m.sum_over_sub_groups([&, e = e](size_t len) { return striped(options, len * e); });
    }
  }
  if (n.nvme.shadows > 0 && n.nvme.paths > 0) {
    n.nvme.bytes_per_path_with_shadows = round_up(
        n.nvme.bytes_per_path + n.nvme.shadows / n.nvme.paths + n.nvme.shadow_objects * stripe,
        4096);
  }
}

}  // namespace

TierNeeds tier_needs(const std::vector<ModuleHomes>& homes, const TierOptions& options,
                     int world_size, DType dt, size_t activation_bytes,
                     const Program& train_program, const ZeroPPShape& zeropp) {
  TierNeeds n;
  const StagingMaxima mx = add_state_needs(homes, options, dtype_size(dt), &n);
  add_device_needs(homes, options, world_size, dt, activation_bytes, train_program, zeropp, &n);
  add_host_staging(options, mx, world_size > 1, &n);
  add_nvme_layout(homes, options, &n);
  return n;
}

Result<TierNeeds> tier_needs(const Architecture& arch, const TierOptions& options, int world_size,
                             DType dt, DType moment_dt, size_t activation_bytes,
                             const ZeroPPShape& zeropp) {
  STRATA_ASSIGN_OR_RETURN(auto homes,
                          module_homes(arch.layout(), options.placement, world_size, dt, moment_dt,
                                       options.delayed_update, options.sub_group_elems),
                          "memory model");
  return tier_needs(homes, options, world_size, dt, activation_bytes, arch.program(Pass::kTrain),
                    zeropp);
}

TierShortfall tier_shortfall(const TierNeeds& need, const TierOptions& options,
                             size_t device_capacity) {
  TierShortfall s;
  s.device = need.device.total() > device_capacity;
  s.host = need.host.total() > options.host_capacity;
  s.nvme_paths = need.nvme.state > 0 && options.nvme_paths.empty();
  return s;
}

int auto_forward_group(int max, const TierNeeds& one, size_t set_bytes, size_t part_bytes,
                       size_t device_capacity, uint64_t param_cache_bytes, bool sharded) {
  if (max <= 1) return 1;
  const uint64_t busy1 = one.device.total();
  const uint64_t busyK = busy1 + uint64_t(max - 1) * set_bytes + part_bytes;
  if (busyK > device_capacity) return 1;
  if (param_cache_bytes == 0) return max;  // every parameter is homed on the device
  const auto cached = [&](uint64_t busy) {
    if (sharded) return 0.0;
    const double free_dev = device_capacity > busy ? double(device_capacity - busy) : 0.0;
    return std::min(1.0, free_dev / double(param_cache_bytes));
  };
  const double A = max;
  const double fetch1 = 2.0 * A * (1.0 - cached(busy1));
  const double fetchK = (part_bytes > 0 ? 2.0 : 1.0 + A) * (1.0 - cached(busyK));
  return fetchK <= fetch1 ? max : 1;
}

int resolve_forward_group(const std::vector<ModuleHomes>& homes, const TierOptions& options,
                          int world_size, DType dt, size_t activation_bytes,
                          const Program& train_program, const ZeroPPShape& zeropp,
                          size_t device_capacity, bool sharded, TierNeeds* need) {
  const size_t slot_bytes =
      options.activation_slot_bytes ? options.activation_slot_bytes : activation_bytes;
  int group = options.forward_group;
  if (group == 0) {
    uint64_t param_cache = 0;  // parameters the device caches (not homed there)
    for (const ModuleHomes& m : homes) {
      if (m.params.tier != Tier::kDevice) param_cache += m.params.bytes;
    }
    // The gradient parts a group of forward_group_max would add (grouped backwards).
    TierOptions most = options;
    most.forward_group = options.forward_group_max;
    const size_t parts =
        tier_needs(homes, most, world_size, dt, activation_bytes, train_program, zeropp)
            .device.grad_parts;
    group = auto_forward_group(options.forward_group_max, *need, slot_bytes, parts, device_capacity,
                               param_cache, sharded);
  }
  if (group > 1) {
    TierOptions grouped = options;
    grouped.forward_group = group;
    *need = tier_needs(homes, grouped, world_size, dt,
                       activation_bytes + slot_bytes * size_t(group - 1), train_program, zeropp);
  }
  return group;
}

Tier default_grads_tier(const Architecture& arch, const TierOptions& options, int world_size,
                        DType dt, DType moment_dt, size_t activation_bytes, size_t* with_host,
                        size_t* with_nvme) {
  if (with_host) *with_host = 0;
  if (with_nvme) *with_nvme = 0;
  if (!options.grads_auto || options.placement.grads != Tier::kHost) {
    return options.placement.grads;
  }
  // The host tier's need with the gradients on `grads` (0 when that placement is invalid).
  auto host_need = [&](Tier grads) -> size_t {
    TierOptions o = options;
    o.placement.grads = grads;
    auto n = tier_needs(arch, o, world_size, dt, moment_dt, activation_bytes);
    return n.is_ok() ? n->host.total() : 0;
  };
  const size_t host = host_need(Tier::kHost);
  const size_t nvme = host > options.host_capacity ? host_need(Tier::kNvme) : 0;
  if (with_host) *with_host = host;
  if (with_nvme) *with_nvme = nvme;
  if (nvme == 0) return options.placement.grads;
  return auto_grads_placement(options.placement, host, nvme, options.host_capacity, world_size > 1,
                              options.delayed_update);
}

namespace {
// The arena without the read-ahead: what the host tier needs, and room for the buffers that
// come and go to fall apart in. The homes (state) and the activation stash are taken once, in
// order, at create: they do not fragment. First fit over at most two live pieces of a kind
// (parameter staging, gradient landing) may need 1.5x their room, so half the staging, at most
// an eighth of the whole.
size_t host_arena_base(const TierNeeds& needs, const TierOptions& options) {
  const size_t want = needs.host.total();
  const size_t comes_and_goes = needs.host.staging + needs.host.param_shadows;
  return std::min(options.host_capacity,
                  want + std::min(want / 8, comes_and_goes / 2) + (size_t{64} << 20));
}
}  // namespace

size_t host_undo_bytes(const TierNeeds& needs, const TierOptions& options, bool shadow_extents) {
  if (!options.undo_copies) return 0;
  const size_t undo = needs.host.undo - (shadow_extents ? needs.host.undo_nvme : 0);
  const size_t base = host_arena_base(needs, options);
  const size_t left = options.host_capacity > base ? options.host_capacity - base : 0;
  return std::min(left, undo + undo / 8) / 4096 * 4096;
}

size_t read_ahead_sub_groups(const TierNeeds& needs, const TierOptions& options,
                             bool shadow_extents) {
  const size_t unit = needs.host.optimizer_sub_group;
  const size_t depth = size_t(std::max(1, options.buffer_count));
  if (unit == 0 || needs.host.optimizer_sub_groups <= depth) return 0;
  const size_t base =
      host_arena_base(needs, options) + host_undo_bytes(needs, options, shadow_extents);
  const size_t left = options.host_capacity > base ? options.host_capacity - base : 0;
  // auto: all of it (a pass keeps what the room holds for the next step, so the
  // room saves the disk those bytes each step; it had been at most half the budget).
  const size_t want = options.read_ahead_bytes == SIZE_MAX ? left : options.read_ahead_bytes;
  return std::min(std::min(want, left) / unit, needs.host.optimizer_sub_groups - depth);
}

size_t host_arena_bytes(const TierNeeds& needs, const TierOptions& options, bool shadow_extents) {
  return host_arena_base(needs, options) +
         read_ahead_sub_groups(needs, options, shadow_extents) * needs.host.optimizer_sub_group;
}

}  // namespace strata
