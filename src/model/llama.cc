#include "src/model/llama.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "src/model/decoder_runner.h"
#include "strata/kernels.h"

namespace strata {
namespace {

// A block's intermediates (dt unless noted). kKeep: one per layer, and res3 is the next block's
// input. kRecompute/kOffload: one scratch (res3 unused: outputs go to inputs/out).
// qkv holds the projections after the rotary embedding (the attention's input). att (fp32): the
// attention probabilities [B,NH,T,T], or with the fused attention each row's log-sum-exp
// [B,NH,T].
struct Layer {
  void *ln1, *qkv, *atty, *attproj, *res2, *ln2, *gu, *act, *down, *res3;
  float *ln1_rstd, *ln2_rstd, *att;
};

// Every activation buffer of a micro-batch, carved from one device arena.
struct Buffers {
  int32_t* tokens = nullptr;
  int32_t* targets = nullptr;
  float* losses = nullptr;
  std::vector<Layer> layers;
  // kRecompute: every block's input (inputs[0] == encoded); kOffload: two slots, block l's
  // input in inputs[l % 2]. out: the last block's output, the head's input (not kKeep).
  std::vector<void*> inputs;
  void* out = nullptr;
  void *encoded = nullptr, *lnf = nullptr, *logits = nullptr;
  float* lnf_rstd = nullptr;
  // activation-gradient scratch, reused by every layer. dA: gradient w.r.t. the residual stream
  // at the current layer boundary, carried from one backward step to the next.
  void *dA = nullptr, *dB = nullptr, *dln = nullptr, *dqkv = nullptr, *datty = nullptr,
       *dgu = nullptr, *dact = nullptr;
  float* datt_scratch = nullptr;  // the attention backward's scratch, att's size
};

// The one carve of the activation arena: activation_plan() measures it, the runner allocates
// what it measured and carves again for real.
void carve(Carver& c, const LlamaShape& sh, int B, int T, DType dt, ActivationMode mode, bool fused,
           Buffers* m) {
  const bool keep = mode == ActivationMode::kKeep;
  const int L = sh.L;
  m->layers.resize(size_t(keep ? L : 1));
  m->inputs.assign(size_t(keep                                 ? 0
                          : mode == ActivationMode::kRecompute ? L
                                                               : std::min(L, 2)),
                   nullptr);
  const size_t N = size_t(B) * T, C = sh.C, es = dtype_size(dt), NH = sh.NH;
  const size_t W = sh.qkv_width(), A = size_t(sh.NH) * sh.hs(), I = sh.I;
  const size_t att_bytes = size_t(B) * NH * T * (fused ? 1 : size_t(T)) * 4;
  m->tokens = static_cast<int32_t*>(c.take(N * 4));
  m->targets = static_cast<int32_t*>(c.take(N * 4));
  m->losses = static_cast<float*>(c.take(N * 4));
  for (Layer& y : m->layers) {
    y.ln1 = c.take(N * C * es);
    y.qkv = c.take(N * W * es);
    y.atty = c.take(N * A * es);
    y.attproj = c.take(N * C * es);
    y.res2 = c.take(N * C * es);
    y.ln2 = c.take(N * C * es);
    y.gu = c.take(N * 2 * I * es);
    y.act = c.take(N * I * es);
    y.down = c.take(N * C * es);
    y.res3 = keep ? c.take(N * C * es) : nullptr;
    y.ln1_rstd = static_cast<float*>(c.take(N * 4));
    y.ln2_rstd = static_cast<float*>(c.take(N * 4));
    y.att = static_cast<float*>(c.take(att_bytes));
  }
  for (void*& in : m->inputs) in = c.take(N * C * es);
  m->encoded = keep ? c.take(N * C * es) : m->inputs[0];
  m->out = keep ? nullptr : c.take(N * C * es);
  m->lnf = c.take(N * C * es);
  m->logits = c.take(N * size_t(sh.Vp) * es);
  m->lnf_rstd = static_cast<float*>(c.take(N * 4));
  m->dA = c.take(N * C * es);
  m->dB = c.take(N * C * es);
  m->dln = c.take(N * C * es);
  m->datty = c.take(N * A * es);
  m->dqkv = c.take(N * W * es);
  m->dgu = c.take(N * 2 * I * es);
  m->dact = c.take(N * I * es);
  m->datt_scratch = static_cast<float*>(c.take(att_bytes));
}

// One batch shape's device state and Llama's compute steps.
class LlamaRunner final : public DecoderRunner<LlamaShape, Buffers> {
 public:
  using DecoderRunner::DecoderRunner;

