// The training loop: `strata train`'s engine.
//
// One step: for each of gradient_accumulation_steps micro-batches, run the architecture's
// training program (src/model/architecture.h): its acquires and releases go to the tier manager
// (src/tiers/tier_manager.h), which brings each module's parameters to the device just before
// its compute and drains each module's gradients to their home just after; its compute steps go
// to the model runner on the device's compute stream. Under the last micro-batch's backward the
// tier manager steps the optimizer of each module whose gradients are final (speculatively,
// validated after backward). Then: reduce the loss, the global gradient norm and the inf/nan
// flag over ranks; let the loss scaler decide (fp16: skip the step on overflow); keep, redo or
// finish the optimizer step with grad_mult = clip coefficient / loss scale.
//
// Batches, initialization and every kernel are deterministic, so a run stopped and resumed from
// a checkpoint reproduces the uninterrupted run bit for bit, whatever the placement of the state.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "src/tiers/counters.h"
#include "src/train/op_profile.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "strata/storage_faults.h"

namespace strata {

struct TrainOptions {
  std::string resume;         // "" fresh; "latest": newest in train.checkpoint_dir; else a path
  bool progress = true;       // progress lines on stdout
  int64_t stop_at_step = -1;  // behave as if stopped by a signal once this step is done
  const std::atomic<int>* stop_signal = nullptr;  // non-zero: stop after the current step
  std::shared_ptr<FaultPlan> storage_faults;      // tests: faults injected under the NVMe tier
  std::function<void(int64_t step)> on_step_end;  // called after each completed step
  // Tests: called in the middle of step `step` (0-based), after micro-batch `micro`'s
  // backward has been enqueued and before the next micro-batch or the step's reductions.
  std::function<void(int64_t step, int micro)> mid_step;
  // Tests: replaces the device the run created (e.g. by a wrapper around it).
  std::function<std::unique_ptr<Device>(std::unique_ptr<Device>)> wrap_device;
  // Tests: the wall time the schedules' trials (strata.optimizer.defer and .speculate "auto")
  // see for step `step` (0-based), given whether it stepped under backward and its measured
  // `seconds`.
  std::function<double(int64_t step, bool under_backward, double seconds)> trial_time;
};

struct TrainResult {
  int rank = 0;  // this process's rank, and the number of ranks
  int world_size = 1;
  // The micro-batches whose forwards ran together (strata.grouped_forwards, auto decided).
  int forward_group = 1;
  int64_t start_step = 0;      // first step run here (0, or resumed)
  int64_t end_step = 0;        // steps completed at the end
  std::vector<double> losses;  // train loss of each step run here
  // NVMe bytes read + written during each step run here (what a deferred optimizer step moves
  // counts in the step that ran it; evals and checkpoints between steps are not counted).
  std::vector<uint64_t> step_nvme_bytes;
  std::vector<uint64_t> step_device_bytes;  // the same for host<->device (the device tier)
  std::vector<uint64_t> step_device_in;     // of which host->device
  // How each step run here ran its optimizer: 0 after backward (strata.optimizer.overlap off,
  // or a skipped step), 1 under backward and kept (the modules whose gradients were final last
  // deferred to the next forward), 2 under backward and rolled back (restored, then redone or
  // skipped), 3 nothing under backward (the step before clipped or overflowed: the state was
  // read ahead), all of it deferred to the next forward.
  std::vector<uint8_t> optimizer_schedule;
  // Per step run here: 1 when an fp16 overflow skipped it.
  std::vector<uint8_t> step_skipped;
  std::vector<std::pair<int64_t, double>> eval_losses;  // (step, eval loss)
  // Preference data (DPO): (step, the held-out pairs' reward accuracy) at each eval, and each
  // step's reward accuracy over its pairs (TRL's rewards/accuracies).
  std::vector<std::pair<int64_t, double>> eval_accuracies;
  std::vector<double> accuracies;
  int64_t skipped_steps = 0;    // fp16 overflow skips in this run
  double loss_scale = 1.0;      // at the end (fp16; else 1)
  bool stopped_early = false;   // by signal or stop_at_step
  std::string last_checkpoint;  // path, "" if none written
  std::string metrics_error;    // the first failed write of the metrics log; "" if none
  uint32_t weights_crc = 0;     // CRC32C of all fp32 master weights
  double tokens_per_s = 0;      // over the steps run here
  // Time split over the steps run here, seconds: forward+backward (the fetch waits included)
  // and any thread's waits on NVMe I/O. The optimizer's schedule over them: the compute
  // stream's waits on parameter fetches, the optimizer pass (its I/O included) and the part of
  // it hidden under the backward (strata.optimizer.overlap) or under the next step (delayed
  // update), steps whose speculative update was undone and redone or skipped, the modules
  // that took, the sub-groups read ahead or kept (src/tiers/counters.h).
  double fwd_bwd_s = 0, io_wait_s = 0;
  ScheduleCounts schedule;
  // Training micro-batches run here that came with positions (chat data packed per sequence,
  // data.packing "sequence"), and those of them that attention masked per conversation (a row
  // held a conversation boundary); the others' rows each held one conversation, or a piece of
  // one, and ran plain causal attention (on a GPU, cuDNN's).
  int64_t micro_batches_with_positions = 0, micro_batches_per_sequence = 0;
  // Whether a delayed (one step stale) update ran.
  bool approximate = false;
  // Seconds in collectives over the steps run here (Communicator::busy_seconds of the three
  // communicators: gathers and reduce-scatters overlap compute, the step-end reductions block
  // it); 0 on one rank.
  double comm_s = 0;
  uint64_t comm_bytes = 0;  // bytes this rank sent to other ranks in the steps (not in evals)
  // Parameter fetches into the device cache (all-gathers when sharded) over this run, eval
  // included, and how many of them were prefetches issued ahead of use from the recorded
  // trace; gradient reduce-scatters issued (one per bucket; 0 on one rank), and how many of
  // them carried more than one module's gradients.
  uint64_t param_fetches = 0, param_prefetches = 0, grad_reductions = 0;
  uint64_t grad_shared_reductions = 0;
  struct TierUse {
    std::string name;  // device | host | nvme
    size_t capacity = 0, peak = 0;
    uint64_t bytes_in = 0, bytes_out = 0;
    size_t current = 0;          // in use at the end (host, nvme: this rank's resident state)
    size_t undo_room = 0;        // host: of capacity, the undo room taken (TierStats::undo_room)
    size_t undo_given_back = 0;  // host: of it, given back (TierStats::undo_given_back)
  };
  std::vector<TierUse> tiers;
  // The process's peak resident set (VmHWM of /proc/self/status, bytes; 0 where unknown): what
  // strata.host_memory_limit bounds, plus the device arena on the CPU backend, the model's
  // host-side buffers and the binary's own footprint.
  size_t peak_rss = 0;
  // VmRSS when train() was called (the binary, its libraries, the config), and whether the
  // device's memory is host memory (the CPU backend: its arena counts in the RSS).
  size_t base_rss = 0;
  bool device_in_rss = false;
  size_t end_rss = 0;  // VmRSS when the run ended (after the undo room was given back, if it was)
  // flops_profiler.enabled: the profiled step's ops (none when the step was not run here).
  std::optional<OpProfile> op_profile;
};

// Trains on every rank of the communicator strata.comm.backend gives (mpirun -np N: N ranks,
// ZeRO-3 sharded state, data-parallel batches; see src/tiers/tier_manager.h). `cfg` must have been
// resolved for that world size (train_batch_size = micro * accumulation * world size); every
// rank calls train() with the same config. Rank 0 alone prints, writes the JSONL log and moves
// `latest`; losses in the result are global (averaged over ranks) on every rank. A peer that
// dies or hangs makes the collectives fail after strata.comm.timeout_s with a message naming
// the rank; train() then returns that Status.
Result<TrainResult> train(const Config& cfg, const TrainOptions& opts);

// `strata eval`: the mean next-token cross-entropy of the model over every window of the token
// file data.source (the whole file: data.eval_fraction plays no part). With T = model.context
// (data.seq_len when set) and N tokens, windows start at token 0, T, 2T, ... while
// start + T + 1 <= N; each scores inputs [s, s+T) against targets [s+1, s+T+1). Batches of
// train_micro_batch_size_per_gpu windows per rank; under mpirun the ranks share the windows
// (ZeRO-3 sharded parameters gathered as in training). The model, its placement and its tiers
// are set up exactly as train() sets them up, so any placement evaluates (NVMe-homed
// parameters included), with the same forward kernels; no gradients are made and nothing is
// written (train.checkpoint_dir is not touched).
struct EvalOptions {
  // "" the initial weights (model.from_pretrained's, else train.seed's initialization); else a
  // checkpoint file or a sharded checkpoint's manifest. Its model must be the config's; its
  // train.seed and step need not match.
  std::string checkpoint;
};

struct EvalResult {
  int rank = 0;  // this process's rank, and the number of ranks
  int world_size = 1;
  double loss = 0;        // mean cross-entropy over every target token, nats
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // target tokens scored: windows * T
  int64_t windows = 0;
  int T = 0;                  // tokens per window
  int64_t corpus_tokens = 0;  // N
  // Preference data (DPO): loss is the DPO loss over every pair, against the initial model
  // (model.from_pretrained's weights, or train.seed's) as the reference; windows counts the
  // pairs' sequences, tokens their answers' tokens.
  bool preference = false;
  int64_t pairs = 0;
  double reward_chosen = 0, reward_rejected = 0, reward_accuracy = 0;
  double logp_chosen = 0, logp_rejected = 0;  // the checkpoint's mean log-probabilities
};

// Every rank calls evaluate() with the same config; every rank gets the global result. A file
// shorter than T + 1 tokens is kInvalidArgument naming data.source, its length and T.
Result<EvalResult> evaluate(const Config& cfg, const EvalOptions& opts);

// The world size the launcher (mpirun, srun) announces in the environment, before MPI is
// initialised (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_SIZE, SLURM_NTASKS...); 1 when none.
// The CLI resolves the config's batch triple with it.
int launcher_world_size();

}  // namespace strata
