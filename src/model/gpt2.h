// GPT-2: the first Architecture (src/model/architecture.h). A decoder of L pre-norm blocks
// (LayerNorm, multi-head attention with a packed qkv projection, GELU MLP of width 4C, biases
// everywhere), learned positions, and an output projection tied to the token embedding unless
// model.tied_embeddings is false.
//
// Modules, in forward order: "embedding" (wte [Vp,C], wpe [maxT,C]), "block.<i>" (12 tensors),
// "final_norm" (lnfw, lnfb), and "head" (lm_head [Vp,C]) when embeddings are not tied.
// Block tensor order inside the flat buffer, with shapes (C channels):
//   ln1w [C], ln1b [C], qkvw [3C,C], qkvb [3C], attprojw [C,C], attprojb [C],
//   ln2w [C], ln2b [C], fcw [4C,C], fcb [4C], fcprojw [C,4C], fcprojb [C]
//
// The program of a training micro-batch (P = acquire params, R = release params, G = acquire
// gradients, D = drain gradients; H is the embedding when tied):
//   P(emb) embedding_fwd R(emb); per block l: P(l) block_fwd(l) R(l); P(final) P(H) head_fwd
//   G(final) G(H) head_bwd R(final) R(H) D(final) [D(H) untied];
//   per block l, last first: P(l) G(l) block_bwd(l) R(l) D(l);  [G(emb) untied] embedding_bwd
//   D(emb)
// Eval runs the forward and releases the head's modules.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "src/model/architecture.h"

namespace strata {

// GPT's shape, from ModelConfig.
struct GptShape {
  int L = 0, NH = 0, C = 0, V = 0, Vp = 0, maxT = 0;
  bool tied = true;
  // Module indices.
  int embedding() const { return 0; }
  int block(int l) const { return 1 + l; }
  int final_norm() const { return 1 + L; }
  int head() const { return tied ? 0 : 2 + L; }  // the module holding the output projection
};

class GptArchitecture final : public Architecture {
 public:
  // Validates the shape (errors name the model.* key).
  static Result<std::unique_ptr<GptArchitecture>> create(const ModelConfig& config);

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
  // GPT-2's initialization: normal(0, 0.02); projections feeding the residual stream
  // (attprojw, fcprojw) std 0.02/sqrt(2L); norms' weights one, biases zero; the padding rows of
  // the vocabulary (V..Vp-1) zero (they never receive gradient).
  void init_range(int m, uint64_t seed, size_t begin, size_t count, float* out) const override;
  // Hugging Face's GPT2LMHeadModel names ("transformer.h.<i>.attn.c_attn.weight", or without the
  // "transformer." prefix); its Conv1D weights are stored transposed. wpe holds model.context
  // rows: a checkpoint's positions beyond it are not read.
  std::vector<HfTensor> hf_tensors(int m) const override;
  bool hf_ignorable(const std::string& name) const override;
  Result<std::unique_ptr<ModelRunner>> create_runner(Device& device, int B, int T, DType dt,
                                                     ActivationMode mode,
                                                     ActivationStore* store) const override;

  const GptShape& shape() const { return shape_; }

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
  explicit GptArchitecture(const GptShape& shape);
  void build_programs();

  std::string name_ = "gpt2";
  GptShape shape_;
  ModelLayout layout_;
  Program train_, eval_;
};

}  // namespace strata