  void compute(const ProgramOp& op, const ModuleBindings& bound, const MicroBatch& mb) override;

 private:
  void forward_embedding(const void* params);
  void forward_block(int l, const void* params);
  void forward_head(const void* final_norm_params, const void* head_params, float dloss,
                    float* losses_out, void* logits_out);
  void backward_head(const void* final_norm_params, float* final_norm_grads,
                     const void* head_params, float* head_grads);
  void backward_block(int l, const void* params, float* grads);
  void backward_embedding(float* grads);
  // Enqueues block l's forward from `in` into `y`; writes the residual output to `out` unless
  // it is nullptr (a recompute). With kOffload, the compute stream first waits for any stash
  // still reading input slot `wait_slot_before_out` (-1: none).
  void block_forward(int l, const void* p, const void* in, Layer& y, void* out,
                     int wait_slot_before_out);
};

}  // namespace

Result<std::unique_ptr<LlamaArchitecture>> LlamaArchitecture::create(const ModelConfig& mc) {
  LlamaShape s;
  s.L = mc.n_layer;
  s.NH = mc.n_head;
  s.KVH = mc.num_key_value_heads > 0 ? mc.num_key_value_heads : mc.n_head;
  s.C = mc.n_embd;
  s.I = mc.intermediate_size;
  s.V = mc.vocab_size;
  s.Vp = mc.padded_vocab_size > 0 ? mc.padded_vocab_size : (mc.vocab_size + 63) / 64 * 64;
  s.maxT = mc.context;
  s.tied = mc.tied_embeddings;
  s.qkv_bias = mc.attention_bias;
  s.eps = float(mc.rms_norm_eps);
  s.rope.theta = mc.rope_theta;
  if (mc.rope_scaling.type == "llama3") {
    s.rope.llama3 = true;
    s.rope.factor = mc.rope_scaling.factor;
    s.rope.low_freq_factor = mc.rope_scaling.low_freq_factor;
    s.rope.high_freq_factor = mc.rope_scaling.high_freq_factor;
    s.rope.original_max_position = mc.rope_scaling.original_max_position_embeddings;
  } else if (!mc.rope_scaling.type.empty() && mc.rope_scaling.type != "none") {
    return invalid_argument(
        fmt::format("model.rope_scaling.type: \"{}\" is not supported (use llama3, or none)",
                    mc.rope_scaling.type));
  }
  if (s.L < 1 || s.NH < 1 || s.C < 1 || s.V < 2 || s.maxT < 1) {
    return invalid_argument("model: n_layer, n_head, n_embd, context must be >= 1, vocab >= 2");
  }
  if (s.I < 1) {
    return invalid_argument(
        "model.intermediate_size: a llama model needs the width of its MLP (e.g. 4 * n_embd "
        "rounded, as its config.json's intermediate_size)");
  }
  if (s.C % s.NH != 0) {
    return invalid_argument(
        fmt::format("model.n_embd: {} is not divisible by model.n_head {}", s.C, s.NH));
  }
  if (s.NH % s.KVH != 0) {
    return invalid_argument(
        fmt::format("model.num_key_value_heads: {} does not divide model.n_head {}", s.KVH, s.NH));
  }
  if (s.hs() % 2 != 0 || s.hs() / 2 > kMaxRopePairs) {
    return invalid_argument(fmt::format(
        "model.n_head: head size n_embd/n_head = {} must be even and <= {} for rotary positions",
        s.hs(), 2 * kMaxRopePairs));
  }
  if (!(s.eps > 0.0f)) {
    return invalid_argument(fmt::format("model.rms_norm_eps: {} must be > 0", mc.rms_norm_eps));
  }
  if (!(s.rope.theta > 1.0)) {
    return invalid_argument(fmt::format("model.rope_theta: {} must be > 1", mc.rope_theta));
  }
  if (s.rope.llama3 && !(s.rope.factor > 0 && s.rope.high_freq_factor > s.rope.low_freq_factor &&
                         s.rope.low_freq_factor > 0 && s.rope.original_max_position > 0)) {
    return invalid_argument(
        "model.rope_scaling: llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor "
        "and original_max_position_embeddings > 0");
  }
  if (s.Vp < s.V) {
    return invalid_argument(
        fmt::format("model.padded_vocab_size: {} is smaller than model.vocab_size {}", s.Vp, s.V));
  }
  return std::unique_ptr<LlamaArchitecture>(new LlamaArchitecture(s));
}

LlamaArchitecture::LlamaArchitecture(const LlamaShape& s) : shape_(s) {
  const size_t C = s.C, Vp = s.Vp, I = s.I, hs = s.hs();
  const size_t Q = size_t(s.NH) * hs, KV = size_t(s.KVH) * hs;
  auto add = [](ModuleSpec& m, const char* name, size_t n, int kind) {
    m.tensors.push_back({name, m.numel, n, kind, 0.02f});
    m.numel += n;
  };
  ModuleSpec emb{"embedding", {}, 0};
  add(emb, "embed_tokens", Vp * C, 0);
  layout_.modules.push_back(std::move(emb));
  for (int i = 0; i < s.L; ++i) {
    ModuleSpec b{fmt::format("block.{}", i), {}, 0};
    add(b, "input_layernorm", C, 2);
    add(b, "q_proj", Q * C, 0);
    add(b, "k_proj", KV * C, 0);
    add(b, "v_proj", KV * C, 0);
    if (s.qkv_bias) {
      add(b, "q_bias", Q, 1);
      add(b, "k_bias", KV, 1);
      add(b, "v_bias", KV, 1);
    }
    add(b, "o_proj", C * Q, 0);
    add(b, "post_attention_layernorm", C, 2);
    add(b, "gate_proj", I * C, 0);
    add(b, "up_proj", I * C, 0);
    add(b, "down_proj", C * I, 0);
    layout_.modules.push_back(std::move(b));
  }
  ModuleSpec fn{"final_norm", {}, 0};
  add(fn, "norm", C, 2);
  layout_.modules.push_back(std::move(fn));
  if (!s.tied) {
    ModuleSpec h{"head", {}, 0};
    add(h, "lm_head", Vp * C, 0);
    layout_.modules.push_back(std::move(h));
  }
  build_programs();
}

void LlamaArchitecture::build_programs() {
  const LlamaShape& s = shape_;
  const int E = s.embedding(), F = s.final_norm(), H = s.head();
  using K = ProgramOp;
  auto state = [](Program& p, ProgramOp::Kind k, int m) { p.ops.push_back({k, m, -1, -1}); };
  auto run = [](Program& p, int fn, int layer = -1) {
    p.ops.push_back({ProgramOp::kCompute, -1, fn, layer});
  };
  for (Program* p : {&train_, &eval_}) {
    state(*p, K::kAcquireParams, E);
    run(*p, kEmbeddingForward);
    state(*p, K::kReleaseParams, E);
    for (int l = 0; l < s.L; ++l) {
      state(*p, K::kAcquireParams, s.block(l));
      run(*p, kBlockForward, l);
      state(*p, K::kReleaseParams, s.block(l));
    }
    // The head keeps the final norm and the (tied) embedding acquired through its backward.
    state(*p, K::kAcquireParams, F);
    state(*p, K::kAcquireParams, H);
    run(*p, kHeadForward);
  }
  state(eval_, K::kReleaseParams, F);
  state(eval_, K::kReleaseParams, H);

  // Backward: each module's gradients leave the device as soon as its backward is done. A tied
  // embedding's gradient buffer collects the head's and the embedding's parts.
  Program& p = train_;
  state(p, K::kAcquireGrads, F);
  state(p, K::kAcquireGrads, H);
  run(p, kHeadBackward);
  state(p, K::kReleaseParams, F);
  state(p, K::kReleaseParams, H);
  state(p, K::kDrainGrads, F);
  if (H != E) state(p, K::kDrainGrads, H);
  for (int l = s.L - 1; l >= 0; --l) {
    state(p, K::kAcquireParams, s.block(l));
    state(p, K::kAcquireGrads, s.block(l));
    run(p, kBlockBackward, l);
    state(p, K::kReleaseParams, s.block(l));
    state(p, K::kDrainGrads, s.block(l));
  }
  if (H != E) state(p, K::kAcquireGrads, E);
  run(p, kEmbeddingBackward);
  state(p, K::kDrainGrads, E);
}

std::string LlamaArchitecture::describe() const {
  const LlamaShape& s = shape_;
  return fmt::format(
      "Llama {} layers, {} heads ({} key/value), width {}, MLP {}, vocab {} (padded {}), "
      "context {}, rope theta {}{}{}{}: {:.2f}M params in {} modules",
      s.L, s.NH, s.KVH, s.C, s.I, s.V, s.Vp, s.maxT, s.rope.theta,
      s.rope.llama3 ? " (llama3 scaling)" : "", s.qkv_bias ? ", qkv bias" : "",
      s.tied ? ", tied head" : "", double(layout_.num_params()) / 1e6, layout_.modules.size());
}

std::string LlamaArchitecture::shape_string() const {
  const LlamaShape& s = shape_;
  return fmt::format(
      "llama L={} NH={} KVH={} C={} I={} V={} Vp={} T={} tied={} qkv_bias={} eps={} theta={} "
      "llama3={} factor={} low={} high={} orig={}",
      s.L, s.NH, s.KVH, s.C, s.I, s.V, s.Vp, s.maxT, s.tied, s.qkv_bias, s.eps, s.rope.theta,
      s.rope.llama3, s.rope.factor, s.rope.low_freq_factor, s.rope.high_freq_factor,
      s.rope.original_max_position);
}

std::vector<HfTensor> LlamaArchitecture::hf_tensors(int module) const {
  const LlamaShape& s = shape_;
  const int64_t C = s.C, V = s.V, I = s.I, Q = int64_t(s.NH) * s.hs(), KV = int64_t(s.KVH) * s.hs();
  const ModuleSpec& m = layout_.modules[size_t(module)];
  std::vector<HfTensor> out;
  const std::string block =
      m.name.rfind("block.", 0) == 0 ? "model.layers." + m.name.substr(6) + "." : std::string();
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const std::string& n = m.tensors[i].name;
    HfTensor h;
    h.tensor = int(i);
    if (n == "embed_tokens") {
      h.name = "model.embed_tokens.weight", h.shape = {V, C};
    } else if (n == "norm") {
      h.name = "model.norm.weight", h.shape = {C};
    } else if (n == "lm_head") {
      h.name = "lm_head.weight", h.shape = {V, C};
    } else if (n == "input_layernorm" || n == "post_attention_layernorm") {
      h.name = block + n + ".weight", h.shape = {C};
    } else if (n == "q_proj") {
      h.name = block + "self_attn.q_proj.weight", h.shape = {Q, C};
    } else if (n == "k_proj" || n == "v_proj") {
      h.name = block + "self_attn." + n + ".weight", h.shape = {KV, C};
    } else if (n == "q_bias") {
      h.name = block + "self_attn.q_proj.bias", h.shape = {Q};
    } else if (n == "k_bias" || n == "v_bias") {
      h.name = block + "self_attn." + n.substr(0, 1) + "_proj.bias", h.shape = {KV};
    } else if (n == "o_proj") {
      h.name = block + "self_attn.o_proj.weight", h.shape = {C, Q};
    } else if (n == "gate_proj" || n == "up_proj") {
      h.name = block + "mlp." + n + ".weight", h.shape = {I, C};
    } else if (n == "down_proj") {
      h.name = block + "mlp.down_proj.weight", h.shape = {C, I};
    } else {
      STRATA_CHECK(false, "llama tensor without a Hugging Face name");
    }
    out.push_back(std::move(h));
  }
  return out;
}

