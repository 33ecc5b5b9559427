// The planner's time part (src/plan/plan_parts.h): the bytes and FLOPs of one step, each over
// the profile's rate, and how the schedules combine them (docs/PLANNER.md, "Time: one step").
#include <algorithm>
#include <cmath>

#include "src/plan/plan_parts.h"
#include "src/tiers/trace.h"
#include "strata/simulated_device.h"

namespace strata {
namespace {

// Bytes a step fetches again because the device cache releases a parameter copy after a use
// whose next use, in the same step, lies farther than `max_reuse` bytes of other parameters
// (DeviceCachePolicy's release after use, stage3_max_reuse_distance): the early blocks of a
// deep model between their forward and their backward. The step's acquisitions in the order the
// trainer runs them: per forward group of up to K of the A micro-batches, the program's
// forward prefix once, then the rest per micro-batch (once for the first group when its
// backwards are grouped). A release before the next step's first use costs nothing more (the
// optimizer then writes the home, and that use fetches it instead of the copy being written
// through): over the link the same bytes, but from NVMe-homed parameters a read more, which
// `*released_at_end` receives. A `persistent` module (under stage3_param_persistence_threshold)
// is never released.
double reuse_refetch_bytes(const Program& program, const std::vector<size_t>& copies,
                           const std::vector<bool>& persistent, uint64_t max_reuse, int A, int K,
                           bool grouped_backward, double* released_at_end) {
  *released_at_end = 0;
  if (max_reuse == UINT64_MAX) return 0;
  std::vector<Access> acc;
  auto add = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; ++i) {
      const ProgramOp& op = program.ops[i];
      if (op.kind == ProgramOp::kAcquireParams) {
        acc.push_back({op.module, copies[size_t(op.module)]});
      }
    }
  };
  const size_t prefix = program.forward_end, end = program.ops.size();
  for (int first = 0, g = 0; first < A; first += K, ++g) {
    const int in_group = std::min(K, A - first);
    add(0, prefix);
    const int rests = g == 0 && grouped_backward && prefix > 0 ? 1 : in_group;
    for (int r = 0; r < rests; ++r) add(prefix, end);
  }
  if (acc.empty()) return 0;
  const Trace t(std::move(acc));
  double bytes = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    if (persistent[size_t(t.accesses()[i].object)] || t.reuse_distance(i) <= max_reuse) continue;
    (t.next_use(i) < t.size() ? bytes : *released_at_end) += double(t.accesses()[i].bytes);
  }
  return bytes;
}

// What one step moves and computes, per rank, and how its micro-batches run.
struct StepTraffic {
  double flops = 0;
  double fetch = 0;  // parameter bytes fetched to the device
  // Of link: the new parameters the optimizer's pass copies to the device (params on the
  // device: those the host steps; elsewhere: the cached copies' write-through).
  double publish = 0;
  double link = 0;  // bytes crossing host<->device
  double nvme_read = 0, nvme_write = 0;
  double nvme_param_read = 0;  // of nvme_read: the NVMe-homed parameters' fetches
  // Cached copies released after their last use in a step (reuse_refetch_bytes): fetched by
  // the next step's first use instead of written through.
  double released_at_end = 0;
  double forward_groups = 1;  // forward passes a step: ceil(A / K)
  double backwards = 1;       // backward passes a step (a grouped backward counts once)
  bool grouped_backward = false;
};

