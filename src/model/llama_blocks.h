// Llama's block definition of the decoder skeleton (src/model/decoder.h), shared by the models
// built on Llama's block: llama (src/model/llama.h) and the mixtures of experts
// (src/model/moe.h), which replace its MLP. See llama.h for the tensors and their names.
#pragma once

#include <fmt/format.h>

#include <string>
#include <vector>

#include "src/model/decoder.h"
#include "src/model/llama.h"

namespace strata {

// Llama's parts of a decoder: RMSNorm, grouped-query attention with rotary positions over one
// packed q|k|v matmul (biases when model.attention_bias; heads model.head_dim wide, each query
// and key head RMS-normalized before its rotation when model.qk_norm, as Qwen3's), a SwiGLU MLP
// over one packed gate|up matmul, token embeddings only. Phi-3's checkpoints (model.type phi3,
// Phi3Blocks in llama.cc) store the packed weights as they are computed: one qkv_proj, one
// gate_up_proj; the arithmetic is the same.
class LlamaBlocks {
 public:
  static constexpr const char* kType = "llama";
  static constexpr uint64_t kInitStream = 0x11a3a;

  static Status check(const ModelConfig& mc) {
    STRATA_RETURN_IF_ERROR(check_attention(mc), "");
    if (mc.intermediate_size < 1) {
      return invalid_argument(
          "model.intermediate_size: a llama model needs the width of its MLP (e.g. 4 * n_embd "
          "rounded, as its config.json's intermediate_size)");
    }
    return Status::ok();
  }
  // model.* checks of everything but the MLP (norm, attention, rotary positions).
  static Status check_attention(const ModelConfig& mc);

  explicit LlamaBlocks(const ModelConfig& s)
      : s_(s), eps_(float(s.rms_norm_eps)), rope_(llama_rope(s)), fused_(s.type == "phi3") {
    ModuleSpec b;
    block_tensors(b);
    ln1w_ = tensor_offset(b, "input_layernorm");
    qkvw_ = tensor_offset(b, fused_ ? "qkv_proj" : "q_proj");
    qkvb_ = s_.attention_bias ? tensor_offset(b, "q_bias") : 0;
    qnw_ = s_.qk_norm ? tensor_offset(b, "q_norm") : 0;
    knw_ = s_.qk_norm ? tensor_offset(b, "k_norm") : 0;
    ow_ = tensor_offset(b, "o_proj");
    ln2w_ = tensor_offset(b, "post_attention_layernorm");
    guw_ = tensor_offset(b, fused_ ? "gate_up_proj" : "gate_proj");
    downw_ = tensor_offset(b, "down_proj");
  }

