// The run configuration: a DeepSpeed ds_config.json, accepted as is, plus strata's own sections.
//
// DeepSpeed sections (same keys, same defaults, same consistency rules): train_batch_size,
// train_micro_batch_size_per_gpu, gradient_accumulation_steps, fp16, bf16, optimizer,
// scheduler, gradient_clipping, steps_per_print, zero_optimization, aio.
// strata's sections: model, data, device, train, strata (finer knobs DeepSpeed lacks).
//
// Parsing is strict where DeepSpeed is silent: an unknown key is an error naming its JSON
// path and the closest known key; a wrong type or out-of-range value names the path and the
// allowed range; sizes accept numbers (1e8) and strings ("16GiB", "512MB"); "auto" is resolved
// and the resolved value logged. Keys DeepSpeed knows that strata accepts but does not act on
// yet are listed in Config::not_acted_on, logged once at start-up.
//
// Thread safety: a Config is a plain value; parse once, then share const.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/dtype.h"
#include "strata/status.h"

namespace strata {

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;         // 0 = dynamic loss scaling
  int initial_scale_power = 16;    // dynamic: initial scale 2^power
  int loss_scale_window = 1000;    // steps without overflow before the scale doubles
  int hysteresis = 2;              // overflows tolerated before the scale halves
  int consecutive_hysteresis = 0;  // DeepSpeed's bool, stored 0/1
  double min_loss_scale = 1.0;
  bool auto_cast = false;  // DeepSpeed: cast module inputs to fp16 (accepted, not acted on)
};

struct Bf16Config {
  bool enabled = false;
};

struct OptimizerConfig {
  std::string type = "AdamW";  // Adam | AdamW | Adagrad | Lion (case-insensitive)
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;  // DeepSpeed's Adam: true makes "Adam" decoupled (AdamW)
  bool torch_adam = false;
  bool bias_correction = true;
};

struct SchedulerConfig {
  std::string type;  // "" (constant lr) | WarmupLR | WarmupDecayLR | WarmupCosineLR
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;  // "auto" or absent: optimizer.lr
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // log | linear
  int64_t total_num_steps = 0;      // WarmupDecayLR / WarmupCosineLR; "auto": train.steps
  double warmup_min_ratio = 0.0;    // WarmupCosineLR
  double cos_min_ratio = 0.0001;    // WarmupCosineLR
};

// zero_optimization.offload_param / offload_optimizer.
struct OffloadConfig {
  std::string device = "none";              // none | cpu | nvme
  std::vector<std::string> nvme_path = {};  // one or more directories (a string or a list)
  int buffer_count = 5;                     // param: 5, optimizer: 4 (DeepSpeed's defaults)
  size_t buffer_size = 100'000'000;         // param only
  size_t max_in_cpu = 1'000'000'000;        // param only
  bool pin_memory = false;
  bool pipeline_read = false;   // optimizer only
  bool pipeline_write = false;  // optimizer only
  bool fast_init = false;       // optimizer only
  double ratio = 1.0;           // optimizer only: fraction offloaded
};

struct ZeroConfig {
  int stage = 0;  // 0..3
  OffloadConfig offload_param;
  OffloadConfig offload_optimizer{.buffer_count = 4};
  bool overlap_comm = false;  // absent: true at stage 3, false otherwise (DeepSpeed's rule)
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  size_t reduce_bucket_size = 500'000'000;
  size_t allgather_bucket_size = 500'000'000;
  bool allgather_partitions = true;
  bool round_robin_gradients = false;
  size_t sub_group_size = 1'000'000'000;
  size_t stage3_prefetch_bucket_size = 50'000'000;
  size_t stage3_param_persistence_threshold = 100'000;
  size_t stage3_max_live_parameters = 1'000'000'000;
  size_t stage3_max_reuse_distance = 1'000'000'000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  // ZeRO++ (src/comm/zeropp.h).
  bool zero_quantized_weights = false;    // qwZ
  int zero_hpz_partition_size = 1;        // hpZ (0, 1: off)
  bool zero_quantized_gradients = false;  // qgZ
};

struct AioConfig {
  std::string backend = "auto";  // strata: auto | io_uring | libaio | posix
  size_t block_size = 1'048'576;
  int queue_depth = 8;
  int intra_op_parallelism = 1;  // alias: thread_count
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;
};