// The step's FLOPs, link bytes and NVMe bytes (the `compute`, `link` and `nvme` rows).
StepTraffic step_traffic(const PlanRequest& r, const Placement& where, const PlanMemory& mem,
                         const PlanPeaks& peaks, const FlopsPerToken& fpt) {
  StepTraffic x;
  const MachineProfile& pf = r.profile;
  const StateBytes& s = mem.state;
  const uint64_t W = uint64_t(r.hw.gpus);
  const uint64_t es = dtype_size(r.dtype());
  const double A = double(r.accumulation()), tokens = double(r.micro_batch()) * r.seq();
  const int K = mem.forward_group;
  x.flops = double(uint64_t(fpt.train() * tokens * A));
  // Params fetched to the device per step: what the device cannot keep cached, once in each
  // backward and again in each forward (what backward evicted); a cached copy is updated in
  // place by the optimizer (write-through over the link), never fetched again. The room is the
  // device's free bytes beside the working set's gradient buffers (the parameters in use are
  // in the room): a gradient buffer still draining when the next is allocated is waited for,
  // not made room for by evicting a copy (DeviceCache::release_after), so it takes none of the
  // cache's room. Sharded: every gathered group is dropped after its use, so each pass fetches
  // every parameter. Params resident on the device are fetched never, but written once after
  // the step.
  // Each forward group's forward fetches once (strata.grouped_forwards), each backward once,
  // the first group's backwards once for the group (strata.grouped_backwards, one rank), which
  // drains its gradients once too; a later group's run one at a time.
  x.forward_groups = std::ceil(A / double(K));
  x.grouped_backward = K > 1 && mem.options.grouped_backward && W == 1;
  x.backwards = x.grouped_backward ? 1.0 + (A - std::min(A, double(K))) : A;
  if (where.params != Tier::kDevice) {
    const uint64_t busy = mem.device.total();
    // The parameters in use are cached copies themselves (DeviceCache: what is acquired is
    // resident), so the working set's parameter part is the cache's room, not beside it: counted
    // beside it, lora-hostmem-350m's minimum was 367.59 MiB a step against 190.62 measured (its
    // head alone is 93 MiB in use), bench-25m's 478.58 against 460.04.
    std::vector<size_t> copies(mem.homes.size()), no_grads(mem.homes.size(), 0);
    // Modules under stage3_param_persistence_threshold stay cached once fetched, whatever
    // their reuse distance (DeviceCache: persistent, unsharded).
    std::vector<bool> persistent(mem.homes.size());
    for (size_t i = 0; i < mem.homes.size(); ++i) {
      copies[i] = round_up(mem.homes[i].padded_numel * es, 256);
      persistent[i] = persistent_copy(mem.homes[i].numel, mem.options, W > 1);
    }
    // The persistent copies are the cache's too (the memory model counts them beside the
    // working set).
    const uint64_t in_use =
        std::min<uint64_t>(mem.needs.device.working_set,
                           working_set_bytes(copies, no_grads, mem.arch->program(Pass::kTrain))) +
        mem.needs.device.persistent;
    const uint64_t others = busy - in_use;
    const double free_dev =
        mem.device.capacity > others ? double(mem.device.capacity - others) : 0.0;
    const double pbytes = double(s.param_bytes);
    const double cached = W > 1 ? 0.0 : std::min(1.0, free_dev / pbytes);
    x.fetch = pbytes * (x.forward_groups + x.backwards) * (1.0 - cached);
    // What the cache keeps, it releases where a copy's next use is too far away.
    x.fetch += cached * reuse_refetch_bytes(mem.arch->program(Pass::kTrain), copies, persistent,
                                            mem.options.max_reuse_distance, int(A), std::max(1, K),
                                            x.grouped_backward, &x.released_at_end);
    x.released_at_end *= cached;
    // The fetches and the write-through (of the stepped parameters: not a frozen base's).
    x.publish = double(s.trained) * es * cached;
    x.link += x.fetch + x.publish;
  } else if (!pf.cpu_backend) {
    // New low-precision params back to the device (the CPU backend's host-stepped optimizer
    // writes a host-addressable device's parameters in place: nothing crosses).
    x.publish = double(s.opt_host) * es;
    x.link += x.publish;
  }
  // fp32 grads to the host tier; on the CPU backend (one rank) the first micro-batch's backward
  // writes a host accumulator in place (GradBuckets::in_place): only NVMe-bound ones cross.
  const double in_place =
      pf.cpu_backend && W == 1 ? double(s.grads_off_device - s.grads_nvme) : 0.0;
  x.link += (x.backwards * double(s.grads_off_device) - in_place) * 4;
  // Offloaded block inputs: out after each block's forward, back before its backward.
  x.link += A * 2.0 * double(mem.acts.stash_layers) * double(mem.acts.stash_bytes);

  x.nvme_read += double(s.opt_nvme);
  x.nvme_write += double(s.opt_nvme);
  // With the overlap, a pass keeps the staging of the first read-ahead's-room sub-groups in
  // module order for the next step (OptimizerPipeline::Pass::keep): written, never read back.
  if (r.config.strata.optimizer_overlap && !r.config.strata.delayed_update) {
    x.nvme_read -= s.first_sub_groups(mem.homes, peaks.read_ahead_sub_groups, /*backward=*/false);
  }
  // Gradients on NVMe: every backward (a group's: one) writes the fp32 accumulators, the later
  // ones read them first, and the optimizer reads them once.
  x.nvme_write += x.backwards * double(s.grads_nvme_bytes);
  x.nvme_read += x.backwards * double(s.grads_nvme_bytes);
  if (where.params == Tier::kNvme) {
    // This rank's shards, each fetched extent in whole blocks.
    x.nvme_param_read =
        (x.fetch + x.released_at_end) / double(W) *
        (s.params_nvme_raw ? double(s.params_nvme_extents) / double(s.params_nvme_raw) : 1.0);
    x.nvme_read += x.nvme_param_read;
    x.nvme_write += double(s.trained_params_nvme_extents);  // the stepped parameters written back
  }
  return x;
}

