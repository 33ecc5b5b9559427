#include "src/plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/tiers/memory_model.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;

std::string gb(double bytes) { return format_bytes(bytes); }

}  // namespace

ActivationSizes activations_of(const ModelConfig& shape, int B, int T, DType dt,
                               ActivationMode mode) {
  auto arch = create_architecture(shape);
  return arch.is_ok() ? (*arch)->activation_plan(B, T, dt, mode) : ActivationSizes{};
}

// ---- placements -------------------------------------------------------------------------------

std::vector<PlacementOption> placement_options() {
  using T = Tier;
  // Gradients follow the optimizer onto the device, else stay on the host (parse_placement).
  auto p = [](const char* name, T params, T opt) {
    return PlacementOption{name, {params, opt, opt, opt == T::kDevice ? T::kDevice : T::kHost}};
  };
  return {p("all-device", T::kDevice, T::kDevice), p("opt-host", T::kDevice, T::kHost),
          p("opt-nvme", T::kDevice, T::kNvme), p("params-host", T::kHost, T::kHost),
          p("params-host+opt-nvme", T::kHost, T::kNvme),
          p("params-nvme+opt-host", T::kNvme, T::kHost),
          p("params-nvme+opt-nvme", T::kNvme, T::kNvme),
          // strata.placement.grads = nvme: no gradient accumulator in host memory (GradSpill).
          PlacementOption{"all-nvme", {T::kNvme, T::kNvme, T::kNvme, T::kNvme}}};
}

Config plan_default_config() {
  Config c;
  c.gradient_clipping = 1.0;
  return c;
}

TierOptions tier_options_of(const PlanRequest& r, const Placement& placement,
                            const ActivationSizes& acts) {
  Config c = r.engine;
  c.strata.host_memory_limit = size_t(r.hw.host_mem / uint64_t(std::max(1, r.hw.gpus)));
  TierOptions to = TierOptions::from_config(c, r.dtype);
  to.placement = placement;
  to.nvme_paths = r.hw.nvme_paths;
  to.stash_layers = acts.stash_layers;
  to.stash_bytes = acts.stash_bytes;
  to.activation_slot_bytes = acts.slot_bytes;
  // strata.grouped_forwards for the request's accumulation and activations.
  c.gradient_accumulation_steps = std::max(1, r.accumulation);
  to.forward_group_max =
      r.activations != ActivationMode::kOffload ? strata::forward_group_max(c) : 1;
  if (to.forward_group > r.accumulation || r.activations == ActivationMode::kOffload) {
    to.forward_group = r.activations == ActivationMode::kOffload ? 1 : r.accumulation;
  }
  return to;
}

