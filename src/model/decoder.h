// The decoder skeleton: what every decoder-only model in strata is, with the parts that differ
// left to a block definition. A model (src/model/gpt2.h, src/model/llama.h) is a `Blocks` type
// plugged into `DecoderArchitecture<Blocks>` (src/model/decoder_architecture.h, with its
// `DecoderRunner`); the skeleton owns everything else:
//
//   modules     "embedding", "block.<i>" (i < model.n_layer), "final_norm", and "head" (the
//               output projection lm_head [Vp, C], normal(0, 0.02)) unless model.tied_embeddings
//               (DecoderModules gives their indices)
//   programs    the training and eval program over those modules (decoder_programs)
//   a block     pre-norm residual: x + attention(norm1(x)), then that + mlp(norm2(that))
//   the head    final norm, logits = lm_head x, fused cross-entropy and its gradient
//   activations one device arena carved per batch shape, the block inputs kept, recomputed or
//               offloaded per strata.activations (the offload stash and restore slots)
//   runner      compute dispatch, token upload, the loss copy, create_runner
//   init        init_module_range over the model's tensors, one random stream per module
//
// A block definition says what a norm, an attention and an MLP are (their tensors, their
// activations, their kernels), what the embedding is, its Hugging Face names and its FLOPs. A
// third architecture is a third `Blocks` type (see docs/ARCHITECTURE.md for the files it
// touches). The requirements, as `DecoderArchitecture` uses them (BatchDims and DecoderStep
// below):
//
//   static constexpr const char* kType;       model.type ("gpt2", "llama")
//   static constexpr uint64_t kInitStream;    module m draws from random stream kInitStream + m
//   static Status check(const ModelConfig&);  shape checks beyond the skeleton's (L, NH, C, V,
//                                             context >= 1; C % NH == 0; Vp >= V), naming keys
//   explicit Blocks(const ModelConfig&);      the resolved shape (decoder_shape)
//   void embedding_tensors(ModuleSpec&), block_tensors(ModuleSpec&), final_norm_tensors(...)
//                                             the modules' tensors, in flat-buffer order
//   int head_size() const;                    attention's head size (fused_attention asks it)
//   double blocks_flops(int T) const;         forward FLOPs per token of all L blocks
//   std::string describe(const ModelLayout&), shape_string()
//   std::vector<HfTensor> hf_tensors(const ModuleSpec&); bool hf_ignorable(const std::string&)
//   std::string hf_block_prefix(int l)        block l's Hugging Face prefix ("model.layers.3.")
//   std::vector<LoraSite> lora_sites()        its linear layers as PEFT names them (lora.h); its
//                                             parts call st.lora_forward / st.lora_backward
//                                             after each matmul, with the site's matmul id
//   struct NormStats, AttentionActs, MlpActs, AttentionScratch, MlpScratch and, for each,
//     void carve(Carver&, const BatchDims&, X*) const   its device buffers (one carve measures,
//                                             the same carve places them)
//   void embedding_forward(const DecoderStep&, const void* p, const int32_t* tokens, void* out)
//   void embedding_backward(const DecoderStep&, float* g, const void* dout, const int32_t* tokens)
//   void norm_forward(st, NormSite, const void* p, const void* in, void* out, const NormStats&)
//   void norm_backward(st, NormSite, p, float* g, void* din, const void* dres, const void* dout,
//                      const void* in, const NormStats&)
//                                             din = dres + the norm's input gradient (dres may
//                                             be din; nullptr: written), Kernels' rule
//   void residual_norm_forward(st, NormSite, p, const void* a, const void* b, void* res,
//                              void* out, const NormStats&)
//                                             res = a + b, then norm_forward of res into out
//                                             (in one call where supports(kResidualNorm))
//   void attention_forward(st, p, const void* in, const AttentionActs&, void* out)
//   void attention_backward(st, p, float* g, const void* dout, const void* in,
//                           const AttentionActs&, const AttentionScratch&, void* din (zeroed
//                           here, then written))
//   void mlp_forward / mlp_backward           the same for the MLP
//   void attention_decode(st, p, const void* in, const AttentionActs&, const KvLayer&, void* out)
//                                             generation's attention (decoder_kv.h): the
//                                             projections of st.T new tokens at positions st.pos,
//                                             then Kernels::attention_decode against the layer's
//                                             cache
// p and g are the flat parameter (model dtype) and gradient (fp32) buffers of the module the
// part lives in (the block, or final_norm for NormSite::kFinal); the part knows its tensors'
// offsets. Every compute function only enqueues kernels on st.s.
//
// Thread safety: as architecture.h (immutable architecture; a runner driven by one thread).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "src/model/base_quant.h"
#include "src/model/lora.h"
#include "strata/kernels.h"