// Compute on the simulated device (MachineProfile::simulated): one micro-batch's training
// program through the simulated kernels' tally (simulated_program_time: every GEMM, attention,
// elementwise kernel and launch as the device charges it), once per micro-batch. Should the
// runner not build, the GEMMs (the architecture's FLOPs at T = 0, which leave attention's T x T
// products out) at the GEMM rate and attention's products at its rates, the kernels' rule for
// them (simulated_attention_seconds), without the elementwise kernels and launches.
double simulated_compute_s(const PlanRequest& r, const PlanMemory& mem, uint64_t* kernels) {
  const SimulatedDeviceOptions& sim = r.profile.sim;
  const double A = r.accumulation();
  if (auto t = simulated_program_time(*mem.arch, sim, r.micro_batch(), r.seq(), r.dtype(),
                                      r.activations());
      t.is_ok()) {
    *kernels = t->kernels * uint64_t(r.accumulation());
    return t->seconds * A;
  }
  const FlopsPerToken all = mem.arch->flops_per_token(r.seq(), r.activations());
  const FlopsPerToken gemm = mem.arch->flops_per_token(0, r.activations());
  const double tokens = double(r.micro_batch()) * r.seq() * A;
  const double square_fwd = (all.forward - gemm.forward) * tokens;
  const double square_rec = (all.recompute - gemm.recompute) * tokens;
  return gemm.train() * tokens / (sim.gemm_tflops * 1e12) +
         simulated_attention_seconds(sim, square_fwd + square_rec, /*backward=*/false) +
         simulated_attention_seconds(sim, square_fwd, /*backward=*/true);
}

// Each term of the step alone: its bytes or FLOPs over the profile's rate.
void time_terms(const PlanRequest& r, const PlanMemory& mem, const PlanPeaks& peaks,
                const StepTraffic& x, TimeTerms& t) {
  const MachineProfile& pf = r.profile;
  const StateBytes& s = mem.state;
  const uint64_t W = uint64_t(r.hw.gpus);
  const uint64_t es = dtype_size(r.dtype());
  t.gemm_flops = gemm_rate_at(pf, r.config.model.n_embd, r.micro_batch() * r.seq());
  t.compute_s = x.flops / t.gemm_flops;
  if (pf.simulated) t.compute_s = simulated_compute_s(r, mem, &t.device_kernels);
  t.link_s = x.link / (pf.link_gbps.value * 1e9);
  // Every local rank shares the node's NVMe bandwidth.
  t.nvme_s = double(W) * (x.nvme_read / (pf.nvme_read_gbps.value * 1e9) +
                          x.nvme_write / (pf.nvme_write_gbps.value * 1e9));
  t.cpu_optim_s = double(W) * double(s.opt_host) / pf.optimizer_pps.value;
  // The device's optimizer, per rank on its own device: the CPU optimizer's rate on the CPU
  // backend (where the node's ranks share it), else the bytes it streams through device memory:
  // grad, master (read and write), both moments (read and write), the new parameter.
  if (pf.cpu_backend) {
    t.device_optim_s = double(W) * double(s.opt_device) / pf.optimizer_pps.value;
  } else {
    t.device_optim_s = double(s.opt_device) *
                       device_optimizer_bytes_per_param(r.moment_dtype(), r.dtype()) /
                       (pf.device_mem_gbps.value * 1e9);
  }
  // The optimizer thread also copies the master + moments that keep their undo state as a copy
  // (of what has room for undo state: peaks.host.undo of undo_wanted).
  if (peaks.undo_wanted > 0) {
    t.cpu_optim_s += double(peaks.undo_copied) * double(peaks.host.undo) /
                     double(peaks.undo_wanted) / (pf.host_copy_gbps.value * 1e9);
  }
  if (W > 1) {
    const double Pfull = double(s.param_bytes) / double(es);  // model-dtype elements, as gathered
    const ZeroPPTraffic z = zeropp_traffic(r.zeropp(), int(W), int(W), Pfull, r.dtype());
    const double bytes =
        double(r.accumulation()) * (z.gather_forward + z.gather_backward + z.reduce);
    const double bw = pf.collective_gbps.value > 0 ? pf.collective_gbps.value : 25.0;
    t.collectives_s = bytes / (bw * 1e9);
  }
}

