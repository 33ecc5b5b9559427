// The planner's memory part (src/plan/plan_parts.h): the memory model's reservations of one
// placement, and the peaks the run is expected to reach beside them (docs/PLANNER.md, "Memory").
#include <fmt/format.h>

#include <algorithm>

#include "src/plan/plan_parts.h"
#include "strata/log.h"

namespace strata {
namespace {

std::string gb(double bytes) { return format_bytes(bytes); }

}  // namespace

uint64_t StateBytes::largest_extents(uint64_t k) const {
  uint64_t sum = 0;
  for (const auto& [bytes, count] : opt_nvme_extents) {
    const uint64_t take = std::min(k, count);
    sum += take * bytes;
    k -= take;
  }
  return sum;
}

double StateBytes::first_sub_groups(const std::vector<ModuleHomes>& homes, size_t count,
                                    bool backward) const {
  double bytes = 0;
  for (size_t u = 0; u < homes.size() && count > 0; ++u) {
    const size_t i = backward ? homes.size() - 1 - u : u;
    const ModuleHomes& h = homes[i];
    const size_t n = h.sub_groups();
    if (opt_nvme_of[i] == 0 || n == 0 || h.shard_numel == 0) continue;
    const size_t take = std::min(count, n);
    // Whole sub-groups unless the module's last, shorter one is taken too (a share of the
    // sub-groups had put the short one's deficit on the first ones).
    bytes += take == n || opt_nvme_sub_full[i] == 0
                 ? double(opt_nvme_of[i]) * double(take) / double(n)
                 : double(take) * double(opt_nvme_sub_full[i]);
    count -= take;
  }
  return bytes;
}

StateBytes state_bytes_of(const std::vector<ModuleHomes>& homes, const ModelLayout& layout,
                          DType dtype) {
  const uint64_t es = dtype_size(dtype);
  StateBytes s;
  s.opt_nvme_of.assign(homes.size(), 0);
  s.opt_nvme_sub_full.assign(homes.size(), 0);
  for (size_t i = 0; i < homes.size(); ++i) {
    const ModuleHomes& h = homes[i];
    s.max_params = std::max<uint64_t>(s.max_params, h.params.bytes);
    s.max_grads = std::max<uint64_t>(s.max_grads, h.grads.bytes);
    // A frozen module (LoRA's base) has no gradients and no optimizer step.
    const size_t trained = h.master.bytes > 0 ? h.shard_numel : 0;
    s.trained += trained;
    if (h.master.tier != Tier::kDevice || h.moments.tier != Tier::kDevice) {
      s.opt_host += trained;
      if (trained > 0) {
        s.max_host_piece =
            std::max<uint64_t>(s.max_host_piece, std::min(h.sub_group, h.shard_numel) * es);
      }
    } else {
      s.opt_device += trained;
    }
    if (h.grads.tier != Tier::kDevice) s.grads_off_device += trained;
    if (h.grads.tier == Tier::kNvme && trained > 0) {
      s.grads_nvme += trained;
      // GradSpill's extents: one per sub-group, in whole 4 KiB blocks (O_DIRECT).
      s.grads_nvme_bytes += extent_bytes(h, 4);
    }
    if (h.params.tier == Tier::kNvme) {
      const uint64_t stored = layout.modules[i].stored_bytes;
      const uint64_t raw = stored ? stored : h.params.bytes;
      const uint64_t extents = stored ? stored : extent_bytes(h, es);
      s.params_nvme_raw += raw;
      s.params_nvme_extents += extents;
      if (trained > 0) s.trained_params_nvme_extents += extents;
    }
    size_t writes = 0;  // the pipeline's NVMe writes of this module's state per sub-group
    for (const auto* x : {&h.master, &h.moments}) {
      if (x->tier == Tier::kNvme) s.opt_nvme_of[i] += x->bytes;
      if (x->tier == Tier::kNvme && x->bytes > 0) ++writes;
    }
    s.opt_nvme_writes = std::max(s.opt_nvme_writes, writes);
    auto sub_bytes = [&](size_t len) {
      uint64_t sub = 0;
      for (const auto* x : {&h.master, &h.moments}) {
        if (x->tier == Tier::kNvme) sub += round_up(len * (x->bytes / h.shard_numel), 4096);
      }
      return sub;
    };
    if (const size_t n = h.sub_groups(); s.opt_nvme_of[i] > 0 && n > 0 && h.sub_group > 0) {
      s.opt_nvme_extents.push_back({sub_bytes(h.sub_group_len(0)), n - 1});
      s.opt_nvme_extents.push_back({sub_bytes(h.sub_group_len(n - 1)), 1});
      // What the optimizer moves: each sub-group's extents in whole 4 KiB blocks (O_DIRECT).
      s.opt_nvme_sub_full[i] = sub_bytes(h.sub_group_len(0));
      s.opt_nvme_of[i] = (n - 1) * s.opt_nvme_sub_full[i] + sub_bytes(h.sub_group_len(n - 1));
    }
    s.opt_nvme += s.opt_nvme_of[i];
  }
  std::sort(s.opt_nvme_extents.rbegin(), s.opt_nvme_extents.rend());
  for (const ModuleSpec& m : layout.modules) {
    s.full_trained += m.trainable ? m.numel : 0;
    s.param_bytes += m.stored_bytes ? m.stored_bytes : m.numel * es;
  }
  return s;
}

Result<PlanMemory> plan_memory(const PlanRequest& r, const Placement& where,
                               std::shared_ptr<const Architecture> arch) {
  PlanMemory mem;
  const uint64_t W = uint64_t(r.hw.gpus);
  mem.arch = std::move(arch);
  const Architecture& a = *mem.arch;
  mem.acts = a.activation_plan(r.micro_batch(), r.seq(), r.dtype(), r.activations());

  // The memory model, per rank (what TierManager::create's preflight checks).
  TierOptions& to = mem.options;
  to = tier_options_of(r, where, mem.acts);
  STRATA_ASSIGN_OR_RETURN(mem.homes,
                          module_homes(a.layout(), where, r.hw.gpus, r.dtype(), r.moment_dtype(),
                                       to.delayed_update, to.sub_group_elems),
                          "model " + r.model_name);
  // ZeRO++'s buffers (qwZ's gather buffer, hpZ's secondary chunks, qgZ's scratch) on the
  // planner's grid: its ranks are one node's.
  mem.zeropp.quantized_weights = r.zeropp().quantized_weights;
  mem.zeropp.hpz = std::max(1, r.zeropp().hpz_partition_size);
  mem.zeropp.quantized_gradients = r.zeropp().quantized_gradients;
  mem.zeropp.world = mem.zeropp.per_node = r.hw.gpus;
  TierNeeds& needs = mem.needs;
  needs = tier_needs(mem.homes, to, r.hw.gpus, r.dtype(), mem.acts.bytes, a.program(Pass::kTrain),
                     mem.zeropp);
  // strata.grouped_forwards as TierManager::create resolves it, and the device's sets.
  to.forward_group = resolve_forward_group(
      mem.homes, to, r.hw.gpus, r.dtype(), mem.acts.bytes, a.program(Pass::kTrain), mem.zeropp,
      r.hw.gpu_mem > 0 ? size_t(r.hw.gpu_mem) : SIZE_MAX, W > 1, &needs);
  mem.forward_group = std::max(1, to.forward_group);

  // The node's bytes per tier: the host tier of one node holds every local rank's state and
  // staging, and so do its NVMe paths.
  mem.device.state = needs.device.resident_state;
  mem.device.buffers = needs.device.transient();
  mem.device.activations = needs.device.activations;
  mem.device.capacity = r.hw.gpu_mem;
  mem.host.state = needs.host.state * W;
  mem.host.buffers = (needs.host.staging + needs.host.param_shadows) * W;
  mem.host.activations = needs.host.stash * W;
  mem.host.capacity = r.hw.host_mem;
  mem.nvme.state = needs.nvme.state * W;
  if (needs.nvme.bytes_per_path > 0) {
    mem.nvme.buffers = (needs.nvme.bytes_per_path * needs.nvme.paths - needs.nvme.state) * W;
  }
  mem.nvme.capacity = r.hw.nvme_bytes;
  mem.state = state_bytes_of(mem.homes, a.layout(), r.dtype());

  // Fits? The preflight's decision (tier_shortfall) for one rank; a capacity of 0 is unknown.
  TierShortfall short_of =
      tier_shortfall(needs, to, r.hw.gpu_mem > 0 ? size_t(r.hw.gpu_mem) : SIZE_MAX);
  if (r.hw.host_mem == 0) short_of.host = false;
  const TierBytes &d = mem.device, &h = mem.host, &n = mem.nvme;
  if (short_of.device) {
    mem.why.push_back(fmt::format("device needs {} (activations {}, state {}, working set {}) > {}",
                                  gb(double(d.total())), gb(double(d.activations)),
                                  gb(double(d.state)), gb(double(d.buffers)),
                                  gb(double(d.capacity))));
  }
  if (short_of.host) {
    mem.why.push_back(
        fmt::format("host needs {} (state {}, staging {}{}) > {}", gb(double(h.total())),
                    gb(double(h.state)), gb(double(h.buffers)),
                    h.activations ? ", offloaded activations " + gb(double(h.activations)) : "",
                    gb(double(h.capacity))));
  }
  if (short_of.nvme_paths) {
    mem.why.push_back("nvme: state placed on nvme but no --nvme path given");
  } else if (n.capacity > 0 && n.total() > n.capacity) {
    mem.why.push_back(
        fmt::format("nvme needs {} > {} free", gb(double(n.total())), gb(double(n.capacity))));
  }
  return mem;
}

PlanPeaks plan_peaks(const PlanRequest& r, const Placement& where, const PlanMemory& mem) {
  PlanPeaks p;
  const uint64_t W = uint64_t(r.hw.gpus);
  const TierNeeds& needs = mem.needs;
  const TierOptions& to = mem.options;
  const StateBytes& s = mem.state;
  // Device: every module's per-micro-batch gradient buffer (fp32, full module) is alive at the
  // end of backward while the drains run; offloaded params are cached in what is left.
  p.device.peak = mem.device.total() + s.full_trained * 4;
  if (where.params != Tier::kDevice) p.device.peak += s.param_bytes;
  if (mem.device.capacity > 0) p.device.peak = std::min(p.device.peak, mem.device.capacity);
  // Host, a step after backward (overlap off) or under it: the homes, the parameter pieces (the
  // NVMe fetch ring, held from the first fetch, and the new parameters' staging), the gradients'
  // landing buffers (the memory model's: a module's size for gradients in host or device
  // memory, sub-groups for gradients on NVMe) and the optimizer pipeline's staging.
  // Gradients in host or device memory land through the landing buffers where a micro-batch
  // after the first drains its own (the first is copied into the accumulator; a backward group's
  // parts are added on the device): the model counts them only then.
  const uint64_t homes_and_pieces = needs.host.state + needs.host.param_shadows + needs.host.stash +
                                    needs.host.param_fetch_staging;
  const uint64_t landing = needs.host.grad_landing + needs.host.grad_staging;
  uint64_t host_peak = homes_and_pieces + needs.host.param_publish_staging + landing;
  if (s.opt_nvme > 0) {
    // The pipeline holds at most 2*buffer_count+1 sub-groups' master+moments, and never more
    // than the model has: the largest ones.
    host_peak += s.largest_extents(pipeline_staging_sub_groups(to.buffer_count));
  }
  // Host, every step deferred to the next forward (the overlap with a step that clipped: no
  // undo state): under backward the state is read ahead (the pipeline's whole staging, 2 *
  // buffer_count + 1 sub-groups, once the last pass's writes drained:
  // OptimizerPipeline::read_ahead_room) while the gradients land; the pass under the next
  // forward holds the sub-groups it reads ahead and writes behind (pipeline_sub_groups_held) and
  // the new parameters' pieces.
  const uint64_t deferred_bwd =
      homes_and_pieces + landing + s.largest_extents(pipeline_staging_sub_groups(to.buffer_count));
  const uint64_t deferred_fwd =
      homes_and_pieces + needs.host.param_publish_staging + needs.host.grad_staging +
      s.largest_extents(pipeline_sub_groups_held(to.buffer_count, s.opt_nvme_writes,
                                                 where.params == Tier::kNvme));
  p.host.peak_deferred = std::max(deferred_bwd, deferred_fwd) * W;
  p.device.peak_deferred = p.device.peak;
  p.nvme.peak_deferred = mem.nvme.state;  // no shadow extents: nothing is stepped under backward
  // The optimizer under backward with clipping or fp16 keeps every stepped module's pre-step
  // master + moments until the step is validated (TierManager::take_undo): NVMe-homed state as
  // its old extents, the step written to fresh ones (nvme.undo: on the swap paths when they
  // have room, the memory model's shadow extents), other state as host copies (host.undo: taken
  // while the host budget has room beyond the reservation; modules without room are stepped
  // after backward instead). On a GPU device-resident state takes no undo copy: with clipping
  // or fp16 its modules are stepped by the device's optimizer after backward (Speculation).
  uint64_t undo_host = 0, undo_nvme = 0, undo_copied = 0;
  if (to.undo_copies) {
    for (const ModuleHomes& h : mem.homes) {
      for (const auto* x : {&h.master, &h.moments}) {
        if (x->tier == Tier::kDevice && !r.profile.cpu_backend) continue;
        const uint64_t b = round_up(x->bytes, 4096) * W;
        (x->tier == Tier::kNvme ? undo_nvme : undo_host) += b;
        if (x->tier == Tier::kDevice) undo_copied += b;
      }
    }
  }
  if (undo_nvme > 0) {
    const uint64_t with_shadows = needs.nvme.bytes_per_path_with_shadows * needs.nvme.paths * W;
    if (mem.nvme.capacity == 0 || (with_shadows > 0 && with_shadows <= mem.nvme.capacity)) {
      p.nvme.undo = undo_nvme;
    } else {
      undo_host += undo_nvme;  // no room on the disks: host copies instead
      undo_copied += undo_nvme;
    }
  }
  p.undo_copied = undo_copied;
  p.undo_wanted = undo_host;
  p.host.undo = undo_host;
  if (mem.host.capacity > 0) {
    const uint64_t room =
        mem.host.capacity > mem.host.total() ? mem.host.capacity - mem.host.total() : uint64_t{0};
    p.host.undo = std::min(undo_host, room);
  }
  // The optimizer's read-ahead during backward: what the budget leaves after the arena's other
  // parts (the engine's TierManager::create sizes it the same way), held from backward into
  // the deferred pass.
  p.read_ahead_sub_groups = read_ahead_sub_groups(needs, to, p.nvme.undo > 0);
  p.host.read_ahead = uint64_t(p.read_ahead_sub_groups) * needs.host.optimizer_sub_group * W;
  // The staging and the room are the engine's limit on buffers (OptimizerPipeline::
  // read_ahead_room counts the sub-groups read ahead and those still being written), not on
  // distinct sub-groups: one whose last write is in flight when it is read again holds two. So
  // this is a bound the timing may not reach: tiny-cpu's NVMe row peaks at it (21.19 MiB
  // against 20.42 predicted), bench-25m's, where the staging alone could hold every sub-group,
  // 1.24-1.41x below it (xeon-amx, docs/BENCHMARKS.md).
  p.host.peak_deferred += p.host.read_ahead;
  if (p.host.undo > 0) {
    // With undo copies the peak comes at the end of the speculative pass instead: the homes, the
    // undo copies, and the NVMe optimizer pipeline's buffer_count + 1 modules (read ahead or
    // written behind, one stepped; with NVMe params also their new params' staging) — the
    // gradient landing and write-back staging are free by then. Measured: docs/PLANNER.md.
    uint64_t spec =
        needs.host.state + needs.host.param_shadows + needs.host.stash + p.host.undo / W;
    if (s.opt_nvme > 0) spec += s.largest_extents(uint64_t(to.buffer_count + 1));
    if (where.params == Tier::kNvme) {  // the fetch ring, and the pieces being published
      spec += needs.host.param_fetch_staging + needs.host.param_publish_staging;
    }
    host_peak = std::max(host_peak, spec);
  }
  p.host.peak = host_peak * W;
  p.nvme.peak = mem.nvme.state + p.nvme.undo;
  return p;
}

}  // namespace strata
