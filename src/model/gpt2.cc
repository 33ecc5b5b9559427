#include "src/model/gpt2.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "src/model/decoder_architecture.h"
#include "src/model/family.h"

namespace strata {
namespace {

// GPT-2's parts of a decoder: LayerNorm, multi-head attention over a packed qkv projection with
// biases, a GELU MLP of width 4C, token and learned position embeddings.
class Gpt2Blocks {
 public:
  static constexpr const char* kType = "gpt2";
  static constexpr uint64_t kInitStream = 0x9e11;
  static Status check(const ModelConfig& mc) {
    if ((mc.head_dim != 0 && mc.head_dim * mc.n_head != mc.n_embd) || mc.qk_norm) {
      return invalid_argument(
          "model.head_dim, model.qk_norm: a gpt2 model's heads are n_embd / n_head wide and not "
          "normalized (these keys are the llama family's: Qwen3's shape is model.type llama)");
    }
    if (mc.pad_token_id >= 0) {
      return invalid_argument(
          "model.pad_token_id: GPT-2's embedding has no padding row (transformers' GPT2 trains "
          "every row); set it to -1");
    }
    return Status::ok();
  }

  explicit Gpt2Blocks(const ModelConfig& s) : s_(s) {
    ModuleSpec b;
    block_tensors(b);
    for (const char* n : {"ln1w", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "fcw", "fcb",
                          "fcprojw", "fcprojb"}) {
      at_.push_back(tensor_offset(b, n));
    }
  }