bool LlamaArchitecture::hf_ignorable(const std::string& name) const {
  const std::string inv = "rotary_emb.inv_freq";
  if (name.size() >= inv.size() && name.compare(name.size() - inv.size(), inv.size(), inv) == 0) {
    return true;  // a buffer older checkpoints saved
  }
  return shape_.tied && name == "lm_head.weight";
}

void LlamaArchitecture::init_range(int module, uint64_t seed, size_t begin, size_t count,
                                   float* out) const {
  const ModuleSpec& m = layout_.modules[size_t(module)];
  // Padding rows of the vocabulary (V..Vp-1) start at zero: they never receive gradient.
  const bool vocab = m.name == "embedding" || m.name == "head";
  const size_t C = shape_.C;
  init_module_range(m, seed, 0x11a3a + static_cast<uint64_t>(module),
                    vocab ? size_t(shape_.V) * C : 0, vocab ? size_t(shape_.Vp) * C : 0, begin,
                    count, out);
}

bool LlamaArchitecture::fused_attention(const Kernels& kernels, DType dt) const {
  return kernels.fused_attention_supported(dt, shape_.hs());
}

ActivationSizes LlamaArchitecture::activation_plan(int B, int T, DType dt, ActivationMode mode,
                                                   bool fused_attention) const {
  Carver measure(nullptr);
  Buffers b;
  carve(measure, shape_, B, T, dt, mode, fused_attention, &b);
  ActivationSizes s;
  s.bytes = measure.used();
  if (mode == ActivationMode::kOffload) {
    s.stash_layers = shape_.L - 1;
    s.stash_bytes = size_t(B) * T * shape_.C * dtype_size(dt);
    s.host_bytes = size_t(s.stash_layers) * ((s.stash_bytes + 4095) / 4096 * 4096);
  }
  return s;
}