// LoRA adapters over a frozen base (the top-level "lora" section: PEFT's LoraConfig keys, read
// as PEFT reads them; src/model/lora.h). Given at all, the section turns adapters on: every base
// parameter is frozen (parameters only, no master weights, moments or gradients) and each
// block's targeted linear layers gain y += scaling * B(A(dropout(x))), A [r, in]
// kaiming-uniform (a = sqrt(5), PEFT's default), B [out, r] zero.
struct LoraConfig {
  bool enabled = false;  // set by the parser when any lora.* key is given
  int r = 8;
  double alpha = 8.0;       // lora_alpha
  bool use_rslora = false;  // scaling alpha / sqrt(r) (rank-stabilized LoRA) instead of alpha / r
  // lora_dropout, in [0, 1): inverted dropout on each adapter's input in training (not in eval
  // or generate), its masks drawn from train.seed, the step, the micro-batch, the rank, the block
  // and the site (MicroBatch::dropout_key).
  double dropout = 0.0;
  // target_modules as a list: PEFT's module names, each matching a linear layer whose full name
  // is it or ends in "." + it (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
  // GPT-2's c_attn, c_proj, c_fc, or "mlp.c_proj"); empty (and no target_pattern): PEFT's default
  // for the model type (q_proj, v_proj; c_attn).
  std::vector<std::string> target_modules;
  // target_modules as a string (then target_modules is empty): "all-linear" (every linear layer
  // but the output head) or a regular expression matched against each linear layer's whole
  // name ("model.layers.0.self_attn.q_proj"), as PEFT's re.fullmatch.
  std::string target_pattern;
  // target_modules given as [] (not left out): beside target_parameters no linear layer is
  // adapted (PEFT's target_modules=[]); without them [] is PEFT's default as above.
  bool target_modules_none = false;
  // PEFT's target_parameters: the mixtures' routed experts, fused parameters of the block
  // (transformers' experts.gate_up_proj [E, 2I, C] and experts.down_proj [E, C, I]), each name
  // matching a parameter whose full name is it or ends in "." + it ("experts.gate_up_proj",
  // "down_proj"); per expert e an adapter of rank r (lora_A [E*r, in], lora_B [out, r*E], as
  // PEFT's ParamWrapper). Refused with lora_dropout != 0, as PEFT does.
  std::vector<std::string> target_parameters;
  std::string bias = "none";  // only "none": biases stay frozen (all / lora_only are refused)
  // PEFT's modules_to_save (whole modules trained and saved beside the adapters): only empty.
  std::vector<std::string> modules_to_save;
  // How the frozen base's linear-layer weights are stored (QLoRA; src/model/base_quant.h):
  // "none" (the model dtype), "int8" (one byte per weight and an fp32 scale per row), "nf4"
  // (QLoRA's 4-bit NormalFloat, blocks of 64 with an fp32 absmax each, as bitsandbytes).
  std::string base_quantization = "none";
  bool double_quant = false;  // nf4's absmax quantized again (bitsandbytes'): not implemented
  float scaling() const {
    return float(use_rslora ? alpha / std::sqrt(double(r)) : alpha / double(r));
  }
};

struct ModelConfig {
  // architecture (src/model/): gpt2 ("gpt" is accepted) | llama | mixtral | qwen2_moe
  std::string type = "gpt2";
  // A Hugging Face model directory (config.json + safetensors): the shape above comes from its
  // config.json (src/hf/hf_config.h) and the initial weights from its safetensors
  // (src/hf/hf_checkpoint.h). "" = the shape keys and a random initialization.
  std::string from_pretrained;
  // False when a parsed config had no model at all (no "model" section, no model.* override):
  // a DeepSpeed config describes the engine, not the model, and training the defaults' tiny
  // GPT instead would be a silent surprise. check_model_given() refuses it.
  bool given = true;
  int n_layer = 4;
  int n_head = 4;
  int n_embd = 128;
  int vocab_size = 256;
  int padded_vocab_size = 0;  // 0 / "auto": vocab_size rounded up to a multiple of 64
  int context = 64;           // maximum sequence length (llm.c's max_seq_len / block_size)
  bool tied_embeddings = true;
  // llama only (src/model/llama.h):
  int intermediate_size = 0;    // SwiGLU MLP width
  int num_key_value_heads = 0;  // grouped-query attention; 0 = n_head
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool attention_bias = false;  // q/k/v biases (Qwen2)
  int head_dim = 0;             // a head's width; 0 = n_embd / n_head (Qwen3, Mistral Nemo: more)
  bool qk_norm = false;         // RMSNorm of each query and key head (Qwen3's q_norm, k_norm)
  int pad_token_id = -1;  // the token whose embedding row takes no gradient (padding_idx); -1 none
  struct RopeScaling {    // Llama 3.1's rope_scaling
    std::string type = "none";  // none | llama3
    double factor = 8.0;
    double low_freq_factor = 1.0;
    double high_freq_factor = 4.0;
    double original_max_position_embeddings = 8192.0;
  } rope_scaling;
  // mixtral and qwen2_moe only (src/model/moe.h): every block's MLP is a mixture of experts.
  int num_experts = 0;                      // routed experts per layer (>= 1 for a mixture)
  int num_experts_per_tok = 2;              // top-k: experts each token is routed to
  int moe_intermediate_size = 0;            // an expert's SwiGLU width; 0 = intermediate_size
  int shared_expert_intermediate_size = 0;  // qwen2_moe: the shared expert's width (0: none)
  bool norm_topk_prob = true;               // the top-k probabilities renormalized to sum 1
  double router_aux_loss_coef = 0.001;      // load-balancing loss weight, added in training
  DType dtype = DType::kBF16;  // resolved from fp16/bf16 sections; fp32 when neither enabled
  // The top-level "lora" section (not a model.* key): adapters are modules of the architecture.
  LoraConfig lora;
};

