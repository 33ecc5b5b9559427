// LoRA adapters on a decoder's linear layers (model.lora, the config's "lora" section).
//
// A block definition names its linear layers as PEFT does (LoraSite: "self_attn.q_proj",
// "mlp.c_fc", ...) and says which of its matmuls computes each and at which output columns (q,
// k and v are column ranges of one packed matmul in Llama). With adapters on, the skeleton
// (decoder.h) appends one adapter module per block, "lora.<i>", after the base's modules: for
// each targeted site, in the block's site order, the tensors "<site>.lora_A" [r, in] (PEFT's
// kaiming_uniform_(a = sqrt(5)): uniform(-1/sqrt(in), 1/sqrt(in))) and "<site>.lora_B" [out, r]
// (zeros). Every base module is frozen (ModuleSpec::trainable false): only its parameters exist.
//
// The compute, with s = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), for a site whose
// matmul computes y = x W^T (+ b):
//   forward   y[:, cols] += s * (x A^T) B^T
//   backward  dB += s * dy[:, cols]^T (x A^T);  du = s * dy[:, cols] B;  dA += du^T x;
//             dx += du A
// built from the kernel table's matmul, cast, scale and add calls only (so every backend that
// has those runs it): u = x A^T is recomputed in backward (N x r, small) rather than kept, and B
// is scattered, times s, into the site's rows of a zero [width, r] matrix so that one matmul
// writes the whole packed output's delta.
// With lora_dropout p > 0, in training (DecoderStep::dropout_key != 0), x above is
// xd = dropout(x) (Kernels::dropout: kept elements times 1 / (1 - p)), a mask of its own per
// micro-batch, block and site (lora_dropout_key); dA += du^T xd, and dx += dropout(du A) with
// the same mask. The backward redraws the mask from the key instead of keeping it. Eval,
// generate and p = 0 take the plain path above, unchanged.
//
// The mixtures' routed experts (lora.target_parameters, PEFT's ParamWrapper over a fused 3-D
// parameter of E experts, each expert e's weight W_e [out, in]): per expert a rank-r adapter,
// the E of them stored as PEFT stores them, lora_A [E*r, in] (expert e's rows e*r .. e*r + r)
// and lora_B [out, r*E] (expert e's rank k in column k*E + e):
//   W_e' = W_e + s * B_e A_e,  B_e[o, k] = B[o, k*E + e],  A_e = A[e*r .. e*r + r, :]
// computed on each expert's routed rows as y_e += s * (x_e A_e^T) B_e^T, dropout-free (PEFT
// refuses lora_dropout there). Per block, lora_experts_prepare turns B into s * B_e per expert
// ([E, out, r], a transpose that is a matmul by the identity, exact), and lora_experts_finish
// returns the experts' dB_e into lora_B's interleaved columns the same way.
//
// Thread safety: LoraLayout is immutable; a LoraRun is owned by one runner's thread.
#pragma once

#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "src/model/base_quant.h"
#include "strata/config.h"
#include "strata/kernels.h"
#include "strata/status.h"