// Bytes read and written (per rank), over the disk's rates.
struct RwBytes {
  double read = 0, write = 0;
  double seconds(const MachineProfile& p) const {
    return read / (p.nvme_read_gbps.value * 1e9) + write / (p.nvme_write_gbps.value * 1e9);
  }
};
// The optimizer's NVMe traffic a step waits on, per schedule.
struct OptimizerWindows {
  RwBytes under_backward;  // the optimizer under backward, from the last backward on
  RwBytes deferred;        // a pass deferred into the next forward
  RwBytes after_backward;  // a pass after backward, its last writes draining behind
};

OptimizerWindows optimizer_windows(const Placement& where, const PlanMemory& mem,
                                   const PlanPeaks& peaks, const StepTraffic& x) {
  OptimizerWindows w;
  const StateBytes& s = mem.state;
  // The share of the pass's writes that drain behind it into the next step: the sub-groups
  // it leaves writing (buffer_count and the read-ahead's, OptimizerPipeline::max_writes).
  double drained = 0;
  if (s.opt_nvme > 0) {
    // The sub-groups read ahead: the pipeline's staging (2 * buffer_count + 1, its writes
    // drained under backward: OptimizerPipeline::read_ahead_room) and
    // strata.optimizer.read_ahead's, the last in module order (backward's first); for a step
    // deferred to the next forward, the first (the forward's first).
    const size_t n_ahead =
        pipeline_staging_sub_groups(mem.options.buffer_count) + peaks.read_ahead_sub_groups;
    const double ahead = s.first_sub_groups(mem.homes, n_ahead, true),
                 ahead_fwd = s.first_sub_groups(mem.homes, n_ahead, false);
    const double opt = double(s.opt_nvme);
    w.under_backward.read += opt - std::min(opt, ahead);
    w.under_backward.write += opt;
    w.deferred.read += opt - std::min(opt, ahead_fwd);
    w.deferred.write += opt;
    // After backward (a step after one that clipped, strata.optimizer.defer chose it): the
    // pass steps the sub-groups read ahead under backward (in module order) first and waits
    // for the reads of the rest and for its writes but the last ones, which drain behind.
    drained = std::min(
        1.0, double(size_t(std::max(1, mem.options.buffer_count)) + peaks.read_ahead_sub_groups) /
                 double(std::max<size_t>(1, mem.needs.host.optimizer_sub_groups)));
    w.after_backward.read += opt - std::min(opt, ahead_fwd);
    w.after_backward.write += opt * (1.0 - drained);
  }
  if (where.params == Tier::kNvme) {
    w.under_backward.write += double(s.trained_params_nvme_extents);
    w.deferred.write += double(s.trained_params_nvme_extents);
    w.after_backward.write += double(s.trained_params_nvme_extents) * (1.0 - drained);
  }
  // Gradients accumulated on NVMe: the pass reads each module's (fp32) once more.
  w.under_backward.read += double(s.grads_nvme_bytes);
  w.deferred.read += double(s.grads_nvme_bytes);
  w.after_backward.read += double(s.grads_nvme_bytes);
  // The last backward pass's param reads.
  if (where.params == Tier::kNvme) {
    w.under_backward.read += x.nvme_param_read / (x.forward_groups + x.backwards);
  }
  return w;
}

// TimeTerms::expected_s and schedule, from step_s, step_after_s and clipped_deferred.
void expected_schedule(const PlanRequest& r, TimeTerms& t) {
  const std::string after = t.clipped_deferred ? "next forward" : "after backward";
  const Config& c = r.config;
  const bool clips = !c.device.simulate.empty() && c.gradient_clipping > 0 &&
                     c.device.simulate_grad_norm > c.gradient_clipping;
  const std::string& spec = c.strata.optimizer_speculate;
  // "auto" speculates on the CPU backend (the device is the host); elsewhere it keeps the faster.
  t.speculates =
      spec == "always" || (spec == "auto" && (r.profile.cpu_backend || t.step_s <= t.step_after_s));
  t.every_step_clips = clips;
  const bool under_backward = !clips && t.speculates;
  t.expected_s = under_backward ? t.step_s : t.step_after_s;
  t.schedule = under_backward ? "under backward" : after;
}