struct DataConfig {
  std::string source = "synthetic";  // synthetic | path to a file
  std::string format = "auto";       // auto | uint16 | uint32 | llmc | text
  int seq_len = 0;                   // 0 / "auto": model.context
  double eval_fraction = 0.05;       // held-out tail of the corpus for eval loss
  std::string eval_source;           // "": the eval_fraction tail; else a held-out token file
  std::string loss_mask = "auto";    // auto: <token file>.mask when it exists | none
  // A masked (chat) split's windows: "sequence": each conversation attends only to itself and
  // its positions restart at 0 (TRL's padding_free / position_ids packing); "window": one causal
  // window over every conversation in it, positions 0..T-1. Plain corpora are windows either way.
  std::string packing = "sequence";
  int eval_batches = 4;
  size_t synthetic_tokens = 1 << 20;  // size of the built-in corpus
};

struct DeviceConfig {
  std::string backend = "auto";  // cpu | cuda | auto (cuda if a GPU is visible, else cpu)
  size_t memory_limit = 0;  // bytes of device memory to use; 0 = cpu: 1 GiB, cuda: free-reserve
  size_t reserve = 0;       // cuda: HBM left free for libraries; 0 = max(1 GiB, 1/32 of the GPU's)
  int cpu_threads = 0;      // 0 = all cores
  int ordinal = -1;         // cuda: -1 = local rank
  // cuda: cuDNN's attention backward deterministic (CudaDeviceOptions::deterministic).
  bool deterministic = true;
  // A fast device simulated on the CPU backend (strata/device.h, SimulatedDeviceOptions):
  // "" = none, else a preset (h200 | h100 | a100) whose rates the simulate_* keys override
  // (0 = the preset's). The gradient norm the trainer sees is simulate_grad_norm.
  std::string simulate;
  double simulate_grad_norm = 0.5;
  double simulate_gemm_tflops = 0;
  double simulate_attention_fwd_tflops = 0;
  double simulate_attention_bwd_tflops = 0;
  double simulate_hbm_gbps = 0;
  double simulate_link_gbps = 0;
  double simulate_launch_us = -1;  // < 0: the preset's
};

// Preference training (TRL's DPOConfig keys), used when the training data holds preference pairs
// (tools/prepare_data.py --format preference): by default DPO's sigmoid loss
//   L = -(1 - label_smoothing) log sigma(z) - label_smoothing log sigma(-z),
//   z = beta ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))),
// the log-probabilities summed over each completion's tokens; ref is the run's initial model.
// The other loss types, their weights and the f-divergences are TRL's
// (src/train/preference.h).
inline constexpr const char* kDpoLossTypes =
    "sigmoid|hinge|ipo|exo_pair|nca_pair|robust|bco_pair|sppo_hard|aot|aot_unpaired|apo_zero|"
    "apo_down|discopop|sft|sigmoid_norm";
inline constexpr const char* kFDivergenceTypes =
    "reverse_kl|forward_kl|js_divergence|alpha_divergence";