namespace strata {

// Bump allocator over one arena: 256-byte aligned slices. With base == nullptr it only measures.
// The arena's size is the sum of its slices, whatever their order.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  void* take(size_t bytes) {
    void* p = base_ ? base_ + off_ : nullptr;
    off_ += (bytes + 255) / 256 * 256;
    return p;
  }
  float* take_f32(size_t n) { return static_cast<float*>(take(n * 4)); }
  size_t used() const { return off_; }

 private:
  char* base_;
  size_t off_ = 0;
};

// Module indices of a decoder of L blocks, each block followed by X extra modules of its own
// (a mixture of experts' experts; X = 0 for a dense block). With LoRA adapters (`lora`) the
// base's modules are frozen and block l's adapter module "lora.<l>" follows all of them.
struct DecoderModules {
  int L = 0;
  bool tied = true;
  int X = 0;
  bool lora = false;
  int embedding() const { return 0; }
  int block(int l) const { return 1 + l * (1 + X); }
  int extra(int l, int j) const { return block(l) + 1 + j; }  // j < X
  int final_norm() const { return 1 + L * (1 + X); }
  int head() const { return tied ? 0 : 2 + L * (1 + X); }  // the module holding the output head
  int base_modules() const { return tied ? 2 + L * (1 + X) : 3 + L * (1 + X); }
  int adapter(int l) const { return lora ? base_modules() + l : -1; }  // -1: none
};

// The compute functions of a decoder's program (ProgramOp::fn).
enum DecoderFn : int {
  kEmbeddingForward,
  kBlockForward,
  kHeadForward,  // final norm, output projection, fused cross-entropy (+ its gradient)
  kHeadBackward,
  kBlockBackward,
  kEmbeddingBackward
};

// The programs of a decoder (P = acquire params, R = release params, G = acquire gradients,
// D = drain gradients; H is the head module, the embedding when tied; l+ is block l with its X
// extra modules, acquired, released and drained together, every one of them every time):
//   P(emb) embedding_fwd R(emb); per block l: P(l+) block_fwd(l) R(l+); P(final) P(H) head_fwd
//   G(final) G(H) head_bwd R(final) R(H) D(final) [D(H) untied];
//   per block l, last first: P(l+) G(l+) block_bwd(l) R(l+) D(l+);  [G(emb) untied]
//   embedding_bwd D(emb)
// Eval runs the forward and releases the head's modules. With LoRA adapters (a = block l's
// adapter module) the blocks' steps become P(l+) P(a) block_fwd(l) R(l+) R(a) and
// P(l+) P(a) G(a) block_bwd(l) R(l+) R(a) D(a); the frozen base acquires no gradients and the
// embedding's backward is not run.
void decoder_programs(const DecoderModules& m, Program* train, Program* eval);

// The shape a decoder is built from: `config` with padded_vocab_size (0: vocab_size rounded up
// to 64) and num_key_value_heads (0: n_head) resolved, checked against what every decoder needs
// (errors name the model.* key). The block definition checks the rest.
Result<ModelConfig> decoder_shape(const ModelConfig& config);

// Which norm of a model: a block's first (before attention) or second (before the MLP), or the
// final one (its own module, before the head).
enum class NormSite : uint8_t { kBlockIn, kBlockMid, kFinal };

// A batch shape: B sequences of T tokens in dtype dt, attention fused or not.
struct BatchDims {
  int B = 0, T = 0;
  DType dt = DType::kF32;
  bool fused = true;  // fused attention (Kernels::fused_attention_*): att holds the log-sum-exp
  size_t N() const { return size_t(B) * size_t(T); }
  size_t es() const { return dtype_size(dt); }
};

