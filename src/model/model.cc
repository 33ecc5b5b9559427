#include "src/model/model.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "src/base/rng.h"
#include "strata/kernels.h"

namespace strata {

size_t ModelLayout::num_params() const {
  size_t n = 0;
  for (const auto& m : modules) n += m.numel;
  return n;
}

Result<ModelLayout> ModelLayout::from_config(const ModelConfig& mc) {
  ModelLayout l;
  l.L = mc.n_layer;
  l.NH = mc.n_head;
  l.C = mc.n_embd;
  l.V = mc.vocab_size;
  l.Vp = mc.padded_vocab_size > 0 ? mc.padded_vocab_size : (mc.vocab_size + 63) / 64 * 64;
  l.maxT = mc.context;
  l.tied = mc.tied_embeddings;
  if (l.L < 1 || l.NH < 1 || l.C < 1 || l.V < 2 || l.maxT < 1) {
    return invalid_argument("model: n_layer, n_head, n_embd, context must be >= 1, vocab >= 2");
  }
  if (l.C % l.NH != 0) {
    return invalid_argument(
        fmt::format("model.n_embd: {} is not divisible by model.n_head {}", l.C, l.NH));
  }
  if (l.Vp < l.V) {
    return invalid_argument(
        fmt::format("model.padded_vocab_size: {} is smaller than model.vocab_size {}", l.Vp, l.V));
  }
  const size_t C = l.C, Vp = l.Vp, T = l.maxT;
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(l.L));
  auto add = [](ModuleSpec& m, const char* name, size_t n, int kind, float std = 0.02f) {
    m.tensors.push_back({name, m.numel, n, kind, std});
    m.numel += n;
  };
  ModuleSpec emb{"embedding", {}, 0};
  add(emb, "wte", Vp * C, 0);
  add(emb, "wpe", T * C, 0, 0.01f);
  l.modules.push_back(std::move(emb));
  for (int i = 0; i < l.L; ++i) {
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
    l.modules.push_back(std::move(b));
  }
  ModuleSpec fn{"final_norm", {}, 0};
  add(fn, "lnfw", C, 2);
  add(fn, "lnfb", C, 1);
  l.modules.push_back(std::move(fn));
  if (!l.tied) {
    ModuleSpec h{"head", {}, 0};
    add(h, "lm_head", Vp * C, 0);
    l.modules.push_back(std::move(h));
  }
  return l;
}

void init_module_params(const ModelLayout& layout, int module, uint64_t seed, float* master) {
  const ModuleSpec& m = layout.modules[module];
  Rng rng(seed, 0x9e11 + static_cast<uint64_t>(module));
  for (const TensorSpec& t : m.tensors) {
    float* p = master + t.offset;
    if (t.init_kind == 0) {
      for (size_t i = 0; i < t.numel; ++i) p[i] = static_cast<float>(rng.normal()) * t.init_std;
    } else {
      std::fill(p, p + t.numel, t.init_kind == 2 ? 1.0f : 0.0f);
    }
  }
  // Padding rows of the vocabulary (V..Vp-1) start at zero: they never receive gradient.
  if (m.name == "embedding" || m.name == "head") {
    const size_t C = layout.C;
    std::fill(master + size_t(layout.V) * C, master + size_t(layout.Vp) * C, 0.0f);
  }
}

namespace {

// Bump allocator over one arena: 256-byte aligned slices. With base == nullptr it only measures.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  void* take(size_t bytes) {
    void* p = base_ ? base_ + off_ : nullptr;
    off_ += (bytes + 255) / 256 * 256;
    return p;
  }
  size_t used() const { return off_; }

 private:
  char* base_;
  size_t off_ = 0;
};

size_t r256(size_t b) { return (b + 255) / 256 * 256; }

}  // namespace

const char* activation_mode_name(ActivationMode mode) {
  switch (mode) {
    case ActivationMode::kKeep:
      return "keep";
    case ActivationMode::kRecompute:
      return "recompute";
    case ActivationMode::kOffload:
      return "offload";
  }
  return "?";
}

