// The planner behind `strata plan`: for a model, a batch and a machine, the bytes each tier
// needs under each placement of the training state, whether it fits, the predicted step time
// with the resource that bounds it, and the fastest feasible placement as a config that
// `strata train` runs as is. docs/PLANNER.md states every term and where its number comes from.
//
// Memory. The reservations are the memory model's (src/tiers/memory_model.h): module_homes()
// of the architecture's layout under the option's Placement (ShardLayout's 4 KiB shards with
// several GPUs, the optimizer ratio, the delayed update's second accumulator) and tier_needs()
// over the engine's own TierOptions::from_config of the request's config (tier_options_of),
// judged by tier_shortfall() — the very functions TierManager::create's preflight calls, so a
// plan that the tier manager would refuse is reported here as not fitting, with the same
// numbers. Host and NVMe needs are per node: the memory model's per-rank need times the
// GPUs. Per parameter, strata holds params (2 B in bf16/fp16), an fp32 gradient (4 B), fp32
// master weights (4 B) and two moments (8 B fp32, 4 B bf16): 18 B/param with fp32 moments,
// where the ZeRO paper counts 16 (it keeps fp16 gradients). The expected peaks and the time
// model have their own rules (docs/PLANNER.md) but take every module's size from module_homes.
//
// Time. A step is gradient_accumulation_steps micro-batches of forward+backward plus one
// optimizer pass. Each term is bytes or FLOPs divided by a rate from the machine profile
// (`strata probe`), or from the documented defaults when no profile is given:
//   compute      model FLOPs (6 per param per token + attention, + one more block forward when
//                activations are recomputed or offloaded) / measured GEMM rate
//   link         bytes crossing host<->device / host<->device bandwidth
//   nvme         bytes read and written on the swap paths / NVMe read, write bandwidth
//   cpu_optim    owned params with offloaded optimizer state / the CPU optimizer's params
//                per second
//   device_optim owned params with device-resident optimizer state x bytes the step moves per
//                param / device memory bandwidth (CPU backend: / the CPU optimizer's rate)
//   collectives  all-gather + reduce-scatter bytes / bus bandwidth (world > 1)
// How terms combine (what overlaps what) depends on the backend; see docs/PLANNER.md.
//
// Thread safety: plain functions over values; no global state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "src/comm/zeropp.h"
#include "src/model/architecture.h"
#include "src/tiers/placement.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata {

// ---- models -------------------------------------------------------------------------------

// A model as the planner sees it: a name to print and the shape, the config's own model
// section (one type for the config, the planner and the models). Every byte and FLOP the
// planner counts comes from the architecture strata builds from `shape`
// (create_architecture): its module layout, activation carve and FLOPs per token.
struct PlanModel {
  std::string name;   // preset name, "custom", the config's or the --hf directory's path
  ModelConfig shape;  // model.type and the model.* shape keys (model.from_pretrained with --hf)
  std::string note;   // printed beside the plan
};
// A GPT-2 of this shape (the other model.* keys at their defaults), named `name`.
PlanModel gpt_model(std::string name, int layers, int width, int heads, int vocab, int context,
                    bool tied_embeddings = true);

// GPT: gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, gpt3-6.7b, gpt3-13b, gpt3-175b. Llama
// (their config.json shapes: grouped-query attention, SwiGLU, untied head): llama2-7b,
// llama2-13b, llama2-70b, llama3-8b, llama3-70b, llama3.1-405b, qwen2.5-7b, qwen2.5-72b (q/k/v
// biases), mistral-7b. Unknown names are kNotFound listing the known ones.
Result<PlanModel> model_preset(const std::string& name);
std::vector<std::string> model_preset_names();
// Parameter count of strata's model at this shape: its architecture's layout (0 for a shape
// that is not a valid model).
uint64_t model_params(const ModelConfig& shape);
// Activations of a micro-batch at this shape: the runner's own carve (zero for a shape that is
// not a valid model; evaluate_placement reports that).
ActivationSizes activations_of(const ModelConfig& shape, int B, int T, DType dt,
                               ActivationMode mode);

// ---- the machine --------------------------------------------------------------------------

// Rates the time model divides by. Each carries where it came from ("probe <file>",
// "default", "--nvme"), printed beside the plan so that every number can be traced.
struct Rate {
  double value = 0;  // units given by the field
  std::string source = "default";
};