  // ---- layout ---------------------------------------------------------------------------------
  void embedding_tensors(ModuleSpec& m) const {
    add_tensor(m, "wte", size_t(s_.padded_vocab_size) * s_.n_embd, 0);
    add_tensor(m, "wpe", size_t(s_.context) * s_.n_embd, 0, 0.01f);
  }
  void block_tensors(ModuleSpec& b) const {
    const size_t C = size_t(s_.n_embd);
    const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(s_.n_layer));
    add_tensor(b, "ln1w", C, 2);
    add_tensor(b, "ln1b", C, 1);
    add_tensor(b, "qkvw", 3 * C * C, 0);
    add_tensor(b, "qkvb", 3 * C, 1);
    add_tensor(b, "attprojw", C * C, 0, proj_std);
    add_tensor(b, "attprojb", C, 1);
    add_tensor(b, "ln2w", C, 2);
    add_tensor(b, "ln2b", C, 1);
    add_tensor(b, "fcw", 4 * C * C, 0);
    add_tensor(b, "fcb", 4 * C, 1);
    add_tensor(b, "fcprojw", C * 4 * C, 0, proj_std);
    add_tensor(b, "fcprojb", C, 1);
  }
  void final_norm_tensors(ModuleSpec& m) const {
    add_tensor(m, "lnfw", size_t(s_.n_embd), 2);
    add_tensor(m, "lnfb", size_t(s_.n_embd), 1);
  }
  int head_size() const { return s_.n_embd / s_.n_head; }
  double blocks_flops(int T) const {
    const double C = s_.n_embd, L = s_.n_layer;
    // 2 FLOPs per weight of each GEMM (12C^2 per block) + attention's QK^T and AV over the
    // whole T x T square (4TC per block).
    return 2.0 * 12.0 * C * C * L + 4.0 * T * C * L;
  }
  std::string describe(const ModelLayout& layout) const {
    return fmt::format(
        "GPT {} layers, {} heads, width {}, vocab {} (padded {}), context {}{}: {:.2f}M params "
        "in {} modules",
        s_.n_layer, s_.n_head, s_.n_embd, s_.vocab_size, s_.padded_vocab_size, s_.context,
        s_.tied_embeddings ? "" : ", untied head", double(layout.num_params()) / 1e6,
        layout.modules.size());
  }
  std::string shape_string() const {
    return fmt::format("L={} NH={} C={} V={} Vp={} T={} tied={}", s_.n_layer, s_.n_head, s_.n_embd,
                       s_.vocab_size, s_.padded_vocab_size, s_.context, s_.tied_embeddings);
  }
  std::vector<HfTensor> hf_tensors(const ModuleSpec& m) const;
  std::string hf_block_prefix(int l) const { return fmt::format("transformer.h.{}.", l); }
  // The matmuls of a block: c_attn (qkv), attn.c_proj, c_fc, mlp.c_proj.
  enum Matmul { kQkv, kAttProj, kFc, kFcProj };
  std::vector<LoraSite> lora_sites() const {
    const int C = s_.n_embd;
    return {{"attn.c_attn", kQkv, C, 3 * C, 0, 3 * C, "qkvw"},
            {"attn.c_proj", kAttProj, C, C, 0, C, "attprojw"},
            {"mlp.c_fc", kFc, C, 4 * C, 0, 4 * C, "fcw"},
            {"mlp.c_proj", kFcProj, 4 * C, C, 0, C, "fcprojw"}};
  }
  bool hf_ignorable(const std::string& name) const {
    auto ends_with = [&](const std::string& tail) {
      return name.size() >= tail.size() &&
             name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    // The causal mask buffers older transformers versions saved.
    return ends_with(".attn.bias") || ends_with(".attn.masked_bias");
  }

  // ---- activations ----------------------------------------------------------------------------
  // A LayerNorm's saved statistics (fp32 [N]).
  struct NormStats {
    float *mean = nullptr, *rstd = nullptr;
  };
  // qkv [N,3C], atty [N,C]; att (fp32): the probabilities [B,NH,T,T], or with the fused
  // attention each row's log-sum-exp [B,NH,T].
  struct AttentionActs {
    void *qkv = nullptr, *atty = nullptr;
    float* att = nullptr;
  };
  struct MlpActs {
    void *fch = nullptr, *fch_gelu = nullptr;  // [N,4C] before and after GELU
  };
  struct AttentionScratch {
    void *datty = nullptr, *dqkv = nullptr;
    float* datt = nullptr;  // the attention backward's scratch, att's size
  };
  struct MlpScratch {
    void *dfch = nullptr, *dfch_gelu = nullptr;
  };
  void carve(Carver& c, const BatchDims& d, NormStats* n) const {
    n->mean = c.take_f32(d.N());
    n->rstd = c.take_f32(d.N());
  }
  void carve(Carver& c, const BatchDims& d, AttentionActs* a) const {
    a->qkv = c.take(d.N() * 3 * s_.n_embd * d.es());
    a->atty = c.take(d.N() * s_.n_embd * d.es());
    a->att = static_cast<float*>(c.take(att_bytes(d)));
  }
  void carve(Carver& c, const BatchDims& d, MlpActs* a) const {
    a->fch = c.take(d.N() * 4 * s_.n_embd * d.es());
    a->fch_gelu = c.take(d.N() * 4 * s_.n_embd * d.es());
  }
  void carve(Carver& c, const BatchDims& d, AttentionScratch* a) const {
    a->datty = c.take(d.N() * s_.n_embd * d.es());
    a->dqkv = c.take(d.N() * 3 * s_.n_embd * d.es());
    a->datt = static_cast<float*>(c.take(att_bytes(d)));
  }
  void carve(Carver& c, const BatchDims& d, MlpScratch* a) const {
    a->dfch = c.take(d.N() * 4 * s_.n_embd * d.es());
    a->dfch_gelu = c.take(d.N() * 4 * s_.n_embd * d.es());
  }

  // ---- compute --------------------------------------------------------------------------------
  void embedding_forward(const DecoderStep& st, const void* p, const int32_t* tokens,
                         void* out) const {
    const char* pb = static_cast<const char*>(p);
    st.k->encoder_forward(*st.s, st.dt, out, tokens, st.pos, pb,
                          pb + size_t(s_.padded_vocab_size) * s_.n_embd * st.es(), st.B, st.T,
                          s_.n_embd);
  }
  void embedding_backward(const DecoderStep& st, float* g, const void* dout,
                          const int32_t* tokens) const {
    st.k->encoder_backward(*st.s, st.dt, g, g + size_t(s_.padded_vocab_size) * s_.n_embd, dout,
                           tokens, st.pos, st.B, st.T, s_.n_embd);
  }
  void norm_forward(const DecoderStep& st, NormSite site, const void* p, const void* in, void* out,
                    const NormStats& n) const {
    const char* w = param(p, st, norm_at(site));
    st.k->layernorm_forward(*st.s, st.dt, out, n.mean, n.rstd, in, w,
                            w + size_t(s_.n_embd) * st.es(), int(st.N()), s_.n_embd);
  }
  // res = a + b, then the norm of res into out: one call where the kernels fuse them (the same
  // bits: Kernels::residual_layernorm_forward).
  void residual_norm_forward(const DecoderStep& st, NormSite site, const void* p, const void* a,
                             const void* b, void* res, void* out, const NormStats& n) const {
    const int N = int(st.N()), C = s_.n_embd;
    if (st.k->supports(KernelOp::kResidualNorm, {.dt = st.dt, .N = N, .C = C}).supported) {
      const char* w = param(p, st, norm_at(site));
      st.k->residual_layernorm_forward(*st.s, st.dt, res, out, n.mean, n.rstd, a, b, w,
                                       w + size_t(C) * st.es(), N, C);
      return;
    }
    st.k->residual_forward(*st.s, st.dt, res, a, b, size_t(N) * size_t(C));
    norm_forward(st, site, p, res, out, n);
  }
  void norm_backward(const DecoderStep& st, NormSite site, const void* p, float* g, void* din,
                     const void* dres, const void* dout, const void* in, const NormStats& n) const {
    const size_t at = norm_at(site);
    const size_t C = size_t(s_.n_embd);
    st.k->layernorm_backward(*st.s, st.dt, din, dres, st.norm_grad(g, at, 0, C),
                             st.norm_grad(g, at, 1, C), dout, in, param(p, st, at), n.mean, n.rstd,
                             int(st.N()), s_.n_embd);
  }
  void attention_forward(const DecoderStep& st, const void* p, const void* in,
                         const AttentionActs& a, void* out) const {
    Kernels& k = *st.k;
    const int N = int(st.N()), C = s_.n_embd, NH = s_.n_head;
    k.matmul_forward(*st.s, st.dt, a.qkv, in, param(p, st, at_[kQkvw]), param(p, st, at_[kQkvb]), N,
                     C, 3 * C);
    st.lora_forward(kQkv, in, a.qkv);
    if (st.fused) {
      k.fused_attention_forward(*st.s, st.dt, a.atty, a.att, a.qkv, st.pos, st.B, st.T, NH, NH,
                                C / NH);
    } else {
      k.attention_gqa_forward(*st.s, st.dt, a.atty, a.att, a.qkv, st.pos, st.B, st.T, NH, NH,
                              C / NH);
    }
    k.matmul_forward(*st.s, st.dt, out, a.atty, param(p, st, at_[kAttprojw]),
                     param(p, st, at_[kAttprojb]), N, C, C);
    st.lora_forward(kAttProj, a.atty, out);
  }
  void attention_decode(const DecoderStep& st, const void* p, const void* in,
                        const AttentionActs& a, const KvLayer& kv, void* out) const {
    Kernels& k = *st.k;
    const int N = int(st.N()), C = s_.n_embd, NH = s_.n_head;
    k.matmul_forward(*st.s, st.dt, a.qkv, in, param(p, st, at_[kQkvw]), param(p, st, at_[kQkvb]), N,
                     C, 3 * C);
    k.attention_decode(*st.s, st.dt, a.atty, kv.k, kv.v, a.qkv, st.B, st.T, kv.pos0, kv.maxT, NH,
                       NH, C / NH);
    k.matmul_forward(*st.s, st.dt, out, a.atty, param(p, st, at_[kAttprojw]),
                     param(p, st, at_[kAttprojb]), N, C, C);
  }
  void attention_backward(const DecoderStep& st, const void* p, float* g, const void* dout,
                          const void* in, const AttentionActs& a, const AttentionScratch& d,
                          void* din) const {
    Kernels& k = *st.k;
    Stream& s = *st.s;
    const int N = int(st.N()), C = s_.n_embd, NH = s_.n_head;
    const size_t NC = size_t(N) * C, es = st.es();
    k.matmul_backward(s, st.dt, d.datty, st.wgrad(g, at_[kAttprojw]), st.wgrad(g, at_[kAttprojb]),
                      dout, a.atty, param(p, st, at_[kAttprojw]), N, C, C, /*accumulate=*/false);
    st.lora_backward(kAttProj, a.atty, dout, d.datty);
    if (st.fused) {  // dqkv written
      k.fused_attention_backward(s, st.dt, d.dqkv, d.datt, d.datty, a.qkv, a.atty, a.att, st.pos,
                                 st.B, st.T, NH, NH, C / NH, /*accumulate=*/false);
    } else {
      st.zero(d.dqkv, NC * 3 * es);
      k.attention_gqa_backward(s, st.dt, d.dqkv, d.datt, d.datty, a.qkv, a.att, st.pos, st.B, st.T,
                               NH, NH, C / NH);
    }
    k.matmul_backward(s, st.dt, din, st.wgrad(g, at_[kQkvw]), st.wgrad(g, at_[kQkvb]), d.dqkv, in,
                      param(p, st, at_[kQkvw]), N, C, 3 * C, /*accumulate=*/false);
    st.lora_backward(kQkv, in, d.dqkv, din);
  }
  void mlp_forward(const DecoderStep& st, const void* p, const void* in, const MlpActs& a,
                   void* out) const {
    Kernels& k = *st.k;
    const int N = int(st.N()), C = s_.n_embd;
    // The up-projection and its GELU in one call where the kernels fuse them (cuBLASLt's
    // epilogue; the CPU backend computes the two ops' bits). An adapter adds to fch between the
    // two, so with LoRA they stay apart.
    const OpShape up{.dt = st.dt, .N = N, .C = C, .OC = 4 * C};
    if (st.lora == nullptr && k.supports(KernelOp::kMatmulGelu, up).supported) {
      k.matmul_gelu_forward(*st.s, st.dt, a.fch_gelu, a.fch, in, param(p, st, at_[kFcw]),
                            param(p, st, at_[kFcb]), N, C, 4 * C);
    } else {
      k.matmul_forward(*st.s, st.dt, a.fch, in, param(p, st, at_[kFcw]), param(p, st, at_[kFcb]), N,
                       C, 4 * C);
      st.lora_forward(kFc, in, a.fch);
      k.gelu_forward(*st.s, st.dt, a.fch_gelu, a.fch, size_t(N) * 4 * C);
    }
    k.matmul_forward(*st.s, st.dt, out, a.fch_gelu, param(p, st, at_[kFcprojw]),
                     param(p, st, at_[kFcprojb]), N, 4 * C, C);
    st.lora_forward(kFcProj, a.fch_gelu, out);
  }
  void mlp_backward(const DecoderStep& st, const void* p, float* g, const void* dout,
                    const void* in, const MlpActs& a, const MlpScratch& d, void* din) const {
    Kernels& k = *st.k;
    Stream& s = *st.s;
    const int N = int(st.N()), C = s_.n_embd;
    const size_t NC = size_t(N) * C, es = st.es();
    // The down-projection's input gradient and the GELU's in one call where the kernels fuse
    // them (cuBLASLt's DGELU epilogue; the CPU backend computes the two ops' bits). An adapter
    // adds to dfch_gelu between the two, so with LoRA they stay apart.
    const OpShape down{.dt = st.dt, .N = N, .C = 4 * C, .OC = C};
    if (st.lora == nullptr && k.supports(KernelOp::kMatmulBackwardGelu, down).supported) {
      k.matmul_backward_gelu(s, st.dt, d.dfch, st.wgrad(g, at_[kFcprojw]),
                             st.wgrad(g, at_[kFcprojb]), dout, a.fch_gelu,
                             param(p, st, at_[kFcprojw]), a.fch, N, 4 * C, C);
    } else {
      k.matmul_backward(s, st.dt, d.dfch_gelu, st.wgrad(g, at_[kFcprojw]),
                        st.wgrad(g, at_[kFcprojb]), dout, a.fch_gelu, param(p, st, at_[kFcprojw]),
                        N, 4 * C, C, /*accumulate=*/false);
      st.lora_backward(kFcProj, a.fch_gelu, dout, d.dfch_gelu);
      st.zero(d.dfch, NC * 4 * es);
      k.gelu_backward(s, st.dt, d.dfch, a.fch, d.dfch_gelu, NC * 4);
    }
    k.matmul_backward(s, st.dt, din, st.wgrad(g, at_[kFcw]), st.wgrad(g, at_[kFcb]), d.dfch, in,
                      param(p, st, at_[kFcw]), N, C, 4 * C, /*accumulate=*/false);
    st.lora_backward(kFc, in, d.dfch, din);
  }

 private:
  // Indices into at_: the block tensors' offsets (elements) in its flat buffer.
  enum At { kLn1w, kQkvw, kQkvb, kAttprojw, kAttprojb, kLn2w, kFcw, kFcb, kFcprojw, kFcprojb };
  static const char* param(const void* p, const DecoderStep& st, size_t at) {
    return static_cast<const char*>(p) + at * st.es();
  }
  // A norm's weight; its bias follows (C elements further).
  size_t norm_at(NormSite site) const {
    return site == NormSite::kBlockIn ? at_[kLn1w] : site == NormSite::kBlockMid ? at_[kLn2w] : 0;
  }
  size_t att_bytes(const BatchDims& d) const {
    return size_t(d.B) * size_t(s_.n_head) * size_t(d.T) * (d.fused ? 1 : size_t(d.T)) * 4;
  }

  ModelConfig s_;  // the resolved shape (decoder_shape)
  std::vector<size_t> at_;
};

std::vector<HfTensor> Gpt2Blocks::hf_tensors(const ModuleSpec& m) const {
  const int64_t C = s_.n_embd, V = s_.vocab_size, T = s_.context;
  const std::string block =
      m.name.rfind("block.", 0) == 0 ? "h." + m.name.substr(6) + "." : std::string();
  struct Name {
    const char* strata;
    const char* hf;
    bool transposed;
  };
  // strata's tensors in [out, in]; the Conv1D ones are stored [in, out].
  static const Name kNames[] = {{"ln1w", "ln_1.weight", false},
                                {"ln1b", "ln_1.bias", false},
                                {"qkvw", "attn.c_attn.weight", true},
                                {"qkvb", "attn.c_attn.bias", false},
                                {"attprojw", "attn.c_proj.weight", true},
                                {"attprojb", "attn.c_proj.bias", false},
                                {"ln2w", "ln_2.weight", false},
                                {"ln2b", "ln_2.bias", false},
                                {"fcw", "mlp.c_fc.weight", true},
                                {"fcb", "mlp.c_fc.bias", false},
                                {"fcprojw", "mlp.c_proj.weight", true},
                                {"fcprojb", "mlp.c_proj.bias", false},
                                {"wte", "wte.weight", false},
                                {"wpe", "wpe.weight", false},
                                {"lnfw", "ln_f.weight", false},
                                {"lnfb", "ln_f.bias", false}};
  std::vector<HfTensor> out;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorSpec& t = m.tensors[i];
    HfTensor h;
    h.tensor = int(i);
    if (t.name == "lm_head") {
      h.name = "lm_head.weight";
      h.shape = {V, C};
      out.push_back(std::move(h));
      continue;
    }
    const Name* n = nullptr;
    for (const Name& k : kNames) {
      if (t.name == k.strata) n = &k;
    }
    STRATA_CHECK(n != nullptr, "gpt2 tensor without a Hugging Face name");
    h.alt_name = block + n->hf;
    h.name = "transformer." + h.alt_name;
    h.transposed = n->transposed;
    if (t.name == "wte") {
      h.shape = {V, C};
    } else if (t.name == "wpe") {
      h.shape = {T, C};
      h.more_rows_ok = true;
    } else if (n->transposed) {
      // strata's [out, in]: qkvw [3C, C], attprojw [C, C], fcw [4C, C], fcprojw [C, 4C].
      const int64_t in = t.name == "fcprojw" ? 4 * C : C;
      h.shape = {in, int64_t(t.numel) / in};
    } else {
      h.shape = {int64_t(t.numel)};
    }
    out.push_back(std::move(h));
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<Architecture>> create_gpt2(const ModelConfig& config) {
  return DecoderArchitecture<Gpt2Blocks>::create(config);
}

namespace {

// GPT2LMHeadModel's config.json: n_embd, n_layer, n_head, vocab_size, n_positions; what strata's
// GPT-2 does not have (another epsilon, MLP width, attention scaling or activation) is refused.
Status gpt2_hf_read(const HfConfigIn& in, const std::string&, ModelConfig* m,
                    HfShapeExtras* extras) {
  const nlohmann::json& c = in.json();
  m->type = "gpt2";
  STRATA_RETURN_IF_ERROR(in.get_int("n_embd", -1, &m->n_embd), "");
  STRATA_RETURN_IF_ERROR(in.get_int("n_layer", -1, &m->n_layer), "");
  STRATA_RETURN_IF_ERROR(in.get_int("n_head", -1, &m->n_head), "");
  STRATA_RETURN_IF_ERROR(in.get_int("vocab_size", -1, &m->vocab_size), "");
  STRATA_RETURN_IF_ERROR(in.get_int("n_positions", 1024, &extras->max_positions), "");
  m->tied_embeddings = true;
  double eps = 1e-5;
  STRATA_RETURN_IF_ERROR(in.get_real("layer_norm_epsilon", 1e-5, &eps), "");
  if (std::fabs(eps - 1e-5) > 1e-12) {
    return in.bad("layer_norm_epsilon",
                  fmt::format("{} is not 1e-5, the only one strata's layernorm has", eps));
  }
  if (c.contains("n_inner") && !c["n_inner"].is_null() && c["n_inner"] != 4 * m->n_embd) {
    return in.bad("n_inner", fmt::format("{} is not 4 * n_embd, the MLP width strata's GPT-2 has",
                                         c["n_inner"].dump()));
  }
  for (const char* k : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"}) {
    if (c.value(k, false) == true) {
      return in.bad(k, "true is not supported (strata's attention scales by 1/sqrt(head size))");
    }
  }
  if (c.contains("scale_attn_weights") && c["scale_attn_weights"] == false) {
    return in.bad("scale_attn_weights", "false is not supported");
  }
  STRATA_RETURN_IF_ERROR(in.get_bool("tie_word_embeddings", true, &m->tied_embeddings), "");
  if (c.contains("activation_function") && c["activation_function"] != "gelu_new") {
    return in.bad("activation_function",
                  fmt::format("{} is not gelu_new (GPT-2's tanh GELU, the one strata has)",
                              c["activation_function"].dump()));
  }
  return Status::ok();
}

void gpt2_hf_write(const ModelConfig& m, nlohmann::json* out) {
  nlohmann::json& c = *out;
  c["architectures"] = {"GPT2LMHeadModel"};
  c["model_type"] = "gpt2";
  c["n_embd"] = m.n_embd;
  c["n_layer"] = m.n_layer;
  c["n_head"] = m.n_head;
  // The position table as the checkpoint stored it (the export writes every row back): a
  // model trained at a shorter context keeps the length it had.
  c["n_positions"] = std::max<int64_t>(m.context, c.value("n_positions", int64_t(0)));
  c["n_ctx"] = c["n_positions"];
  c["activation_function"] = "gelu_new";
  c["layer_norm_epsilon"] = 1e-5;
}

std::string gpt2_hf_key(const std::string&, const std::string& strata_key) {
  static const std::pair<const char*, const char*> kKeys[] = {
      {"model.n_layer", "n_layer"},
      {"model.n_head", "n_head"},
      {"model.n_embd", "n_embd"},
      {"model.vocab_size", "vocab_size"},
      {"model.padded_vocab_size", "vocab_size"},
      {"model.context", "n_positions"},
  };
  for (const auto& [k, v] : kKeys) {
    if (strata_key == k) return v;
  }
  return "";
}

}  // namespace

const ModelFamily& gpt2_family() {
  static const ModelFamily kFamily{
      .types = {"gpt2", "gpt"},
      .hf_architectures = {"GPT2LMHeadModel"},
      .create = create_gpt2,
      .lora_default_targets = {"c_attn"},
      .hf_read = gpt2_hf_read,
      .hf_write = gpt2_hf_write,
      .hf_key = gpt2_hf_key,
      .hf_embedding = "transformer.wte.weight",
  };
  return kFamily;
}

}  // namespace strata