Result<PlanOption> evaluate_placement(const PlanRequest& r, const PlacementOption& pl) {
  const ModelConfig& m = r.model.shape;
  if (m.n_layer < 1 || m.n_embd < 1 || m.n_head < 1 || m.n_embd % m.n_head != 0 ||
      m.vocab_size < 2 || m.context < 1) {
    return invalid_argument(fmt::format(
        "model {}: layers {}, width {}, heads {}, vocab {}, context {}: all must be >= 1 and "
        "width divisible by heads",
        r.model.name, m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.context));
  }
  if (r.micro_batch < 1 || r.seq < 1 || r.accumulation < 1 || r.hw.gpus < 1) {
    return invalid_argument("--batch, --seq, accumulation and --gpus must be >= 1");
  }
  if (r.seq > m.context) {
    return invalid_argument(
        fmt::format("--seq {} exceeds the model's context {}", r.seq, m.context));
  }
  PlanOption o;
  o.placement = pl;
  const Placement& where = pl.where;
  const uint64_t W = uint64_t(r.hw.gpus);
  const uint64_t es = dtype_size(r.dtype);
  STRATA_ASSIGN_OR_RETURN(const auto arch, create_architecture(m), "model " + r.model.name);
  const ActivationSizes acts = arch->activation_plan(r.micro_batch, r.seq, r.dtype, r.activations);

  // ---- memory: the memory model, per rank (what TierManager::create's preflight checks) ----
  TierOptions to = tier_options_of(r, where, acts);
  STRATA_ASSIGN_OR_RETURN(const std::vector<ModuleHomes> homes,
                          module_homes(arch->layout(), where, r.hw.gpus, r.dtype, r.moment_dtype,
                                       to.delayed_update, to.sub_group_elems),
                          "model " + r.model.name);
  // ZeRO++'s buffers (qwZ's gather buffer, hpZ's secondary chunks, qgZ's scratch) on the
  // planner's grid: its ranks are one node's.
  ZeroPPShape zeropp;
  zeropp.quantized_weights = r.zeropp.quantized_weights;
  zeropp.hpz = std::max(1, r.zeropp.hpz_partition_size);
  zeropp.quantized_gradients = r.zeropp.quantized_gradients;
  zeropp.world = zeropp.per_node = r.hw.gpus;
  TierNeeds needs =
      tier_needs(homes, to, r.hw.gpus, r.dtype, acts.bytes, arch->program(Pass::kTrain), zeropp);
  // strata.grouped_forwards: TierManager::create's choice, and the device's sets.
  const uint64_t dev_cap = r.hw.gpu_mem > 0 ? uint64_t(r.hw.gpu_mem) : UINT64_MAX;
  if (to.forward_group == 0) {
    uint64_t param_cache = 0;
    for (const ModuleHomes& h : homes) {
      if (h.params.tier != Tier::kDevice) param_cache += h.params.bytes;
    }
    TierOptions most = to;
    most.forward_group = to.forward_group_max;
    const size_t parts =
        tier_needs(homes, most, r.hw.gpus, r.dtype, acts.bytes, arch->program(Pass::kTrain), zeropp)
            .device.grad_parts;
    to.forward_group = auto_forward_group(to.forward_group_max, needs, acts.slot_bytes, parts,
                                          dev_cap, param_cache, W > 1);
  }
  const int K = std::max(1, to.forward_group);
  o.forward_group = K;
  if (K > 1) {
    needs = tier_needs(homes, to, r.hw.gpus, r.dtype, acts.bytes + acts.slot_bytes * size_t(K - 1),
                       arch->program(Pass::kTrain), zeropp);
  }
  o.device.state = needs.device.resident_state;
  o.device.buffers = needs.device.transient();
  o.device.activations = needs.device.activations;
  o.device.capacity = r.hw.gpu_mem;
  // The host tier of one node holds every local rank's state and staging.
  o.host.state = needs.host.state * W;
  o.host.buffers = (needs.host.staging + needs.host.param_shadows) * W;
  o.host.activations = needs.host.stash * W;
  o.host.capacity = r.hw.host_mem;
  o.nvme.state = needs.nvme.state * W;
  if (needs.nvme.bytes_per_path > 0) {
    o.nvme.buffers = (needs.nvme.bytes_per_path * needs.nvme.paths - needs.nvme.state) * W;
  }
  o.nvme.capacity = r.hw.nvme_bytes;

  // Sizes per module on this rank, for the peaks and the time model (module_homes' shards).
  uint64_t max_p = 0, max_g = 0;
  uint64_t P_trained = 0;  // elements with gradients and an optimizer step (not a frozen base)
  uint64_t opt_host_params = 0;   // elements whose optimizer step runs on the CPU
  uint64_t opt_dev_params = 0;    // elements stepped by the device's optimizer
  uint64_t grads_off_device = 0;  // elements whose gradients land in the host tier
  uint64_t grads_nvme = 0;        // ... of them accumulated on NVMe
  uint64_t grads_nvme_bytes = 0;  // their fp32 accumulators' NVMe extents, bytes
  // NVMe-homed parameters: their bytes, and their extents' (one per sub-group, whole 4 KiB
  // blocks; a quantized base's as stored), all and the trained ones'.
  uint64_t params_nvme_raw = 0, params_nvme_extents = 0, trained_params_nvme_extents = 0;
  uint64_t opt_nvme_bytes = 0;  // NVMe-homed master + moments, bytes (what the optimizer moves)
  size_t opt_nvme_writes = 0;   // NVMe writes of master + moments per sub-group (0, 1 or 2)
  std::vector<uint64_t> opt_nvme_of(homes.size(), 0);        // the same per module
  std::vector<uint64_t> opt_nvme_sub_full(homes.size(), 0);  // ... of one of its whole sub-groups
  // Per sub-group, in 4 KiB host buffers: (bytes, how many sub-groups have them), two entries
  // per module (its full sub-groups and its last).
  std::vector<std::pair<uint64_t, uint64_t>> opt_nvme_extents;
  for (size_t i = 0; i < homes.size(); ++i) {
    const ModuleHomes& h = homes[i];
    max_p = std::max<uint64_t>(max_p, h.params.bytes);
    max_g = std::max<uint64_t>(max_g, h.grads.bytes);
    // A frozen module (LoRA's base) has no gradients and no optimizer step.
    const size_t trained = h.master.bytes > 0 ? h.shard_numel : 0;
    P_trained += trained;
    if (h.master.tier != Tier::kDevice || h.moments.tier != Tier::kDevice) {
      opt_host_params += trained;
    } else {
      opt_dev_params += trained;
    }
    if (h.grads.tier != Tier::kDevice) grads_off_device += trained;
    if (h.grads.tier == Tier::kNvme && trained > 0) {
      grads_nvme += trained;
      // GradSpill's extents: one per sub-group, in whole 4 KiB blocks (O_DIRECT).
      grads_nvme_bytes += extent_bytes(h, 4);
    }
    if (h.params.tier == Tier::kNvme) {
      const uint64_t stored = arch->layout().modules[i].stored_bytes;
      const uint64_t raw = stored ? stored : h.params.bytes;
      const uint64_t extents = stored ? stored : extent_bytes(h, es);
      params_nvme_raw += raw;
      params_nvme_extents += extents;
      if (trained > 0) trained_params_nvme_extents += extents;
    }
    size_t writes = 0;  // the pipeline's NVMe writes of this module's state per sub-group
    for (const auto* x : {&h.master, &h.moments}) {
      if (x->tier == Tier::kNvme) opt_nvme_of[i] += x->bytes;
      if (x->tier == Tier::kNvme && x->bytes > 0) ++writes;
    }
    opt_nvme_writes = std::max(opt_nvme_writes, writes);
    auto sub_bytes = [&](size_t len) {
      uint64_t sub = 0;
      for (const auto* x : {&h.master, &h.moments}) {
        if (x->tier == Tier::kNvme) sub += round_up(len * (x->bytes / h.shard_numel), 4096);
      }
      return sub;
    };
    if (const size_t n = h.sub_groups(); opt_nvme_of[i] > 0 && n > 0 && h.sub_group > 0) {
      opt_nvme_extents.push_back({sub_bytes(h.sub_group_len(0)), n - 1});
      opt_nvme_extents.push_back({sub_bytes(h.sub_group_len(n - 1)), 1});
      // What the optimizer moves: each sub-group's extents in whole 4 KiB blocks (O_DIRECT).
      opt_nvme_sub_full[i] = sub_bytes(h.sub_group_len(0));
      opt_nvme_of[i] = (n - 1) * opt_nvme_sub_full[i] + sub_bytes(h.sub_group_len(n - 1));
    }
    opt_nvme_bytes += opt_nvme_of[i];
  }
  // The bytes of the k largest sub-groups' NVMe master + moments.
  std::sort(opt_nvme_extents.rbegin(), opt_nvme_extents.rend());
  auto largest_extents = [&](uint64_t k) {
    uint64_t sum = 0;
    for (const auto& [bytes, count] : opt_nvme_extents) {
      const uint64_t take = std::min(k, count);
      sum += take * bytes;
      k -= take;
    }
    return sum;
  };

  // Fits? The preflight's decision (tier_shortfall) for one rank; a capacity of 0 is unknown.
  TierShortfall short_of =
      tier_shortfall(needs, to, r.hw.gpu_mem > 0 ? size_t(r.hw.gpu_mem) : SIZE_MAX);
  if (r.hw.host_mem == 0) short_of.host = false;
  if (short_of.device) {
    o.why.push_back(fmt::format("device needs {} (activations {}, state {}, working set {}) > {}",
                                gb(double(o.device.total())), gb(double(o.device.activations)),
                                gb(double(o.device.state)), gb(double(o.device.buffers)),
                                gb(double(o.device.capacity))));
  }
  if (short_of.host) {
    o.why.push_back(fmt::format(
        "host needs {} (state {}, staging {}{}) > {}", gb(double(o.host.total())),
        gb(double(o.host.state)), gb(double(o.host.buffers)),
        o.host.activations ? ", offloaded activations " + gb(double(o.host.activations)) : "",
        gb(double(o.host.capacity))));
  }
  if (short_of.nvme_paths) {
    o.why.push_back("nvme: state placed on nvme but no --nvme path given");
  } else if (o.nvme.capacity > 0 && o.nvme.total() > o.nvme.capacity) {
    o.why.push_back(fmt::format("nvme needs {} > {} free", gb(double(o.nvme.total())),
                                gb(double(o.nvme.capacity))));
  }
  o.fits = o.why.empty();

  // Expected peaks (what the run reports), beside the reservations above.
  // Device: every module's per-micro-batch gradient buffer (fp32, full module) is alive at the
  // end of backward while the drains run; offloaded params are cached in what is left.
  uint64_t Pf_trained = 0;
  // The parameters' bytes as the tiers hold them (a quantized base: its stored bytes).
  uint64_t P_bytes = 0;
  for (const ModuleSpec& m : arch->layout().modules) {
    Pf_trained += m.trainable ? m.numel : 0;
    P_bytes += m.stored_bytes ? m.stored_bytes : m.numel * es;
  }
  o.device.peak = o.device.total() + Pf_trained * 4;
  if (where.params != Tier::kDevice) o.device.peak += P_bytes;
  if (o.device.capacity > 0) o.device.peak = std::min(o.device.peak, o.device.capacity);
  // Host, a step after backward (overlap off) or under it: the homes, the parameter pieces (the
  // NVMe fetch ring, held from the first fetch, and the new parameters' staging), the gradients'
  // landing buffers (the memory model's: a module's size for gradients in host or device
  // memory, sub-groups for gradients on NVMe) and the optimizer pipeline's staging.
  // Gradients in host or device memory land through the landing buffers from the second
  // micro-batch on (the first is copied into the accumulator).
  const uint64_t homes_and_pieces = needs.host.state + needs.host.param_shadows + needs.host.stash +
                                    needs.host.param_fetch_staging;
  const uint64_t landing =
      (r.accumulation > 1 ? needs.host.grad_landing : 0) + needs.host.grad_staging;
  uint64_t host_peak = homes_and_pieces + needs.host.param_publish_staging + landing;
  if (opt_nvme_bytes > 0) {
    // The pipeline holds at most 2*buffer_count+1 sub-groups' master+moments, and never more
    // than the model has: the largest ones.
    host_peak += largest_extents(pipeline_staging_sub_groups(to.buffer_count));
  }
  // Host, every step deferred to the next forward (the overlap with a step that clipped: no
  // undo state): under backward the state is read ahead (the pipeline's whole staging, 2 *
  // buffer_count + 1 sub-groups, once the last pass's writes drained:
  // OptimizerPipeline::read_ahead_room) while the gradients land; the pass under the next
  // forward holds the sub-groups it reads ahead and writes behind (pipeline_sub_groups_held) and
  // the new parameters' pieces.
  const uint64_t deferred_bwd =
      homes_and_pieces + landing + largest_extents(pipeline_staging_sub_groups(to.buffer_count));
  const uint64_t deferred_fwd = homes_and_pieces + needs.host.param_publish_staging +
                                needs.host.grad_staging +
                                largest_extents(pipeline_sub_groups_held(
                                    to.buffer_count, opt_nvme_writes, where.params == Tier::kNvme));
  o.host.peak_deferred = std::max(deferred_bwd, deferred_fwd) * W;
  o.device.peak_deferred = o.device.peak;
  o.nvme.peak_deferred = o.nvme.state;  // no shadow extents: nothing is stepped under backward
  // The optimizer under backward with clipping or fp16 keeps every stepped module's pre-step
  // master + moments until the step is validated (TierManager::take_undo): NVMe-homed state as
  // its old extents, the step written to fresh ones (nvme.undo: on the swap paths when they
  // have room, the memory model's shadow extents), other state as host copies (host.undo: taken
  // while the host budget has room beyond the reservation; modules without room are stepped
  // after backward instead). On a GPU device-resident state takes no undo copy: with clipping
  // or fp16 its modules are stepped by the device's optimizer after backward (Speculation).
  uint64_t undo_host = 0, undo_nvme = 0;
  if (to.undo_copies) {
    for (const ModuleHomes& h : homes) {
      for (const auto* x : {&h.master, &h.moments}) {
        if (x->tier == Tier::kDevice && !r.profile.cpu_backend) continue;
        (x->tier == Tier::kNvme ? undo_nvme : undo_host) += round_up(x->bytes, 4096) * W;
      }
    }
  }
  if (undo_nvme > 0) {
    const uint64_t with_shadows = needs.nvme.bytes_per_path_with_shadows * needs.nvme.paths * W;
    if (o.nvme.capacity == 0 || (with_shadows > 0 && with_shadows <= o.nvme.capacity)) {
      o.nvme.undo = undo_nvme;
    } else {
      undo_host += undo_nvme;  // no room on the disks: host copies instead
    }
  }
  const uint64_t undo_want = undo_host;
  o.host.undo = undo_want;
  if (o.host.capacity > 0) {
    const uint64_t room =
        o.host.capacity > o.host.total() ? o.host.capacity - o.host.total() : uint64_t{0};
    o.host.undo = std::min(undo_want, room);
  }
  // The optimizer's read-ahead during backward: what the budget leaves after the arena's other
  // parts (the engine's TierManager::create sizes it the same way), held from backward into
  // the deferred pass.
  const size_t read_ahead_subs = read_ahead_sub_groups(needs, to, o.nvme.undo > 0);
  o.host.read_ahead = uint64_t(read_ahead_subs) * needs.host.optimizer_sub_group * W;
  o.host.peak_deferred += o.host.read_ahead;
  if (o.host.undo > 0) {
    // With undo copies the peak comes at the end of the speculative pass instead: the homes, the
    // undo copies, and the NVMe optimizer pipeline's buffer_count + 1 modules (read ahead or
    // written behind, one stepped; with NVMe params also their new params' staging) — the
    // gradient landing and write-back staging are free by then. Measured: docs/PLANNER.md.
    uint64_t spec =
        needs.host.state + needs.host.param_shadows + needs.host.stash + o.host.undo / W;
    if (opt_nvme_bytes > 0) spec += largest_extents(uint64_t(to.buffer_count + 1));
    if (where.params == Tier::kNvme) {  // the fetch ring, and the pieces being published
      spec += needs.host.param_fetch_staging + needs.host.param_publish_staging;
    }
    host_peak = std::max(host_peak, spec);
  }
  o.host.peak = host_peak * W;
  o.nvme.peak = o.nvme.state + o.nvme.undo;
  if (!r.profile.cpu_backend) {
    Status st = check_placement(where, /*host_addressable=*/false, "cuda");
    if (!st.is_ok()) {
      o.runnable = false;
      o.why.push_back(st.message());
    }
  }

  // ---- time ----
  const MachineProfile& pf = r.profile;
  const double A = double(r.accumulation), tokens = double(r.micro_batch) * r.seq;
  const FlopsPerToken fpt = arch->flops_per_token(r.seq, r.activations);
  o.flops = uint64_t(fpt.train() * tokens * A);
  TimeTerms& t = o.time;
  t.gemm_flops = gemm_rate_at(pf, m.n_embd, r.micro_batch * r.seq);
  t.compute_s = double(o.flops) / t.gemm_flops;

  const double Pfull = double(P_bytes) / double(es);  // in model-dtype elements, as gathered
  // Params fetched to the device per step: what the device cannot keep cached, once in each
  // backward and again in each forward (what backward evicted); a cached copy is updated in
  // place by the optimizer (write-through over the link), never fetched again. The room is the
  // device's free bytes beside the working set's gradient buffers (the parameters in use are
  // in the room): a gradient buffer still draining when the next is allocated is waited for,
  // not made room for by evicting a copy (DeviceCache::release_after), so it takes none of the
  // cache's room. Sharded: every gathered
  // group is dropped after its use, so each pass fetches every parameter. Params resident on
  // the device are fetched never, but written once after the step.
  double link = 0, fetch = 0;
  // Each forward group's forward fetches once (strata.grouped_forwards), each backward once,
  // the first group's backwards once for the group (strata.grouped_backwards, one rank), which
  // drains its gradients once too; a later group's run one at a time.
  const double forward_groups = std::ceil(A / double(K));
  const bool grouped_backward = K > 1 && to.grouped_backward && W == 1;
  o.backward_grouped = grouped_backward;
  const double backwards = grouped_backward ? 1.0 + (A - std::min(A, double(K))) : A;
  if (where.params != Tier::kDevice) {
    const uint64_t busy = o.device.total();
    // The parameters in use are cached copies themselves (DeviceCache: what is acquired is
    // resident), so the working set's parameter part is the cache's room, not beside it: counted
    // beside it, lora-hostmem-350m's minimum was 367.59 MiB a step against 190.62 measured (its
    // head alone is 93 MiB in use), bench-25m's 478.58 against 460.04.
    std::vector<size_t> copies(homes.size()), no_grads(homes.size(), 0);
    for (size_t i = 0; i < homes.size(); ++i) {
      copies[i] = round_up(homes[i].padded_numel * es, 256);
    }
    const uint64_t in_use = std::min<uint64_t>(
        needs.device.working_set, working_set_bytes(copies, no_grads, arch->program(Pass::kTrain)));
    const uint64_t others = busy - in_use;
    const double free_dev = o.device.capacity > others ? double(o.device.capacity - others) : 0.0;
    const double pbytes = double(P_bytes);
    const double cached = W > 1 ? 0.0 : std::min(1.0, free_dev / pbytes);
    fetch = pbytes * (forward_groups + backwards) * (1.0 - cached);
    // The fetches and the write-through (of the stepped parameters: not a frozen base's).
    link += fetch + double(P_trained) * es * cached;
  } else if (!pf.cpu_backend) {
    // New low-precision params back to the device (the CPU backend's host-stepped optimizer
    // writes a host-addressable device's parameters in place: nothing crosses).
    link += double(opt_host_params) * es;
  }
  // fp32 grads to the host tier; on the CPU backend (one rank) the first micro-batch's backward
  // writes a host accumulator in place (GradBuckets::in_place): only NVMe-bound ones cross.
  const double in_place = pf.cpu_backend && W == 1 ? double(grads_off_device - grads_nvme) : 0.0;
  link += (backwards * double(grads_off_device) - in_place) * 4;
  // Offloaded block inputs: out after each block's forward, back before its backward.
  link += A * 2.0 * double(acts.stash_layers) * double(acts.stash_bytes);
  o.link_bytes = uint64_t(link);
  t.link_s = link / (pf.link_gbps.value * 1e9);

  double nr = 0, nw = 0;
  nr += double(opt_nvme_bytes);
  nw += double(opt_nvme_bytes);
  // NVMe-homed master + moments of the first `count` sub-groups with such state, in module
  // order or (backward) from the last module; within a module its first sub-groups, as the
  // pipeline keeps and reads them ahead: whole sub-groups unless the module's last, shorter one
  // is taken too (a share of the sub-groups had put the short one's deficit on the first ones).
  auto state_of_first_sub_groups = [&](size_t count, bool backward) {
    double bytes = 0;
    for (size_t u = 0; u < homes.size() && count > 0; ++u) {
      const size_t i = backward ? homes.size() - 1 - u : u;
      const ModuleHomes& h = homes[i];
      const size_t n = h.sub_groups();
      if (opt_nvme_of[i] == 0 || n == 0 || h.shard_numel == 0) continue;
      const size_t take = std::min(count, n);
      bytes += take == n || opt_nvme_sub_full[i] == 0
                   ? double(opt_nvme_of[i]) * double(take) / double(n)
                   : double(take) * double(opt_nvme_sub_full[i]);
      count -= take;
    }
    return bytes;
  };
  // With the overlap, a pass keeps the staging of the first read-ahead's-room sub-groups in
  // module order for the next step (OptimizerPipeline::Pass::keep): written, never read back.
  if (r.engine.strata.optimizer_overlap && !r.engine.strata.delayed_update) {
    nr -= state_of_first_sub_groups(read_ahead_subs, /*backward=*/false);
  }
  // Gradients on NVMe: every backward (a group's: one) writes the fp32 accumulators, the later
  // ones read them first, and the optimizer reads them once.
  nw += backwards * double(grads_nvme_bytes);
  nr += backwards * double(grads_nvme_bytes);
  double nvme_param_read = 0;
  if (where.params == Tier::kNvme) {
    // This rank's shards, each fetched extent in whole blocks.
    nvme_param_read =
        fetch / double(W) *
        (params_nvme_raw ? double(params_nvme_extents) / double(params_nvme_raw) : 1.0);
    nr += nvme_param_read;
    nw += double(trained_params_nvme_extents);  // the stepped parameters written back
  }
  o.nvme_read_bytes = uint64_t(nr) * W;
  o.nvme_write_bytes = uint64_t(nw) * W;
  // Every local rank shares the node's NVMe bandwidth.
  t.nvme_s =
      double(W) * (nr / (pf.nvme_read_gbps.value * 1e9) + nw / (pf.nvme_write_gbps.value * 1e9));
  t.cpu_optim_s = double(W) * double(opt_host_params) / pf.optimizer_pps.value;
  // The device's optimizer, per rank on its own device: the CPU optimizer's rate on the CPU
  // backend (where the node's ranks share it), else the bytes it streams through device memory:
  // grad, master (read and write), both moments (read and write), the new parameter.
  if (pf.cpu_backend) {
    t.device_optim_s = double(W) * double(opt_dev_params) / pf.optimizer_pps.value;
  } else {
    const double per_param = 4.0 + 8.0 + 4.0 * double(dtype_size(r.moment_dtype)) + double(es);
    t.device_optim_s = double(opt_dev_params) * per_param / (pf.device_mem_gbps.value * 1e9);
  }
  // The optimizer thread also copies each module's master + moments into its undo copy.
  t.cpu_optim_s += double(o.host.undo) / (pf.host_copy_gbps.value * 1e9);
  if (W > 1) {
    const ZeroPPTraffic z = zeropp_traffic(r.zeropp, int(W), int(W), Pfull, r.dtype);
    const double bytes = A * (z.gather_forward + z.gather_backward + z.reduce);
    const double bw = pf.collective_gbps.value > 0 ? pf.collective_gbps.value : 25.0;
    t.collectives_s = bytes / (bw * 1e9);
  }
  // The optimizer under backward in the steady state (the trainer does not speculate under
  // the delayed update), and whether a step can fall back to stepping after backward (clipping
  // or fp16 make the speculative step wrong).
  const bool overlap = r.engine.strata.optimizer_overlap && !r.engine.strata.delayed_update;
  const bool may_fall_back = r.engine.gradient_clipping > 0 || r.engine.fp16.enabled;
  // Combination (docs/PLANNER.md, "Step time"). Plain schedule: the optimizer pass (CPU Adam
  // pipelined with its NVMe traffic) follows backward. GPU: transfers and collectives overlap
  // compute (prefetch). CPU backend: compute, copies and the optimizer share the same cores, so
  // they add; NVMe transfers run on I/O threads under the optimizer. The device's optimizer
  // runs in the compute stream's order: it adds to compute (comp) on either backend.
  const double comp = t.compute_s + t.device_optim_s;
  const double plain =
      pf.cpu_backend
          ? comp + t.link_s + std::max(t.cpu_optim_s, t.nvme_s) + t.collectives_s
          : std::max({comp, t.link_s, t.collectives_s}) + std::max(t.cpu_optim_s, t.nvme_s);
  t.hidden_share = 0;
  t.step_s = plain;
  if (overlap) {
    // The optimizer under backward starts with the last micro-batch's backward (a backward
    // group's: the last group's backwards): each micro-batch is a forward (1) and a backward (2,
    // plus 1 when blocks are recomputed) in compute units.
    const double rc = fpt.recompute / fpt.forward;
    const double last_backwards = grouped_backward && forward_groups == 1.0 ? A : 1.0;
    const double start_share = (A * (3.0 + rc) - last_backwards * (2.0 + rc)) / (A * (3.0 + rc));
    // Its NVMe traffic from then on: the optimizer state's reads (less the sub-groups read
    // ahead from the step's start, in backward order: final norm, last blocks, ...), its
    // writes, the new params' writes, and the last backward pass's param reads.
    // Each as bytes read and written (per rank, then per node), over the disk's rates.
    struct Bytes {
      double read = 0, write = 0;
      double seconds(const MachineProfile& p) const {
        return read / (p.nvme_read_gbps.value * 1e9) + write / (p.nvme_write_gbps.value * 1e9);
      }
    } window, deferred, after;
    // The share of the pass's writes that drain behind it into the next step: the sub-groups
    // it leaves writing (buffer_count and the read-ahead's, OptimizerPipeline::max_writes).
    double drained = 0;
    if (opt_nvme_bytes > 0) {
      // The sub-groups read ahead: the pipeline's staging (2 * buffer_count + 1, its writes
      // drained under backward: OptimizerPipeline::read_ahead_room) and
      // strata.optimizer.read_ahead's, the last in module order (backward's first); for a step
      // deferred to the next forward, the first (the forward's first).
      const size_t n_ahead = pipeline_staging_sub_groups(to.buffer_count) + read_ahead_subs;
      const double ahead = state_of_first_sub_groups(n_ahead, true),
                   ahead_fwd = state_of_first_sub_groups(n_ahead, false);
      const double opt = double(opt_nvme_bytes);
      window.read += opt - std::min(opt, ahead);
      window.write += opt;
      deferred.read += opt - std::min(opt, ahead_fwd);
      deferred.write += opt;
      // After backward (a step after one that clipped, strata.optimizer.defer chose it): the
      // pass steps the sub-groups read ahead under backward (in module order) first and waits
      // for the reads of the rest and for its writes but the last ones, which drain behind.
      drained = std::min(1.0, double(size_t(std::max(1, to.buffer_count)) + read_ahead_subs) /
                                  double(std::max<size_t>(1, needs.host.optimizer_sub_groups)));
      after.read += opt - std::min(opt, ahead_fwd);
      after.write += opt * (1.0 - drained);
    }
    if (where.params == Tier::kNvme) {
      window.write += double(trained_params_nvme_extents);
      deferred.write += double(trained_params_nvme_extents);
      after.write += double(trained_params_nvme_extents) * (1.0 - drained);
    }
    // Gradients accumulated on NVMe: the pass reads each module's (fp32) once more.
    window.read += double(grads_nvme_bytes);
    deferred.read += double(grads_nvme_bytes);
    after.read += double(grads_nvme_bytes);
    if (where.params == Tier::kNvme) window.read += nvme_param_read / (forward_groups + backwards);
    // Every local rank shares the node's NVMe bandwidth.
    o.deferred_pass = {uint64_t(deferred.read) * W, uint64_t(deferred.write) * W};
    o.after_backward_pass = {uint64_t(after.read) * W, uint64_t(after.write) * W};
    const double window_s = double(W) * window.seconds(pf);
    const double window_deferred = double(W) * deferred.seconds(pf);
    const double window_after = double(W) * after.seconds(pf);
    // A step after one that clipped or overflowed only reads ahead under backward (the trainer
    // predicts the next will clip too) and defers its optimizer to the next forward, which
    // steps module i just before module i's forward: it overlaps the first forward group's
    // forwards (K micro-batches, strata.grouped_forwards), the share f0 = K / (A·(3 + r)) of
    // compute, and no more (the backward needs every module's forward). On the CPU backend the
    // optimizer's CPU work shares the cores.
    const double f0 = double(std::min<uint64_t>(uint64_t(K), uint64_t(A))) / (A * (3.0 + rc));
    o.first_forward_share = f0;
    if (pf.cpu_backend) {
      const double cl = comp + t.link_s;
      t.step_deferred_s = std::max(
          {cl + t.collectives_s + t.cpu_optim_s,
           cl * (1.0 - f0) + t.collectives_s + std::max(window_deferred, cl * f0), t.nvme_s});
    } else {
      const double dev = std::max({comp, t.link_s, t.collectives_s});
      t.step_deferred_s = std::max(
          dev * (1.0 - f0) + std::max({t.cpu_optim_s, window_deferred, dev * f0}), t.nvme_s);
    }
    double after_backward = 0;
    if (pf.cpu_backend) {
      after_backward = std::max(
          comp + t.link_s + t.collectives_s + std::max(t.cpu_optim_s, window_after), t.nvme_s);
    } else {
      after_backward = std::max(
          std::max({comp, t.link_s, t.collectives_s}) + std::max(t.cpu_optim_s, window_after),
          t.nvme_s);
    }
    double overlapped = 0;
    if (pf.cpu_backend) {
      const double start = (t.compute_s + t.link_s) * start_share;  // before the device optimizer
      overlapped =
          std::max({comp + t.link_s + t.cpu_optim_s + t.collectives_s, start + window_s, t.nvme_s});
    } else {
      const double dev = std::max({comp, t.link_s, t.collectives_s});
      const double start = t.compute_s * start_share;  // before the device optimizer
      overlapped = std::max({dev, start + std::max(t.cpu_optim_s, window_s), t.nvme_s});
    }
    // Modules without room for their undo copies are stepped after backward.
    t.hidden_share = o.host.undo < undo_want ? double(o.host.undo) / double(undo_want) : 1.0;
    t.step_s = t.hidden_share * overlapped + (1.0 - t.hidden_share) * plain;
    // strata.optimizer.defer: which of the two a step after one that clipped runs ("auto" times
    // both on the run's first such steps and keeps the faster: predicted as the faster here).
    const std::string& defer = r.engine.strata.optimizer_defer;
    t.clipped_deferred = defer == "always"  ? true
                         : defer == "never" ? false
                                            : t.step_deferred_s <= after_backward;
    t.step_after_s = t.clipped_deferred ? t.step_deferred_s : after_backward;
    t.step_plain_s = after_backward;
    t.falls_back = may_fall_back;
    if (!may_fall_back) {  // nothing can make a step fall back
      t.step_after_s = t.step_deferred_s = t.step_s;
      t.step_plain_s = plain;
      t.clipped_deferred = false;
    }
  } else {
    t.step_after_s = t.step_deferred_s = t.step_plain_s = plain;
  }
  const std::pair<const char*, double> terms[] = {{"compute", t.compute_s},
                                                  {"host<->device link", t.link_s},
                                                  {"nvme", t.nvme_s},
                                                  {"cpu optimizer", t.cpu_optim_s},
                                                  {"device optimizer", t.device_optim_s},
                                                  {"collectives", t.collectives_s}};
  double best = -1;
  for (const auto& [name, v] : terms) {
    if (v > best) {
      best = v;
      t.bottleneck = name;
    }
  }
  return o;
}