namespace strata {

struct DecoderStep;
class Carver;

// One linear layer of a block an adapter can wrap.
struct LoraSite {
  std::string name;  // PEFT's path within the block: "self_attn.q_proj", "attn.c_proj"
  int matmul = 0;    // which matmul of the block computes it (the block definition's id)
  int in = 0, out = 0;
  int col0 = 0;   // its output columns [col0, col0 + out) of the matmul's ...
  int width = 0;  // ... `width` outputs
  // The block tensor that starts the matmul's weight ([width, in], strata's [out, in] order):
  // the site's own weight is its rows [col0, col0 + out) (merging adds s * B A there).
  std::string weight;
  // 0: a linear layer of the block (target_modules). E > 0: a fused parameter of the block's E
  // routed experts (target_parameters; "mlp.experts.gate_up_proj"), expert e's weight [out, in]
  // the tensor `weight` of the block's e-th extra module; col0 0, width out.
  int experts = 0;
};

// The adapted sites of a block and where their tensors sit in the adapter module.
struct LoraLayout {
  struct Target {
    LoraSite site;
    size_t a = 0, b = 0;  // offsets (elements) of lora_A [r, in] and lora_B [out, r]
  };
  int r = 0;
  float scaling = 0;
  float dropout = 0;  // lora_dropout: p of the adapters' input dropout in training
  std::vector<Target> targets;
  // The routed experts' adapted parameters (site.experts = E), after `targets` in the module:
  // a = lora_A [E*r, in], b = lora_B [out, r*E].
  std::vector<Target> experts;
  size_t numel = 0;
  int max_width = 0;       // the widest adapted matmul
  int max_in = 0;          // the widest adapted input
  bool all_sites = false;  // every linear layer of the block is adapted (PEFT's "all-linear")
  size_t expert_b = 0;     // the experts' lora_B elements, all targets together
  std::vector<float> eye;  // [E, E] the identity the experts' transposes multiply by
  bool empty() const { return targets.empty() && experts.empty(); }
};

// The largest lora_alpha / r lora_layout accepts: past it one step moves the model by that many
// times the learning rate (PEFT's usual scaling is 1 to 2; rsLoRA's alpha / sqrt(r) stays far
// below it too).
inline constexpr double kMaxLoraScaling = 1000;

// PEFT's default target_modules for a model type (llama: q_proj, v_proj; gpt2: c_attn).
std::vector<std::string> lora_default_targets(const std::string& type);

// The adapters `lora` asks for over blocks of `sites`, block l's full names prefixed
// `block_prefixes[l]` ("model.layers.3."), as PEFT selects them: a target_modules list entry
// must match a site (its whole name, or its last components: "q_proj", "mlp.c_proj"); a string
// is "all-linear" (every site) or a regular expression (ECMAScript, as std::regex; PEFT's
// Python patterns of names, alternatives, classes and repetitions read the same) matched
// against each site's full name as re.fullmatch; its matches must be the same sites in every
// block (strata adapts each block alike). kInvalidArgument naming lora.target_modules for a
// name or pattern that matches no site (listing the sites' full names of block 0), a bad
// pattern, or one that matches unevenly; naming lora.r for r < 1. lora.target_parameters
// selects among the sites with `experts` > 0 (which target_modules never selects) by name as
// target_modules' lists do (beside them lora.target_modules given as [] selects no linear
// layer, as PEFT's target_modules=[]): kInvalidArgument naming it for a name that matches no
// expert parameter or a model without experts, and naming it and lora.lora_dropout when both
// are given.
Result<LoraLayout> lora_layout(const LoraConfig& lora, const std::string& type,
                               const std::vector<LoraSite>& sites,
                               const std::vector<std::string>& block_prefixes);

// Whether the backend runs `layout`'s adapters: lora_dropout > 0 needs Kernels::dropout
// (supports(KernelOp::kDropout); the CPU and CUDA backends have it): kUnavailable naming
// lora.lora_dropout otherwise.
Status lora_check_backend(const LoraLayout& layout, const Kernels& kernels);

// The dropout key of site `target` (an index into LoraLayout::targets) of block `layer` in a
// micro-batch whose key is `micro_key` (MicroBatch::dropout_key, not 0).
uint64_t lora_dropout_key(uint64_t micro_key, int layer, int target);

// lora.base_quantization of a model whose adapters are `layout`: kNone when "none"; an error
// naming the key for an unknown value, for a quantized base without adapters, or for a model
// type whose blocks list no linear layers (`sites`).
Result<BaseQuantKind> lora_base_quant_kind(const LoraConfig& lora, const std::string& type,
                                           const LoraLayout& layout,
                                           const std::vector<LoraSite>& sites);
// The stored layout of a block module `block` whose linear layers are `sites`: the weight of
// every distinct matmul ([width, in] from its `weight` tensor) quantized as `kind`.
BaseQuant lora_base_quant(BaseQuantKind kind, const ModuleSpec& block,
                          const std::vector<LoraSite>& sites);

// The adapter module's tensors (for ModuleSpec): A uniform(+-1/sqrt(in)) (init kind 3), B zero;
// the experts' "<site>.lora_A" [E*r, in] and "<site>.lora_B" [out, r*E] after the linear ones.
void lora_tensors(const LoraLayout& layout, ModuleSpec& m);

// describe()'s and shape_string()'s suffixes ("" without adapters).
std::string lora_describe(const LoraLayout& layout, int n_layer);
std::string lora_shape_string(const LoraLayout& layout);
// An adapter module's tensors under PEFT's names, block prefix `prefix` ("model.layers.3."):
// "base_model.model.<prefix><site>.lora_A.weight" [r, in], "...lora_B.weight" [out, r]. An
// expert parameter's as PEFT nests its ParamWrappers on the experts' module (one per targeted
// parameter, in the module's parameter order, the last outermost): "...mlp.experts.lora_A.weight"
// [E*r, in] for the outermost, "...mlp.experts.base_layer.lora_A.weight" for the one inside it.
std::vector<HfTensor> lora_hf_tensors(const LoraLayout& layout, const std::string& prefix);

// Merges block l's adapters into its weights: W[rows of a site] += s * B A, in fp32. `block` is
// the block module's values (spec: its tensors), `adapter` the adapter module's.
void lora_merge(const LoraLayout& layout, const ModuleSpec& block, const float* adapter,
                float* block_values);
// Merges the experts' adapters into expert `e`'s weights (`expert`: the spec of the block's
// e-th extra module, `expert_values` its values): W_e += s * B_e A_e, in fp32.
void lora_merge_expert(const LoraLayout& layout, int e, const ModuleSpec& expert,
                       const float* adapter, float* expert_values);

// One runner's adapters: the layout, its scratch on the device, and the current block's
// adapter parameters and gradients (bound by the runner before each block's compute).
struct LoraRun {
  const LoraLayout* layout = nullptr;
  void *u = nullptr, *du = nullptr;    // [N, r] dt
  void* bpad = nullptr;                // [max_width, r] dt: s * B scattered into its rows
  float* bf32 = nullptr;               // [max_width * r] fp32: B's staging, then dB's
  void* delta = nullptr;               // [N, max_width] dt
  void *xd = nullptr, *dxd = nullptr;  // [N, max_in] dt: dropout(x), its gradient (dropout > 0)
  // The routed experts' (LoraLayout::experts non-empty):
  float* eye = nullptr;     // [E, E] fp32 identity
  float* ed = nullptr;      // [E, E] fp32: the transposes' unused input gradient
  float* eb32 = nullptr;    // [max out * r * E] fp32: one target's B, staged
  void* ebt = nullptr;      // [expert_b] dt: per target, s * B_e for each expert e ([E, out, r])
  float* edbt = nullptr;    // [expert_b] fp32: per target, d(s * B_e) for each expert e
  const void* p = nullptr;  // this block's adapter parameters (dt)
  float* g = nullptr;       // its gradient (fp32); nullptr in eval
  void carve(Carver& c, size_t N, size_t es);
};

// y (the output of the block's matmul `matmul`, [N, width]) += each adapted site's delta.
void lora_forward(const DecoderStep& st, const LoraRun& run, int matmul, const void* x, void* y);
// After the base matmul's backward of `matmul` (x its input, dy its output's gradient):
// accumulates the adapters' gradients into run.g and their part of dx into `dx`.
void lora_backward(const DecoderStep& st, const LoraRun& run, int matmul, const void* x,
                   const void* dy, void* dx);

// The routed experts' adapters, on one block: lora_experts_prepare before its experts' compute
// (forward or backward: s * B_e of each target and, with gradients, a zero d(s * B_e)), then
// per expert e with n routed rows lora_expert_forward (y [n, out] of the experts' matmul
// `matmul` += the delta of x [n, in]) or, after the base matmul's backward, lora_expert_backward
// (dA_e into run.g, dx [n, in] += its part, d(s * B_e) kept), then lora_experts_finish after the
// backward's last expert (dB into run.g). No-ops without expert targets.
void lora_experts_prepare(const DecoderStep& st, const LoraRun& run);
void lora_expert_forward(const DecoderStep& st, const LoraRun& run, int matmul, int e, int n,
                         const void* x, void* y);
void lora_expert_backward(const DecoderStep& st, const LoraRun& run, int matmul, int e, int n,
                          const void* x, const void* dy, void* dx);
void lora_experts_finish(const DecoderStep& st, const LoraRun& run);

}  // namespace strata