struct MachineProfile {
  bool cpu_backend = true;  // the device is the CPU backend (device memory = host RAM)
  Rate gemm_flops{1.0e11};  // device GEMM rate, FLOP/s per device
  // The rate of a whole training micro-batch by model width C and tokens per micro-batch
  // (B x T), from the probe (model_probe_shapes: small on the CPU backend, training's sizes on
  // a GPU); empty = gemm_flops everywhere. The planner
  // interpolates log-log in width, then in tokens, clamped at the ends (gemm_rate_at).
  struct GemmPoint {
    int width = 0;
    int tokens = 0;
    double flops = 0;  // FLOP/s (the planner's FLOP formula)
  };
  std::vector<GemmPoint> gemm_by_width;  // sorted by (tokens, width)
  Rate link_gbps{10.0};                  // host<->device, GB/s (CPU backend: host memcpy bandwidth)
  Rate host_copy_gbps{10.0};             // host memory copy bandwidth, GB/s
  // One thread's memcpy in module-sized pieces (host.copy_one_thread_gbps): what a CPU device
  // stream's copy runs at. 0: the profile has none (host_copy_gbps is taken).
  Rate stream_copy_gbps{0.0};
  Rate optimizer_pps{2.0e8};  // CPU optimizer, parameters per second (all threads)
  // The same with one thread fewer (cpu_optimizer.by_threads, interpolated): the rate of the
  // optimizer stepped under backward beside a device, where the thread that launches the
  // device's kernels steps the modules between its launches and keeps a core. 0: the profile has
  // no per-thread rates (optimizer_pps is taken).
  double optimizer_pps_beside = 0;
  Rate nvme_read_gbps{1.0};   // aggregate over the swap paths, GB/s
  Rate nvme_write_gbps{1.0};  //
  Rate collective_gbps{0.0};  // bus bandwidth, GB/s; 0 = unmeasured
  // Device memory bandwidth, GB/s: the optimizer on the device streams each parameter's
  // gradient, master weight, moments and new parameter through it (CUDA; the CPU backend's
  // device optimizer is the CPU optimizer, at optimizer_pps).
  Rate device_mem_gbps{2000.0};
  // Every NVMe case the probe ran (backend, block, queue depth): a config evaluated with the
  // planner gets the rates of the aio case it asks for, not the probe's recommended one.
  struct NvmeCase {
    std::string backend;
    size_t block_size = 0;
    int queue_depth = 0;
    double read_gbps = 0, write_gbps = 0;  // median, or fastest pass with `fastest`
  };
  std::vector<NvmeCase> nvme_cases;
  std::string aio_backend = "auto";
  size_t aio_block_size = 1 << 20;
  int aio_queue_depth = 8;
  // The simulated fast device (device.simulate; simulated_profile): compute is timed at its
  // preset's rates, the host's rates stay the profile's. Unset: a real device.
  bool simulated = false;
  SimulatedDeviceOptions sim;
};

// The profile of `host`'s machine running a config's simulated device (device.simulate,
// strata/device.h): the simulated device's memory is not host-addressable, so the tiers take a
// GPU's paths (cpu_backend false); compute is its GEMM rate for the GEMMs and its attention
// rates for attention (simulated_attention_seconds, the kernels' own rule); the link is the
// slower of its link and stream_copy_gbps (its copies are real host memcpys, each by its
// stream's thread, that take at least the link's time; host_copy_gbps where unmeasured); the
// optimizer on the device streams through its HBM; the CPU optimizer, the host's copies and NVMe
// keep `host`'s rates. The kernels' bytes over HBM and their launch time are not counted
// (docs/PLANNER.md).
MachineProfile simulated_profile(MachineProfile host, const SimulatedDeviceOptions& sim);

// The compute rate (FLOP/s) the planner uses for a model of `width` run at `tokens` per
// micro-batch: gemm_by_width interpolated, or gemm_flops when the profile has no table.
double gemm_rate_at(const MachineProfile& p, int width, int tokens);

// The bytes the device's optimizer moves a parameter: the fp32 gradient read, the fp32 master
// weight and both moments read and written, the new parameter written. The planner's
// device-optimizer term divides them by device.mem_gbps, which the probe measures the same way.
inline double device_optimizer_bytes_per_param(DType moments, DType params) {
  return 4.0 + 8.0 + 4.0 * double(dtype_size(moments)) + double(dtype_size(params));
}

