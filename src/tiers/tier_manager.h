// TierManager: where every piece of training state lives, and the only thing that moves it.
//
// Three tiers: device (the Device's memory: HBM, or the CPU backend's capped arena), host (a
// byte-budgeted buffer pool, pinned when offload_*.pin_memory), and nvme (swap files on one or
// more paths, read and written through the storage engine). Per module m the manager holds:
//   P[m]     low-precision parameters (model dtype)      home: placement.params
//   MASTER   fp32 master weights                         home: placement.master
//   MOM      first and second moments, contiguous        home: placement.moments
//   GACC     fp32 gradient accumulator                   home: placement.grads (device/host/nvme)
// plus transient device buffers: a cached device copy of P[m] while it is needed, and a fresh
// gradient buffer per micro-batch that is drained to GACC as soon as the module's backward ends.
// Each object has a stable id "<module>.<kind>", independent of where it is.
//
// Device cache policy (src/tiers/cache_policy.h, the code `strata trace replay` runs too): the
// first step of a phase records the order in which parameters are acquired; later steps know
// every object's next use. Eviction takes the cached object used furthest in the future
// (Belady); after each acquire the manager prefetches upcoming objects up to
// stage3_prefetch_bucket_size bytes in flight, never evicting something needed sooner; an
// object whose reuse distance exceeds stage3_max_reuse_distance is dropped after use; objects
// under stage3_param_persistence_threshold elements stay once fetched. If the order changes,
// the manager logs it, fetches on demand for the rest of that step and re-records.
//
// Streams: fetches run on the device's h2d stream (an NVMe fetch first waits for its read on
// that stream), gradient drains on the d2h stream, compute waits on events. Nothing is freed
// while queued work may still use it (frees wait on the last-use event).
//
// Errors: allocation failures name the tier, bytes needed and capacity and the config key to
// change; I/O failures inside stream callbacks are kept and returned by the next sync point
// (end_backward, optimizer_step), so a failed read never feeds an optimizer step.
//
// Thread safety: one host thread drives the manager; its stream callbacks run on the device's
// stream threads and only touch internally locked state (counters, the first async error).
//
// The parts, one concern per file in src/tiers/: placement and options (placement.h), the
// memory model behind the preflight (memory_model.h), the homes and the host/NVMe tiers
// (homes.h), the device cache (device_cache.h, with ZeRO-3 gathers in zero3_gather.cc) and its
// policy (cache_policy.h), gradient drains and reduce-scatter buckets (grad_buckets.h) and
// gradient accumulators on NVMe (grad_spill.h), the
// optimizer pipeline (optimizer_pipeline.h), the optimizer under backward
// (speculation.h), the delayed update (delayed_update.h), offloaded activations
// (activation_stash.h), checkpoints of tier state (tier_checkpoint.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "src/checkpoint/checkpoint.h"
#include "src/model/architecture.h"
#include "src/tiers/counters.h"
#include "src/tiers/placement.h"
#include "src/tiers/trace.h"
#include "strata/buffer_pool.h"
#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/optimizer.h"
#include "strata/status.h"
#include "strata/storage.h"

namespace strata {

struct TierStats {
  size_t capacity = 0;
  size_t current = 0;
  size_t peak = 0;
  uint64_t bytes_in = 0;   // bytes moved into this tier
  uint64_t bytes_out = 0;  // bytes moved out of this tier
  // Device tier only: parameter fetches into the device cache (all-gathers when sharded), and
  // how many of them were prefetches issued ahead of use from the trace.
  uint64_t fetches = 0;
  uint64_t prefetches = 0;
  // Device tier, sharded only: gradient reduce-scatters issued (one per bucket), and how many
  // of them carried the gradients of more than one module.
  uint64_t grad_reductions = 0;
  uint64_t grad_shared_reductions = 0;
  // NVMe tier only: bytes of reads and writes asked for (bytes_in/out count them as they
  // complete; a write behind a step may land in the next).
  uint64_t bytes_queued = 0;
  // Host tier only: of `capacity`, the undo room taken (Homes::undo_capacity: regions the
  // optimizer under backward took for undo state, the most held at once; the rest is the
  // arena), and of it the bytes given back (release_undo_room).
  size_t undo_room = 0;
  size_t undo_given_back = 0;
};

// What the steps since the last take_times() call did: the optimizer's schedule (its times
// and counts) and any thread's waits on NVMe I/O, seconds.
struct TierTimes {
  ScheduleCounts schedule;
  double io_wait_s = 0;
};

struct TierShortfall;  // src/tiers/memory_model.h

// Also the ActivationStore of strata.activations = offload (the functions at the end).
class TierManager : public ActivationStore {
 public:
  // Builds the tiers and checks that the plan fits BEFORE allocating anything: every tier's
  // need (state + buffers + working set; device also the activations: `activation_bytes` per
  // set, options.forward_group sets, or as many as auto_forward_group decides for 0) against
  // its capacity.
  // The device's working set is the most that the architecture's training program holds at
  // once (program_peak_bytes). `shortfall`, if given, receives which tiers did not fit (all
  // false when the preflight passed or failed on something else), so a caller can advise
  // without reading the message.
  static Result<std::unique_ptr<TierManager>> create(Device& device, const Architecture& arch,
                                                     DType dt, DType moment_dt,
                                                     const TierOptions& options,
                                                     size_t activation_bytes,
                                                     TierShortfall* shortfall = nullptr);
  ~TierManager();