Result<ActivationMode> parse_activation_mode(const std::string& name) {
  for (auto m : {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
    if (name == activation_mode_name(m)) return m;
  }
  return invalid_argument(
      fmt::format("strata.activations: \"{}\" is not one of keep, recompute, offload", name));
}

ActivationSizes activation_bytes(const ModelLayout& l, int B, int T, DType dt,
                                 ActivationMode mode) {
  // Mirrors GptModel::create's carving (checked there).
  const size_t N = size_t(B) * T, C = l.C, es = dtype_size(dt), NH = l.NH;
  const size_t nc = r256(N * C * es);  // one [B,T,C] tensor: a block input or output
  const size_t per_layer = nc * 7 + r256(N * 3 * C * es) + r256(N * 4 * C * es) * 2 +
                           r256(N * 4) * 4 + r256(size_t(B) * NH * T * T * 4);
  // tokens, targets, losses; final norm, logits, its mean/rstd; gradient scratch.
  size_t total = r256(N * 4) * 3;
  total += nc + r256(N * size_t(l.Vp) * es) + r256(N * 4) * 2;
  total +=
      nc * 4 + r256(N * 3 * C * es) + r256(N * 4 * C * es) * 2 + r256(size_t(B) * NH * T * T * 4);
  ActivationSizes s;
  const size_t L = size_t(l.L);
  switch (mode) {
    case ActivationMode::kKeep:  // every layer's intermediates; the embedding output
      total += per_layer * L + nc;
      break;
    case ActivationMode::kRecompute:  // one scratch layer (no res3); L inputs; the output
      total += (per_layer - nc) + nc * L + nc;
      break;
    case ActivationMode::kOffload:  // one scratch layer; two input slots; the output
      total += (per_layer - nc) + nc * std::min<size_t>(L, 2) + nc;
      s.stash_layers = l.L - 1;
      s.stash_bytes = N * C * es;
      s.host_bytes = size_t(s.stash_layers) * ((s.stash_bytes + 4095) / 4096 * 4096);
      break;
  }
  s.bytes = total;
  return s;
}

Result<std::unique_ptr<GptModel>> GptModel::create(Device& device, const ModelLayout& layout, int B,
                                                   int T, DType dt, ActivationMode mode,
                                                   ActivationStore* store) {
  if (T > layout.maxT) {
    return invalid_argument(
        fmt::format("data.seq_len: {} exceeds model.context {}", T, layout.maxT));
  }
  if (mode == ActivationMode::kOffload && store == nullptr) {
    return invalid_argument(
        "strata.activations: offload needs an activation store (the tier manager's host tier)");
  }
  std::unique_ptr<GptModel> m(new GptModel(device, layout, B, T, dt, mode, store));
  const int L = layout.L;
  const bool keep = mode == ActivationMode::kKeep;
  const int n_layers = keep ? L : 1;
  const int n_inputs = keep ? 0 : mode == ActivationMode::kRecompute ? L : std::min(L, 2);
  m->layers_.resize(size_t(n_layers));
  m->inputs_.assign(size_t(n_inputs), nullptr);
  m->restored_.assign(size_t(L), false);
  auto carve = [&](Carver& c) {
    const size_t N = size_t(B) * T, C = layout.C, es = dtype_size(dt), NH = layout.NH;
    m->tokens_ = static_cast<int32_t*>(c.take(N * 4));
    m->targets_ = static_cast<int32_t*>(c.take(N * 4));
    m->losses_ = static_cast<float*>(c.take(N * 4));
    for (Layer& y : m->layers_) {
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
      y.att = static_cast<float*>(c.take(size_t(B) * NH * T * T * 4));
    }
    for (void*& in : m->inputs_) in = c.take(N * C * es);
    m->encoded_ = keep ? c.take(N * C * es) : m->inputs_[0];
    m->out_ = keep ? nullptr : c.take(N * C * es);
    m->lnf_ = c.take(N * C * es);
    m->logits_ = c.take(N * size_t(layout.Vp) * es);
    m->lnf_mean_ = static_cast<float*>(c.take(N * 4));
    m->lnf_rstd_ = static_cast<float*>(c.take(N * 4));
    m->dA_ = c.take(N * C * es);
    m->dB_ = c.take(N * C * es);
    m->dln_ = c.take(N * C * es);
    m->datty_ = c.take(N * C * es);
    m->dqkv_ = c.take(N * 3 * C * es);
    m->dfch_ = c.take(N * 4 * C * es);
    m->dfch_gelu_ = c.take(N * 4 * C * es);
    m->datt_scratch_ = static_cast<float*>(c.take(size_t(B) * NH * T * T * 4));
  };
  Carver measure(nullptr);
  carve(measure);
  const size_t bytes = measure.used();
  STRATA_CHECK(bytes == activation_bytes(layout, B, T, dt, mode).bytes, "activation size mismatch");
  STRATA_ASSIGN_OR_RETURN(
      m->arena_, device.allocate(bytes, "activations"),
      fmt::format("allocating activations ({}) for batch {}x{}", activation_mode_name(mode), B, T));
  Carver real(static_cast<char*>(m->arena_));
  carve(real);
  const size_t N = size_t(B) * T;
  STRATA_ASSIGN_OR_RETURN(void* h, device.allocate_host(N * 8 + N * 4), "host staging");
  m->host_io_ = static_cast<int32_t*>(h);
  m->host_losses_ = reinterpret_cast<float*>(m->host_io_ + 2 * N);
  return m;
}

GptModel::~GptModel() {
  dev_.synchronize(dev_.compute_stream()).ignore();
  if (arena_) dev_.release(arena_);
  if (host_io_) dev_.release_host(host_io_);
}

void GptModel::begin_batch(const int32_t* tokens, const int32_t* targets) {
  const size_t N = size_t(B_) * T_;
  Stream& s = dev_.compute_stream();
  // The staging buffer is reused per micro-batch: wait until the last upload consumed it.
  dev_.synchronize(s).ignore();
  std::memcpy(host_io_, tokens, N * 4);
  std::memcpy(host_io_ + N, targets, N * 4);
  dev_.copy_h2d(s, tokens_, host_io_, N * 4);
  dev_.copy_h2d(s, targets_, host_io_ + N, N * 4);
}

// Tensor views inside a module's flat buffer: parameters (dt) and gradients (fp32).
#define PARAM(mod, params, idx) \
  (static_cast<const char*>(params) + lay_.modules[mod].tensors[idx].offset * es)
#define GRAD(mod, grads, idx) ((grads) + lay_.modules[mod].tensors[idx].offset)
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

void* GptModel::input(int l) const {
  switch (mode_) {
    case ActivationMode::kKeep:
      return l == 0 ? encoded_ : layers_[size_t(l) - 1].res3;
    case ActivationMode::kRecompute:
      return inputs_[size_t(l)];
    case ActivationMode::kOffload:
      return inputs_[size_t(l % 2)];
  }
  return nullptr;
}

void* GptModel::output(int l) const {
  if (mode_ == ActivationMode::kKeep) return layers_[size_t(l)].res3;
  return l + 1 < lay_.L ? input(l + 1) : out_;
}

GptModel::Layer& GptModel::acts(int l) {
  return mode_ == ActivationMode::kKeep ? layers_[size_t(l)] : layers_[0];
}

void GptModel::note(const Status& s) {
  if (!s.is_ok() && error_.is_ok()) error_ = s;
}

void GptModel::wait_slot(int slot) {
  if (mode_ != ActivationMode::kOffload || slot < 0 || slot_stash_[slot] < 0) return;
  store_->compute_waits_activation(slot_stash_[slot]);
  slot_stash_[slot] = -1;
}

void GptModel::forward_embedding(const void* p) {
  const size_t es = dtype_size(dt_);
  const int E = lay_.embedding();
  wait_slot(0);  // encoded_ is input slot 0 under kOffload
  dev_.kernels().encoder_forward(dev_.compute_stream(), dt_, encoded_, tokens_, PARAM(E, p, 0),
                                 PARAM(E, p, 1), B_, T_, lay_.C);
}

void GptModel::block_forward(int l, const void* p, const void* residual, Layer& y, void* out,
                             int wait_slot_before_out) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int B = B_, T = T_, C = lay_.C, NH = lay_.NH, N = B * T;
  const size_t es = dtype_size(dt_);
  const int m = lay_.block(l);
  k.layernorm_forward(s, dt_, y.ln1, y.ln1_mean, y.ln1_rstd, residual, PARAM(m, p, kLn1w),
                      PARAM(m, p, kLn1b), N, C);
  k.matmul_forward(s, dt_, y.qkv, y.ln1, PARAM(m, p, kQkvw), PARAM(m, p, kQkvb), N, C, 3 * C);
  k.attention_forward(s, dt_, y.atty, y.att, y.qkv, B, T, C, NH);
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

void GptModel::forward_block(int l, const void* p) {
  const int L = lay_.L;
  const void* in = input(l);
  int out_slot = -1;
  if (mode_ == ActivationMode::kOffload) {
    // Block l's input leaves as soon as it is complete (it overlaps this block's forward); the
    // last block's input stays for the backward that follows the head.
    if (l + 1 < L) {
      note(store_->stash_activation(l, in, size_t(B_) * T_ * lay_.C * dtype_size(dt_)));
      slot_stash_[l % 2] = l;
      restored_[size_t(l)] = false;
    }
    if (l + 1 < L) out_slot = (l + 1) % 2;  // still being stashed from block l-1
  }
  block_forward(l, p, in, acts(l), output(l), out_slot);
}

void GptModel::forward_head(const void* pf, const void* ph, float dloss, float* losses_out) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int N = B_ * T_, C = lay_.C;
  const size_t es = dtype_size(dt_);
  const int F = lay_.final_norm(), H = lay_.head();
  k.layernorm_forward(s, dt_, lnf_, lnf_mean_, lnf_rstd_, output(lay_.L - 1), PARAM(F, pf, 0),
                      PARAM(F, pf, 1), N, C);
  k.matmul_forward(s, dt_, logits_, lnf_, PARAM(H, ph, 0), nullptr, N, C, lay_.Vp);
  k.crossentropy_forward_backward(s, dt_, losses_, logits_, targets_, dloss, N, lay_.V, lay_.Vp);
  dev_.copy_d2h(s, host_losses_, losses_, size_t(N) * 4);
  float* src = host_losses_;
  dev_.host_fn(s, [src, losses_out, N] { std::memcpy(losses_out, src, size_t(N) * 4); });
}