// Defaults for a GPU machine (H100-class numbers, stated in docs/PLANNER.md) or the CPU
// backend on this kind of host.
MachineProfile default_profile(bool cpu_backend);

// The profile written by `strata probe` (JSON; magic "strata-machine-profile", version
// kMachineProfileVersion). A wrong magic, another version or a missing field is
// kInvalidArgument naming `origin`, the field, and the command that regenerates the file.
inline constexpr int kMachineProfileVersion = 1;
// `fastest`: take each rate from its fastest timed pass instead of the median (the machine's
// capability when other work shares it; what --validate compares with the fastest step).
Result<MachineProfile> parse_machine_profile(const std::string& json_text,
                                             const std::string& origin, bool fastest = false);
Result<MachineProfile> load_machine_profile(const std::string& path, bool fastest = false);

// The CPU optimizer at `beside_pps` parameters/s where it steps beside the device's step (the
// rate `strata train` measures for its kernel: cpu_optimizer_params_per_s): that becomes
// optimizer_pps_beside, and optimizer_pps (the rate alone) is scaled by the same factor, so
// that the profile's thread-count ratio between the two stays. A probe measures the CPU
// alone; beside a GPU's step it runs slower (the copies share the host's memory, the
// launcher a core), and the ratio the planner recommends is only as good as this rate.
void set_cpu_optimizer_rate(MachineProfile* profile, double beside_pps, const std::string& source);

struct Hardware {
  int gpus = 1;                         // ranks (world size)
  uint64_t gpu_mem = 0;                 // device memory per rank, bytes
  uint64_t host_mem = 0;                // host RAM for the host tier, per node, bytes
  std::vector<std::string> nvme_paths;  // swap directories
  uint64_t nvme_bytes = 0;              // free bytes on the swap paths (0 = unknown: no check)
};

// ---- the plan -----------------------------------------------------------------------------

// A placement the planner evaluates: the engine's Placement under a name.
struct PlacementOption {
  std::string name;  // "all-device", "opt-host", ..., or "config" for a config's own placement
  Placement where;
  // A config that leaves strata.placement.grads unset: add_placement moves the gradients as
  // the engine would (auto_grads_placement against the request's host budget).
  bool grads_auto = false;
};
// The seven options the planner compares, fastest-first in intent: params on device, host or
// NVMe; master and moments together on device, host or NVMe; gradients on the device with them,
// else on the host (what zero_optimization.offload_* alone says); optimizer_ratio 1.
std::vector<PlacementOption> placement_options();

// The config a plan assumes when none is given: the config defaults, with gradient clipping
// at 1.0 (what plan_config_json writes), one sequence per micro-batch and one micro-batch per
// step.
Config plan_default_config();

// What the planner is asked: a run's config, the machine and its rates. Every number of the run
// is read from `config` as `strata train` reads it — the model (model.*, its dtype), the batch
// (train_micro_batch_size_per_gpu, gradient_accumulation_steps, data.seq_len), the activations
// (strata.activations), ZeRO++ (zero_optimization.zero_quantized_weights, .zero_hpz_partition_size,
// .zero_quantized_gradients) and the engine's options, from which tier_options_of builds the tier
// manager's with the engine's own TierOptions::from_config (zero_optimization's buffer_count,
// sub_group_size, bucket sizes; strata.optimizer.overlap, .delayed_update, .read_ahead, .defer;
// gradient_clipping and fp16, which make the optimizer under backward keep undo copies). Its
// zero_optimization offload sections are not read: the placement evaluated says where the
// state lives. The accessors below are the values the planner reads, one place each.
struct PlanRequest {
  std::string model_name = "custom";  // printed: a preset's name, "custom", a config's path
  std::string model_note;             // printed beside the plan
  Config config = plan_default_config();
  Hardware hw;
  MachineProfile profile;