  // Fresh state: init(m, begin, count, out) fills out[0, count) with elements [begin, begin +
  // count) of module m's fp32 master weights (Architecture::init_range,
  // HfCheckpointReader::read_range), and its failure ends the init. It is asked for this
  // rank's real elements of each module only (its shard's, sharded), modules in order: the
  // whole shard into a home the host can address, else one sub-group at a time into one host
  // piece (so the host never holds a module's master weights whole), each split into ranges
  // that init fills from several threads at once (a 1 Mi-element range a task; `init` must be
  // thread-safe and give element k the same value whatever range asks for it). The shard's padding
  // is zero; moments start at zero; the low-precision parameters are derived (a sub-group at a
  // time) and written to their homes.
  using InitFn = std::function<Status(int m, size_t begin, size_t count, float* out)>;
  Status init_state(const InitFn& init);

  // --- one step -------------------------------------------------------------------------
  void begin_phase(const std::string& phase);  // "train" or "eval": one trace per phase
  // Before each training micro-batch: the device room prefetches leave for its gradients.
  void begin_micro(int micro);
  // Device pointer to P[m], valid for work enqueued on the compute stream until release.
  Result<const void*> acquire_params(int m);
  void release_params(int m);
  // A zeroed gradient buffer for module m for micro-batch `micro` (device memory, or on the CPU
  // backend the first micro-batch's accumulator itself: GradBuckets::acquire).
  Result<float*> acquire_grads(int m, int micro);
  // After module m's backward: drain its gradient buffer into GACC[m] (copy for micro 0, add
  // for later ones) on the d2h stream; with `last`, also reduce its norm and inf/nan flag.
  void drain_grads(int m, int micro, bool last);
  // A backward group (backward_grouped()): a zeroed device buffer for module m's gradients of a
  // further micro-batch of the group, its backward computed into it as into acquire_grads'
  // buffer; add_grad_part then adds it to that buffer on the compute stream (the same fp32 sums,
  // in micro-batch order, as the host's accumulation) and frees it. The group's one
  // drain_grads follows the last part's add.
  Result<float*> acquire_grad_part(int m);
  void add_grad_part(int m, float* part);
  // Waits for every drain; returns the first asynchronous error; then grad_stats() is valid.
  Status end_backward();
  GradStats grad_stats() const;
  // Steps every module's optimizer state with grad = GACC * grad_mult, pipelined over NVMe
  // reads/writes, writing the new parameters to their homes (and cached device copies).
  // NVMe writes are left draining behind later work (reads of the same extent wait for them);
  // flush_writes() waits for them all and for the new parameters' copies to the device, and
  // returns the first failure.
  // With `defer` (the exact overlap whatever the clipping), the modules not already stepped
  // under backward are stepped later, in module order, each just before its parameters are
  // next acquired or fetched: the next forward's acquire of module m (or a prefetch of it)
  // steps the pass through m on the host thread while the device runs the forward of the
  // modules before it, so module m's forward waits only for module m's update. The numbers are
  // those of the plain step. finish_pending_step() completes it; so do acquire_grads,
  // end_backward, the next optimizer_step/skip_step, flush_writes (and so save, load,
  // weights_crc) and start_delayed_update. A speculation begun meanwhile starts when it
  // completes.
  Status optimizer_step(const OptimizerHyper& hyper, float grad_mult, bool defer = false);
  Status flush_writes();
  // Completes a deferred optimizer step and a pending delayed update, and waits for their new
  // parameters' copies to the device (their staging back in the host tier); call before
  // evaluating.
  Status finish_pending_step();

