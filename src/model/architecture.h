// What a model is to the engine: data (its modules, each one flat buffer of named tensors) plus
// a program (its forward and backward as a sequence of "acquire module m's parameters / its
// gradient buffer", "compute", "release" steps). The trainer runs the program, the tier manager
// serves its acquires and releases, the planner and the preflight walk it to know how much is
// live at once. None of them names a model's parts: a second architecture is a second
// implementation of this interface, nothing else.
//
//   Architecture   the static description, derived from ModelConfig alone (no device): the
//                  module layout, the program for a micro-batch, the activation plan per
//                  strata.activations mode, FLOPs per token, initialization, and a shape string
//                  that checkpoints compare.
//   ModelRunner    one batch shape's device state (activations, token buffers) and the compute
//                  steps of the program, enqueued on the device's compute stream.
//
// Every model so far is a decoder: src/model/decoder.h is the skeleton, gpt2.h and llama.h its
// block definitions. create_architecture() picks one from model.type.
//
// Thread safety: an Architecture is immutable after creation and may be shared. A ModelRunner
// is driven by one host thread; its compute steps only enqueue work.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata {

struct LoraLayout;  // src/model/lora.h
struct BaseQuant;   // src/model/base_quant.h

// One named tensor inside a module's flat buffer.
struct TensorSpec {
  std::string name;
  size_t offset = 0;  // elements from the module's start
  size_t numel = 0;
  // Initialization: kind 0 = normal(0, std), 1 = zeros, 2 = ones, 3 = uniform(-std, std).
  int init_kind = 0;
  float init_std = 0.02f;
};
inline constexpr int kInitNormal = 0, kInitZeros = 1, kInitOnes = 2, kInitUniform = 3;

// A module: the unit that is sharded (ZeRO-3), offloaded and prefetched — one flat buffer of
// parameters (model dtype) and one of gradients (fp32) with the same layout; one transfer per
// module, never one per tensor.
struct ModuleSpec {
  std::string name;  // a stable id, e.g. "embedding", "block.3"
  std::vector<TensorSpec> tensors;
  size_t numel = 0;  // total elements in the flat buffer
  // False for a frozen module (a LoRA run's base): it has parameters only — no master weights,
  // moments or gradients — and the program never acquires its gradients.
  bool trainable = true;
  // A frozen module stored quantized (lora.base_quantization; src/model/base_quant.h): its
  // parameters in the tiers are these bytes (held as ceil(stored_bytes / es) model-dtype
  // elements), dequantized on the device before use. 0: numel elements of the model dtype.
  size_t stored_bytes = 0;
};

// The modules of a model, in the order its forward first touches them.
struct ModelLayout {
  std::vector<ModuleSpec> modules;
  size_t num_params() const;
};

// ---- the program --------------------------------------------------------------------------

// One step of a micro-batch's program.
//   kAcquireParams  module m's parameters must be on the device until its kReleaseParams
//   kReleaseParams  ... no longer needed by work enqueued after this point
//   kAcquireGrads   module m needs a zeroed fp32 gradient buffer on the device (acquiring one
//                   already held is a no-op and returns the same buffer)
//   kDrainGrads     module m's gradient for this micro-batch is complete: it leaves the device
//   kCompute        the architecture's compute function `fn` with argument `layer`; it reads
//                   the parameters and gradient buffers acquired at that point
struct ProgramOp {
  enum Kind : uint8_t { kAcquireParams, kReleaseParams, kAcquireGrads, kDrainGrads, kCompute };
  Kind kind = kCompute;
  int module = -1;  // the four state steps
  int fn = -1;      // kCompute: the architecture's function id
  int layer = -1;   // kCompute: its argument (a block index), -1 when it has none
};

// kTrain: forward, the loss and its gradient, backward — every module acquired is released and
// every gradient buffer drained by the end. kEval: forward and the loss only (no gradients).
enum class Pass : uint8_t { kTrain, kEval };