struct DpoConfig {
  double beta = 0.1;
  // cDPO's (TRL 0.x's sigmoid loss with label_smoothing): the chance that a pair's labels
  // are flipped; Robust DPO's and EXO's epsilon.
  double label_smoothing = 0.0;
  std::vector<std::string> loss_type = {"sigmoid"};  // kDpoLossTypes, summed
  std::vector<double> loss_weights;                  // one per loss_type; empty: 1 each
  std::string f_divergence_type = "reverse_kl";      // kFDivergenceTypes
  double f_alpha_divergence_coef = 0.5;
  double discopop_tau = 0.05;
  bool disable_dropout = true;  // TRL's default: no dropout (lora.lora_dropout) while training
};

struct TrainConfig {
  int64_t steps = 200;
  int64_t eval_interval = 50;
  std::string checkpoint_dir = "runs/default";
  int64_t checkpoint_interval = 0;  // 0 = only at the end and on SIGINT/SIGTERM
  // false: no checkpoint at the end of the run (a benchmark whose state would not fit on the
  // disk twice); checkpoint_interval's and a stop's checkpoints are still written.
  bool final_checkpoint = true;
  uint64_t seed = 1234;
  std::string log_file;  // JSONL metrics; "" = <checkpoint_dir>/metrics.jsonl
  // Steps between metrics records (train.log_file, tensorboard, csv_monitor): each holds the
  // per-step means since the last one. steps_per_print paces the progress lines on stdout.
  int64_t log_interval = 1;
  // After the final checkpoint, rank 0 exports it here as a Hugging Face checkpoint
  // (src/hf/hf_export.h); "" = no export. Not after a stop (Ctrl-C): the run is not finished.
  std::string export_dir;
};

// DeepSpeed's "tensorboard" and "csv_monitor" sections: the trainer's metrics records also go
// to <output_path>/<job_name>/ as TensorBoard event files (events.out.tfevents.*) or as one
// CSV file per metric.
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;  // "" = train.checkpoint_dir
  std::string job_name = "DeepSpeedJobName";
};

// DeepSpeed's "flops_profiler" section: strata's op profile of one step (src/train/op_profile.h):
// every kernel and copy timed on the device, by op and stream, with its FLOPs, bytes and rates.
struct FlopsProfilerConfig {
  bool enabled = false;
  // The step profiled: the one that starts after `profile_step` steps (DeepSpeed's global step,
  // 0-based; the default 1 is the second step, after one of warm-up).
  int64_t profile_step = 1;
  std::string output_file;  // "" = the log only; else the table is also written here
};

// strata's own extensions, under "strata": {...}.
struct StrataConfig {
  bool io_checksum = false;              // strata.io.checksum: CRC32C per extent
  DType moment_dtype = DType::kF32;      // strata.optimizer.moment_dtype
  bool optimizer_overlap = true;         // strata.optimizer.overlap: step under backward
  std::string optimizer_defer = "auto";  // strata.optimizer.defer: auto | always | never
  // strata.optimizer.speculate: always | never | auto — whether a step after one that did not
  // clip is stepped under backward (speculatively) or handled as a clipped one (`defer`).
  std::string optimizer_speculate = "auto";
  // strata.optimizer.read_ahead: host bytes of NVMe-homed optimizer state read during backward
  // beyond offload_optimizer.buffer_count sub-groups; SIZE_MAX = auto (TierOptions).
  size_t optimizer_read_ahead = SIZE_MAX;
  bool delayed_update = false;         // strata.optimizer.delayed_update
  int64_t delayed_update_warmup = 10;  // strata.optimizer.delayed_update_warmup: exact steps
  std::string comm_backend = "auto";   // strata.comm.backend
  double comm_timeout_s = 300.0;       // strata.comm.timeout_s: a collective's wait for peers
  int comm_ranks_per_node = 0;         // strata.comm.ranks_per_node: ZeRO++ nodes; 0 = hosts
  std::string activations = "keep";    // strata.activations: keep | recompute | offload
  int64_t grouped_forwards = 0;        // strata.grouped_forwards: 0 = auto (resolved at setup)
  bool grouped_backwards = true;       // strata.grouped_backwards: a forward group's backwards too
  std::string log_level = "info";      // strata.log_level
  // strata.placement.{params,grads,master,moments}: device | host | nvme; "" = derived from
  // zero_optimization.offload_param / offload_optimizer (DeepSpeed cannot split these).
  std::string placement_params, placement_grads, placement_master, placement_moments;
  size_t host_memory_limit = 0;  // strata.host_memory_limit: host tier budget; 0 = 90% of free
  std::string trace_file;        // strata.trace_file: write the recorded access trace here
};