// What a compute function sees: the device, its kernels and compute stream, the batch shape;
// in a block's step, the block's index and its extra modules' buffers; the step's loss scale;
// the block definition's per-runner state, if it declares one.
// A frozen module (LoRA's base) is bound without a gradient buffer (g == nullptr): its matmuls
// skip the weight gradient (wgrad gives nullptr) and its norms' weight gradients land in
// `discard` (norm_grad), 2 x max(n_embd, head size) fp32 of scratch. `lora`: the adapters of the
// block being computed (nullptr without adapters); a block definition calls lora_forward /
// lora_backward after each of its matmuls.
struct DecoderStep : BatchDims {
  Device* dev = nullptr;
  Kernels* k = nullptr;
  Stream* s = nullptr;
  int layer = -1;                             // the block computed, -1 outside a block
  std::span<const void* const> extra_params;  // the block's X extra modules (model dtype)
  std::span<float* const> extra_grads;        // ... and their gradients (backward only)
  float dloss = 0;                            // MicroBatch::dloss of the step
  uint64_t dropout_key = 0;                   // MicroBatch::dropout_key (0: no dropout)
  // Each token's position in its sequence, a device array [B*T] (Kernels::encoder_forward), or
  // nullptr: position t of row b,t (the default: one sequence per row). The runner sets it
  // from begin_batch's positions (the selected slot's copy); the blocks pass it to the
  // embedding, the rotary op and the attention (masked per sequence).
  const int32_t* pos = nullptr;
  void* state = nullptr;  // Blocks::RunnerState (see DecoderRunner)
  float* discard = nullptr;
  const LoraRun* lora = nullptr;
  void zero(void* p, size_t bytes) const { dev->memset_zero(*s, p, bytes); }
  static float* wgrad(float* g, size_t at) { return g ? g + at : nullptr; }
  // A norm's weight gradient at `at` (slot 0) or its bias's (slot 1, the n_embd after it).
  float* norm_grad(float* g, size_t at, int slot = 0, size_t C = 0) const {
    return g ? g + at + size_t(slot) * C : discard + size_t(slot) * C;
  }
  void lora_forward(int matmul, const void* x, void* y) const {
    if (lora) strata::lora_forward(*this, *lora, matmul, x, y);
  }
  void lora_backward(int matmul, const void* x, const void* dy, void* dx) const {
    if (lora && lora->g) strata::lora_backward(*this, *lora, matmul, x, dy, dx);
  }
};

// One layer's key/value cache in generation (DecoderKv, Kernels::attention_decode): keys and
// values [maxT, KVH * hs] of dt, positions [0, pos0) filled; a call's new tokens go to pos0...
struct KvLayer {
  void* k = nullptr;
  void* v = nullptr;
  int pos0 = 0;
  int maxT = 0;
};

// A block definition's optional per-runner host state: `struct RunnerState` (default
// constructible, with a `Status error` the runner's status() reports), prepared once by `Status
// prepare(const DecoderStep&, RunnerState&) const` when the runner allocates its activations, and
// handed to every compute function as DecoderStep::state. After the head's forward, `void
// end_forward(const DecoderStep&, const MicroBatch&) const` runs (a mixture reports its auxiliary
// loss there). Dense blocks have none.
template <class B>
struct RunnerStateOf {
  struct type {};
  static constexpr bool kHas = false;
};
template <class B>
requires requires { typename B::RunnerState; }
struct RunnerStateOf<B> {
  using type = typename B::RunnerState;
  static constexpr bool kHas = true;
};

// A block definition's extra modules per block (`int extra_modules() const`; 0 without it),
// with `void extra_tensors(int j, ModuleSpec&) const` and `std::string extra_name(int l, int j)`.
template <class B>
int extra_modules_of(const B& b) {
  if constexpr (requires { b.extra_modules(); }) {
    return b.extra_modules();
  } else {
    return 0;
  }
}

// The modules of a decoder, each filled by its tensor function; the head module (lm_head) when
// the embeddings are not tied.
// With X > 0 each block is followed by its X extra modules, named extra_name(l, j) and filled
// by extra(j, spec). With adapters (`lora` not empty) every base module is frozen and one
// adapter module "lora.<i>" per block follows them.
ModelLayout decoder_layout(const ModelConfig& shape,
                           const std::function<void(ModuleSpec&)>& embedding,
                           const std::function<void(ModuleSpec&)>& block,
                           const std::function<void(ModuleSpec&)>& final_norm, int X,
                           const std::function<std::string(int, int)>& extra_name,
                           const std::function<void(int, ModuleSpec&)>& extra,
                           const LoraLayout& lora);

// init_module_range for a decoder's module `spec`, from stream `stream`: the vocabulary's
// padding rows (V..Vp-1) of "embedding" and "head" start at zero (they never receive gradient).
void decoder_init_range(const ModelConfig& shape, const ModuleSpec& spec, uint64_t stream,
                        uint64_t seed, size_t begin, size_t count, float* out);

// create_runner's checks: T within the context, a store for kOffload, one slot under kOffload
// (its store keeps one stash per layer).
Status check_decoder_runner(const ModelConfig& shape, int T, ActivationMode mode,
                            const ActivationStore* store, int slots);

// Appends tensor `name` of n elements to module m (init kind 0 normal(0, std), 1 zeros, 2 ones).
inline void add_tensor(ModuleSpec& m, const char* name, size_t n, int kind, float std = 0.02f) {
  m.tensors.push_back({name, m.numel, n, kind, std});
  m.numel += n;
}

// The offset (elements) of module m's tensor `name`; a missing name is a bug.
size_t tensor_offset(const ModuleSpec& m, const std::string& name);

}  // namespace strata