// kTrain's ops [0, forward_end) are the forward up to the head: parameter acquires, releases
// and forward computes only, so a forward group runs them once with each compute run for every
// micro-batch of the group in turn (module i's parameters acquired once for all of them); the
// rest (the head's forward with the loss, and backward) then runs per micro-batch. 0: the
// program has no such prefix (every micro-batch runs it whole).
struct Program {
  std::vector<ProgramOp> ops;
  size_t forward_end = 0;
};

// The most bytes live at once while `program` runs, given what holding one module's parameters
// and one module's gradient buffer costs on the device: acquires add (once per module while
// held), releases and drains subtract. `live_modules`, if given, receives the most modules with
// parameters or a gradient buffer live at once. The device working set of the tier manager's
// preflight and of the planner.
size_t program_peak_bytes(const Program& program, const std::function<size_t(int)>& param_bytes,
                          const std::function<size_t(int)>& grad_bytes,
                          int* live_modules = nullptr);

// A group's segments (Run::run_program): a segment of ops [begin, end) starts at `begin` and
// at each op that follows a release or drain and is neither; it ends where the next starts. A
// group of micro-batches runs each segment once per micro-batch, in order: parameters acquired
// on the first run and released on the last, the first micro-batch's gradient buffers from
// kAcquireGrads and each further one's in a part of its own (TierManager::acquire_grad_part),
// added to the first's at each kDrainGrads and drained on the last run. (A backward group is
// a step's first group: its sums, ((g0 + g1) + g2)..., are what the accumulator's would be.)
bool segment_starts(const Program& program, size_t i, size_t begin);

// The device bytes a backward group of `group` micro-batches adds for its gradient parts: one
// part at a time of a module acquired and drained in one segment (the largest), and one per
// further micro-batch of each module whose gradients are held across segments (a tied
// embedding's, acquired by the head and drained after the embedding's backward).
size_t grad_part_bytes(const Program& program, const std::function<size_t(int)>& grad_bytes,
                       int group);

// ---- activations --------------------------------------------------------------------------

// What happens to a block's activations between its forward and its backward
// (strata.activations; DeepSpeed's activation_checkpointing.* maps onto it, see
// src/config/config.cc).
//   kKeep       every block's intermediate tensors stay on the device until its backward: the
//               most device memory, no extra work.
//   kRecompute  only each block's INPUT (the residual stream, [B,T,C] in dt) stays, plus ONE
//               block's set of intermediates (a scratch shared by all blocks); a block's
//               backward first re-runs its forward from its saved input into the scratch. One
//               extra block forward per block per micro-batch; the numbers do not change (the
//               same deterministic kernels run on the same inputs).
//   kOffload    like kRecompute, but block inputs leave the device (to host-tier buffers,
//               through an ActivationStore) and come back one block ahead of the backward that
//               needs them; two input buffers stay on the device. The last block's input never
//               leaves: its backward follows the head's directly.
enum class ActivationMode : uint8_t { kKeep = 0, kRecompute = 1, kOffload = 2 };
const char* activation_mode_name(ActivationMode mode);  // "keep", "recompute", "offload"
// Parses strata.activations; an unknown name is kInvalidArgument naming the key.
Result<ActivationMode> parse_activation_mode(const std::string& name);

// Memory a batch shape needs for activations under a mode. Device bytes are exact: they are
// measured by the same carve that allocates the runner's arena, so the preflight and the
// planner use what the runner allocates. Host bytes (kOffload only) are the host-tier buffers
// the tier manager reserves for block inputs: stash_layers buffers of stash_bytes, each rounded
// to 4 KiB.
struct ActivationSizes {
  size_t bytes = 0;  // device: activations + activation gradients (+ block inputs)
  // device: what each further micro-batch of a forward group adds (strata.grouped_forwards):
  // its tokens, targets and what its forward keeps to its backward; the rest is shared.
  size_t slot_bytes = 0;
  size_t host_bytes = 0;   // host tier: offloaded block inputs (kOffload), else 0
  int stash_layers = 0;    // kOffload: blocks whose input leaves the device
  size_t stash_bytes = 0;  // one block input
};