  // The model as a PlanModel: model_name, config.model, model_note.
  PlanModel model() const { return {model_name, config.model, model_note}; }
  // Names the request's model `m.name` and takes its shape, keeping config.model.dtype (the
  // precision is the run's: --dtype, a config's fp16/bf16).
  void set_model(const PlanModel& m);
  int micro_batch() const { return int(config.train_micro_batch_size_per_gpu); }
  int accumulation() const { return int(config.gradient_accumulation_steps); }
  // Tokens per sequence: data.seq_len, or the model's context when it is 0 ("auto").
  int seq() const { return config.data.seq_len > 0 ? config.data.seq_len : config.model.context; }
  DType dtype() const { return config.model.dtype; }
  DType moment_dtype() const { return config.strata.moment_dtype; }
  // strata.activations: device bytes per activation_plan(); kRecompute/kOffload add one block
  // forward per block to compute, kOffload adds its block inputs to the host tier and their
  // round trip to the link. An unknown name (the config parser refuses one) is kKeep.
  ActivationMode activations() const;
  // ZeRO++'s switches: the collectives' bytes per zeropp_traffic() (src/comm/zeropp.h), and the
  // device buffers the memory model counts for them (ZeroPPShape). The planner's ranks are one
  // node's, so qgZ's levels collapse into one.
  ZeroPPOptions zeropp() const;
};

struct TierBytes {
  uint64_t state = 0;        // homes of params/grads/master/moments in this tier
  uint64_t buffers = 0;      // working set (device) or staging (host) or swap overhead (nvme)
  uint64_t activations = 0;  // device: activation_bytes(); host: offloaded block inputs
  uint64_t capacity = 0;     // 0 = unknown/unbounded
  // The peak the run is expected to reach (what TrainResult::tiers reports), as opposed to
  // total(), the preflight reservation that decides fit: the device cache of offloaded params
  // fills free device memory; the host optimizer pipeline holds fewer modules than it reserves;
  // NVMe counts allocated extents, not swap-file slack. docs/PLANNER.md gives each rule.
  uint64_t peak = 0;
  // The peak of a run whose every step defers its optimizer step to the next forward (the
  // overlap, when each step clipped or overflowed, as step_after_s): nothing is stepped under
  // backward, so no undo state; the host holds the deferred pass's staging instead.
  uint64_t peak_deferred = 0;
  // What the optimizer under backward keeps to undo a step (TierOptions::undo_copies; every
  // module's master + moments): host copies of host/device-homed state, taken when the budget
  // has room; NVMe-homed state's old extents on the swap paths (the step goes to fresh ones).
  // Not part of total(): a run fits without them (host: steps the modules they do not cover
  // after backward; NVMe: copies to the host instead).
  uint64_t undo = 0;
  // Host: NVMe-homed optimizer state read ahead during backward beyond buffer_count sub-groups
  // (strata.optimizer.read_ahead: read_ahead_sub_groups() of the memory model), in the peaks.
  // Not part of total(): what the budget leaves.
  uint64_t read_ahead = 0;
  uint64_t total() const { return state + buffers + activations; }
};

struct TimeTerms {
  double gemm_flops = 0;  // the GEMM rate used (FLOP/s), after the width lookup
  double compute_s = 0, link_s = 0, nvme_s = 0, cpu_optim_s = 0, collectives_s = 0;
  // The optimizer on the device (device-resident master weights and moments): in the compute
  // stream's order, so it adds to compute.
  double device_optim_s = 0;
  // A simulated device (MachineProfile::simulated): the kernels a step launches on its compute
  // stream, which compute_s holds with their launch time; 0 elsewhere.
  uint64_t device_kernels = 0;
  // The share of the optimizer that runs under backward: 1 when the undo copies fit in the host
  // budget (or none are needed), less by the share of them that does not; 0 without overlap.
  double hidden_share = 0;
  double step_s = 0;  // combined (see docs/PLANNER.md)
  // A step after one that clipped or overflowed, as the run will step it (strata.optimizer.
  // defer: "always" deferred into the next forward, "never" after backward, "auto" the faster of
  // the two predicted here, as the trainer keeps the faster it measures). Equal to step_s when
  // the overlap is off or nothing can make a step fall back.
  double step_after_s = 0;
  double step_deferred_s = 0;  // such a step deferred into the next forward
  // Such a step with the optimizer after backward: the plain schedule's (overlap off), or with
  // the overlap the state read ahead under backward stepped first, the pass waiting only for
  // the reads of the rest (its writes drain behind), within the step's NVMe time.
  double step_plain_s = 0;
  bool clipped_deferred = false;  // step_after_s is step_deferred_s
  // The overlap is on and clipping or fp16 can make a step fall back: step_after_s applies.
  bool falls_back = false;
  // The steady-state step of the schedule the run picks, and its name: "plain" (the overlap
  // off), "under backward" (step_s), "next forward" (step_deferred_s) or "after backward"
  // (step_plain_s). A step clips when the config simulates a device whose gradient norm
  // (device.simulate_grad_norm) exceeds gradient_clipping, else it is taken not to; a step that
  // does not clip runs under backward unless strata.optimizer.speculate is "never", or "auto"
  // on a device that is not the host with the other schedule predicted faster (the trainer keeps
  // the faster it measures); one that clips (or is not speculated) runs as step_after_s.
  double expected_s = 0;
  std::string schedule;
  // A step that does not clip runs under backward (step_s) rather than as step_after_s:
  // strata.optimizer.speculate's choice, as expected_s's; and whether no step can be one (the
  // simulated norm over the threshold: every step clips).
  bool speculates = false;
  bool every_step_clips = false;
  std::string bottleneck;  // name of the largest term
};