  // ---- layout ---------------------------------------------------------------------------------
  void embedding_tensors(ModuleSpec& m) const {
    add_tensor(m, "embed_tokens", size_t(s_.padded_vocab_size) * s_.n_embd, 0);
  }
  void block_tensors(ModuleSpec& b) const {
    const size_t C = s_.n_embd, I = s_.intermediate_size;
    attention_tensors(b);
    if (fused_) {
      add_tensor(b, "gate_up_proj", 2 * I * C, 0);
    } else {
      add_tensor(b, "gate_proj", I * C, 0);
      add_tensor(b, "up_proj", I * C, 0);
    }
    add_tensor(b, "down_proj", C * I, 0);
  }
  // A block's tensors up to its MLP: input_layernorm, q/k/v (biases), the query/key norms, o_proj,
  // post_attention_layernorm (a mixture's block starts the same way).
  void attention_tensors(ModuleSpec& b) const {
    const size_t C = s_.n_embd, Q = size_t(s_.n_head) * hs(),
                 KV = size_t(s_.num_key_value_heads) * hs();
    add_tensor(b, "input_layernorm", C, 2);
    if (fused_) {
      add_tensor(b, "qkv_proj", (Q + 2 * KV) * C, 0);
    } else {
      add_tensor(b, "q_proj", Q * C, 0);
      add_tensor(b, "k_proj", KV * C, 0);
      add_tensor(b, "v_proj", KV * C, 0);
    }
    if (s_.attention_bias) {
      add_tensor(b, "q_bias", Q, 1);
      add_tensor(b, "k_bias", KV, 1);
      add_tensor(b, "v_bias", KV, 1);
    }
    if (s_.qk_norm) {
      add_tensor(b, "q_norm", size_t(hs()), 2);
      add_tensor(b, "k_norm", size_t(hs()), 2);
    }
    add_tensor(b, "o_proj", C * Q, 0);
    add_tensor(b, "post_attention_layernorm", C, 2);
  }
  void final_norm_tensors(ModuleSpec& m) const { add_tensor(m, "norm", size_t(s_.n_embd), 2); }
  int head_size() const { return hs(); }
  double blocks_flops(int T) const {
    const double C = s_.n_embd, L = s_.n_layer, W = qkv_width(), A = double(s_.n_head) * hs(),
                 I = s_.intermediate_size;
    // 2 FLOPs per weight of each GEMM (qkv C x W, o_proj A x C, gate/up/down 3 C x I) +
    // attention's QK^T and AV over the whole T x T square (4 T A per block).
    return 2.0 * (C * W + A * C + 3.0 * C * I) * L + 4.0 * T * A * L;
  }
  std::string describe(const ModelLayout& layout) const {
    return fmt::format(
        "{} {} layers, {} heads ({} key/value), width {}, MLP {}, vocab {} (padded {}), "
        "context {}, rope theta {}{}{}{}{}: {:.2f}M params in {} modules",
        fused_ ? "Phi-3" : "Llama", s_.n_layer, s_.n_head, s_.num_key_value_heads, s_.n_embd,
        s_.intermediate_size, s_.vocab_size, s_.padded_vocab_size, s_.context, rope_.theta,
        rope_.llama3 ? " (llama3 scaling)" : "", s_.attention_bias ? ", qkv bias" : "",
        attention_note(), s_.tied_embeddings ? ", tied head" : "",
        double(layout.num_params()) / 1e6, layout.modules.size());
  }
  std::string shape_string() const {
    return fmt::format(
               "{} L={} NH={} KVH={} C={} I={} V={} Vp={} T={} tied={} qkv_bias={} eps={} "
               "theta={} "
               "llama3={} factor={} low={} high={} orig={}",
               fused_ ? "phi3" : "llama", s_.n_layer, s_.n_head, s_.num_key_value_heads, s_.n_embd,
               s_.intermediate_size, s_.vocab_size, s_.padded_vocab_size, s_.context,
               s_.tied_embeddings, s_.attention_bias, eps_, rope_.theta, rope_.llama3, rope_.factor,
               rope_.low_freq_factor, rope_.high_freq_factor, rope_.original_max_position) +
           attention_shape();
  }
  // describe()'s and shape_string()'s words for a head width other than n_embd / n_head and the
  // query/key norms ("" for neither: the strings of checkpoints written before them).
  std::string attention_note() const {
    return (wide_heads() ? fmt::format(", heads {} wide", hs()) : std::string()) +
           (s_.qk_norm ? ", q/k norms" : "");
  }
  std::string attention_shape() const {
    return wide_heads() || s_.qk_norm ? fmt::format(" hd={} qk_norm={}", hs(), s_.qk_norm) : "";
  }
  std::vector<HfTensor> hf_tensors(const ModuleSpec& m) const;
  std::string hf_block_prefix(int l) const { return fmt::format("model.layers.{}.", l); }
  // The matmuls of a block: q|k|v, o_proj, gate|up, down_proj (LoRA's sites, src/model/lora.h).
  enum Matmul { kQkv, kO, kGateUp, kDown };
  std::vector<LoraSite> lora_sites() const {
    const int C = s_.n_embd, I = s_.intermediate_size, Q = s_.n_head * hs(),
              KV = s_.num_key_value_heads * hs(), W = qkv_width();
    if (fused_) {  // Phi-3's linear layers: the packed matmuls themselves
      return {{"self_attn.qkv_proj", kQkv, C, W, 0, W, "qkv_proj"},
              {"self_attn.o_proj", kO, Q, C, 0, C, "o_proj"},
              {"mlp.gate_up_proj", kGateUp, C, 2 * I, 0, 2 * I, "gate_up_proj"},
              {"mlp.down_proj", kDown, I, C, 0, C, "down_proj"}};
    }
    return {{"self_attn.q_proj", kQkv, C, Q, 0, W, "q_proj"},
            {"self_attn.k_proj", kQkv, C, KV, Q, W, "q_proj"},
            {"self_attn.v_proj", kQkv, C, KV, Q + KV, W, "q_proj"},
            {"self_attn.o_proj", kO, Q, C, 0, C, "o_proj"},
            {"mlp.gate_proj", kGateUp, C, I, 0, 2 * I, "gate_proj"},
            {"mlp.up_proj", kGateUp, C, I, I, 2 * I, "gate_proj"},
            {"mlp.down_proj", kDown, I, C, 0, C, "down_proj"}};
  }
  // Tensor `n` of a module as Hugging Face names it (`block`: "model.layers.<i>." in a block,
  // else ""); false for a name a llama does not have.
  bool hf_tensor(const std::string& block, const std::string& n, HfTensor* h) const;
  bool hf_ignorable(const std::string& name) const {
    // A buffer older checkpoints saved.
    const std::string inv = "rotary_emb.inv_freq";
    return name.size() >= inv.size() &&
           name.compare(name.size() - inv.size(), inv.size(), inv) == 0;
  }