Result<PlanReport> make_plan(const PlanRequest& request) {
  PlanReport rep;
  rep.request = request;
  if (auto arch = create_architecture(request.model.shape); arch.is_ok()) {
    rep.params = (*arch)->layout().num_params();
    rep.model = (*arch)->describe();
  }
  for (const auto& pl : placement_options()) {
    STRATA_ASSIGN_OR_RETURN(PlanOption o, evaluate_placement(request, pl), "planning");
    rep.options.push_back(std::move(o));
  }
  for (size_t i = 0; i < rep.options.size(); ++i) {
    const auto& o = rep.options[i];
    if (!o.fits || !o.runnable) continue;
    if (rep.best < 0 || o.time.step_s < rep.options[size_t(rep.best)].time.step_s)
      rep.best = int(i);
  }
  return rep;
}

Result<PlacementOption> placement_of_config(const Config& cfg) {
  // parse_placement's message names the key; no context to add.
  STRATA_ASSIGN_OR_RETURN(Placement where, parse_placement(cfg), "");
  const bool grads_auto = cfg.strata.placement_grads.empty();
  for (auto o : placement_options()) {
    o.grads_auto = grads_auto;
    if (o.where == where) return o;
  }
  return PlacementOption{"config", where, grads_auto};
}

Result<int> add_placement(PlanReport& report, const PlacementOption& asked) {
  PlacementOption p = asked;
  if (p.grads_auto && p.where.grads == Tier::kHost) {
    // The gradients go where TierManager::create would put them, by the same function over the
    // same options (one rank's).
    const PlanRequest& r = report.request;
    STRATA_ASSIGN_OR_RETURN(const auto arch, create_architecture(r.model.shape),
                            "model " + r.model.name);
    const ActivationSizes acts =
        arch->activation_plan(r.micro_batch, r.seq, r.dtype, r.activations);
    TierOptions to = tier_options_of(r, p.where, acts);
    to.grads_auto = true;
    const Tier g = default_grads_tier(*arch, to, r.hw.gpus, r.dtype, r.moment_dtype, acts.bytes);
    if (g != p.where.grads) {
      p.where.grads = g;
      p.name = "config";
      for (const auto& o : placement_options()) {
        if (o.where == p.where) p.name = o.name;
      }
    }
  }
  for (size_t i = 0; i < report.options.size(); ++i) {
    if (report.options[i].placement.where == p.where) return int(i);
  }
  STRATA_ASSIGN_OR_RETURN(PlanOption o, evaluate_placement(report.request, p),
                          "planning the placement " + p.name);
  report.options.push_back(std::move(o));
  return int(report.options.size() - 1);
}

