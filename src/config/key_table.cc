// The table of every accepted config key (key_table.h). When a feature lands, its keys' reason
// goes to nullptr here (and docs/CONFIG.md is regenerated from the table).
#include "src/config/key_table_builder.h"

namespace strata::config_internal {
namespace table {

void TableBuilder::add_training_keys() {
  // --- batch, clipping, printing ------------------------------------------------------------
  group("DeepSpeed: batch, clipping, printing");
  add(F("train_batch_size", Int(1, kMaxInt), STRATA_M(train_batch_size),
        "global batch: micro x accumulation x world size", nullptr, kAuto, "derived"));
  add(F("train_micro_batch_size_per_gpu", Int(1, kMaxI32), STRATA_M(train_micro_batch_size_per_gpu),
        "sequences per rank per forward/backward", nullptr, kAuto,
        "derived (1 if only this is missing)"));
  add(F("gradient_accumulation_steps", Int(1, kMaxI32), STRATA_M(gradient_accumulation_steps),
        "micro-batches per optimizer step", nullptr, kAuto, "derived (1 if only this is missing)"));
  add(F("gradient_clipping", Real(0, kInf, false, true), STRATA_M(gradient_clipping),
        "max global gradient L2 norm; 0 = off (auto: 1.0)", nullptr, kAuto));
  add(F("steps_per_print", Int(1, kMaxInt), STRATA_M(steps_per_print), "steps between log lines"));
  add(F("wall_clock_breakdown", Bool(), STRATA_M(wall_clock_breakdown),
        "DeepSpeed's per-phase timers", kTimers));

  // --- fp16 / bf16 ----------------------------------------------------------------------------
  group("DeepSpeed: fp16 / bf16");
  add(F("fp16.enabled", Bool(), STRATA_M(fp16.enabled),
        "fp16 params/activations (auto: model.from_pretrained's dtype is float16)", nullptr,
        kAuto));
  add(F("fp16.loss_scale", Real(0, kInf, false, true), STRATA_M(fp16.loss_scale),
        "static loss scale; 0 = dynamic; 20 overflows in a row at it stop the run"));
  add(F("fp16.initial_scale_power", Int(0, 62), STRATA_M(fp16.initial_scale_power),
        "dynamic: initial scale 2^power"));
  add(F("fp16.loss_scale_window", Int(1, kMaxI32), STRATA_M(fp16.loss_scale_window),
        "dynamic: overflow-free steps before the scale doubles"));
  add(F("fp16.hysteresis", Int(1, kMaxI32), STRATA_M(fp16.hysteresis),
        "dynamic: overflows tolerated before the scale halves"));
  add(F(
      "fp16.consecutive_hysteresis", Bool(),
      [](Config& c, const json& v) { c.fp16.consecutive_hysteresis = v.get<bool>() ? 1 : 0; },
      [](const Config& c) -> json { return c.fp16.consecutive_hysteresis != 0; },
      "dynamic: refill hysteresis after an overflow-free step"));
  add(F("fp16.min_loss_scale", Real(0, kInf, true, true), STRATA_M(fp16.min_loss_scale),
        "dynamic: floor of the scale; an overflow at it stops the run"));
  add(F("fp16.auto_cast", Bool(), STRATA_M(fp16.auto_cast), "cast module inputs to fp16", kNoCast));
  add(F("bf16.enabled", Bool(), STRATA_M(bf16.enabled),
        "bf16 params/activations (auto: model.from_pretrained's dtype is bfloat16)", nullptr,
        kAuto));

  // --- optimizer --------------------------------------------------------------------------------
  group("DeepSpeed: optimizer");
  add(F("optimizer.type", Enum("Adam|AdamW|Adagrad|Lion"), STRATA_M(optimizer.type),
        "optimizer (case-insensitive); required when the section is given"));
  add(F("optimizer.params.lr", Real(0, kMaxF32, true, false), STRATA_M(optimizer.lr),
        "learning rate (auto: scheduler.params.warmup_max_lr if given, else 1e-3)", nullptr,
        kAuto));
  add(F(
      "optimizer.params.betas", Betas(),
      [](Config& c, const json& v) {
        c.optimizer.beta1 = v[0].get<double>();
        c.optimizer.beta2 = v[1].get<double>();
      },
      [](const Config& c) -> json {
        return json::array({c.optimizer.beta1, c.optimizer.beta2});
      },
      "[beta1, beta2], each in [0, 1) (auto: [0.9, 0.999])", nullptr, kAuto));
  add(F("optimizer.params.eps", Real(0, 1, true, false), STRATA_M(optimizer.eps),
        "denominator epsilon (auto: 1e-8)", nullptr, kAuto));
  add(F("optimizer.params.weight_decay", Real(0, kMaxF32), STRATA_M(optimizer.weight_decay),
        "weight decay (auto: 0)", nullptr, kAuto));
  add(F("optimizer.params.adam_w_mode", Bool(), STRATA_M(optimizer.adam_w_mode),
        "Adam: decoupled weight decay (AdamW)"));
  add(F("optimizer.params.torch_adam", Bool(), STRATA_M(optimizer.torch_adam),
        "DeepSpeed: use torch's Adam", kOneAdam));
  add(F("optimizer.params.bias_correction", Bool(), STRATA_M(optimizer.bias_correction),
        "Adam bias correction"));

  // --- scheduler --------------------------------------------------------------------------------
  group("DeepSpeed: scheduler");
  add(F("scheduler.type", Enum("WarmupLR|WarmupDecayLR|WarmupCosineLR"), STRATA_M(scheduler.type),
        "lr schedule; absent = constant optimizer.params.lr", nullptr, 0, "\"\" (constant)"));
  add(F("scheduler.params.warmup_min_lr", Real(0, kMaxF32), STRATA_M(scheduler.warmup_min_lr),
        "WarmupLR/WarmupDecayLR: lr at step 0 (auto: 0)", nullptr, kAuto));
  add(F("scheduler.params.warmup_max_lr", Real(0, kMaxF32, true, false),
        STRATA_M(scheduler.warmup_max_lr), "WarmupLR/WarmupDecayLR: lr after warmup", nullptr,
        kAuto, "optimizer.params.lr"));
  add(F("scheduler.params.warmup_num_steps", Int(0, kMaxInt), STRATA_M(scheduler.warmup_num_steps),
        "warmup length (WarmupLR/WarmupDecayLR: at least 2, as in DeepSpeed; auto: 10% of "
        "train.steps, rounded up)",
        nullptr, kAuto));
  add(F("scheduler.params.warmup_type", Enum("log|linear"), STRATA_M(scheduler.warmup_type),
        "warmup curve"));
  add(F("scheduler.params.total_num_steps", Int(1, kMaxInt), STRATA_M(scheduler.total_num_steps),
        "WarmupDecayLR/WarmupCosineLR: schedule length", nullptr, kAuto, "train.steps"));
  add(F("scheduler.params.warmup_min_ratio", Real(0, 1), STRATA_M(scheduler.warmup_min_ratio),
        "WarmupCosineLR: lr ratio at step 0"));
  add(F("scheduler.params.cos_min_ratio", Real(0, 1), STRATA_M(scheduler.cos_min_ratio),
        "WarmupCosineLR: lr ratio at the end"));
  add(U("scheduler.params.last_batch_iteration", Int(-1, kMaxInt), "-1",
        "DeepSpeed: step to resume the schedule from", kResume));
}

void TableBuilder::add_zero_keys() {
  // --- zero_optimization --------------------------------------------------------------------
  group("DeepSpeed: zero_optimization");
  add(F("zero_optimization.stage", Int(0, 3), STRATA_M(zero.stage),
        "0 off, 1 optimizer states, 2 + gradients, 3 + parameters partitioned", kAlwaysStage3));
  const char* offload_dev = "none|cpu|nvme";
  add(F("zero_optimization.offload_param.device", Enum(offload_dev),
        STRATA_M(zero.offload_param.device), "home tier of parameters (stage 3 only)", nullptr));
  add(F("zero_optimization.offload_param.nvme_path", StrList(),
        STRATA_M(zero.offload_param.nvme_path), "swap directory, or a list to stripe over", nullptr,
        0, "[]"));
  add(F("zero_optimization.offload_param.buffer_count", Int(1, 65536),
        STRATA_M(zero.offload_param.buffer_count), "pinned staging buffers", kOwnStaging));
  add(F("zero_optimization.offload_param.buffer_size", Size(1),
        STRATA_M(zero.offload_param.buffer_size), "elements per staging buffer", kOwnStaging));
  add(F("zero_optimization.offload_param.max_in_cpu", Size(),
        STRATA_M(zero.offload_param.max_in_cpu), "elements kept in host RAM when device is nvme",
        kOwnStaging));
  add(F("zero_optimization.offload_param.pin_memory", Bool(),
        STRATA_M(zero.offload_param.pin_memory), "page-lock host buffers", nullptr));
  add(F("zero_optimization.offload_optimizer.device", Enum(offload_dev),
        STRATA_M(zero.offload_optimizer.device), "home tier of master weights and moments",
        nullptr));
  add(F("zero_optimization.offload_optimizer.nvme_path", StrList(),
        STRATA_M(zero.offload_optimizer.nvme_path), "swap directory, or a list to stripe over",
        nullptr, 0, "[]"));
  add(F("zero_optimization.offload_optimizer.buffer_count", Int(1, 65536),
        STRATA_M(zero.offload_optimizer.buffer_count), "pinned staging buffers", nullptr));
  add(F("zero_optimization.offload_optimizer.pin_memory", Bool(),
        STRATA_M(zero.offload_optimizer.pin_memory), "page-lock host buffers", nullptr));
  add(F("zero_optimization.offload_optimizer.pipeline_read", Bool(),
        STRATA_M(zero.offload_optimizer.pipeline_read), "overlap state reads with the step",
        kAlwaysPipelined));
  add(F("zero_optimization.offload_optimizer.pipeline_write", Bool(),
        STRATA_M(zero.offload_optimizer.pipeline_write), "overlap state writes with the step",
        kAlwaysPipelined));
  add(F("zero_optimization.offload_optimizer.fast_init", Bool(),
        STRATA_M(zero.offload_optimizer.fast_init), "DeepSpeed: fast swap-file init", kFastInit));
  add(F("zero_optimization.offload_optimizer.ratio", Real(0, 1),
        STRATA_M(zero.offload_optimizer.ratio),
        "fraction of optimizer state offloaded (< 1 needs stage 3; the first modules' state "
        "stays on the device, stepped there); strata plan recommends one",
        nullptr));
  add(F("zero_optimization.overlap_comm", Bool(), STRATA_M(zero.overlap_comm),
        "several ranks: gradient reduce-scatters overlap the next module's backward (false: "
        "compute waits for each bucket's reduction)",
        nullptr, 0, "true at stage 3, else false"));
  add(F("zero_optimization.contiguous_gradients", Bool(), STRATA_M(zero.contiguous_gradients),
        "copy gradients into one buffer", kFlatModules));
  add(F("zero_optimization.reduce_scatter", Bool(), STRATA_M(zero.reduce_scatter),
        "reduce-scatter instead of all-reduce", kFlatModules));
  add(F("zero_optimization.reduce_bucket_size", Size(), STRATA_M(zero.reduce_bucket_size),
        "elements per gradient reduce-scatter bucket over ranks, capped at the largest module "
        "(auto: n_embd^2)",
        nullptr, kAuto));
  add(F("zero_optimization.allgather_bucket_size", Size(), STRATA_M(zero.allgather_bucket_size),
        "elements per all-gather", kGatherWindow));
  add(F("zero_optimization.allgather_partitions", Bool(), STRATA_M(zero.allgather_partitions),
        "all-gather (vs broadcasts) after the step", kGatherWindow));
  add(F("zero_optimization.round_robin_gradients", Bool(), STRATA_M(zero.round_robin_gradients),
        "stage 1/2: spread gradient copies over ranks", kAlwaysStage3));
  add(F("zero_optimization.sub_group_size", Size(1), STRATA_M(zero.sub_group_size),
        "elements per optimizer sub-group: the optimizer reads, steps and writes master weights "
        "and moments in pieces of at most this many (rounded down to a multiple of 2048), and "
        "at most what keeps its host staging (2 x offload_optimizer.buffer_count + 1 pieces) "
        "within 1/8 of the host budget (strata.host_memory_limit); parameter fetches, their "
        "write-back, the initial weights (random or model.from_pretrained), checkpoints, "
        "resharding and the weights' checksum move in pieces of the same size"));
  add(F("zero_optimization.stage3_prefetch_bucket_size", Size(),
        STRATA_M(zero.stage3_prefetch_bucket_size),
        "elements fetched ahead of use (auto: 0.9 n_embd^2)", nullptr, kAuto));
  add(F("zero_optimization.stage3_param_persistence_threshold", Size(),
        STRATA_M(zero.stage3_param_persistence_threshold),
        "parameters smaller than this stay unpartitioned (auto: 10 n_embd)", nullptr, kAuto));
  add(F("zero_optimization.stage3_max_live_parameters", Size(),
        STRATA_M(zero.stage3_max_live_parameters), "gathered elements resident per GPU (auto: 1e9)",
        kGatherWindow, kAuto));
  add(F("zero_optimization.stage3_max_reuse_distance", Size(),
        STRATA_M(zero.stage3_max_reuse_distance),
        "keep a gathered parameter reused within this many elements (auto: 1e9); one whose next "
        "use is farther (other parameters' elements in between) is released after its use and "
        "fetched again for it: with parameters off the device, host<->device bytes (the "
        "planner counts them)",
        nullptr, kAuto));
  add(F("zero_optimization.stage3_gather_16bit_weights_on_model_save", Bool(),
        STRATA_M(zero.stage3_gather_16bit_weights_on_model_save),
        "gather full 16-bit weights when saving", kNo16bitSave));
  alias("zero_optimization.gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save");
  alias("zero_optimization.stage3_gather_fp16_weights_on_model_save",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save");
  alias("zero_optimization.prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size");
  alias("zero_optimization.param_persistence_threshold",
        "zero_optimization.stage3_param_persistence_threshold");
  alias("zero_optimization.max_live_parameters", "zero_optimization.stage3_max_live_parameters");
  alias("zero_optimization.max_reuse_distance", "zero_optimization.stage3_max_reuse_distance");
  // Further DeepSpeed ZeRO knobs seen in real configs: accepted, checked, not acted on.
  add(U("zero_optimization.stage3_model_persistence_threshold", Size(), "9223372036854775807",
        "cap on unpartitioned elements", kPersistence));
  add(U("zero_optimization.stage3_module_granularity_threshold", Size(), "0",
        "fetch fine-grained modules as one unit", kFlatModules));
  add(U("zero_optimization.stage3_use_all_reduce_for_fetch_params", Bool(), "false",
        "all-reduce when fetching parameters", kGatherWindow));
  add(U("zero_optimization.load_from_fp32_weights", Bool(), "true",
        "init master weights from fp32 checkpoint copies", kDsOnly));
  add(U("zero_optimization.elastic_checkpoint", Bool(), "false",
        "load checkpoints across GPU counts", kDsOnly));
  add(U("zero_optimization.ignore_unused_parameters", Bool(), "true", "tolerate unused parameters",
        kDsOnly));
  add(U("zero_optimization.use_multi_rank_bucket_allreduce", Bool(), "true",
        "combine reduce buckets of ranks", kFlatModules));
  add(F("zero_optimization.zero_hpz_partition_size", Int(0, kMaxInt),
        STRATA_M(zero.zero_hpz_partition_size),
        "ZeRO++ hpZ: ranks of one node holding a secondary parameter partition, so backward's "
        "gathers stay within the node (0, 1: off; must divide the ranks per node)"));
  add(F("zero_optimization.zero_quantized_weights", Bool(), STRATA_M(zero.zero_quantized_weights),
        "ZeRO++ qwZ: parameter all-gathers as int8 with an fp32 scale per 256 elements"));
  add(F("zero_optimization.zero_quantized_gradients", Bool(),
        STRATA_M(zero.zero_quantized_gradients),
        "ZeRO++ qgZ: gradient reduce-scatters as int4 (fp32 scale per 128 elements), "
        "hierarchical: within each node, then across nodes"));
  add(U("zero_optimization.memory_efficient_linear", Bool(), "true",
        "DeepSpeed's memory-efficient linear", kDsOnly));
}

void TableBuilder::add_aio_and_unbound_keys() {
  // --- aio --------------------------------------------------------------------------------------
  group("DeepSpeed: aio");
  add(F("aio.backend", Enum("auto|io_uring|libaio|posix"), STRATA_M(aio.backend),
        "strata: storage engine", nullptr));
  add(F("aio.block_size", Size(4096, kInf, 4096), STRATA_M(aio.block_size),
        "bytes per I/O request, a multiple of 4096", nullptr));
  add(F("aio.queue_depth", Int(1, 4096), STRATA_M(aio.queue_depth), "requests in flight", nullptr));
  add(F("aio.intra_op_parallelism", Int(1, 1024), STRATA_M(aio.intra_op_parallelism),
        "I/O threads per request", nullptr));
  alias("aio.thread_count", "aio.intra_op_parallelism");
  add(F("aio.single_submit", Bool(), STRATA_M(aio.single_submit), "submit requests one by one",
        kIoWorker));
  add(F("aio.overlap_events", Bool(), STRATA_M(aio.overlap_events),
        "overlap submission and completion", kIoWorker));
  add(F("aio.use_gds", Bool(), STRATA_M(aio.use_gds), "GPUDirect Storage", kNoGds));

  // --- other DeepSpeed top-level keys: accepted, checked, not acted on ---------------------
  group("DeepSpeed: other sections (accepted, not acted on)");
  add(U("zero_allow_untested_optimizer", Bool(), "false", "DeepSpeed: allow client optimizers",
        kDsOnly));
  add(U("zero_force_ds_cpu_optimizer", Bool(), "true", "DeepSpeed: force its CPU Adam", kDsOnly));
  add(U("gradient_predivide_factor", Real(0, kInf, true, true), "1.0",
        "divide gradients before averaging", kFp32Grads));
  add(U("prescale_gradients", Bool(), "false", "scale gradients before all-reduce", kFp32Grads));
  add(U("communication_data_type", Enum("fp32|fp16|bf16"), "null",
        "dtype of gradient communication", kFp32Grads));
  add(U("memory_breakdown", Bool(), "false", "DeepSpeed memory report", kDsOnly));
  add(U("dump_state", Bool(), "false", "print DeepSpeed's state after init", kDsOnly));
  add(U("amp", Any(), "null", "NVIDIA Apex AMP settings (any keys)", kDsOnly));
  add(U("data_types.grad_accum_dtype", Enum("fp32|fp16|bf16"), "null",
        "gradient accumulation dtype", kDsOnly));
  add(U("activation_checkpointing.partition_activations", Bool(), "false",
        "true: strata.activations = recompute (keep each block's input, recompute the rest in "
        "backward) unless strata.activations is given",
        nullptr));
  add(U("activation_checkpointing.cpu_checkpointing", Bool(), "false",
        "true: strata.activations = offload (block inputs to host RAM) unless "
        "strata.activations is given",
        nullptr));
  add(U("activation_checkpointing.contiguous_memory_optimization", Bool(), "false",
        "checkpoints into one buffer", kActCkptContiguous));
  add(U("activation_checkpointing.number_checkpoints", Int(0, kMaxInt), "null",
        "checkpoints per step", kActCkptCount));
  add(U("activation_checkpointing.synchronize_checkpoint_boundary", Bool(), "false",
        "synchronize at checkpoint boundaries", kActCkptSync));
  add(U("activation_checkpointing.profile", Bool(), "false", "time checkpoint functions",
        kActCkptProfile));
  add(F("flops_profiler.enabled", Bool(), STRATA_M(flops_profiler.enabled),
        "time every kernel and copy of one step on the device, by op and stream, with its FLOPs, "
        "bytes and rates (the op profile: a table in the log)"));
  add(F("flops_profiler.profile_step", Int(0, kMaxInt), STRATA_M(flops_profiler.profile_step),
        "the step profiled, as DeepSpeed's global step (0-based; 1: the second, after a step of "
        "warm-up)"));
  add(F("flops_profiler.output_file", Str(), STRATA_M(flops_profiler.output_file),
        "also write the op profile's table here (null or \"\": the log only)"));
  add(U("flops_profiler.recompute_fwd_factor", Real(0, kInf), "0.0", "", kOpProfile));
  add(U("flops_profiler.module_depth", Int(-1, kMaxInt), "-1", "", kOpProfile));
  add(U("flops_profiler.top_modules", Int(0, kMaxInt), "1", "", kOpProfile));
  add(U("flops_profiler.detailed", Bool(), "true", "", kOpProfile));
  add(F("tensorboard.enabled", Bool(), STRATA_M(tensorboard.enabled),
        "also write the metrics records as TensorBoard event files"));
  add(F("tensorboard.output_path", Str(), STRATA_M(tensorboard.output_path),
        "their directory's parent; \"\" = train.checkpoint_dir"));
  add(F("tensorboard.job_name", Str(), STRATA_M(tensorboard.job_name),
        "their directory under output_path"));
  add(F("csv_monitor.enabled", Bool(), STRATA_M(csv_monitor.enabled),
        "also write the metrics records as CSV, one <metric>.csv of step,value rows each"));
  add(F("csv_monitor.output_path", Str(), STRATA_M(csv_monitor.output_path),
        "their directory's parent; \"\" = train.checkpoint_dir"));
  add(F("csv_monitor.job_name", Str(), STRATA_M(csv_monitor.job_name),
        "their directory under output_path"));
  add(U("wandb.enabled", Bool(), "false",
        "true is refused: no network; tensorboard's files upload with `wandb sync DIR`", kMonitor));
  add(U("wandb.group", Str(), "null", "", kMonitor));
  add(U("wandb.team", Str(), "null", "", kMonitor));
  add(U("wandb.project", Str(), "\"deepspeed\"", "", kMonitor));
  add(U("comms_logger.enabled", Bool(), "false", "DeepSpeed communication logger", kDsOnly));
  add(U("comms_logger.verbose", Bool(), "false", "", kDsOnly));
  add(U("comms_logger.prof_all", Bool(), "true", "", kDsOnly));
  add(U("comms_logger.debug", Bool(), "false", "", kDsOnly));
  add(U("comms_logger.prof_ops", StrList(), "[]", "", kDsOnly));
}

void TableBuilder::add_run_keys() {
  // --- strata: data -----------------------------------------------------------------------------
  group("strata: data");
  add(F("data.source", Str(), STRATA_M(data.source), "\"synthetic\" or a token file path"));
  add(F("data.format", Enum("auto|uint16|uint32|llmc|text"), STRATA_M(data.format),
        "token file format"));
  add(F("data.seq_len", Int(0, 1 << 24), STRATA_M(data.seq_len),
        "tokens per sequence, <= model.context; 0/auto: model.context", nullptr, kAuto));
  add(F("data.eval_fraction", Real(0, 1, false, true), STRATA_M(data.eval_fraction),
        "held-out tail for eval loss (unused with data.eval_source)"));
  add(F("data.eval_source", Str(), STRATA_M(data.eval_source),
        "a held-out token file for eval (and strata eval); \"\": the eval_fraction tail"));
  add(F("data.loss_mask", Enum("auto|none"), STRATA_M(data.loss_mask),
        "auto: <token file>.mask (prepare_data --chat) when it exists; none: every token"));
  add(F("data.packing", Enum("sequence|window"), STRATA_M(data.packing),
        "a masked (chat) file's packed windows: sequence: each conversation attends only to "
        "itself, positions restart (TRL padding_free); window: causal over the whole window"));
  add(F("data.eval_batches", Int(0, kMaxI32), STRATA_M(data.eval_batches),
        "batches per evaluation"));
  add(F("data.synthetic_tokens", Size(1, double(uint64_t{1} << 32)),
        STRATA_M(data.synthetic_tokens),
        "tokens in the built-in corpus (4 bytes each in host memory)"));

  // --- strata: device ---------------------------------------------------------------------------
  group("strata: device");
  add(F("device.backend", Enum("auto|cpu|cuda"), STRATA_M(device.backend),
        "auto: cuda if a GPU is visible, else cpu"));
  add(F("device.memory_limit", Size(), STRATA_M(device.memory_limit),
        "device bytes to use; 0 = cpu: 1 GiB, cuda: free - reserve"));
  add(F("device.reserve", Size(), STRATA_M(device.reserve),
        "cuda: HBM left outside strata's arena for CUDA, cuBLASLt, NCCL and cuDNN's attention "
        "workspace; 0 = 1 GiB or 1/32 of the GPU's memory, the larger"));
  add(F("device.deterministic", Bool(), STRATA_M(device.deterministic),
        "cuda: cuDNN's attention backward deterministic, the same bits run to run (on Hopper "
        "its workspace holds B*heads*T^2 bf16 scores, out of device.reserve); false: its faster "
        "non-deterministic backward. The own kernels are deterministic either way"));
  add(F("device.cpu_threads", Int(0, 4096), STRATA_M(device.cpu_threads), "0 = all cores"));
  add(F("device.ordinal", Int(-1, 1024), STRATA_M(device.ordinal), "cuda: -1 = local rank"));
  add(F("device.simulate", Str(), STRATA_M(device.simulate),
        "h200 | h100 | a100: a fast device simulated on the CPU backend: kernels do no arithmetic "
        "and each takes the "
        "preset GPU's modeled time; copies, the optimizer, the tiers and I/O are real (times and "
        "bytes are, losses are not); \"\" = none"));
  add(F("device.simulate_grad_norm", Real(0, kInf, true), STRATA_M(device.simulate_grad_norm),
        "simulate: the gradient norm the trainer sees (under or over gradient_clipping)"));
  add(F("device.simulate_gemm_tflops", Real(0, kInf), STRATA_M(device.simulate_gemm_tflops),
        "simulate: GEMM TFLOP/s achieved; 0 = the preset's"));
  add(F("device.simulate_attention_fwd_tflops", Real(0, kInf),
        STRATA_M(device.simulate_attention_fwd_tflops),
        "simulate: fused attention forward TFLOP/s; 0 = the preset's"));
  add(F("device.simulate_attention_bwd_tflops", Real(0, kInf),
        STRATA_M(device.simulate_attention_bwd_tflops),
        "simulate: fused attention backward TFLOP/s; 0 = the preset's"));
  add(F("device.simulate_hbm_gbps", Real(0, kInf), STRATA_M(device.simulate_hbm_gbps),
        "simulate: GB/s the elementwise kernels achieve; 0 = the preset's"));
  add(F("device.simulate_link_gbps", Real(0, kInf), STRATA_M(device.simulate_link_gbps),
        "simulate: pinned host<->device GB/s each way (copies are no faster than the host's "
        "memcpy); 0 = the preset's"));
  add(F("device.simulate_launch_us", Real(-1, kInf), STRATA_M(device.simulate_launch_us),
        "simulate: microseconds a kernel adds (launch and gap); -1 = the preset's"));

  // --- strata: train ----------------------------------------------------------------------------
  group("strata: train");
  add(F("train.steps", Int(0, kMaxInt), STRATA_M(train.steps), "optimizer steps"));
  add(F("train.eval_interval", Int(0, kMaxInt), STRATA_M(train.eval_interval),
        "steps between evals; 0 = never"));
  add(F("train.checkpoint_dir", Str(), STRATA_M(train.checkpoint_dir), "run directory"));
  add(F("train.export_dir", Str(), STRATA_M(train.export_dir),
        "after the final checkpoint, write the model here as a Hugging Face checkpoint "
        "(config.json + safetensors in the model dtype); \"\" = none. Checked before training: "
        "never model.from_pretrained's directory, nor one holding another model or another "
        "run's export"));
  add(F("train.checkpoint_interval", Int(0, kMaxInt), STRATA_M(train.checkpoint_interval),
        "steps between checkpoints; 0 = at the end and on SIGINT/SIGTERM"));
  add(F("train.final_checkpoint", Bool(), STRATA_M(train.final_checkpoint),
        "write a checkpoint when the run ends (false: none at the end, for a benchmark whose "
        "state would not fit on the disk twice; interval and stop checkpoints still are)"));
  add(F("train.seed", Int(0, kMaxInt), STRATA_M(train.seed), "initialization and data seed"));
  add(F("train.log_file", Str(), STRATA_M(train.log_file),
        "JSONL metrics; \"\" = <checkpoint_dir>/metrics.jsonl; appended to, each run's "
        "lines after one naming its run_id and start_step"));
  add(F("train.log_interval", Int(1, kMaxInt), STRATA_M(train.log_interval),
        "steps between metrics records (train.log_file, tensorboard, csv_monitor), each the "
        "per-step means since the last (steps_per_print paces the lines on stdout)"));

  // --- strata: dpo ------------------------------------------------------------------------------
  group("strata: dpo (TRL's DPOConfig keys; used when data.source holds preference pairs)");
  add(F("dpo.beta", Real(0, kInf, true), STRATA_M(dpo.beta),
        "DPO's beta: how far the policy may move from the reference (the initial model)"));
  add(F("dpo.label_smoothing", Real(0, 0.5, false, true), STRATA_M(dpo.label_smoothing),
        "the chance that a pair's preference is flipped: cDPO with the sigmoid loss (TRL 0.x's "
        "sigmoid; TRL 1.x's ignores it), Robust DPO's (robust) and EXO's epsilon (exo_pair, "
        "where it must be above 0; the paper's 1e-3); 0 = plain DPO"));
  add(F("dpo.loss_type", EnumList(kDpoLossTypes), STRATA_M(dpo.loss_type),
        "the loss, as TRL's DPOTrainer computes it, or a list of them summed with "
        "dpo.loss_weights (e.g. MPO: [\"sigmoid\", \"bco_pair\", \"sft\"]): sigmoid is DPO's "
        "(the default); ipo and sigmoid_norm take per-token means of the log-ratios; aot and "
        "aot_unpaired sort within a micro-batch, sft is the mean next-token loss of its chosen "
        "completions (TRL's per-device batch)"));
  add(F("dpo.loss_weights", RealList(-kInf, kInf, true, true), STRATA_M(dpo.loss_weights),
        "one weight per dpo.loss_type entry; [] = 1 each", nullptr, 0, "[]"));
  add(F("dpo.f_divergence_type", Enum(kFDivergenceTypes), STRATA_M(dpo.f_divergence_type),
        "the f-divergence between policy and reference (f-DPO): each log-ratio's score; "
        "reverse_kl is DPO's; the others apply to sigmoid, sigmoid_norm, hinge, ipo, exo_pair, "
        "robust, discopop and sft"));
  add(F("dpo.f_alpha_divergence_coef", Real(-kInf, kInf, true, true),
        STRATA_M(dpo.f_alpha_divergence_coef),
        "alpha of dpo.f_divergence_type alpha_divergence (1 = reverse_kl)"));
  add(F("dpo.discopop_tau", Real(0, kInf, true, true), STRATA_M(dpo.discopop_tau),
        "DiscoPOP's temperature (dpo.loss_type discopop)"));
  add(F("dpo.disable_dropout", Bool(), STRATA_M(dpo.disable_dropout),
        "no dropout (lora.lora_dropout) in a preference run's training forwards, as TRL's "
        "DPOConfig by default; false: dropout in the policy's forwards (never the reference's)"));
}

void TableBuilder::add_engine_keys() {
  // --- strata: engine knobs ---------------------------------------------------------------------
  group("strata: strata");
  add(F("strata.io.checksum", Bool(), STRATA_M(strata.io_checksum), "CRC32C per swapped extent",
        nullptr));
  add(U("strata.written_by", Str(), "null",
        "what wrote this config: `strata plan --write-config` writes \"strata plan\" and replaces "
        "an existing file only when it holds that mark (else --force)",
        nullptr));
  // The optimizers step fp32 or bf16 moments (cpu_optim, the device's kernel): fp16 is refused
  // here, not at the first step.
  add(F("strata.optimizer.moment_dtype", DTypeT("fp32|bf16"), STRATA_M(strata.moment_dtype),
        "dtype of Adam moments", nullptr));
  add(F("strata.optimizer.overlap", Bool(), STRATA_M(strata.optimizer_overlap),
        "step each module's optimizer state under the rest of backward, exact (rolled back and "
        "redone when clipping or an overflow says so); while clipping bites, each step is "
        "deferred to the next forward instead (module i stepped just before its forward)",
        nullptr));
  add(F("strata.optimizer.defer", Enum("auto|always|never"), STRATA_M(strata.optimizer_defer),
        "with strata.optimizer.overlap, where a step that clipping or an overflow keeps from "
        "being stepped under backward runs: deferred into the next forward (always), after "
        "backward (never), or auto: both timed on the first steps that clip (8 deferred, 4 "
        "after backward) and the faster kept; the same bits either way",
        nullptr));
  add(F("strata.optimizer.speculate", Enum("always|never|auto"),
        STRATA_M(strata.optimizer_speculate),
        "with strata.optimizer.overlap, whether a step after one that did not clip is stepped "
        "under backward as if it will not clip (always), or runs where strata.optimizer.defer "
        "puts a step that clips (never), or auto: on a GPU (or device.simulate) both timed on "
        "the first such steps (8 under backward once its undo room is ready, 4 not) and the "
        "faster kept, on the CPU backend always; the same bits either way. Speculated steps keep "
        "undo state: with clipping or fp16 the host tier takes room for the host-homed master "
        "weights and moments of the modules stepped under backward (at most all of them), "
        "unless never; auto gives it back when it settles on not stepping under backward",
        nullptr));
  add(F("strata.optimizer.read_ahead", Size(), STRATA_M(strata.optimizer_read_ahead),
        "with strata.optimizer.overlap and optimizer state on nvme: host bytes of the next "
        "step's master weights and moments read during backward (besides "
        "the optimizer pipeline's staging, 2 x offload_optimizer.buffer_count + 1 sub-groups; "
        "with parameters on nvme each also holds "
        "its new parameters' staging piece, and with gradients on nvme the pass reads their "
        "accumulator into it with the state), so the optimizer pass, deferred into the next "
        "forward or after backward, reads less while the step waits; a pass keeps the "
        "sub-groups it steps in the same room for the next step (written, not read back); at "
        "most what the host budget leaves after the host tier's needs. auto: all of that "
        "(strata.host_memory_limit; without it 90% of MemAvailable); 0: the staging's "
        "sub-groups only",
        nullptr, kAuto, "auto"));
  add(F("strata.optimizer.delayed_update", Bool(), STRATA_M(strata.delayed_update),
        "overlap step t's update with step t+1's forward and backward (one step stale: changes "
        "the numbers)",
        nullptr));
  add(F("strata.optimizer.delayed_update_warmup", Int(0, kMaxInt),
        STRATA_M(strata.delayed_update_warmup), "exact steps before the delayed update starts",
        nullptr));
  add(F("strata.comm.backend", Enum("auto|single|mpi|nccl"), STRATA_M(strata.comm_backend),
        "communicator", nullptr));
  add(F("strata.comm.ranks_per_node", Int(0, kMaxInt), STRATA_M(strata.comm_ranks_per_node),
        "ZeRO++ node grouping: ranks [n*L, (n+1)*L) form node n; 0 = the ranks sharing a host "
        "(MPI's shared-memory split)"));
  add(F("strata.comm.timeout_s", Real(0, kInf, false, true), STRATA_M(strata.comm_timeout_s),
        "seconds a collective waits for its peers before failing (0 = forever)", nullptr));
  add(F("strata.activations", Enum("keep|recompute|offload"), STRATA_M(strata.activations),
        "block activations between forward and backward: keep on the device, recompute from "
        "each block's saved input, or offload the inputs to the host tier too"));
  add(F("strata.grouped_forwards", Int(1, kMaxInt), STRATA_M(strata.grouped_forwards),
        "micro-batches of a step whose forwards run together, module by module (each module's "
        "parameters acquired once for all of them; each micro-batch keeps what its forward "
        "leaves for its backward on the device, the rest of the activations shared); their "
        "backwards then run one by one as before, or together too (strata.grouped_backwards): "
        "the same bits. A step deferred into the next forward (clipping biting) overlaps "
        "its optimizer pass with all of these forwards instead of the first one's. At most "
        "gradient_accumulation_steps; 1 under strata.activations = offload. auto: "
        "gradient_accumulation_steps when the optimizer can be deferred (strata.optimizer.overlap "
        "with gradient_clipping or fp16) or the backwards grouped (strata.grouped_backwards), "
        "without the delayed update, the activations are kept or recomputed, the device "
        "holds the further micro-batches' activations (and, with strata.grouped_backwards, the "
        "gradient parts) and they cost no parameter fetches (the planner's cache model, which "
        "counts a backward group's one fetch); else 1",
        nullptr, kAuto, "auto"));
  add(F("strata.grouped_backwards", Bool(), STRATA_M(strata.grouped_backwards),
        "with a forward group of more than one micro-batch (strata.grouped_forwards) on one "
        "rank: the step's first group's backwards run together too, module by module after each "
        "one's head: each module's parameters acquired once for the group, each further "
        "micro-batch's gradients computed into a device buffer of their own and added to the "
        "first's on the device (the same sums, in the same order, as the host's accumulation: "
        "the same bits), then drained once: one gradient drain and one backward parameter "
        "fetch per group instead of per micro-batch (with gradients on NVMe, one write of the "
        "accumulators per group instead of a write, then a read and a write). Costs the "
        "device one module's gradient buffer (and, for gradients held from the head to the "
        "embedding's backward, one per further micro-batch). A later group's backwards, and a "
        "sharded run's, run one at a time (their sums must reach the accumulator one "
        "micro-batch at a time; each micro-batch's reduce-scatter is its own)"));
  add(F("strata.log_level", Enum("debug|info|warn|error|off"), STRATA_M(strata.log_level),
        "logger level"));
  add(F("strata.placement.params", Enum("device|host|nvme"), STRATA_M(strata.placement_params),
        "home tier of parameters (overrides offload_param.device)"));
  add(F("strata.placement.grads", Enum("device|host|nvme"), STRATA_M(strata.placement_grads),
        "where the fp32 gradient accumulators live between backward and the optimizer step "
        "(default: with the optimizer, else host; nvme when the optimizer state is on nvme and "
        "host accumulators would exceed the host budget); nvme: one swap extent per optimizer "
        "sub-group, so no whole-model gradient is held in host memory (one rank, no delayed "
        "update)"));
  add(F("strata.placement.master", Enum("device|host|nvme"), STRATA_M(strata.placement_master),
        "home tier of fp32 master weights (overrides offload_optimizer.device)"));
  add(F("strata.placement.moments", Enum("device|host|nvme"), STRATA_M(strata.placement_moments),
        "home tier of optimizer moments (overrides offload_optimizer.device)"));
  add(F("strata.host_memory_limit", Size(), STRATA_M(strata.host_memory_limit),
        "host tier budget in bytes; 0 = 90% of MemAvailable"));
  add(F("strata.trace_file", Str(), STRATA_M(strata.trace_file),
        "write the first step's access trace here (for strata trace replay)"));
}

}  // namespace table

std::vector<Key> build_table() { return table::TableBuilder().build(); }

}  // namespace strata::config_internal