void GptModel::backward_head(const void* pf, float* gf, const void* ph, float* gh) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int N = B_ * T_, C = lay_.C;
  const size_t es = dtype_size(dt_), NC = size_t(N) * C;
  const int F = lay_.final_norm(), H = lay_.head();
  // logits now hold dlogits.
  dev_.memset_zero(s, dln_, NC * es);
  k.matmul_backward(s, dt_, dln_, GRAD(H, gh, 0), nullptr, logits_, lnf_, PARAM(H, ph, 0), N, C,
                    lay_.Vp);
  dev_.memset_zero(s, dA_, NC * es);
  k.layernorm_backward(s, dt_, dA_, GRAD(F, gf, 0), GRAD(F, gf, 1), dln_, output(lay_.L - 1),
                       PARAM(F, pf, 0), lnf_mean_, lnf_rstd_, N, C);
}

void GptModel::backward_block(int l, const void* p, float* g) {
  Kernels& k = dev_.kernels();
  Stream& s = dev_.compute_stream();
  const int B = B_, T = T_, C = lay_.C, NH = lay_.NH, N = B * T;
  const size_t es = dtype_size(dt_), NC = size_t(N) * C;
  const int m = lay_.block(l);
  const int L = lay_.L;
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
  dev_.memset_zero(s, dB_, NC * es);
  k.add_inplace(s, dt_, dB_, dA_, NC);
  dev_.memset_zero(s, dfch_gelu_, NC * 4 * es);
  k.matmul_backward(s, dt_, dfch_gelu_, GRAD(m, g, kFcprojw), GRAD(m, g, kFcprojb), dA_, y.fch_gelu,
                    PARAM(m, p, kFcprojw), N, 4 * C, C);
  dev_.memset_zero(s, dfch_, NC * 4 * es);
  k.gelu_backward(s, dt_, dfch_, y.fch, dfch_gelu_, NC * 4);
  dev_.memset_zero(s, dln_, NC * es);
  k.matmul_backward(s, dt_, dln_, GRAD(m, g, kFcw), GRAD(m, g, kFcb), dfch_, y.ln2,
                    PARAM(m, p, kFcw), N, C, 4 * C);
  k.layernorm_backward(s, dt_, dB_, GRAD(m, g, kLn2w), GRAD(m, g, kLn2b), dln_, y.res2,
                       PARAM(m, p, kLn2w), y.ln2_mean, y.ln2_rstd, N, C);
  // res2 = residual + attproj: dresidual = dB (+ ln1 path below); dattproj = dB.
  dev_.memset_zero(s, dA_, NC * es);
  k.add_inplace(s, dt_, dA_, dB_, NC);
  dev_.memset_zero(s, datty_, NC * es);
  k.matmul_backward(s, dt_, datty_, GRAD(m, g, kAttprojw), GRAD(m, g, kAttprojb), dB_, y.atty,
                    PARAM(m, p, kAttprojw), N, C, C);
  dev_.memset_zero(s, dqkv_, NC * 3 * es);
  k.attention_backward(s, dt_, dqkv_, datt_scratch_, datty_, y.qkv, y.att, B, T, C, NH);
  dev_.memset_zero(s, dln_, NC * es);
  k.matmul_backward(s, dt_, dln_, GRAD(m, g, kQkvw), GRAD(m, g, kQkvb), dqkv_, y.ln1,
                    PARAM(m, p, kQkvw), N, C, 3 * C);
  k.layernorm_backward(s, dt_, dA_, GRAD(m, g, kLn1w), GRAD(m, g, kLn1b), dln_, residual,
                       PARAM(m, p, kLn1w), y.ln1_mean, y.ln1_rstd, N, C);
}

void GptModel::backward_embedding(float* g) {
  const int E = lay_.embedding();
  dev_.kernels().encoder_backward(dev_.compute_stream(), dt_, GRAD(E, g, 0), GRAD(E, g, 1), dA_,
                                  tokens_, B_, T_, lay_.C);
}

#undef PARAM
#undef GRAD

}  // namespace strata