FlopsPerToken LlamaArchitecture::flops_per_token(int T, ActivationMode mode) const {
  const LlamaShape& s = shape_;
  const double C = s.C, L = s.L, Vp = s.Vp, W = s.qkv_width(), A = double(s.NH) * s.hs(), I = s.I;
  // 2 FLOPs per weight of each GEMM (qkv C x W, o_proj A x C, gate/up/down 3 C x I, the head
  // Vp x C) + attention's QK^T and AV over the whole T x T square (4 T A per block).
  const double blocks = 2.0 * (C * W + A * C + 3.0 * C * I) * L + 4.0 * T * A * L;
  FlopsPerToken f;
  f.forward = blocks + 2.0 * Vp * C;
  f.recompute = mode == ActivationMode::kKeep ? 0.0 : blocks;
  return f;
}

Result<std::unique_ptr<ModelRunner>> LlamaArchitecture::create_runner(
    Device& device, int B, int T, DType dt, ActivationMode mode, ActivationStore* store) const {
  if (T > shape_.maxT) {
    return invalid_argument(
        fmt::format("data.seq_len: {} exceeds model.context {}", T, shape_.maxT));
  }
  if (mode == ActivationMode::kOffload && store == nullptr) {
    return invalid_argument(
        "strata.activations: offload needs an activation store (the tier manager's host tier)");
  }
  auto r = std::make_unique<LlamaRunner>(device, layout_, shape_, B, T, dt, mode,
                                         fused_attention(device.kernels(), dt), store);
  STRATA_RETURN_IF_ERROR(
      r->allocate(carve),
      fmt::format("allocating activations ({}) for batch {}x{}", activation_mode_name(mode), B, T));
  return std::unique_ptr<ModelRunner>(std::move(r));
}

