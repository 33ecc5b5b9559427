// Llama (and the models that share its shape: Mistral, Qwen2, TinyLlama, SmolLM): the second
// Architecture (src/model/architecture.h). A decoder of L pre-norm blocks: RMSNorm (eps from
// model.rms_norm_eps), grouped-query attention (NH query heads, KVH key/value heads) with rotary
// positions (RopeParams: model.rope_theta, model.rope_scaling.*), and a SwiGLU MLP of width
// I = model.intermediate_size. No biases, except q/k/v biases when model.attention_bias
// (Qwen2). No learned positions. The output head is its own matrix unless
// model.tied_embeddings.
//
// Modules, in forward order: "embedding" (embed_tokens [Vp,C]), "block.<i>", "final_norm"
// (norm [C]) and "head" (lm_head [Vp,C]) when embeddings are not tied. Block tensors, in flat
// buffer order (hs = C/NH, W = (NH + 2*KVH)*hs):
//   input_layernorm [C], q_proj [NH*hs,C], k_proj [KVH*hs,C], v_proj [KVH*hs,C],
//   (q_bias [NH*hs], k_bias [KVH*hs], v_bias [KVH*hs] when attention_bias), o_proj [C,NH*hs],
//   post_attention_layernorm [C], gate_proj [I,C], up_proj [I,C], down_proj [C,I]
// The names are Hugging Face's (model.layers.<i>.self_attn.q_proj.weight, ...). q_proj, k_proj
// and v_proj are adjacent, so together they are the [W,C] weight of ONE matmul whose output is
// the packed qkv of Kernels::attention_gqa_forward; gate_proj and up_proj likewise make the
// [2I,C] weight whose output is SwiGLU's packed input.
//
// The program is GPT-2's (gpt2.h): P(emb) embedding_fwd R(emb); per block P(l) block_fwd(l)
// R(l); the head keeps final_norm and the head module acquired through its backward; blocks'
// backward last first; the embedding's backward last.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "src/model/architecture.h"
#include "strata/kernels.h"

namespace strata {

// Llama's shape, from ModelConfig.
struct LlamaShape {
  int L = 0, NH = 0, KVH = 0, C = 0, I = 0, V = 0, Vp = 0, maxT = 0;
  bool tied = false;
  bool qkv_bias = false;
  float eps = 1e-5f;
  RopeParams rope;
  int hs() const { return C / NH; }
  int qkv_width() const { return (NH + 2 * KVH) * hs(); }  // W
  // Module indices.
  int embedding() const { return 0; }
  int block(int l) const { return 1 + l; }
  int final_norm() const { return 1 + L; }
  int head() const { return tied ? 0 : 2 + L; }
};

class LlamaArchitecture final : public Architecture {
 public:
  // Validates the shape (errors name the model.* key).
  static Result<std::unique_ptr<LlamaArchitecture>> create(const ModelConfig& config);

  const std::string& name() const override { return name_; }
  const ModelLayout& layout() const override { return layout_; }
  std::string describe() const override;
  std::string shape_string() const override;
  int vocab_size() const override { return shape_.V; }
  int context() const override { return shape_.maxT; }
  const Program& program(Pass pass) const override { return pass == Pass::kTrain ? train_ : eval_; }
  bool fused_attention(const Kernels& kernels, DType dt) const override;
  ActivationSizes activation_plan(int B, int T, DType dt, ActivationMode mode,
                                  bool fused_attention = true) const override;
  FlopsPerToken flops_per_token(int T, ActivationMode mode) const override;
  // Hugging Face's LlamaPreTrainedModel initialization: every matrix normal(0, 0.02), norms'
  // weights one, biases zero; the vocabulary's padding rows (V..Vp-1) zero.
  void init_range(int m, uint64_t seed, size_t begin, size_t count, float* out) const override;
  // Hugging Face's names (model.embed_tokens.weight, model.layers.<i>.self_attn.q_proj.weight,
  // ..., model.norm.weight, lm_head.weight), all stored as strata keeps them.
  std::vector<HfTensor> hf_tensors(int m) const override;
  bool hf_ignorable(const std::string& name) const override;
  Result<std::unique_ptr<ModelRunner>> create_runner(Device& device, int B, int T, DType dt,
                                                     ActivationMode mode,
                                                     ActivationStore* store) const override;

  const LlamaShape& shape() const { return shape_; }

  // The compute functions of the program (ProgramOp::fn).
  enum Fn : int {
    kEmbeddingForward,
    kBlockForward,
    kHeadForward,  // final norm, output projection, fused cross-entropy (+ its gradient)
    kHeadBackward,
    kBlockBackward,
    kEmbeddingBackward
  };

 private:
  explicit LlamaArchitecture(const LlamaShape& shape);
  void build_programs();

  std::string name_ = "llama";
  LlamaShape shape_;
  ModelLayout layout_;
  Program train_, eval_;
};

}  // namespace strata