// Where kOffload sends block inputs: the TierManager implements it with host-tier buffers
// reserved at its creation (TierOptions::stash_*). Every call only enqueues work and is made
// from the one host thread that drives the model.
class ActivationStore {
 public:
  virtual ~ActivationStore() = default;
  // Copies `bytes` at device pointer `dev` into layer `layer`'s host buffer on the
  // device-to-host stream, after all work enqueued so far on the compute stream. `dev` must not
  // be overwritten until compute_waits_activation(layer) has been enqueued. Fails (nothing
  // enqueued) on a layer or size outside the reservation.
  virtual Status stash_activation(int layer, const void* dev, size_t bytes) = 0;
  // Copies layer `layer`'s stashed bytes back to device pointer `dev` on the host-to-device
  // stream, after all work enqueued so far on the compute stream (the previous user of `dev`)
  // and after every stash enqueued so far. Fails if the layer was never stashed.
  virtual Status restore_activation(int layer, void* dev) = 0;
  // Makes the compute stream wait (in stream order) for the latest stash or restore of `layer`.
  virtual void compute_waits_activation(int layer) = 0;
};

// ---- running it ---------------------------------------------------------------------------

// What a compute step may touch: the device pointers of the modules acquired at that point of
// the program (nullptr for the others), indexed by module.
struct ModuleBindings {
  std::span<const void* const> params;  // model dtype, flat
  std::span<float* const> grads;        // fp32, flat, accumulated into (+=)
};

// Per micro-batch: dloss = loss scale / (tokens of the global batch) multiplies the loss
// gradient (0 for eval); per-token losses land in losses_out (host [B*T]) once the compute
// stream has run the step that computes them: copied straight there when losses_out_pinned
// (it is host memory of the device's, allocate_host), else through the runner's own pinned
// staging and a host function on the compute stream (which holds a GPU's stream until the
// driver's thread has run it). logits_out (tests and tools; nullptr in
// training): host memory (allocate_host, for an asynchronous copy) of B*T*Vp elements of the
// model dtype, Vp the padded vocabulary; the head's forward copies its logits there (row i:
// position i's, columns >= vocab_size padding) before the loss overwrites them.
// aux_loss_out (host, nullptr: not wanted): a mixture of experts writes its micro-batch's
// load-balancing loss there (unweighted, as transformers' aux_loss) when the head's forward is
// enqueued; other models leave it untouched.
// dropout_key: the micro-batch's random stream for training's dropout (LoRA's lora_dropout),
// training_dropout_key(); 0 (eval, generate, a test's plain pass): no dropout.
// row_weights (nullptr: none): a preference (DPO) micro-batch's loss, which is no mean over its
// tokens: the head's loss gradient is then taken per token unscaled (dloss 1), and once the
// per-token losses are in losses_out, row_weights (on the host, in compute-stream order) gives
// each of the B rows the factor that multiplies that row's logits' gradient; dloss still
// weighs a mixture's load-balancing loss.
struct RowWeights {
  virtual ~RowWeights() = default;
  // token_losses: the micro-batch's [B*T] per-token losses (0 where the target is ignored);
  // writes weights[B].
  virtual void weigh(const float* token_losses, int B, int T, float* weights) const = 0;
};

struct MicroBatch {
  float dloss = 0;
  float* losses_out = nullptr;
  void* logits_out = nullptr;
  float* aux_loss_out = nullptr;
  uint64_t dropout_key = 0;
  bool losses_out_pinned = false;
  const RowWeights* row_weights = nullptr;
};