PlanRequest request_from_config(const Config& cfg, const Hardware& hw,
                                const MachineProfile& profile) {
  PlanRequest r;
  r.model = {"config", cfg.model, ""};
  r.micro_batch = int(cfg.train_micro_batch_size_per_gpu);
  r.seq = cfg.data.seq_len > 0 ? cfg.data.seq_len : cfg.model.context;
  r.accumulation = int(cfg.gradient_accumulation_steps);
  r.dtype = cfg.model.dtype;
  r.moment_dtype = cfg.strata.moment_dtype;
  r.engine = cfg;
  r.zeropp.quantized_weights = cfg.zero.zero_quantized_weights;
  r.zeropp.hpz_partition_size = cfg.zero.zero_hpz_partition_size;
  r.zeropp.quantized_gradients = cfg.zero.zero_quantized_gradients;
  auto mode = parse_activation_mode(cfg.strata.activations);  // the parser checked the name
  r.activations = mode.is_ok() ? *mode : ActivationMode::kKeep;
  r.hw = hw;
  r.profile = profile;
  // The NVMe rates of the aio case this config runs (aio.backend "auto" is io_uring where it
  // starts, which the probe's case list then has), when the profile measured it.
  const std::string backend = cfg.aio.backend == "auto" ? "io_uring" : cfg.aio.backend;
  for (const auto& c : profile.nvme_cases) {
    if (c.backend == backend && c.block_size == cfg.aio.block_size &&
        c.queue_depth == cfg.aio.queue_depth && c.read_gbps > 0 && c.write_gbps > 0) {
      const std::string src = fmt::format("{} ({} qd {}, the config's aio)",
                                          profile.nvme_read_gbps.source, backend, c.queue_depth);
      r.profile.nvme_read_gbps = {c.read_gbps, src};
      r.profile.nvme_write_gbps = {c.write_gbps, src};
    }
  }
  return r;
}