  // ---- activations ----------------------------------------------------------------------------
  struct NormStats {
    float* rstd = nullptr;  // fp32 [N]
  };
  // qkv [N,W] after the rotary embedding (the attention's input), atty [N,A]; att (fp32): the
  // probabilities [B,NH,T,T], or with the fused attention each row's log-sum-exp [B,NH,T].
  // With the query/key norms: the heads before them, qk_in [N,(NH + NKV) hs], and their
  // qk_rstd [N (NH + NKV)] (Kernels::qk_norm_forward).
  struct AttentionActs {
    void *qkv = nullptr, *atty = nullptr, *qk_in = nullptr;
    float *att = nullptr, *qk_rstd = nullptr;
  };
  struct MlpActs {
    void *gu = nullptr, *act = nullptr;  // gate|up [N,2I], SwiGLU's output [N,I]
  };
  struct AttentionScratch {
    void *datty = nullptr, *dqkv = nullptr;
    float* datt = nullptr;  // the attention backward's scratch, att's size
  };
  struct MlpScratch {
    void *dgu = nullptr, *dact = nullptr;
  };
  void carve(Carver& c, const BatchDims& d, NormStats* n) const { n->rstd = c.take_f32(d.N()); }
  void carve(Carver& c, const BatchDims& d, AttentionActs* a) const {
    a->qkv = c.take(d.N() * size_t(qkv_width()) * d.es());
    a->atty = c.take(d.N() * size_t(s_.n_head) * hs() * d.es());
    a->att = static_cast<float*>(c.take(att_bytes(d)));
    if (s_.qk_norm) {
      const size_t heads = d.N() * size_t(s_.n_head + s_.num_key_value_heads);
      a->qk_in = c.take(heads * size_t(hs()) * d.es());
      a->qk_rstd = c.take_f32(heads);
    }
  }
  void carve(Carver& c, const BatchDims& d, MlpActs* a) const {
    a->gu = c.take(d.N() * 2 * size_t(s_.intermediate_size) * d.es());
    a->act = c.take(d.N() * size_t(s_.intermediate_size) * d.es());
  }
  void carve(Carver& c, const BatchDims& d, AttentionScratch* a) const {
    a->datty = c.take(d.N() * size_t(s_.n_head) * hs() * d.es());
    a->dqkv = c.take(d.N() * size_t(qkv_width()) * d.es());
    a->datt = static_cast<float*>(c.take(att_bytes(d)));
  }
  void carve(Carver& c, const BatchDims& d, MlpScratch* a) const {
    a->dgu = c.take(d.N() * 2 * size_t(s_.intermediate_size) * d.es());
    a->dact = c.take(d.N() * size_t(s_.intermediate_size) * d.es());
  }