namespace {

void LlamaRunner::compute(const ProgramOp& op, const ModuleBindings& b, const MicroBatch& mb) {
  const int E = sh_.embedding(), F = sh_.final_norm(), H = sh_.head();
  const auto P = [&](int m) { return b.params[size_t(m)]; };
  const auto G = [&](int m) { return b.grads[size_t(m)]; };
  switch (op.fn) {
    case LlamaArchitecture::kEmbeddingForward:
      forward_embedding(P(E));
      break;
    case LlamaArchitecture::kBlockForward:
      forward_block(op.layer, P(sh_.block(op.layer)));
      break;
    case LlamaArchitecture::kHeadForward:
      forward_head(P(F), P(H), mb.dloss, mb.losses_out, mb.logits_out);
      break;
    case LlamaArchitecture::kHeadBackward:
      backward_head(P(F), G(F), P(H), G(H));
      break;
    case LlamaArchitecture::kBlockBackward:
      backward_block(op.layer, P(sh_.block(op.layer)), G(sh_.block(op.layer)));
      break;
    case LlamaArchitecture::kEmbeddingBackward:
      backward_embedding(G(E));
      break;
    default:
      STRATA_CHECK(false, "Llama: unknown compute step");
  }
}

// Where a block's tensors start in its flat buffer (elements), found by name: parameters are
// at params + offset * dtype size, gradients (fp32) at grads + offset.
struct BlockOffsets {
  size_t ln1w, qkvw, qkvb, ow, ln2w, guw, downw;
  bool bias;
};

BlockOffsets block_offsets(const ModuleSpec& m) {
  BlockOffsets o{};
  for (const TensorSpec& t : m.tensors) {
    if (t.name == "input_layernorm") o.ln1w = t.offset;
    if (t.name == "q_proj") o.qkvw = t.offset;
    if (t.name == "q_bias") {
      o.qkvb = t.offset;
      o.bias = true;
    }
    if (t.name == "o_proj") o.ow = t.offset;
    if (t.name == "post_attention_layernorm") o.ln2w = t.offset;
    if (t.name == "gate_proj") o.guw = t.offset;
    if (t.name == "down_proj") o.downw = t.offset;
  }
  return o;
}

void LlamaRunner::forward_embedding(const void* p) {
  wait_slot(0);  // buf_.encoded is input slot 0 under kOffload
  dev_.kernels().encoder_forward(dev_.compute_stream(), dt_, buf_.encoded, buf_.tokens, p, nullptr,
                                 B_, T_, sh_.C);
}

void LlamaRunner::block_forward(int l, const void* p, const void* residual, Layer& y, void* out,
                                int wait_slot_before_out) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int B = B_, T = T_, C = sh_.C, NH = sh_.NH, KVH = sh_.KVH, hs = sh_.hs(), N = B * T;
  const int W = sh_.qkv_width(), A = NH * hs, I = sh_.I;
  const size_t es = dtype_size(dt_);
  const BlockOffsets o = block_offsets(layout_.modules[size_t(sh_.block(l))]);
  const char* pb = static_cast<const char*>(p);
  k.rmsnorm_forward(s, dt_, y.ln1, y.ln1_rstd, residual, pb + o.ln1w * es, sh_.eps, N, C);
  k.matmul_forward(s, dt_, y.qkv, y.ln1, pb + o.qkvw * es, o.bias ? pb + o.qkvb * es : nullptr, N,
                   C, W);
  k.rope_forward(s, dt_, y.qkv, sh_.rope, B, T, NH, KVH, hs);
  if (fused_) {
    k.fused_attention_forward(s, dt_, y.atty, y.att, y.qkv, B, T, NH, KVH, hs);
  } else {
    k.attention_gqa_forward(s, dt_, y.atty, y.att, y.qkv, B, T, NH, KVH, hs);
  }
  k.matmul_forward(s, dt_, y.attproj, y.atty, pb + o.ow * es, nullptr, N, A, C);
  k.residual_forward(s, dt_, y.res2, residual, y.attproj, size_t(N) * C);
  k.rmsnorm_forward(s, dt_, y.ln2, y.ln2_rstd, y.res2, pb + o.ln2w * es, sh_.eps, N, C);
  k.matmul_forward(s, dt_, y.gu, y.ln2, pb + o.guw * es, nullptr, N, C, 2 * I);
  k.swiglu_forward(s, dt_, y.act, y.gu, N, I);
  k.matmul_forward(s, dt_, y.down, y.act, pb + o.downw * es, nullptr, N, I, C);
  if (out == nullptr) return;  // a recompute: backward needs no block output
  wait_slot(wait_slot_before_out);
  k.residual_forward(s, dt_, out, y.res2, y.down, size_t(N) * C);
}