// The dropout key of training micro-batch `micro` of step `step` on rank `rank` of a run seeded
// `seed`: a function of these only (never 0), so a resumed run draws the uninterrupted run's
// masks, and every micro-batch and rank its own.
uint64_t training_dropout_key(uint64_t seed, int64_t step, int micro, int rank);

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // Makes activation set `slot` (< create_runner's slots) the one begin_batch and compute use
  // from here: a micro-batch's forward and its backward must run on the same slot, and a
  // slot's activations are only overwritten by the next forward run on it. Slot 0 at first.
  virtual void select(int slot) = 0;
  // Uploads tokens/targets (host arrays [B*T]) into the selected slot; blocks until the
  // compute stream has run everything enqueued so far (the slot's host staging is reused).
  // positions (host [B*T], or nullptr): each token's position in its sequence, restarting at 0
  // where a packed sequence starts (0 <= positions[b,t] <= t); the slot's passes then embed or
  // rotate by them and attend per sequence (Kernels' positions). nullptr: one sequence per row,
  // position t.
  virtual void begin_batch(const int32_t* tokens, const int32_t* targets,
                           const int32_t* positions = nullptr) = 0;
  // Enqueues one kCompute step of the program on the compute stream. The steps of a pass must
  // be run in the program's order.
  virtual void compute(const ProgramOp& op, const ModuleBindings& bound, const MicroBatch& mb) = 0;
  // The first failure of an ActivationStore call (kOffload), OK otherwise. The store also keeps
  // it for its next sync point (TierManager::end_backward), so a step whose block inputs did
  // not come back fails before its optimizer step.
  virtual Status status() const = 0;
};

// Forward FLOPs per token, split so that a schedule can count what it runs: training runs
// forward + 2 x forward (backward) + recompute (activation modes other than kKeep).
struct FlopsPerToken {
  double forward = 0;    // 2 per weight of each GEMM + attention's QK^T and AV
  double recompute = 0;  // re-running the blocks' forward in backward (kRecompute/kOffload)
  // The forward FLOPs of weights that get no gradient (a LoRA run's frozen base): backward
  // computes their input gradient only, one product per weight instead of two.
  double frozen = 0;
  double train() const { return 3.0 * forward + recompute - frozen; }
};

// ---- Hugging Face checkpoints ----------------------------------------------------------------

// Where one tensor of a module lives in a Hugging Face checkpoint: model.from_pretrained reads
// it (src/hf/hf_checkpoint.h), `strata export` writes it (src/hf/hf_export.h). Its elements are
// the first ones of the module's TensorSpec `tensor`; the TensorSpec's others (the padding rows
// of the vocabulary, V..Vp-1) are zero on import and are not exported.
struct HfTensor {
  std::string name;            // e.g. "model.layers.3.self_attn.q_proj.weight"
  std::string alt_name;        // another name a checkpoint may use ("" none): GPT-2 files
                               // written without the "transformer." prefix
  int tensor = 0;              // index into the module's TensorSpec list
  std::vector<int64_t> shape;  // its shape in the checkpoint
  bool transposed = false;     // 2-D, stored [in, out] (GPT-2's Conv1D) where strata keeps
                               // [out, in]: shape is the stored [in, out]
  bool more_rows_ok = false;   // a checkpoint may hold more rows than shape[0] (GPT-2's
                               // positions beyond model.context): the first shape[0] are read
};

// ---- generation ---------------------------------------------------------------------------------

// Generation's forward with a key/value cache (Architecture::create_kv_decoder): one sequence,
// each layer's keys and values of every position run so far kept on the device, so that a call
// runs only its new tokens — a prompt as one call over its tokens, then one token a call. It is
// made beside the training runner, never instead of it: the trainer and the planner never create
// one, and nothing it does changes a runner's numbers. Without it (a backend whose kernels lack
// KernelOp::kAttentionDecode) generation reruns the whole window through a runner's eval
// program (src/model/generate.h), which gives the same tokens.
//
// Thread safety: driven by one host thread.
class KvDecoder {
 public:
  virtual ~KvDecoder() = default;
  // Runs `tokens` (n >= 1 host ids, each < vocab_size) at positions [position(), position() +
  // n) over `params` (every module's device pointer, model dtype, indexed as
  // ModuleBindings::params), appending their keys and values to the cache, and copies the last
  // token's logits (padded_vocab_size elements of the dtype; columns >= vocab_size are padding)
  // to `logits_out` (host memory from Device::allocate_host); returns once they are there.
  // kInvalidArgument, nothing run, for positions past the context or an empty call; a device
  // failure as Device::synchronize reports it (the cache is then unusable: make a new decoder).
  virtual Status forward(std::span<const int32_t> tokens, std::span<const void* const> params,
                         void* logits_out) = 0;
  virtual int position() const = 0;  // tokens run so far
};