  // ---- compute --------------------------------------------------------------------------------
  void embedding_forward(const DecoderStep& st, const void* p, const int32_t* tokens,
                         void* out) const {
    st.k->encoder_forward(*st.s, st.dt, out, tokens, st.pos, p, nullptr, st.B, st.T, s_.n_embd);
  }
  void embedding_backward(const DecoderStep& st, float* g, const void* dout,
                          const int32_t* tokens) const {
    st.k->encoder_backward(*st.s, st.dt, g, nullptr, dout, tokens, st.pos, st.B, st.T, s_.n_embd);
  }
  void norm_forward(const DecoderStep& st, NormSite site, const void* p, const void* in, void* out,
                    const NormStats& n) const {
    st.k->rmsnorm_forward(*st.s, st.dt, out, n.rstd, in, param(p, st, norm_at(site)), eps_,
                          int(st.N()), s_.n_embd);
  }
  // res = a + b, then the norm of res into out: one call where the kernels fuse them (the same
  // bits: Kernels::residual_rmsnorm_forward).
  void residual_norm_forward(const DecoderStep& st, NormSite site, const void* p, const void* a,
                             const void* b, void* res, void* out, const NormStats& n) const {
    const int N = int(st.N()), C = s_.n_embd;
    if (st.k->supports(KernelOp::kResidualNorm, {.dt = st.dt, .N = N, .C = C}).supported) {
      st.k->residual_rmsnorm_forward(*st.s, st.dt, res, out, n.rstd, a, b,
                                     param(p, st, norm_at(site)), eps_, N, C);
      return;
    }
    st.k->residual_forward(*st.s, st.dt, res, a, b, size_t(N) * size_t(C));
    norm_forward(st, site, p, res, out, n);
  }
  void norm_backward(const DecoderStep& st, NormSite site, const void* p, float* g, void* din,
                     const void* dres, const void* dout, const void* in, const NormStats& n) const {
    const size_t at = norm_at(site);
    st.k->rmsnorm_backward(*st.s, st.dt, din, dres, st.norm_grad(g, at), dout, in, param(p, st, at),
                           n.rstd, int(st.N()), s_.n_embd);
  }
  // a.qkv = q|k|v of `in` (with the adapters' part; the query and key heads normalized with the
  // query/key norms), rotated at the tokens' positions.
  void qkv_forward(const DecoderStep& st, const void* p, const void* in,
                   const AttentionActs& a) const {
    const int NH = s_.n_head, KVH = s_.num_key_value_heads;
    st.k->matmul_forward(*st.s, st.dt, a.qkv, in, param(p, st, qkvw_),
                         s_.attention_bias ? param(p, st, qkvb_) : nullptr, int(st.N()), s_.n_embd,
                         qkv_width());
    st.lora_forward(kQkv, in, a.qkv);
    if (s_.qk_norm) {
      st.k->qk_norm_forward(*st.s, st.dt, a.qkv, a.qk_in, a.qk_rstd, param(p, st, qnw_),
                            param(p, st, knw_), eps_, int(st.N()), NH, KVH, hs());
    }
    st.k->rope_forward(*st.s, st.dt, a.qkv, rope_, st.pos, st.B, st.T, NH, KVH, hs());
  }
  void attention_forward(const DecoderStep& st, const void* p, const void* in,
                         const AttentionActs& a, void* out) const {
    Kernels& k = *st.k;
    Stream& s = *st.s;
    const int N = int(st.N()), C = s_.n_embd, NH = s_.n_head, KVH = s_.num_key_value_heads,
              hs = this->hs();
    const int A = NH * hs;
    qkv_forward(st, p, in, a);
    if (st.fused) {
      k.fused_attention_forward(s, st.dt, a.atty, a.att, a.qkv, st.pos, st.B, st.T, NH, KVH, hs);
    } else {
      k.attention_gqa_forward(s, st.dt, a.atty, a.att, a.qkv, st.pos, st.B, st.T, NH, KVH, hs);
    }
    k.matmul_forward(s, st.dt, out, a.atty, param(p, st, ow_), nullptr, N, A, C);
    st.lora_forward(kO, a.atty, out);
  }
  void attention_decode(const DecoderStep& st, const void* p, const void* in,
                        const AttentionActs& a, const KvLayer& kv, void* out) const {
    Kernels& k = *st.k;
    Stream& s = *st.s;
    const int N = int(st.N()), C = s_.n_embd, NH = s_.n_head, KVH = s_.num_key_value_heads,
              hs = this->hs();
    const int A = NH * hs;
    qkv_forward(st, p, in, a);
    k.attention_decode(s, st.dt, a.atty, kv.k, kv.v, a.qkv, st.B, st.T, kv.pos0, kv.maxT, NH, KVH,
                       hs);
    k.matmul_forward(s, st.dt, out, a.atty, param(p, st, ow_), nullptr, N, A, C);
  }
  void attention_backward(const DecoderStep& st, const void* p, float* g, const void* dout,
                          const void* in, const AttentionActs& a, const AttentionScratch& d,
                          void* din) const {
    Kernels& k = *st.k;
    Stream& s = *st.s;
    const int N = int(st.N()), C = s_.n_embd, NH = s_.n_head, KVH = s_.num_key_value_heads,
              hs = this->hs();
    const int W = qkv_width(), A = NH * hs;
    const size_t es = st.es();
    k.matmul_backward(s, st.dt, d.datty, st.wgrad(g, ow_), nullptr, dout, a.atty, param(p, st, ow_),
                      N, A, C, /*accumulate=*/false);
    st.lora_backward(kO, a.atty, dout, d.datty);
    if (st.fused) {  // dqkv written
      k.fused_attention_backward(s, st.dt, d.dqkv, d.datt, d.datty, a.qkv, a.atty, a.att, st.pos,
                                 st.B, st.T, NH, KVH, hs, /*accumulate=*/false);
    } else {
      st.zero(d.dqkv, size_t(N) * W * es);
      k.attention_gqa_backward(s, st.dt, d.dqkv, d.datt, d.datty, a.qkv, a.att, st.pos, st.B, st.T,
                               NH, KVH, hs);
    }
    // From the rotated q/k back to the projections' outputs (through the query/key norms).
    k.rope_backward(s, st.dt, d.dqkv, rope_, st.pos, st.B, st.T, NH, KVH, hs);
    if (s_.qk_norm) {  // a frozen block's weight gradients land in discard (2 hs there)
      k.qk_norm_backward(s, st.dt, d.dqkv, g ? g + qnw_ : st.discard,
                         g ? g + knw_ : st.discard + hs, a.qk_in, param(p, st, qnw_),
                         param(p, st, knw_), a.qk_rstd, N, NH, KVH, hs);
    }
    k.matmul_backward(s, st.dt, din, st.wgrad(g, qkvw_),
                      s_.attention_bias ? st.wgrad(g, qkvb_) : nullptr, d.dqkv, in,
                      param(p, st, qkvw_), N, C, W, /*accumulate=*/false);
    st.lora_backward(kQkv, in, d.dqkv, din);
  }
  void mlp_forward(const DecoderStep& st, const void* p, const void* in, const MlpActs& a,
                   void* out) const {
    Kernels& k = *st.k;
    Stream& s = *st.s;
    const int N = int(st.N()), C = s_.n_embd, I = s_.intermediate_size;
    k.matmul_forward(s, st.dt, a.gu, in, param(p, st, guw_), nullptr, N, C, 2 * I);
    st.lora_forward(kGateUp, in, a.gu);
    k.swiglu_forward(s, st.dt, a.act, a.gu, N, I);
    k.matmul_forward(s, st.dt, out, a.act, param(p, st, downw_), nullptr, N, I, C);
    st.lora_forward(kDown, a.act, out);
  }
  void mlp_backward(const DecoderStep& st, const void* p, float* g, const void* dout,
                    const void* in, const MlpActs& a, const MlpScratch& d, void* din) const {
    Kernels& k = *st.k;
    Stream& s = *st.s;
    const int N = int(st.N()), C = s_.n_embd, I = s_.intermediate_size;
    k.matmul_backward(s, st.dt, d.dact, st.wgrad(g, downw_), nullptr, dout, a.act,
                      param(p, st, downw_), N, I, C, /*accumulate=*/false);
    st.lora_backward(kDown, a.act, dout, d.dact);
    k.swiglu_backward(s, st.dt, d.dgu, a.gu, d.dact, N, I);  // dgu written
    k.matmul_backward(s, st.dt, din, st.wgrad(g, guw_), nullptr, d.dgu, in, param(p, st, guw_), N,
                      C, 2 * I, /*accumulate=*/false);
    st.lora_backward(kGateUp, in, d.dgu, din);
  }

