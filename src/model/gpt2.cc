#include "src/model/gpt2.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "src/model/decoder_runner.h"
#include "strata/kernels.h"

namespace strata {
namespace {

// A block's intermediates (dt unless noted). kKeep: one per layer, and res3 is the next block's
// input. kRecompute/kOffload: one scratch (res3 unused: outputs go to inputs/out). att (fp32):
// the attention probabilities [B,NH,T,T], or with the fused attention each row's log-sum-exp
// [B,NH,T].
struct Layer {
  void *ln1, *qkv, *atty, *attproj, *res2, *ln2, *fch, *fch_gelu, *fcproj, *res3;
  float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd, *att;
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
  float *lnf_mean = nullptr, *lnf_rstd = nullptr;
  // activation-gradient scratch, reused by every layer. dA: gradient w.r.t. the residual stream
  // at the current layer boundary, carried from one backward step to the next.
  void *dA = nullptr, *dB = nullptr, *dln = nullptr, *dqkv = nullptr, *datty = nullptr,
       *dfch = nullptr, *dfch_gelu = nullptr;
  float* datt_scratch = nullptr;  // the attention backward's scratch, att's size
};

// The one carve of the activation arena: activation_plan() measures it, the runner allocates
// what it measured and carves again for real.
void carve(Carver& c, const GptShape& sh, int B, int T, DType dt, ActivationMode mode, bool fused,
           Buffers* m) {
  const bool keep = mode == ActivationMode::kKeep;
  const int L = sh.L;
  m->layers.resize(size_t(keep ? L : 1));
  m->inputs.assign(size_t(keep                                 ? 0
                          : mode == ActivationMode::kRecompute ? L
                                                               : std::min(L, 2)),
                   nullptr);
  const size_t N = size_t(B) * T, C = sh.C, es = dtype_size(dt), NH = sh.NH;
  const size_t att_bytes = size_t(B) * NH * T * (fused ? 1 : size_t(T)) * 4;
  m->tokens = static_cast<int32_t*>(c.take(N * 4));
  m->targets = static_cast<int32_t*>(c.take(N * 4));
  m->losses = static_cast<float*>(c.take(N * 4));
  for (Layer& y : m->layers) {
    y.ln1 = c.take(N * C * es);
    y.atty = c.take(N * C * es);
    y.attproj = c.take(N * C * es);
    y.res2 = c.take(N * C * es);
    y.ln2 = c.take(N * C * es);
    y.fcproj = c.take(N * C * es);
    y.res3 = keep ? c.take(N * C * es) : nullptr;
    y.qkv = c.take(N * 3 * C * es);
    y.fch = c.take(N * 4 * C * es);
    y.fch_gelu = c.take(N * 4 * C * es);
    y.ln1_mean = static_cast<float*>(c.take(N * 4));
    y.ln1_rstd = static_cast<float*>(c.take(N * 4));
    y.ln2_mean = static_cast<float*>(c.take(N * 4));
    y.ln2_rstd = static_cast<float*>(c.take(N * 4));
    y.att = static_cast<float*>(c.take(att_bytes));
  }
  for (void*& in : m->inputs) in = c.take(N * C * es);
  m->encoded = keep ? c.take(N * C * es) : m->inputs[0];
  m->out = keep ? nullptr : c.take(N * C * es);
  m->lnf = c.take(N * C * es);
  m->logits = c.take(N * size_t(sh.Vp) * es);
  m->lnf_mean = static_cast<float*>(c.take(N * 4));
  m->lnf_rstd = static_cast<float*>(c.take(N * 4));
  m->dA = c.take(N * C * es);
  m->dB = c.take(N * C * es);
  m->dln = c.take(N * C * es);
  m->datty = c.take(N * C * es);
  m->dqkv = c.take(N * 3 * C * es);
  m->dfch = c.take(N * 4 * C * es);
  m->dfch_gelu = c.take(N * 4 * C * es);
  m->datt_scratch = static_cast<float*>(c.take(att_bytes));
}

// One batch shape's device state and GPT's compute steps.
class GptRunner final : public DecoderRunner<GptShape, Buffers> {
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
  // it is nullptr (a recompute, whose output is not needed). With kOffload, the compute stream
  // first waits for any stash still reading input slot `wait_slot_before_out` (-1: none).
  void block_forward(int l, const void* p, const void* in, Layer& y, void* out,
                     int wait_slot_before_out);
};

}  // namespace

size_t ModelLayout::num_params() const {
  size_t n = 0;
  for (const auto& m : modules) n += m.numel;
  return n;
}

Result<std::unique_ptr<GptArchitecture>> GptArchitecture::create(const ModelConfig& mc) {
  GptShape s;
  s.L = mc.n_layer;
  s.NH = mc.n_head;
  s.C = mc.n_embd;
  s.V = mc.vocab_size;
  s.Vp = mc.padded_vocab_size > 0 ? mc.padded_vocab_size : (mc.vocab_size + 63) / 64 * 64;
  s.maxT = mc.context;
  s.tied = mc.tied_embeddings;
  if (s.L < 1 || s.NH < 1 || s.C < 1 || s.V < 2 || s.maxT < 1) {
    return invalid_argument("model: n_layer, n_head, n_embd, context must be >= 1, vocab >= 2");
  }
  if (s.C % s.NH != 0) {
    return invalid_argument(
        fmt::format("model.n_embd: {} is not divisible by model.n_head {}", s.C, s.NH));
  }
  if (s.Vp < s.V) {
    return invalid_argument(
        fmt::format("model.padded_vocab_size: {} is smaller than model.vocab_size {}", s.Vp, s.V));
  }
  return std::unique_ptr<GptArchitecture>(new GptArchitecture(s));
}

GptArchitecture::GptArchitecture(const GptShape& s) : shape_(s) {
  const size_t C = s.C, Vp = s.Vp, T = s.maxT;
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(s.L));
  auto add = [](ModuleSpec& m, const char* name, size_t n, int kind, float std = 0.02f) {
    m.tensors.push_back({name, m.numel, n, kind, std});
    m.numel += n;
  };
  ModuleSpec emb{"embedding", {}, 0};
  add(emb, "wte", Vp * C, 0);
  add(emb, "wpe", T * C, 0, 0.01f);
  layout_.modules.push_back(std::move(emb));
  for (int i = 0; i < s.L; ++i) {
    ModuleSpec b{fmt::format("block.{}", i), {}, 0};
    add(b, "ln1w", C, 2);
    add(b, "ln1b", C, 1);
    add(b, "qkvw", 3 * C * C, 0);
    add(b, "qkvb", 3 * C, 1);
    add(b, "attprojw", C * C, 0, proj_std);
    add(b, "attprojb", C, 1);
    add(b, "ln2w", C, 2);
    add(b, "ln2b", C, 1);
    add(b, "fcw", 4 * C * C, 0);
    add(b, "fcb", 4 * C, 1);
    add(b, "fcprojw", C * 4 * C, 0, proj_std);
    add(b, "fcprojb", C, 1);
    layout_.modules.push_back(std::move(b));
  }
  ModuleSpec fn{"final_norm", {}, 0};
  add(fn, "lnfw", C, 2);
  add(fn, "lnfb", C, 1);
  layout_.modules.push_back(std::move(fn));
  if (!s.tied) {
    ModuleSpec h{"head", {}, 0};
    add(h, "lm_head", Vp * C, 0);
    layout_.modules.push_back(std::move(h));
  }
  build_programs();
}