struct PlanOption {
  PlacementOption placement;
  TierBytes device, host, nvme;
  bool fits = false;
  bool runnable = true;          // false: the backend cannot run this placement (why in `why`)
  std::vector<std::string> why;  // each shortfall, with needed vs available
  TimeTerms time;
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0, link_bytes = 0, flops = 0;
  // With the overlap and clipping or fp16 (a step may fall back), the NVMe bytes of the
  // optimizer's pass that such a step waits on, per node: deferred into the next forward (the
  // first micro-batch's forward waits module by module on them), or after backward (what the
  // read-ahead under backward and the writes that drain behind leave). step_deferred_s and
  // step_plain_s are these over the disk's rates; tests/bench/bench_step_bound.sh puts fio's rate
  // on the same bytes (the schedule's own bound). Zero without the overlap.
  struct PassBytes {
    uint64_t read = 0, write = 0;
  } deferred_pass, after_backward_pass;
  // The share of compute a deferred pass overlaps: the forwards of the first forward group
  // (strata.grouped_forwards, `forward_group` micro-batches; 1: the first micro-batch's).
  double first_forward_share = 0;
  int forward_group = 1;
  // Whether the first forward group's backwards run together too (strata.grouped_backwards:
  // one rank, forward_group > 1): one parameter fetch and one gradient drain per module for it.
  bool backward_grouped = false;
};

// The optimizer ratio (zero_optimization.offload_optimizer.ratio) the planner recommends for a
// placement whose master weights and moments are offloaded: the largest ratio (the least
// optimizer state on the device; the device keeps whole modules, the first in module order) at
// which the placement fits and its step is within kRatioSlack of the fastest that any ratio
// that fits reaches. The step weighed is the expected one (TimeTerms::expected_s), except with
// gradient clipping on and the norm not known (no device.simulate): then the step a clipped
// step runs (step_after_s), the longer, so that the ratio holds whatever the clipping (the
// norm is over the threshold in the first steps of nearly every run). Where the host's
// optimizer hides under the device's compute already, that is 1; where device memory leaves no
// room, 1 too.
inline constexpr double kRatioSlack = 1.05;
struct RatioAdvice {
  int option = -1;             // index in PlanReport::options
  double ratio = 1.0;          // recommended
  TimeTerms time;              // the option at that ratio
  bool clipped = false;        // the step weighed is the clipped one (step_after_s)
  double step_s = 0;           // the step weighed at that ratio
  double step_at_1_s = 0;      // the step weighed at ratio 1
  double fastest_s = 0;        // the fastest step weighed of any ratio that fits
  double fastest_ratio = 1.0;  // ... at this ratio
  int candidates = 0;          // ratios evaluated (one per module boundary)
};

struct PlanReport {
  PlanRequest request;
  uint64_t params = 0;
  std::string model;  // the architecture's describe(): its type and shape, in its own words
  std::vector<PlanOption> options;
  int best = -1;   // index of the fastest feasible option; -1 when none fits
  int asked = -1;  // index of the option a config asked for (strata plan --config); -1 none
  // advise_optimizer_ratio's advice, per option it was asked for; plan_config_json writes an
  // option's recommended ratio.
  std::vector<RatioAdvice> ratio_advice;
  const RatioAdvice* advice_for(int option) const {
    for (const auto& a : ratio_advice) {
      if (a.option == option) return &a;
    }
    return nullptr;
  }
};