  // --- the optimizer under backward -----------------------------------------------------
  // Before the step's last micro-batch's backward: each module whose gradients become final
  // (drain_grads with `last`) is stepped by step_ready() with (hyper, grad_mult) as if no
  // clipping applies and no overflow occurred — its state fetched through the same read-ahead
  // pipeline, its new parameters written to their homes (and cached device copy) — while the
  // device runs the backward of the modules before it. With `keep_undo` (clipping on, or
  // fp16) each stepped module first keeps what a rollback restores: master weights and moments
  // homed on NVMe stay on the disk (the step is written to fresh shadow extents, the old ones
  // are kept) when the swap files have room for them; other state, or NVMe state without that
  // room, is copied to the host tier. When there is room for neither, the remaining modules
  // wait for validation.
  // Then exactly one of: optimizer_step(h, mult) — keeps the speculative updates if (h.lr,
  // h.step, mult) equal the speculated ones (the old extents are freed), else restores and
  // redoes them, and steps the modules not yet stepped; or skip_step() — restores them and
  // re-derives their parameters (the step is skipped). Either way the result is bit-identical
  // to the non-overlapped schedule. A restore without undo state (bf16 without clipping hit
  // non-finite gradients) fails with INVALID_ARGUMENT naming strata.optimizer.overlap.
  // With `step_modules` false, nothing is stepped early: the state is only read ahead during
  // backward (the trainer's choice when the last step clipped or overflowed, so that this one
  // likely will too and a speculative step would be wasted).
  void begin_speculation(const OptimizerHyper& hyper, float grad_mult, bool keep_undo,
                         bool step_modules = true);
  // Steps the modules whose gradients are final; with `wait_all` (after the whole backward has
  // been enqueued) waits for and steps every remaining one, else only those already final.
  Status step_ready(bool wait_all);
  // The step is skipped (overflow): undo what the speculation did. Also call it when no
  // speculation ran, so the step's bookkeeping is reset.
  Status skip_step();
  // Whether the last speculation stepped part of its modules after backward because their undo
  // room was still being made ready (a warm-up step, not yet the schedule's own).
  bool undo_not_ready() const;
  // The run steps nothing under backward from now on (strata.optimizer.speculate "auto"
  // settled on not): gives the host tier's undo room back (Speculation::release_undo_room).
  // Between steps; a deferred step may be pending. Returns the bytes given back.
  size_t release_undo_room();

  // --- delayed parameter update (strata.optimizer.delayed_update) ---------------------------
  // After end_backward and validation: steps every module with GACC * grad_mult on a
  // background thread and returns at once; the gradient accumulators swap, so the next step's
  // backward fills the other one. The new parameters go to host shadows, not to their homes, so
  // the next step's forward and backward see the parameters before this update (one step
  // stale, as ZeRO-Offload's DPU) whatever the thread's timing.
  Status start_delayed_update(const OptimizerHyper& hyper, float grad_mult);
  // Waits for the pending delayed update and applies its parameters to their homes and cached
  // device copies; a no-op when none is pending. Call it between backward and the next
  // forward; save(), weights_crc() and flush_writes() call it first.
  Status finish_delayed_update();
  Status end_phase();

  // --- checkpoints ----------------------------------------------------------------------
  Status save(const std::string& path, const CheckpointMeta& meta);
  // Verifies, then loads master and moments into their homes and derives the parameters.
  Status load(const std::string& path);
  // Sharded checkpoints (world size > 1, or any run resuming from one): this rank's shard of
  // every module (its real elements only) is written to `path` with meta.shard_* filled in.
  // load_shards() rebuilds this rank's shards from the files of ANY world size (`paths` are
  // the old ranks' files in rank order), reading each once and copying the overlap of each
  // old shard with this rank's shard, so 3 ranks can resume on 2 or on 1.
  Status load_shards(const std::vector<std::string>& paths);
  // CRC32C of this rank's fp32 master weights (its shards' real elements), read a sub-group at
  // a time from homes the host cannot address; 0 when they cannot be read.
  uint32_t weights_crc();
  int world_size() const;
  int rank() const;
  // This rank's shard of module m: [offset, offset + count) of the module's elements.
  size_t shard_offset(int m) const;
  size_t shard_count(int m) const;

  TierStats stats(Tier t) const;
  TierTimes take_times();
  const Placement& placement() const { return opt_.placement; }
  // The activation sets counted for the device (strata.grouped_forwards, auto decided): the
  // micro-batches a forward group may hold.
  int forward_group() const { return opt_.forward_group; }
  // Whether a forward group's backwards run together, module by module
  // (strata.grouped_backwards): a group of more than one micro-batch, one rank.
  bool backward_grouped() const;
  std::string describe() const;  // one line per tier: capacity and what lives there
  const Trace* trace(const std::string& phase) const;
  std::string object_name(int object) const;

  // --- offloaded activations (strata.activations = offload) -------------------------------
  // Block inputs in the host-tier buffers reserved by TierOptions::stash_*: a stash is a
  // device-to-host copy on the d2h stream after the compute stream's work so far; a restore a
  // host-to-device copy on the h2d stream after the compute stream's work so far and after
  // every stash; compute_waits_activation makes the compute stream wait for the latest of
  // either (timed, counted in ScheduleCounts::compute_wait_s, on a host-addressable device). The
  // bytes count in the host tier's bytes_in/out and the device tier's bytes_out/in. A bad layer
  // or size is an error naming strata.activations, also kept for end_backward.
  Status stash_activation(int layer, const void* dev, size_t bytes) override;
  Status restore_activation(int layer, void* dev) override;
  void compute_waits_activation(int layer) override;

 private:
  struct Impl;
  explicit TierManager(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  TierOptions opt_;
};

}  // namespace strata