 protected:
  int hs() const { return s_.head_dim > 0 ? s_.head_dim : s_.n_embd / s_.n_head; }
  bool wide_heads() const { return s_.head_dim > 0 && s_.head_dim * s_.n_head != s_.n_embd; }
  int qkv_width() const { return (s_.n_head + 2 * s_.num_key_value_heads) * hs(); }  // W
  static const char* param(const void* p, const DecoderStep& st, size_t at) {
    return static_cast<const char*>(p) + at * st.es();
  }
  size_t norm_at(NormSite site) const {
    return site == NormSite::kBlockIn ? ln1w_ : site == NormSite::kBlockMid ? ln2w_ : 0;
  }
  size_t att_bytes(const BatchDims& d) const {
    return size_t(d.B) * size_t(s_.n_head) * size_t(d.T) * (d.fused ? 1 : size_t(d.T)) * 4;
  }

  ModelConfig s_;  // the resolved shape (decoder_shape)
  float eps_;
  RopeParams rope_;
  bool fused_;  // Phi-3's tensors: qkv_proj and gate_up_proj
  // The block tensors' offsets (elements) in its flat buffer.
  size_t ln1w_, qkvw_, qkvb_, qnw_, knw_, ow_, ln2w_, guw_, downw_;
};

}  // namespace strata