void GptArchitecture::build_programs() {
  const GptShape& s = shape_;
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

std::string GptArchitecture::describe() const {
  const GptShape& s = shape_;
  return fmt::format(
      "GPT {} layers, {} heads, width {}, vocab {} (padded {}), context {}{}: {:.2f}M params in "
      "{} modules",
      s.L, s.NH, s.C, s.V, s.Vp, s.maxT, s.tied ? "" : ", untied head",
      double(layout_.num_params()) / 1e6, layout_.modules.size());
}

std::string GptArchitecture::shape_string() const {
  const GptShape& s = shape_;
  return fmt::format("L={} NH={} C={} V={} Vp={} T={} tied={}", s.L, s.NH, s.C, s.V, s.Vp, s.maxT,
                     s.tied);
}

std::vector<HfTensor> GptArchitecture::hf_tensors(int module) const {
  const GptShape& s = shape_;
  const int64_t C = s.C, V = s.V, T = s.maxT;
  const ModuleSpec& m = layout_.modules[size_t(module)];
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

bool GptArchitecture::hf_ignorable(const std::string& name) const {
  auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() &&
           name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  // The causal mask buffers older transformers versions saved.
  if (ends_with(".attn.bias") || ends_with(".attn.masked_bias")) return true;
  return shape_.tied && name == "lm_head.weight";
}

void GptArchitecture::init_range(int module, uint64_t seed, size_t begin, size_t count,
                                 float* out) const {
  const ModuleSpec& m = layout_.modules[size_t(module)];
  // Padding rows of the vocabulary (V..Vp-1) start at zero: they never receive gradient.
  const bool vocab = m.name == "embedding" || m.name == "head";
  const size_t C = shape_.C;
  init_module_range(m, seed, 0x9e11 + static_cast<uint64_t>(module),
                    vocab ? size_t(shape_.V) * C : 0, vocab ? size_t(shape_.Vp) * C : 0, begin,
                    count, out);
}

bool GptArchitecture::fused_attention(const Kernels& kernels, DType dt) const {
  return kernels.fused_attention_supported(dt, shape_.C / shape_.NH);
}

ActivationSizes GptArchitecture::activation_plan(int B, int T, DType dt, ActivationMode mode,
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

FlopsPerToken GptArchitecture::flops_per_token(int T, ActivationMode mode) const {
  const double C = shape_.C, L = shape_.L, Vp = shape_.Vp;
  // 2 FLOPs per weight of each GEMM (12C^2 per block + the Vp x C head) + attention's QK^T and
  // AV over the whole T x T square (4TC per block); the recompute re-runs the blocks only.
  const double blocks = 2.0 * 12.0 * C * C * L + 4.0 * T * C * L;
  FlopsPerToken f;
  f.forward = blocks + 2.0 * Vp * C;
  f.recompute = mode == ActivationMode::kKeep ? 0.0 : blocks;
  return f;
}

Result<std::unique_ptr<ModelRunner>> GptArchitecture::create_runner(Device& device, int B, int T,
                                                                    DType dt, ActivationMode mode,
                                                                    ActivationStore* store) const {
  if (T > shape_.maxT) {
    return invalid_argument(
        fmt::format("data.seq_len: {} exceeds model.context {}", T, shape_.maxT));
  }
  if (mode == ActivationMode::kOffload && store == nullptr) {
    return invalid_argument(
        "strata.activations: offload needs an activation store (the tier manager's host tier)");
  }
  auto r = std::make_unique<GptRunner>(device, layout_, shape_, B, T, dt, mode,
                                       fused_attention(device.kernels(), dt), store);
  STRATA_RETURN_IF_ERROR(
      r->allocate(carve),
      fmt::format("allocating activations ({}) for batch {}x{}", activation_mode_name(mode), B, T));
  return std::unique_ptr<ModelRunner>(std::move(r));
}

namespace {

void GptRunner::compute(const ProgramOp& op, const ModuleBindings& b, const MicroBatch& mb) {
  const int E = sh_.embedding(), F = sh_.final_norm(), H = sh_.head();
  const auto P = [&](int m) { return b.params[size_t(m)]; };
  const auto G = [&](int m) { return b.grads[size_t(m)]; };
  switch (op.fn) {
    case GptArchitecture::kEmbeddingForward:
      forward_embedding(P(E));
      break;
    case GptArchitecture::kBlockForward:
      forward_block(op.layer, P(sh_.block(op.layer)));
      break;
    case GptArchitecture::kHeadForward:
      forward_head(P(F), P(H), mb.dloss, mb.losses_out, mb.logits_out);
      break;
    case GptArchitecture::kHeadBackward:
      backward_head(P(F), G(F), P(H), G(H));
      break;
    case GptArchitecture::kBlockBackward:
      backward_block(op.layer, P(sh_.block(op.layer)), G(sh_.block(op.layer)));
      break;
    case GptArchitecture::kEmbeddingBackward:
      backward_embedding(G(E));
      break;
    default:
      STRATA_CHECK(false, "GPT: unknown compute step");
  }
}

// Tensor views inside a module's flat buffer: parameters (dt) and gradients (fp32).
#define PARAM(mod, params, idx) \
  (static_cast<const char*>(params) + layout_.modules[mod].tensors[idx].offset * es)
#define GRAD(mod, grads, idx) ((grads) + layout_.modules[mod].tensors[idx].offset)
enum BlockTensor {
  kLn1w,
  kLn1b,
  kQkvw,
  kQkvb,
  kAttprojw,
  kAttprojb,
  kLn2w,
  kLn2b,
  kFcw,
  kFcb,
  kFcprojw,
  kFcprojb
};

void GptRunner::forward_embedding(const void* p) {
  const size_t es = dtype_size(dt_);
  const int E = sh_.embedding();
  wait_slot(0);  // buf_.encoded is input slot 0 under kOffload
  dev_.kernels().encoder_forward(dev_.compute_stream(), dt_, buf_.encoded, buf_.tokens,
                                 PARAM(E, p, 0), PARAM(E, p, 1), B_, T_, sh_.C);
}

void GptRunner::block_forward(int l, const void* p, const void* residual, Layer& y, void* out,
                              int wait_slot_before_out) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int B = B_, T = T_, C = sh_.C, NH = sh_.NH, N = B * T;
  const size_t es = dtype_size(dt_);
  const int m = sh_.block(l);
  k.layernorm_forward(s, dt_, y.ln1, y.ln1_mean, y.ln1_rstd, residual, PARAM(m, p, kLn1w),
                      PARAM(m, p, kLn1b), N, C);
  k.matmul_forward(s, dt_, y.qkv, y.ln1, PARAM(m, p, kQkvw), PARAM(m, p, kQkvb), N, C, 3 * C);
  if (fused_) {
    k.fused_attention_forward(s, dt_, y.atty, y.att, y.qkv, B, T, NH, NH, C / NH);
  } else {
    k.attention_forward(s, dt_, y.atty, y.att, y.qkv, B, T, C, NH);
  }
  k.matmul_forward(s, dt_, y.attproj, y.atty, PARAM(m, p, kAttprojw), PARAM(m, p, kAttprojb), N, C,
                   C);
  k.residual_forward(s, dt_, y.res2, residual, y.attproj, size_t(N) * C);
  k.layernorm_forward(s, dt_, y.ln2, y.ln2_mean, y.ln2_rstd, y.res2, PARAM(m, p, kLn2w),
                      PARAM(m, p, kLn2b), N, C);
  k.matmul_forward(s, dt_, y.fch, y.ln2, PARAM(m, p, kFcw), PARAM(m, p, kFcb), N, C, 4 * C);
  k.gelu_forward(s, dt_, y.fch_gelu, y.fch, size_t(N) * 4 * C);
  k.matmul_forward(s, dt_, y.fcproj, y.fch_gelu, PARAM(m, p, kFcprojw), PARAM(m, p, kFcprojb), N,
                   4 * C, C);
  if (out == nullptr) return;  // a recompute: backward needs no block output
  wait_slot(wait_slot_before_out);
  k.residual_forward(s, dt_, out, y.res2, y.fcproj, size_t(N) * C);
}

void GptRunner::forward_block(int l, const void* p) {
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

void GptRunner::forward_head(const void* pf, const void* ph, float dloss, float* losses_out,
                             void* logits_out) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int N = B_ * T_, C = sh_.C;
  const size_t es = dtype_size(dt_);
  const int F = sh_.final_norm(), H = sh_.head();
  k.layernorm_forward(s, dt_, buf_.lnf, buf_.lnf_mean, buf_.lnf_rstd, output(sh_.L - 1),
                      PARAM(F, pf, 0), PARAM(F, pf, 1), N, C);
  k.matmul_forward(s, dt_, buf_.logits, buf_.lnf, PARAM(H, ph, 0), nullptr, N, C, sh_.Vp);
  if (logits_out) dev_.copy_d2h(s, logits_out, buf_.logits, size_t(N) * sh_.Vp * es);
  k.crossentropy_forward_backward(s, dt_, buf_.losses, buf_.logits, buf_.targets, dloss, N, sh_.V,
                                  sh_.Vp);
  dev_.copy_d2h(s, host_losses_, buf_.losses, size_t(N) * 4);
  float* src = host_losses_;
  dev_.host_fn(s, [src, losses_out, N] { std::memcpy(losses_out, src, size_t(N) * 4); });
}

void GptRunner::backward_head(const void* pf, float* gf, const void* ph, float* gh) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int N = B_ * T_, C = sh_.C;
  const size_t es = dtype_size(dt_), NC = size_t(N) * C;
  const int F = sh_.final_norm(), H = sh_.head();
  // logits now hold dlogits.
  dev_.memset_zero(s, buf_.dln, NC * es);
  k.matmul_backward(s, dt_, buf_.dln, GRAD(H, gh, 0), nullptr, buf_.logits, buf_.lnf,
                    PARAM(H, ph, 0), N, C, sh_.Vp);
  dev_.memset_zero(s, buf_.dA, NC * es);
  k.layernorm_backward(s, dt_, buf_.dA, GRAD(F, gf, 0), GRAD(F, gf, 1), buf_.dln, output(sh_.L - 1),
                       PARAM(F, pf, 0), buf_.lnf_mean, buf_.lnf_rstd, N, C);
}

void GptRunner::backward_block(int l, const void* p, float* g) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int B = B_, T = T_, C = sh_.C, NH = sh_.NH, N = B * T;
  const size_t es = dtype_size(dt_), NC = size_t(N) * C;
  const int m = sh_.block(l);
  const int L = sh_.L;
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
  // res3 = res2 + fcproj: dres2 = dA (+ ln2 path below); dfcproj = dA.
  dev_.memset_zero(s, buf_.dB, NC * es);
  k.add_inplace(s, dt_, buf_.dB, buf_.dA, NC);
  dev_.memset_zero(s, buf_.dfch_gelu, NC * 4 * es);
  k.matmul_backward(s, dt_, buf_.dfch_gelu, GRAD(m, g, kFcprojw), GRAD(m, g, kFcprojb), buf_.dA,
                    y.fch_gelu, PARAM(m, p, kFcprojw), N, 4 * C, C);
  dev_.memset_zero(s, buf_.dfch, NC * 4 * es);
  k.gelu_backward(s, dt_, buf_.dfch, y.fch, buf_.dfch_gelu, NC * 4);
  dev_.memset_zero(s, buf_.dln, NC * es);
  k.matmul_backward(s, dt_, buf_.dln, GRAD(m, g, kFcw), GRAD(m, g, kFcb), buf_.dfch, y.ln2,
                    PARAM(m, p, kFcw), N, C, 4 * C);
  k.layernorm_backward(s, dt_, buf_.dB, GRAD(m, g, kLn2w), GRAD(m, g, kLn2b), buf_.dln, y.res2,
                       PARAM(m, p, kLn2w), y.ln2_mean, y.ln2_rstd, N, C);
  // res2 = residual + attproj: dresidual = dB (+ ln1 path below); dattproj = dB.
  dev_.memset_zero(s, buf_.dA, NC * es);
  k.add_inplace(s, dt_, buf_.dA, buf_.dB, NC);
  dev_.memset_zero(s, buf_.datty, NC * es);
  k.matmul_backward(s, dt_, buf_.datty, GRAD(m, g, kAttprojw), GRAD(m, g, kAttprojb), buf_.dB,
                    y.atty, PARAM(m, p, kAttprojw), N, C, C);
  dev_.memset_zero(s, buf_.dqkv, NC * 3 * es);
  if (fused_) {
    k.fused_attention_backward(s, dt_, buf_.dqkv, buf_.datt_scratch, buf_.datty, y.qkv, y.atty,
                               y.att, B, T, NH, NH, C / NH);
  } else {
    k.attention_backward(s, dt_, buf_.dqkv, buf_.datt_scratch, buf_.datty, y.qkv, y.att, B, T, C,
                         NH);
  }
  dev_.memset_zero(s, buf_.dln, NC * es);
  k.matmul_backward(s, dt_, buf_.dln, GRAD(m, g, kQkvw), GRAD(m, g, kQkvb), buf_.dqkv, y.ln1,
                    PARAM(m, p, kQkvw), N, C, 3 * C);
  k.layernorm_backward(s, dt_, buf_.dA, GRAD(m, g, kLn1w), GRAD(m, g, kLn1b), buf_.dln, residual,
                       PARAM(m, p, kLn1w), y.ln1_mean, y.ln1_rstd, N, C);
}

void GptRunner::backward_embedding(float* g) {
  const int E = sh_.embedding();
  dev_.kernels().encoder_backward(dev_.compute_stream(), dt_, GRAD(E, g, 0), GRAD(E, g, 1), buf_.dA,
                                  buf_.tokens, B_, T_, sh_.C);
}

#undef PARAM
#undef GRAD

}  // namespace
}  // namespace strata