// Evaluates every placement option. Fails only on a malformed request (kInvalidArgument).
Result<PlanReport> make_plan(const PlanRequest& request);
// Evaluates one placement: the request's checks (the model's shape by create_architecture's
// own, the batch, the sequence within the context), then plan_memory, plan_peaks and plan_time
// (src/plan/plan_parts.h). A malformed request is kInvalidArgument.
Result<PlanOption> evaluate_placement(const PlanRequest& request, const PlacementOption& p);

// The placement a parsed config asks for: the engine's parse_placement (zero_optimization.
// offload_* + strata.placement, the optimizer ratio), named after the option of
// placement_options() it equals, else "config". An unknown tier name is the engine's error.
// With strata.placement.grads unset, grads_auto is set (the gradients' home is decided against
// the host budget, which only the request knows: add_placement).
Result<PlacementOption> placement_of_config(const Config& cfg);
// The index in report.options of `p`'s placement: the named option with the same Placement, else
// `p` evaluated and appended (report.best still chooses among the named options only). With
// p.grads_auto the gradients first go where TierManager::create would put them: to NVMe when
// the host need with them on the host exceeds report.request.hw.host_mem and the need with them
// on NVMe is smaller (auto_grads_placement), which may name another option (all-nvme).
Result<int> add_placement(PlanReport& report, const PlacementOption& p);
// A PlanRequest from a config: the config itself (its sequence length resolved: data.seq_len,
// else its model's context), named "config", with the NVMe rates of the config's aio case when
// the profile measured it.
PlanRequest request_from_config(const Config& cfg, const Hardware& hw,
                                const MachineProfile& profile);
// The tier manager's options for one rank of `request` under `placement`: the engine's
// TierOptions::from_config of request.config with each rank's share of the node's host memory
// (hw.host_mem / hw.gpus) as strata.host_memory_limit, the swap paths hw.nvme_paths, and the
// activation stash of `acts`. What evaluate_placement weighs and TierManager::create would
// check for the same config on that machine.
TierOptions tier_options_of(const PlanRequest& request, const Placement& placement,
                            const ActivationSizes& acts);

// Adds to report.ratio_advice the recommended ratio (RatioAdvice) of report.options[option],
// when that option's master weights and moments are both offloaded (else adds nothing):
// evaluate_placement at each ratio that keeps a different set of whole modules on the device.
// Fails only as evaluate_placement does.
Status advise_optimizer_ratio(PlanReport& report, int option);

// The config (JSON text) `strata train` runs as is for `option`: model, batch, precision,
// zero_optimization offload sections (nvme_path from hw.nvme_paths, the ratio of the option's
// RatioAdvice when there is one), aio block, prefetch.
std::string plan_config_json(const PlanReport& report, const PlanOption& option);
// The value of strata.written_by in every config plan_config_json writes: `strata plan
// --write-config` replaces an existing file only when it holds this mark (or with --force).
inline constexpr const char* kPlanWrittenBy = "strata plan";
// The description every chart plan_svg draws holds: `strata plan --svg` replaces an existing
// file only when it holds it (or with --force).
inline constexpr const char* kPlanSvgMark = "<desc>written by strata plan</desc>";
std::string plan_json(const PlanReport& report);
std::string plan_table(const PlanReport& report);
// How `option`'s step runs, as indented lines (plan_table gives the best placement's): the
// micro-batches grouped, where a step after one that clipped and one after one that did not
// run, and what the optimizer under backward holds.
std::string schedule_notes(const PlanReport& report, const PlanOption& option);
// Stacked bars (one per placement) of the time terms, the step time marked; standalone SVG.
std::string plan_svg(const PlanReport& report);

// Capacity mode: the largest model (layers scaled at the preset's width/heads, or width scaled
// with layers fixed) whose best placement still fits. Returns the largest fitting shape, or
// kOutOfMemory when even one layer does not fit.
struct CapacityResult {
  PlanModel model;
  uint64_t params = 0;
  PlanReport report;  // the plan at that size
};
Result<CapacityResult> max_model(const PlanRequest& request);

}  // namespace strata