void LlamaRunner::forward_block(int l, const void* p) {
  const int L = sh_.L;
  const void* in = input(l);
  int out_slot = -1;
  if (mode_ == ActivationMode::kOffload) {
    // Block l's input leaves as soon as it is complete (it overlaps this block's forward); the
    // last block's input stays for the backward that follows the head.
    if (l + 1 < L) {
      note(store_->stash_activation(l, in, size_t(B_) * T_ * sh_.C * dtype_size(dt_)));
      slot_stash_[l % 2] = l;
      restored_[size_t(l)] = false;
    }
    if (l + 1 < L) out_slot = (l + 1) % 2;  // still being stashed from block l-1
  }
  block_forward(l, p, in, acts(l), output(l), out_slot);
}

void LlamaRunner::forward_head(const void* pf, const void* ph, float dloss, float* losses_out,
                               void* logits_out) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int N = B_ * T_, C = sh_.C;
  k.rmsnorm_forward(s, dt_, buf_.lnf, buf_.lnf_rstd, output(sh_.L - 1), pf, sh_.eps, N, C);
  k.matmul_forward(s, dt_, buf_.logits, buf_.lnf, ph, nullptr, N, C, sh_.Vp);
  if (logits_out) dev_.copy_d2h(s, logits_out, buf_.logits, size_t(N) * sh_.Vp * dtype_size(dt_));
  k.crossentropy_forward_backward(s, dt_, buf_.losses, buf_.logits, buf_.targets, dloss, N, sh_.V,
                                  sh_.Vp);
  dev_.copy_d2h(s, host_losses_, buf_.losses, size_t(N) * 4);
  float* src = host_losses_;
  dev_.host_fn(s, [src, losses_out, N] { std::memcpy(losses_out, src, size_t(N) * 4); });
}