class Architecture {
 public:
  virtual ~Architecture() = default;
  virtual const std::string& name() const = 0;  // model.type: "gpt2", "llama"
  virtual const ModelLayout& layout() const = 0;
  // The model's shape: the config's model section with what it leaves to "auto" resolved
  // (padded_vocab_size, num_key_value_heads). The one description of a shape the config, the
  // planner and the models share.
  virtual const ModelConfig& shape() const = 0;
  // A one-line human description for the log ("GPT 4 layers, ...: 0.83M params in 6 modules").
  virtual std::string describe() const = 0;
  // The shape as a string that a checkpoint records and a resume compares (stable across
  // releases: changing it makes old checkpoints unresumable).
  virtual std::string shape_string() const = 0;
  virtual int vocab_size() const = 0;  // token ids are < this
  virtual int context() const = 0;     // the longest sequence

  // The program of one micro-batch. It is the same for every micro-batch and every step.
  virtual const Program& program(Pass pass) const = 0;
  // Whether a runner on `kernels` runs the fused attention (Kernels::fused_attention_*, no
  // [B, heads, T, T] probabilities) for dt: kernels.supports(KernelOp::kFusedAttention) at this
  // model's head size, for any batch and sequence length. create_runner decides with it; the
  // activation plan of that runner is activation_plan(..., fused_attention(kernels, dt)).
  virtual bool fused_attention(const Kernels& kernels, DType dt) const = 0;
  // The device bytes of a runner's activations (and, for kOffload, its host stash). With
  // fused_attention a layer keeps each attention row's log-sum-exp ([B, heads, T] fp32) instead
  // of the probabilities ([B, heads, T, T] fp32), and the backward's scratch shrinks the same
  // way. The default, true, is what every CPU backend and a CUDA one in bf16/fp16 with head size
  // 64 or 128 run (the planner's assumption).
  virtual ActivationSizes activation_plan(int B, int T, DType dt, ActivationMode mode,
                                          bool fused_attention = true) const = 0;
  virtual FlopsPerToken flops_per_token(int T, ActivationMode mode) const = 0;
  // Fills out[0, count) with elements [begin, begin + count) of module m's initial fp32 master
  // weights, deterministically from (seed, m): the same values whatever ranges a module is
  // filled in and in whatever order, at the cost of the range's own elements (the random
  // streams skip ahead), so a module much larger than host memory's share for it is initialized
  // a piece at a time (TierManager::init_state).
  virtual void init_range(int m, uint64_t seed, size_t begin, size_t count, float* out) const = 0;
  // The whole module: init_range(m, seed, 0, numel, master).
  void init_module(int m, uint64_t seed, float* master) const;