Result<CapacityResult> max_model(const PlanRequest& request) {
  // Grow the layer count at the request's width: fitting is monotone in layers (every tier's
  // need grows with it), so a doubling search then a bisection finds the boundary.
  auto fits = [&](int layers, PlanReport* out) -> Result<bool> {
    PlanRequest r = request;
    r.model.shape.n_layer = layers;
    r.model.name = fmt::format("{}-{}L", request.model.name, layers);
    STRATA_ASSIGN_OR_RETURN(PlanReport rep, make_plan(r), fmt::format("{} layers", layers));
    const bool ok = rep.best >= 0;
    if (out) *out = std::move(rep);
    return ok;
  };
  STRATA_ASSIGN_OR_RETURN(bool one, fits(1, nullptr), "capacity search");
  if (!one) {
    return out_of_memory(
        fmt::format("capacity: even 1 layer of width {} does not fit at micro-batch {} x {} tokens",
                    request.model.shape.n_embd, request.micro_batch, request.seq));
  }
  int lo = 1, hi = 2;
  while (hi < (1 << 20)) {
    STRATA_ASSIGN_OR_RETURN(bool f, fits(hi, nullptr), "capacity search");
    if (!f) break;
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    STRATA_ASSIGN_OR_RETURN(bool f, fits(mid, nullptr), "capacity search");
    (f ? lo : hi) = mid;
  }
  CapacityResult c;
  STRATA_ASSIGN_OR_RETURN(bool f, fits(lo, &c.report), "capacity search");
  (void)f;
  c.model = c.report.request.model;
  c.params = c.report.params;
  return c;
}

}  // namespace strata