void LlamaRunner::backward_head(const void* pf, float* gf, const void* ph, float* gh) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int N = B_ * T_, C = sh_.C;
  const size_t es = dtype_size(dt_), NC = size_t(N) * C;
  // logits now hold dlogits.
  dev_.memset_zero(s, buf_.dln, NC * es);
  k.matmul_backward(s, dt_, buf_.dln, gh, nullptr, buf_.logits, buf_.lnf, ph, N, C, sh_.Vp);
  dev_.memset_zero(s, buf_.dA, NC * es);
  k.rmsnorm_backward(s, dt_, buf_.dA, gf, buf_.dln, output(sh_.L - 1), pf, buf_.lnf_rstd, N, C);
}

void LlamaRunner::backward_block(int l, const void* p, float* g) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int B = B_, T = T_, C = sh_.C, NH = sh_.NH, KVH = sh_.KVH, hs = sh_.hs(), N = B * T;
  const int W = sh_.qkv_width(), A = NH * hs, I = sh_.I;
  const size_t es = dtype_size(dt_), NC = size_t(N) * C;
  const int L = sh_.L;
  const BlockOffsets o = block_offsets(layout_.modules[size_t(sh_.block(l))]);
  const char* pb = static_cast<const char*>(p);
  const void* residual = input(l);
  if (mode_ == ActivationMode::kOffload) {
    // Block l's input comes back into its slot (prefetched by backward_block(l + 1)); block
    // l-1's is fetched into the other slot now, behind backward l+1 (its slot's last user),
    // so the copy overlaps this block's recompute and backward.
    if (l + 1 < L && !restored_[size_t(l)]) {
      note(store_->restore_activation(l, input(l)));
      restored_[size_t(l)] = true;
    }
    if (l >= 1 && !restored_[size_t(l) - 1]) {
      note(store_->restore_activation(l - 1, input(l - 1)));
      restored_[size_t(l) - 1] = true;
      slot_stash_[(l - 1) % 2] = l - 1;  // forward waits for this copy before reusing the slot
    }
    if (l + 1 < L) {
      store_->compute_waits_activation(l);
      restored_[size_t(l)] = false;
      if (slot_stash_[l % 2] == l) slot_stash_[l % 2] = -1;
    }
  }
  if (mode_ != ActivationMode::kKeep) block_forward(l, p, residual, acts(l), nullptr, -1);
  Layer& y = acts(l);
  // out = res2 + down: dres2 = dA (+ the rmsnorm path below); ddown = dA.
  dev_.memset_zero(s, buf_.dB, NC * es);
  k.add_inplace(s, dt_, buf_.dB, buf_.dA, NC);
  dev_.memset_zero(s, buf_.dact, size_t(N) * I * es);
  k.matmul_backward(s, dt_, buf_.dact, g + o.downw, nullptr, buf_.dA, y.act, pb + o.downw * es, N,
                    I, C);
  dev_.memset_zero(s, buf_.dgu, size_t(N) * 2 * I * es);
  k.swiglu_backward(s, dt_, buf_.dgu, y.gu, buf_.dact, N, I);
  dev_.memset_zero(s, buf_.dln, NC * es);
  k.matmul_backward(s, dt_, buf_.dln, g + o.guw, nullptr, buf_.dgu, y.ln2, pb + o.guw * es, N, C,
                    2 * I);
  k.rmsnorm_backward(s, dt_, buf_.dB, g + o.ln2w, buf_.dln, y.res2, pb + o.ln2w * es, y.ln2_rstd, N,
                     C);
  // res2 = residual + attproj: dresidual = dB (+ the rmsnorm path below); dattproj = dB.
  dev_.memset_zero(s, buf_.dA, NC * es);
  k.add_inplace(s, dt_, buf_.dA, buf_.dB, NC);
  dev_.memset_zero(s, buf_.datty, size_t(N) * A * es);
  k.matmul_backward(s, dt_, buf_.datty, g + o.ow, nullptr, buf_.dB, y.atty, pb + o.ow * es, N, A,
                    C);
  dev_.memset_zero(s, buf_.dqkv, size_t(N) * W * es);
  if (fused_) {
    k.fused_attention_backward(s, dt_, buf_.dqkv, buf_.datt_scratch, buf_.datty, y.qkv, y.atty,
                               y.att, B, T, NH, KVH, hs);
  } else {
    k.attention_gqa_backward(s, dt_, buf_.dqkv, buf_.datt_scratch, buf_.datty, y.qkv, y.att, B, T,
                             NH, KVH, hs);
  }
  // From the rotated q/k back to the projections' outputs.
  k.rope_backward(s, dt_, buf_.dqkv, sh_.rope, B, T, NH, KVH, hs);
  dev_.memset_zero(s, buf_.dln, NC * es);
  k.matmul_backward(s, dt_, buf_.dln, g + o.qkvw, o.bias ? g + o.qkvb : nullptr, buf_.dqkv, y.ln1,
                    pb + o.qkvw * es, N, C, W);
  k.rmsnorm_backward(s, dt_, buf_.dA, g + o.ln1w, buf_.dln, residual, pb + o.ln1w * es, y.ln1_rstd,
                     N, C);
}

void LlamaRunner::backward_embedding(float* g) {
  dev_.kernels().encoder_backward(dev_.compute_stream(), dt_, g, nullptr, buf_.dA, buf_.tokens, B_,
                                  T_, sh_.C);
}

}  // namespace
}  // namespace strata