struct Config {
  // DeepSpeed batch triple, resolved so that train = micro * accum * world_size.
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  double gradient_clipping = 0.0;  // 0 = off
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;

  Fp16Config fp16;
  Bf16Config bf16;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  AioConfig aio;

  ModelConfig model;
  DataConfig data;
  DeviceConfig device;
  TrainConfig train;
  DpoConfig dpo;
  StrataConfig strata;
  MonitorConfig tensorboard, csv_monitor;
  FlopsProfilerConfig flops_profiler;

  // Filled by the parser: "path = value: accepted; <reason>" lines for settings that are
  // accepted but not acted on yet, and "path = value (auto)" lines for resolved "auto" values.
  // Logged at start-up (log_config_notes).
  std::vector<std::string> not_acted_on;
  std::vector<std::string> resolved_auto;
};

// Parses a JSON document (the file's text) into a Config, applying `overrides` ("a.b.c=value",
// value parsed as JSON, or as a string if it is not valid JSON) before validation, then
// resolves "auto" and the batch triple for `world_size` ranks. `origin` names the source in
// messages (a file path or "<string>"); an override is named as the command line gives it,
// "--set a.b.c=value".
//
// Errors are kInvalidArgument with one message "<origin>: <json path>: <what>", where the origin
// is the file, or the override that gave the key, e.g.
// "configs/x.json: zero_optimization.stage: 4 out of range [0, 3]",
// "configs/x.json: zero_optimization.offload_parm: unknown key; did you mean offload_param?",
// "--set train.steps=-3: train.steps: -3 out of range [0, inf)",
// "--set a.b=1: a: unknown key; did you mean ...?". An error across keys names the file and the
// overrides of the keys it names: "configs/x.json with --set train_batch_size=7: ...". JSON null
// means "the default" (DeepSpeed's None); a key given twice in one object is an error. The full
// key list, defaults and ranges: docs/CONFIG.md (generated from the parser's table).
Result<Config> parse_config(const std::string& json_text, const std::string& origin,
                            const std::vector<std::string>& overrides = {}, int world_size = 1);
// OK when `config` describes a model; otherwise an error saying how to give one (a DeepSpeed
// config written for the Hugging Face Trainer has no "model" section). `strata train`, `eval`
// and `export` call it; configs built in code always describe one.
Status check_model_given(const Config& config);
// OK when every model.* key of `model` is within the key table's range (what a config with that
// model section would take); else kInvalidArgument "<origin>: model.n_layer: ... out of range".
// For shapes built outside a config (strata plan's --layers/--width/--heads, --hf).
Status check_model_ranges(const ModelConfig& model, const std::string& origin);

// The "model" section of a config that builds `model`, as JSON text (an object): model.type,
// n_layer, n_head, n_embd, vocab_size and context always, and every other model.* key whose
// value differs from its default. parse_config reads it back to `model` (but model.dtype, which
// the precision sections set). `strata plan` writes it into the configs it plans.
std::string model_section_json(const ModelConfig& model);

// Reads and parses a file; `path` is the origin. A missing file is kNotFound naming the path.
Result<Config> load_config(const std::string& path, const std::vector<std::string>& overrides = {},
                           int world_size = 1);

// Parses a size: a non-negative number (1e8) or a string with an optional unit
// ("512", "1.5GB", "16GiB", "100 MiB", "4k"). Decimal units are powers of 1000, binary 1024.
Result<size_t> parse_size(const std::string& text);

// A number option's value: the whole of `text`, in [lo, hi]; false (and *out untouched) for
// anything else (empty, trailing characters, out of range; parse_number_in: nan and inf too).
bool parse_int_in(const std::string& text, long long lo, long long hi, long long* out);
bool parse_number_in(const std::string& text, double lo, double hi, double* out);

// Logs each Config::resolved_auto and Config::not_acted_on line at info level ("config: ...").
// Call once at start-up, on rank 0.
void log_config_notes(const Config& config);

// The reference tables of every accepted key (path, type, default, range or values, whether the
// engine acts on it yet), as Markdown, one table per top-level section. docs/CONFIG.md embeds
// this text verbatim between its GENERATED markers; config_test fails when the two disagree.
std::string config_reference_markdown();

}  // namespace strata