  // The Hugging Face tensors module m is made of, in the module's order.
  virtual std::vector<HfTensor> hf_tensors(int m) const = 0;
  // LoRA: the adapters (model.lora), nullptr without. An adapter module's tensors under PEFT's
  // names in adapter_model.safetensors ("base_model.model.model.layers.3.self_attn.q_proj.
  // lora_A.weight", [r, in] / [out, r]); empty for every other module (whose hf_tensors are
  // the base checkpoint's; an adapter module has none there).
  virtual const LoraLayout* lora() const { return nullptr; }
  // How module m's parameters are stored when the base is quantized (lora.base_quantization),
  // nullptr when they are plain model-dtype elements. The tier manager fills a quantized
  // module's homes through it (base_quant_fill) from the same fp32 values init_range or an
  // import gives; the runner dequantizes it before each of the module's compute steps.
  virtual std::shared_ptr<const BaseQuant> base_quant(int /*m*/) const { return nullptr; }
  // The fill of a module whose parameters are stored in another form than model-dtype elements
  // (ModuleSpec::stored_bytes > 0), for the tier manager, which sees stored bytes only: it writes
  // the stored bytes [begin, begin + count) of module m into out from the module's fp32 values,
  // which it reads through `values(b, c, out)` (elements [b, b + c), the init's range function).
  // Its errors name what the stored form is. nullptr for a module of plain elements.
  using StoredValuesFn = std::function<Status(size_t begin, size_t count, float* out)>;
  using StoredFillFn =
      std::function<Status(size_t begin, size_t count, uint8_t* out, const StoredValuesFn& values)>;
  virtual StoredFillFn stored_fill(int /*m*/) const { return nullptr; }
  virtual std::vector<HfTensor> hf_adapter_tensors(int /*m*/) const { return {}; }
  // Whether `name`, a tensor in a Hugging Face checkpoint that no hf_tensors() entry reads, is a
  // buffer or a duplicate import may skip (GPT-2's causal-mask "h.<i>.attn.bias", rotary
  // "inv_freq", a tied model's saved "lm_head.weight"). Any other unread tensor is an error.
  virtual bool hf_ignorable(const std::string& name) const = 0;

  // Allocates a runner's activations on `device` for micro-batches of B sequences of T tokens,
  // as activation_plan(B, T, dt, mode, fused_attention(device.kernels(), dt)).bytes says. kOffload
  // needs `store` (which must outlive the runner). Under kRecompute and kOffload the parameters a
  // block's backward reads must hold the values its forward read (no optimizer step between them;
  // the trainer's schedules, delayed update included, only change parameters between steps).
  // `slots` activation sets (each activation_plan's bytes) let a forward group's micro-batches
  // each keep theirs from its forward to its backward (ModelRunner::select); more than one only
  // under kKeep and kRecompute.
  virtual Result<std::unique_ptr<ModelRunner>> create_runner(
      Device& device, int B, int T, DType dt, ActivationMode mode = ActivationMode::kKeep,
      ActivationStore* store = nullptr, int slots = 1) const = 0;

  // Generation's cached forward on `device` in dtype `dt` for one sequence of up to context()
  // tokens: its activations for context() tokens and its cache (2 x layers x context x
  // key/value width elements of dt, kv_cache_bytes) allocated here. kUnavailable where
  // device.kernels() lacks KernelOp::kAttentionDecode at this model's head size (the caller
  // reruns the window through create_runner's eval program instead), and for a model with LoRA
  // adapters (generation runs the merged weights on the model without them). The default: the
  // first kUnavailable.
  virtual Result<std::unique_ptr<KvDecoder>> create_kv_decoder(Device& device, DType dt) const;
  // The bytes of create_kv_decoder's cache and activations, for a check before either exists.
  virtual size_t kv_decoder_bytes(DType /*dt*/) const { return 0; }
};

// init_range for a module whose init_kind 0 tensors draw, in the module's tensor order, from one
// stream of normals Rng(seed, stream) (the stream continues from one tensor into the next),
// kind 1 tensors are zeros and kind 2 ones, and elements [zero_begin, zero_end) are then zero
// (a vocabulary's padding rows, drawn and overwritten). Elements no tensor covers are zero.
void init_module_range(const ModuleSpec& spec, uint64_t seed, uint64_t stream, size_t zero_begin,
                       size_t zero_end, size_t begin, size_t count, float* out);

// The architecture model.type names ("gpt2", "gpt" its alias; "llama"), with the config's
// shape.
// Errors name the model.* key.
Result<std::unique_ptr<Architecture>> create_architecture(const ModelConfig& config);

}  // namespace strata