// The name of the largest term.
std::string bottleneck_of(const TimeTerms& t) {
  const std::pair<const char*, double> terms[] = {{"compute", t.compute_s},
                                                  {"host<->device link", t.link_s},
                                                  {"nvme", t.nvme_s},
                                                  {"cpu optimizer", t.cpu_optim_s},
                                                  {"device optimizer", t.device_optim_s},
                                                  {"collectives", t.collectives_s}};
  double best = -1;
  std::string name;
  for (const auto& [n, v] : terms) {
    if (v > best) {
      best = v;
      name = n;
    }
  }
  return name;
}

}  // namespace

PlanTime plan_time(const PlanRequest& r, const Placement& where, const PlanMemory& mem,
                   const PlanPeaks& peaks) {
  PlanTime out;
  const MachineProfile& pf = r.profile;
  const uint64_t W = uint64_t(r.hw.gpus);
  const double A = double(r.accumulation());
  const FlopsPerToken fpt = mem.arch->flops_per_token(r.seq(), r.activations());
  const StepTraffic x = step_traffic(r, where, mem, peaks, fpt);
  out.flops = uint64_t(x.flops);
  out.link_bytes = uint64_t(x.link);
  out.nvme_read_bytes = uint64_t(x.nvme_read) * W;
  out.nvme_write_bytes = uint64_t(x.nvme_write) * W;
  out.backward_grouped = x.grouped_backward;
  TimeTerms& t = out.time;
  time_terms(r, mem, peaks, x, t);

  // The optimizer under backward in the steady state (the trainer does not speculate under
  // the delayed update), and whether a step can fall back to stepping after backward (clipping
  // or fp16 make the speculative step wrong).
  const bool overlap = r.config.strata.optimizer_overlap && !r.config.strata.delayed_update;
  const bool may_fall_back = r.config.gradient_clipping > 0 || r.config.fp16.enabled;
  // Combination (docs/PLANNER.md, "Step time"). Plain schedule: the optimizer pass (CPU Adam
  // pipelined with its NVMe traffic) follows backward. GPU: transfers and collectives overlap
  // compute (prefetch). CPU backend: compute, copies and the optimizer share the same cores, so
  // they add; NVMe transfers run on I/O threads under the optimizer. The device's optimizer
  // runs in the compute stream's order: it adds to compute (comp) on either backend.
  const double comp = t.compute_s + t.device_optim_s;
  // A simulated device's copies are the host's memcpys (MachineProfile::simulated), each by its
  // stream's thread: the pass's own (the new parameters to the device) follow each module's
  // step on the h2d stream while the optimizer steps the next, so the pass takes the longer of
  // the two (host_opt); the rest (gradient
  // drains, fetches) run beside the device's compute (link) and, under backward, beside the
  // optimizer too (under_bwd). A GPU's DMA copies take none of the host's time.
  // Parameters homed off the device are published by whichever optimizer steps them: the
  // host's share follows its steps; the device's optimizer copies its share down on the d2h
  // stream without the host waiting (device_optimizer.h), beside the device's compute and the
  // next step's.
  const StateBytes& st = mem.state;
  const double host_share = where.params == Tier::kDevice || st.opt_host + st.opt_device == 0
                                ? 1.0
                                : double(st.opt_host) / double(st.opt_host + st.opt_device);
  const double link_rate = pf.link_gbps.value * 1e9;
  const double publish_s = pf.simulated ? x.publish * host_share / link_rate : 0.0;
  const double copied_down_s = pf.simulated ? x.publish * (1.0 - host_share) / link_rate : 0.0;
  // The pass ends with its last piece's copy, and a module's forward waits for its own (a
  // deferred pass): a piece's new parameters (the largest the host steps) after the steps.
  const double piece_s = x.publish > 0 ? double(st.max_host_piece) / link_rate : 0.0;
  const double host_opt = std::max(t.cpu_optim_s, publish_s) + piece_s;
  const double link = t.link_s - publish_s;
  // Under backward the thread that launches the device's kernels steps the modules between its
  // launches: the optimizer runs with one thread fewer than alone (optimizer_pps_beside; on two
  // cores the one-thread rate). Simulated H200, GPT-2 124M, ratio 0.3132 on a 2-core host: a
  // step of 83-86 ms where the optimizer's share alone (27 ms) would hide under 60 ms of compute
  // (docs/BENCHMARKS.md). The CPU backend's combination counts its own.
  const double beside_pps =
      pf.optimizer_pps_beside > 0 ? pf.optimizer_pps_beside : pf.optimizer_pps.value;
  const double opt_alone = double(W) * double(mem.state.opt_host) / pf.optimizer_pps.value;
  const double slower_beside = opt_alone * (pf.optimizer_pps.value / beside_pps - 1.0);
  const double under_bwd = pf.simulated ? host_opt + slower_beside + link - copied_down_s
                                        : t.cpu_optim_s + slower_beside;
  const double plain = pf.cpu_backend
                           ? comp + t.link_s + std::max(t.cpu_optim_s, t.nvme_s) + t.collectives_s
                           : std::max({comp, link, t.collectives_s}) + std::max(host_opt, t.nvme_s);
  t.hidden_share = 0;
  t.step_s = plain;
  t.bottleneck = bottleneck_of(t);
  if (!overlap) {
    t.step_after_s = t.step_deferred_s = t.step_plain_s = plain;
    t.expected_s = plain;
    t.schedule = "plain";
    return out;
  }
  // The optimizer under backward starts with the last micro-batch's backward (a backward
  // group's: the last group's backwards): each micro-batch is a forward (1) and a backward (2,
  // plus 1 when blocks are recomputed) in compute units.
  const double rc = fpt.recompute / fpt.forward;
  const double last_backwards = x.grouped_backward && x.forward_groups == 1.0 ? A : 1.0;
  const double start_share = (A * (3.0 + rc) - last_backwards * (2.0 + rc)) / (A * (3.0 + rc));
  // Its NVMe traffic from then on: the optimizer state's reads (less the sub-groups read
  // ahead from the step's start, in backward order: final norm, last blocks, ...), its
  // writes, the new params' writes, and the last backward pass's param reads.
  const OptimizerWindows w = optimizer_windows(where, mem, peaks, x);
  // Every local rank shares the node's NVMe bandwidth.
  out.deferred_pass = {uint64_t(w.deferred.read) * W, uint64_t(w.deferred.write) * W};
  out.after_backward_pass = {uint64_t(w.after_backward.read) * W,
                             uint64_t(w.after_backward.write) * W};
  const double window_s = double(W) * w.under_backward.seconds(pf);
  const double window_deferred = double(W) * w.deferred.seconds(pf);
  const double window_after = double(W) * w.after_backward.seconds(pf);
  // A step after one that clipped or overflowed only reads ahead under backward (the trainer
  // predicts the next will clip too) and defers its optimizer to the next forward, which
  // steps module i just before module i's forward: it overlaps the first forward group's
  // forwards (K micro-batches, strata.grouped_forwards), the share f0 = K / (A·(3 + r)) of
  // compute, and no more (the backward needs every module's forward). On the CPU backend the
  // optimizer's CPU work shares the cores.
  const double f0 =
      double(std::min<uint64_t>(uint64_t(mem.forward_group), uint64_t(A))) / (A * (3.0 + rc));
  out.first_forward_share = f0;
  if (pf.cpu_backend) {
    const double cl = comp + t.link_s;
    t.step_deferred_s = std::max(
        {cl + t.collectives_s + t.cpu_optim_s,
         cl * (1.0 - f0) + t.collectives_s + std::max(window_deferred, cl * f0), t.nvme_s});
  } else {
    // The pass hides under the first forward group's compute; the copies and collectives are
    // the backward's (gradient drains, reductions) or spread over the step, so they follow it.
    // Simulated H200, GPT-2 124M with the optimizer in host RAM: 162-165 ms a step where the
    // drains (75 ms) shared the forwards' share with the pass: planned 131.
    const double rest = std::max({comp * (1.0 - f0), link, t.collectives_s});
    // On a simulated device the launcher's forward and the copies (the host's memcpys) take a
    // core while the forwards' kernels run: the pass steps at its rate beside the launcher
    // (optimizer_pps_beside) through that window, at its own after it. Simulated H200 on a
    // 2-core Xeon, GPT-2 124M with 14% of its optimizer in host RAM (a pass longer than the
    // window only at the slower rate): 39-40 ms a step, planned 33 at the rate alone. On a GPU
    // the thread that launches the kernels (and waits for them) holds its core for the whole
    // step, the pass's overflow included: the pass steps beside it throughout, as under
    // backward.
    double host_pass = pf.simulated ? host_opt : host_opt + slower_beside;
    if (pf.simulated) {
      const double q = pf.optimizer_pps.value / beside_pps, window = comp * f0;
      host_pass = host_opt * q <= window ? host_opt * q : window + host_opt - window / q;
    }
    t.step_deferred_s =
        std::max(rest + std::max({host_pass, window_deferred, comp * f0}), t.nvme_s);
  }
  double after_backward = 0;
  if (pf.cpu_backend) {
    after_backward = std::max(
        comp + t.link_s + t.collectives_s + std::max(t.cpu_optim_s, window_after), t.nvme_s);
  } else {
    after_backward = std::max(
        std::max({comp, link, t.collectives_s}) + std::max(host_opt, window_after), t.nvme_s);
  }
  double overlapped = 0;
  if (pf.cpu_backend) {
    const double start = (t.compute_s + t.link_s) * start_share;  // before the device optimizer
    overlapped =
        std::max({comp + t.link_s + t.cpu_optim_s + t.collectives_s, start + window_s, t.nvme_s});
  } else {
    const double dev = std::max({comp, link, t.collectives_s});
    const double start = t.compute_s * start_share;  // before the device optimizer
    // Where undo state takes host memory the speculation stops once the gradients of the
    // modules it steps are final (Speculation::step_ready): the modules left are stepped
    // exactly, once the step is validated (its norm, after backward), by the optimizer alone
    // (host_opt's pace, no launches or drains beside it). Those gradients are final when their
    // drains have landed: on a simulated device the drains' memcpys from the last backward's
    // start on, on a GPU (its DMA) by the end of backward. Simulated H200, 2-core Xeon, the
    // optimizer in host RAM under backward: GPT-2 124M ~165-173 ms a step, planned 238 as if
    // stepped beside backward throughout; the 4-layer Llama ~330, planned 578; GPT-2 with 14%
    // of its optimizer in host RAM 41.7 ms, its last blocks stepped after backward's 31 ms.
    double opt_under = under_bwd;
    if (peaks.undo_wanted > 0 && under_bwd > 0) {
      const double stop_at = pf.simulated ? start + link - copied_down_s : dev;
      const double window = std::max(0.0, stop_at - start);
      if (window < under_bwd) {
        opt_under = std::max(stop_at, dev) - start + (1.0 - window / under_bwd) * host_opt;
      }
      // A simulated device's copies are the host's memcpys: the drains, then each module's new
      // parameters after its step, keep a core busy beside the optimizer to the pass's end, so
      // it steps at its rate beside the launcher throughout (slower_beside), stopped or not.
      // Simulated H200 on a 2-core Xeon, under backward: GPT-2 124M 185-197 ms a step (planned
      // 156 without this), the 4-layer Llama 368-417 (360), hostmem-190m 237 (233).
      if (pf.simulated) opt_under = std::max(opt_under, opt_alone + slower_beside + piece_s);
    }
    overlapped = std::max({dev, start + std::max(opt_under, window_s), t.nvme_s});
  }
  // Modules without room for their undo copies are stepped after backward.
  t.hidden_share = peaks.host.undo < peaks.undo_wanted
                       ? double(peaks.host.undo) / double(peaks.undo_wanted)
                       : 1.0;
  t.step_s = t.hidden_share * overlapped + (1.0 - t.hidden_share) * plain;
  // strata.optimizer.defer: which of the two a step after one that clipped runs ("auto" times
  // both on the run's first such steps and keeps the faster: predicted as the faster here).
  const std::string& defer = r.config.strata.optimizer_defer;
  t.clipped_deferred = defer == "always"  ? true
                       : defer == "never" ? false
                                          : t.step_deferred_s <= after_backward;
  t.step_after_s = t.clipped_deferred ? t.step_deferred_s : after_backward;
  t.step_plain_s = after_backward;
  t.falls_back = may_fall_back;
  expected_schedule(r, t);
  if (!may_fall_back) {  // nothing can make a step fall back
    t.step_after_s = t.step_deferred_s = t.step_s;
    t.step_plain_s = plain;
    t.clipped_deferred = false;
  }
  return out;
}

}  // namespace strata
