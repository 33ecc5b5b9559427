#include "src/model/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "src/model/decoder_architecture.h"
#include "src/model/family.h"
#include "src/model/llama_blocks.h"

namespace strata {
namespace {

// The host's part of a block's routing for one micro-batch (filled by the forward, read by the
// backward; a recompute fills it again with the same values).
struct LayerRouting {
  std::vector<float> probs;   // [N, E] softmax of the router's logits
  std::vector<int> expert;    // [N, K] token t's j-th pick
  std::vector<int> row;       // [N, K] ... its row in the expert-grouped order
  std::vector<int> offsets;   // [E + 1] expert e's rows: offsets[e] .. offsets[e + 1]
  std::vector<float> gate;    // [N] the shared expert's sigmoid gate (qwen2_moe)
  std::vector<double> count;  // [E] tokens routed to each expert
  std::vector<double> psum;   // [E] summed probabilities
};

// A mixture's block: Llama's attention, then a router and its experts in place of the MLP.
class MoeBlocks : public LlamaBlocks {
 public:
  static Status check_moe(const ModelConfig& mc) {
    STRATA_RETURN_IF_ERROR(check_attention(mc), "");
    // Qwen3-MoE's attention (query/key norms, heads of any width) is qwen2_moe's with qk_norm,
    // and has no shared expert: the shapes transformers has.
    const bool wide = mc.head_dim > 0 && int64_t(mc.head_dim) * mc.n_head != mc.n_embd;
    if ((mc.qk_norm || wide) && (mc.type != "qwen2_moe" || !mc.qk_norm)) {
      return invalid_argument(
          "model.qk_norm, model.head_dim: of the mixtures only Qwen3-MoE (model.type qwen2_moe "
          "with qk_norm true) normalizes its queries and keys or has heads other than n_embd / "
          "n_head wide (set head_dim to 0 and qk_norm to false, or qk_norm true on qwen2_moe)");
    }
    if (mc.qk_norm && mc.shared_expert_intermediate_size != 0) {
      return invalid_argument(
          "model.shared_expert_intermediate_size: Qwen3-MoE (qwen2_moe with qk_norm) has no "
          "shared expert; set it to 0");
    }
    if (mc.num_experts < 1) {
      return invalid_argument(fmt::format(
          "model.num_experts: a {} model needs its experts per layer (>= 1, as its config.json's "
          "num_local_experts / num_experts)",
          mc.type));
    }
    if (mc.num_experts_per_tok < 1 || mc.num_experts_per_tok > mc.num_experts) {
      return invalid_argument(
          fmt::format("model.num_experts_per_tok: {} must be in [1, model.num_experts = {}]",
                      mc.num_experts_per_tok, mc.num_experts));
    }
    if (expert_width(mc) < 1) {
      return invalid_argument(
          "model.moe_intermediate_size: an expert needs its SwiGLU width (or "
          "model.intermediate_size)");
    }
    if (!(mc.router_aux_loss_coef >= 0)) {
      return invalid_argument(
          fmt::format("model.router_aux_loss_coef: {} must be >= 0", mc.router_aux_loss_coef));
    }
    return Status::ok();
  }
  static int expert_width(const ModelConfig& mc) {
    return mc.moe_intermediate_size > 0 ? mc.moe_intermediate_size : mc.intermediate_size;
  }

  explicit MoeBlocks(const ModelConfig& s)
      : LlamaBlocks(s),
        E_(s.num_experts),
        K_(s.num_experts_per_tok),
        Ie_(expert_width(s)),
        Is_(s.shared_expert_intermediate_size) {
    ModuleSpec b;
    block_tensors(b);
    routerw_ = tensor_offset(b, "router");
    if (Is_ > 0) {
      sguw_ = tensor_offset(b, "shared_gate_proj");
      sdownw_ = tensor_offset(b, "shared_down_proj");
      sgatew_ = tensor_offset(b, "shared_expert_gate");
    }
  }

  // ---- layout ---------------------------------------------------------------------------------
  void block_tensors(ModuleSpec& b) const {
    const size_t C = s_.n_embd, Is = size_t(Is_);
    attention_tensors(b);
    add_tensor(b, "router", size_t(E_) * C, 0);
    if (Is_ > 0) {
      add_tensor(b, "shared_gate_proj", Is * C, 0);
      add_tensor(b, "shared_up_proj", Is * C, 0);
      add_tensor(b, "shared_down_proj", C * Is, 0);
      add_tensor(b, "shared_expert_gate", C, 0);
    }
  }
  int extra_modules() const { return E_; }
  std::string extra_name(int l, int e) const { return fmt::format("block.{}.expert.{}", l, e); }
  void extra_tensors(int, ModuleSpec& m) const {
    const size_t C = s_.n_embd, I = size_t(Ie_);
    add_tensor(m, "gate_proj", I * C, 0);
    add_tensor(m, "up_proj", I * C, 0);
    add_tensor(m, "down_proj", C * I, 0);
  }
  double blocks_flops(int T) const {
    const double C = s_.n_embd, L = s_.n_layer, W = qkv_width(), A = double(s_.n_head) * hs();
    // Llama's attention (2 per weight of qkv and o_proj + QK^T and AV), the router, the K
    // experts a token reaches and the shared expert with its gate: the ACTIVE weights only.
    const double moe = C * E_ + double(K_) * 3.0 * C * Ie_ + (Is_ > 0 ? 3.0 * C * Is_ + C : 0.0);
    return 2.0 * (C * W + A * C + moe) * L + 4.0 * T * A * L;
  }
  std::string describe(const ModelLayout& layout) const {
    size_t expert = 0;
    for (const ModuleSpec& m : layout.modules) {
      if (m.name.find(".expert.") != std::string::npos) expert += m.numel;
    }
    const double total = double(layout.num_params());
    const double active = total - double(expert) * (1.0 - double(K_) / E_);
    return fmt::format(
        "{} {} layers, {} heads ({} key/value), width {}, {} experts of width {} (top {}{}){}, "
        "vocab {} (padded {}), context {}, rope theta {}{}{}: {:.2f}M params ({:.2f}M active per "
        "token) in {} modules",
        s_.type == "mixtral" ? "Mixtral"
        : s_.qk_norm         ? "Qwen3-MoE"
                             : "Qwen2-MoE",
        s_.n_layer, s_.n_head, s_.num_key_value_heads, s_.n_embd, E_, Ie_, K_,
        s_.norm_topk_prob ? ", renormalized" : "",
        Is_ > 0 ? fmt::format(", shared expert {}", Is_) : std::string(), s_.vocab_size,
        s_.padded_vocab_size, s_.context, rope_.theta, s_.attention_bias ? ", qkv bias" : "",
        attention_note(), total / 1e6, active / 1e6, layout.modules.size());
  }
  std::string shape_string() const {
    return fmt::format(
               "{} L={} NH={} KVH={} C={} E={} K={} Ie={} Is={} norm_topk={} aux={} V={} Vp={} "
               "T={} "
               "tied={} qkv_bias={} eps={} theta={} llama3={} factor={} low={} high={} orig={}",
               s_.type, s_.n_layer, s_.n_head, s_.num_key_value_heads, s_.n_embd, E_, K_, Ie_, Is_,
               s_.norm_topk_prob, s_.router_aux_loss_coef, s_.vocab_size, s_.padded_vocab_size,
               s_.context, s_.tied_embeddings, s_.attention_bias, eps_, rope_.theta, rope_.llama3,
               rope_.factor, rope_.low_freq_factor, rope_.high_freq_factor,
               rope_.original_max_position) +
           attention_shape();
  }
  std::vector<HfTensor> hf_tensors(const ModuleSpec& m) const;
  // LoRA's sites: the attention's q|k|v and o_proj, and Qwen2-MoE's shared expert (gate|up,
  // down_proj, its gate): the linear layers transformers' mixtures have, which PEFT's
  // target_modules (and "all-linear") select. The routed experts are fused parameters there
  // (mlp.experts.gate_up_proj [E, 2Ie, C], mlp.experts.down_proj [E, C, Ie]), which PEFT's
  // target_parameters selects: expert e's gate|up rows are strata's gate_proj and up_proj, its
  // down_proj strata's. The router stays frozen.
  enum MoeMatmul {
    kSharedGateUp = kDown + 1,
    kSharedDown,
    kSharedGate,
    kExpertGateUp,
    kExpertDown
  };
  std::vector<LoraSite> lora_sites() const {
    std::vector<LoraSite> sites;
    for (LoraSite& site : LlamaBlocks::lora_sites()) {
      if (site.matmul == kQkv || site.matmul == kO) sites.push_back(std::move(site));
    }
    if (Is_ > 0) {
      const int C = s_.n_embd;
      sites.push_back(
          {"mlp.shared_expert.gate_proj", kSharedGateUp, C, Is_, 0, 2 * Is_, "shared_gate_proj"});
      sites.push_back(
          {"mlp.shared_expert.up_proj", kSharedGateUp, C, Is_, Is_, 2 * Is_, "shared_gate_proj"});
      sites.push_back(
          {"mlp.shared_expert.down_proj", kSharedDown, Is_, C, 0, C, "shared_down_proj"});
      sites.push_back({"mlp.shared_expert_gate", kSharedGate, C, 1, 0, 1, "shared_expert_gate"});
    }
    const int C = s_.n_embd;
    sites.push_back(
        {"mlp.experts.gate_up_proj", kExpertGateUp, C, 2 * Ie_, 0, 2 * Ie_, "gate_proj", E_});
    sites.push_back({"mlp.experts.down_proj", kExpertDown, Ie_, C, 0, C, "down_proj", E_});
    return sites;
  }

  // ---- activations ----------------------------------------------------------------------------
  // Per block (R = N*K routed rows, grouped by expert): the router's logits, each row's token
  // and weight, the experts' inputs/SwiGLU/outputs over their rows; the shared expert's.
  struct MlpActs {
    void* logits = nullptr;   // [N, E]
    int32_t* idx = nullptr;   // [R] token of each row
    float* w = nullptr;       // [R] its routing weight
    int32_t* iota = nullptr;  // [N] 0..N-1 (the shared expert's rows)
    float* sg = nullptr;      // [N] the shared expert's gate, sigmoid'ed (fp32)
    void *x = nullptr, *gu = nullptr, *act = nullptr, *y = nullptr;       // [R, C|2Ie|Ie|C]
    void *sgl = nullptr, *sgu = nullptr, *sact = nullptr, *sh = nullptr;  // [N, 1|2Is|Is|C]
  };
  struct MlpScratch {
    float *dw = nullptr, *dsg = nullptr;  // [R], [N] fp32
    void *dy = nullptr, *dact = nullptr, *dgu = nullptr, *dx = nullptr;
    void *dlogits = nullptr, *dsgl = nullptr, *dsh = nullptr, *dsact = nullptr, *dsgu = nullptr;
  };
  using LlamaBlocks::carve;
  void carve(Carver& c, const BatchDims& d, MlpActs* a) const {
    const size_t N = d.N(), R = N * K_, C = s_.n_embd, es = d.es();
    a->logits = c.take(N * E_ * es);
    a->idx = static_cast<int32_t*>(c.take(R * 4));
    a->w = c.take_f32(R);
    a->x = c.take(R * C * es);
    a->gu = c.take(R * 2 * Ie_ * es);
    a->act = c.take(R * Ie_ * es);
    a->y = c.take(R * C * es);
    if (Is_ > 0) {
      a->iota = static_cast<int32_t*>(c.take(N * 4));
      a->sg = c.take_f32(N);
      a->sgl = c.take(N * es);
      a->sgu = c.take(N * 2 * Is_ * es);
      a->sact = c.take(N * Is_ * es);
      a->sh = c.take(N * C * es);
    }
  }
  void carve(Carver& c, const BatchDims& d, MlpScratch* a) const {
    const size_t N = d.N(), R = N * K_, C = s_.n_embd, es = d.es();
    a->dw = c.take_f32(R);
    a->dy = c.take(R * C * es);
    a->dact = c.take(R * Ie_ * es);
    a->dgu = c.take(R * 2 * Ie_ * es);
    a->dx = c.take(R * C * es);
    a->dlogits = c.take(N * E_ * es);
    if (Is_ > 0) {
      a->dsg = c.take_f32(N);
      a->dsgl = c.take(N * es);
      a->dsh = c.take(N * C * es);
      a->dsact = c.take(N * Is_ * es);
      a->dsgu = c.take(N * 2 * Is_ * es);
    }
  }

  // The runner's host side: pinned staging for the routing's round trips, and each layer's
  // routing.
  struct RunnerState {
    Status error;
    Device* dev = nullptr;
    char* staging = nullptr;
    size_t staging_bytes = 0;
    std::vector<LayerRouting> layers;
    RunnerState() = default;
    RunnerState(const RunnerState&) = delete;
    RunnerState& operator=(const RunnerState&) = delete;
    ~RunnerState() {
      if (staging) dev->release_host(staging);
    }
  };
  Status prepare(const DecoderStep& st, RunnerState& rs) const {
    const size_t N = st.N();
    // Down: logits [N,E] + gate logits [N] (dt), dw [N*K] + dsg [N] (fp32). Up: idx [N*K],
    // iota [N] (int32), w [N*K], sg [N] (fp32), dlogits [N,E] + dsgl [N] (dt). Each use is
    // preceded by a synchronize of the compute stream, so one region serves them all.
    rs.staging_bytes = N * (E_ + 1) * 4 + N * (K_ + 1) * 8 + N * (K_ + 1) * 4;
    rs.dev = st.dev;
    STRATA_ASSIGN_OR_RETURN(void* h, st.dev->allocate_host(rs.staging_bytes),
                            fmt::format("{} bytes of routing staging", rs.staging_bytes));
    rs.staging = static_cast<char*>(h);
    rs.layers.assign(size_t(s_.n_layer), LayerRouting{});
    return Status::ok();
  }

  void mlp_forward(const DecoderStep& st, const void* p, const void* in, const MlpActs& a,
                   void* out) const;
  void mlp_backward(const DecoderStep& st, const void* p, float* g, const void* dout,
                    const void* in, const MlpActs& a, const MlpScratch& d, void* din) const;
  void end_forward(const DecoderStep& st, const MicroBatch& mb) const {
    if (mb.aux_loss_out) *mb.aux_loss_out = float(aux_loss(state(st)));
  }

 private:
  static RunnerState& state(const DecoderStep& st) { return *static_cast<RunnerState*>(st.state); }
  // transformers' load_balancing_loss_func over every layer's routing.
  double aux_loss(const RunnerState& rs) const {
    std::vector<double> count(size_t(E_), 0.0), psum(size_t(E_), 0.0);
    double rows = 0;
    for (const LayerRouting& r : rs.layers) {
      if (r.count.empty()) continue;
      for (int e = 0; e < E_; ++e) count[size_t(e)] += r.count[size_t(e)];
      for (int e = 0; e < E_; ++e) psum[size_t(e)] += r.psum[size_t(e)];
      rows += double(r.probs.size()) / E_;
    }
    if (rows == 0) return 0;
    double s = 0;
    for (int e = 0; e < E_; ++e) s += (count[size_t(e)] / rows) * (psum[size_t(e)] / rows);
    return s * E_;
  }
  void route(const DecoderStep& st, LayerRouting& r) const;
  // An expert's rows r0.. of the four per-row buffers (input [., C], gate|up [., 2Ie], SwiGLU
  // [., Ie], output [., C]) of the activations or of their gradients.
  struct ExpertRows {
    char *x, *gu, *act, *y;
  };
  ExpertRows expert_rows(void* x, void* gu, void* act, void* y, int r0, size_t es) const {
    const size_t C = size_t(s_.n_embd), I = size_t(Ie_), o = size_t(r0) * es;
    auto at = [o](void* b, size_t w) { return static_cast<char*>(b) + o * w; };
    return {at(x, C), at(gu, 2 * I), at(act, I), at(y, C)};
  }
  const char* expert_param(const DecoderStep& st, int e, size_t at) const {
    return static_cast<const char*>(st.extra_params[size_t(e)]) + at * st.es();
  }

  int E_, K_, Ie_, Is_;
  size_t routerw_ = 0, sguw_ = 0, sdownw_ = 0, sgatew_ = 0;
};

// The top-K of each token's probabilities, the routing weights, each expert's rows.
void MoeBlocks::route(const DecoderStep& st, LayerRouting& r) const {
  const size_t N = st.N();
  RunnerState& rs = state(st);
  std::vector<float> logits(N * E_);
  convert(rs.staging, st.dt, logits.data(), DType::kF32, N * E_);
  r.probs.resize(N * E_);
  r.expert.resize(N * K_);
  r.row.resize(N * K_);
  r.count.assign(size_t(E_), 0.0);
  r.psum.assign(size_t(E_), 0.0);
  std::vector<float> weight(N * K_);
  std::vector<int> order(static_cast<size_t>(E_));
  for (size_t t = 0; t < N; ++t) {
    const float* z = &logits[t * E_];
    float* p = &r.probs[t * E_];
    const float mx = *std::max_element(z, z + E_);
    float sum = 0;
    for (int e = 0; e < E_; ++e) sum += p[e] = std::exp(z[e] - mx);
    for (int e = 0; e < E_; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [p](int x, int y) { return p[x] > p[y]; });
    float top = 0;
    for (int j = 0; j < K_; ++j) top += p[order[size_t(j)]];
    for (int j = 0; j < K_; ++j) {
      const int e = order[size_t(j)];
      r.expert[t * K_ + j] = e;
      weight[t * K_ + j] = s_.norm_topk_prob ? p[e] / top : p[e];
      r.count[size_t(e)] += 1;
    }
    for (int e = 0; e < E_; ++e) r.psum[size_t(e)] += p[e];
  }
  // Rows grouped by expert, tokens in order within an expert.
  r.offsets.assign(size_t(E_) + 1, 0);
  for (int e : r.expert) ++r.offsets[size_t(e) + 1];
  for (int e = 0; e < E_; ++e) r.offsets[size_t(e) + 1] += r.offsets[size_t(e)];
  std::vector<int> next(r.offsets.begin(), r.offsets.end() - 1);
  auto* idx = reinterpret_cast<int32_t*>(rs.staging);
  auto* w = reinterpret_cast<float*>(idx + N * K_);
  for (size_t t = 0; t < N; ++t) {
    for (int j = 0; j < K_; ++j) {
      const int row = next[size_t(r.expert[t * K_ + j])]++;
      r.row[t * K_ + j] = row;
      idx[row] = int32_t(t);
      w[row] = weight[t * K_ + j];
    }
  }
}

void MoeBlocks::mlp_forward(const DecoderStep& st, const void* p, const void* in, const MlpActs& a,
                            void* out) const {
  Kernels& k = *st.k;
  Stream& s = *st.s;
  Device& dev = *st.dev;
  RunnerState& rs = state(st);
  const int N = int(st.N()), C = s_.n_embd;
  const size_t es = st.es(), R = size_t(N) * K_;
  LayerRouting& r = rs.layers[size_t(st.layer)];
  // The router (and the shared expert's gate) on the device; the top-K on the host.
  k.matmul_forward(s, st.dt, a.logits, in, param(p, st, routerw_), nullptr, N, C, E_);
  dev.copy_d2h(s, rs.staging, a.logits, size_t(N) * E_ * es);
  if (Is_ > 0) {
    k.matmul_forward(s, st.dt, a.sgl, in, param(p, st, sgatew_), nullptr, N, C, 1);
    st.lora_forward(kSharedGate, in, a.sgl);
    dev.copy_d2h(s, rs.staging + size_t(N) * E_ * es, a.sgl, size_t(N) * es);
  }
  if (Status e = dev.synchronize(s); !e.is_ok()) {
    if (rs.error.is_ok()) rs.error = e.with_context(fmt::format("routing block {}", st.layer));
    return;
  }
  std::vector<float> gl;
  if (Is_ > 0) {
    gl.resize(size_t(N));
    convert(rs.staging + size_t(N) * E_ * es, st.dt, gl.data(), DType::kF32, size_t(N));
  }
  route(st, r);
  auto* idx = reinterpret_cast<int32_t*>(rs.staging);
  auto* w = reinterpret_cast<float*>(idx + R);
  dev.copy_h2d(s, a.idx, idx, R * 4);
  dev.copy_h2d(s, a.w, w, R * 4);
  if (Is_ > 0) {
    auto* iota = reinterpret_cast<int32_t*>(w + R);
    auto* sg = reinterpret_cast<float*>(iota + N);
    r.gate.resize(size_t(N));
    for (int t = 0; t < N; ++t) {
      iota[t] = t;
      sg[t] = r.gate[size_t(t)] = 1.0f / (1.0f + std::exp(-gl[size_t(t)]));
    }
    dev.copy_h2d(s, a.iota, iota, size_t(N) * 4);
    dev.copy_h2d(s, a.sg, sg, size_t(N) * 4);
  }
  st.zero(out, size_t(N) * C * es);
  if (st.lora) lora_experts_prepare(st, *st.lora);
  for (int e = 0; e < E_; ++e) {
    const int r0 = r.offsets[size_t(e)], n = r.offsets[size_t(e) + 1] - r0;
    if (n == 0) continue;  // acquired and released like the others; nothing to compute
    const auto [x, gu, act, y] = expert_rows(a.x, a.gu, a.act, a.y, r0, es);
    k.gather_rows(s, st.dt, x, in, a.idx + r0, nullptr, n, C);
    k.matmul_forward(s, st.dt, gu, x, expert_param(st, e, 0), nullptr, n, C, 2 * Ie_);
    if (st.lora) lora_expert_forward(st, *st.lora, kExpertGateUp, e, n, x, gu);
    k.swiglu_forward(s, st.dt, act, gu, n, Ie_);
    k.matmul_forward(s, st.dt, y, act, expert_param(st, e, 2 * size_t(Ie_) * C), nullptr, n, Ie_,
                     C);
    if (st.lora) lora_expert_forward(st, *st.lora, kExpertDown, e, n, act, y);
    k.scatter_add_rows(s, st.dt, out, y, a.idx + r0, a.w + r0, n, C);
  }
  if (Is_ > 0) {
    k.matmul_forward(s, st.dt, a.sgu, in, param(p, st, sguw_), nullptr, N, C, 2 * Is_);
    st.lora_forward(kSharedGateUp, in, a.sgu);
    k.swiglu_forward(s, st.dt, a.sact, a.sgu, N, Is_);
    k.matmul_forward(s, st.dt, a.sh, a.sact, param(p, st, sdownw_), nullptr, N, Is_, C);
    st.lora_forward(kSharedDown, a.sact, a.sh);
    k.scatter_add_rows(s, st.dt, out, a.sh, a.iota, a.sg, N, C);
  }
}

void MoeBlocks::mlp_backward(const DecoderStep& st, const void* p, float* g, const void* dout,
                             const void* in, const MlpActs& a, const MlpScratch& d,
                             void* din) const {
  Kernels& k = *st.k;
  Stream& s = *st.s;
  Device& dev = *st.dev;
  RunnerState& rs = state(st);
  const int N = int(st.N()), C = s_.n_embd;
  const size_t es = st.es(), R = size_t(N) * K_;
  const LayerRouting& r = rs.layers[size_t(st.layer)];
  st.zero(din, size_t(N) * C * es);
  if (st.lora) lora_experts_prepare(st, *st.lora);
  for (int e = 0; e < E_; ++e) {
    const int r0 = r.offsets[size_t(e)], n = r.offsets[size_t(e) + 1] - r0;
    if (n == 0) continue;  // its gradient stays the zeros it was acquired as
    const auto [x, gu, act, y] = expert_rows(a.x, a.gu, a.act, a.y, r0, es);
    const auto [dx, dgu, dact, dy] = expert_rows(d.dx, d.dgu, d.dact, d.dy, r0, es);
    float* ge = st.extra_grads[size_t(e)];
    // out += w * y: dw = dout . y, dy = w * dout.
    k.row_dots(s, st.dt, d.dw + r0, dout, a.idx + r0, y, n, C);
    k.gather_rows(s, st.dt, dy, dout, a.idx + r0, a.w + r0, n, C);
    k.matmul_backward(s, st.dt, dact, st.wgrad(ge, 2 * size_t(Ie_) * C), nullptr, dy, act,
                      expert_param(st, e, 2 * size_t(Ie_) * C), n, Ie_, C, /*accumulate=*/false);
    if (st.lora) lora_expert_backward(st, *st.lora, kExpertDown, e, n, act, dy, dact);
    k.swiglu_backward(s, st.dt, dgu, gu, dact, n, Ie_);  // dgu written
    k.matmul_backward(s, st.dt, dx, st.wgrad(ge, 0), nullptr, dgu, x, expert_param(st, e, 0), n, C,
                      2 * Ie_, /*accumulate=*/false);
    if (st.lora) lora_expert_backward(st, *st.lora, kExpertGateUp, e, n, x, dgu, dx);
    k.scatter_add_rows(s, st.dt, din, dx, a.idx + r0, nullptr, n, C);
  }
  if (st.lora) lora_experts_finish(st, *st.lora);
  if (Is_ > 0) {
    // out += sg * sh: dsg = dout . sh, dsh = sg * dout.
    k.row_dots(s, st.dt, d.dsg, dout, a.iota, a.sh, N, C);
    k.gather_rows(s, st.dt, d.dsh, dout, a.iota, a.sg, N, C);
    k.matmul_backward(s, st.dt, d.dsact, st.wgrad(g, sdownw_), nullptr, d.dsh, a.sact,
                      param(p, st, sdownw_), N, Is_, C, /*accumulate=*/false);
    st.lora_backward(kSharedDown, a.sact, d.dsh, d.dsact);
    k.swiglu_backward(s, st.dt, d.dsgu, a.sgu, d.dsact, N, Is_);  // dsgu written
    k.matmul_backward(s, st.dt, din, st.wgrad(g, sguw_), nullptr, d.dsgu, in, param(p, st, sguw_),
                      N, C, 2 * Is_, /*accumulate=*/true);
    st.lora_backward(kSharedGateUp, in, d.dsgu, din);
  }
  // The routing weights' gradients come to the host, which returns the router logits'.
  float* dw = reinterpret_cast<float*>(rs.staging);
  float* dsg = dw + R;
  dev.copy_d2h(s, dw, d.dw, R * 4);
  if (Is_ > 0) dev.copy_d2h(s, dsg, d.dsg, size_t(N) * 4);
  if (Status e = dev.synchronize(s); !e.is_ok()) {
    if (rs.error.is_ok()) rs.error = e.with_context(fmt::format("routing block {}", st.layer));
    return;
  }
  // d aux / d p[t,e] = E * count_e / (L N)^2 (counts over every layer); the micro-batch's aux
  // weighs router_aux_loss_coef * (its tokens' share of the step's loss scale: dloss * N).
  std::vector<double> count(size_t(E_), 0.0);
  double rows = 0;
  for (const LayerRouting& lr : rs.layers) {
    if (lr.count.empty()) continue;
    for (int e = 0; e < E_; ++e) count[size_t(e)] += lr.count[size_t(e)];
    rows += double(lr.probs.size()) / E_;
  }
  const double aux_scale = s_.router_aux_loss_coef * double(st.dloss) * N * E_ / (rows * rows);
  std::vector<float> dlogits(size_t(N) * E_), dsgl(Is_ > 0 ? size_t(N) : 0);
  std::vector<double> dp(static_cast<size_t>(E_));
  for (int t = 0; t < N; ++t) {
    const float* pt = &r.probs[size_t(t) * E_];
    for (int e = 0; e < E_; ++e) dp[size_t(e)] = aux_scale * count[size_t(e)];
    const int* ex = &r.expert[size_t(t) * K_];
    const int* rw = &r.row[size_t(t) * K_];
    if (s_.norm_topk_prob) {
      // w_j = p_j / S over the K picks: dp_j += (dw_j - sum_i dw_i w_i) / S.
      double S = 0, dot = 0;
      for (int j = 0; j < K_; ++j) S += pt[ex[j]];
      for (int j = 0; j < K_; ++j) dot += double(dw[rw[j]]) * pt[ex[j]] / S;
      for (int j = 0; j < K_; ++j) dp[size_t(ex[j])] += (double(dw[rw[j]]) - dot) / S;
    } else {
      for (int j = 0; j < K_; ++j) dp[size_t(ex[j])] += dw[rw[j]];
    }
    double pdp = 0;
    for (int e = 0; e < E_; ++e) pdp += pt[e] * dp[size_t(e)];
    for (int e = 0; e < E_; ++e) dlogits[size_t(t) * E_ + e] = float(pt[e] * (dp[size_t(e)] - pdp));
    if (Is_ > 0) {
      const float sg = r.gate[size_t(t)];
      dsgl[size_t(t)] = dsg[t] * sg * (1.0f - sg);
    }
  }
  char* up = rs.staging;
  convert(dlogits.data(), DType::kF32, up, st.dt, dlogits.size());
  dev.copy_h2d(s, d.dlogits, up, dlogits.size() * es);
  k.matmul_backward(s, st.dt, din, st.wgrad(g, routerw_), nullptr, d.dlogits, in,
                    param(p, st, routerw_), N, C, E_, /*accumulate=*/true);
  if (Is_ > 0) {
    char* up2 = up + dlogits.size() * es;
    convert(dsgl.data(), DType::kF32, up2, st.dt, dsgl.size());
    dev.copy_h2d(s, d.dsgl, up2, dsgl.size() * es);
    k.matmul_backward(s, st.dt, din, st.wgrad(g, sgatew_), nullptr, d.dsgl, in,
                      param(p, st, sgatew_), N, C, 1, /*accumulate=*/true);
    st.lora_backward(kSharedGate, in, d.dsgl, din);
  }
}

std::vector<HfTensor> MoeBlocks::hf_tensors(const ModuleSpec& m) const {
  const int64_t C = s_.n_embd, Ie = Ie_, Is = Is_;
  const bool mixtral = s_.type == "mixtral";
  std::vector<HfTensor> out;
  // "block.<l>" or "block.<l>.expert.<e>".
  std::string layer, expert;
  if (m.name.rfind("block.", 0) == 0) {
    layer = m.name.substr(6);
    const size_t dot = layer.find(".expert.");
    if (dot != std::string::npos) {
      expert = layer.substr(dot + 8);
      layer = layer.substr(0, dot);
    }
  }
  const std::string block = layer.empty() ? std::string() : "model.layers." + layer + ".";
  const std::string moe = block + (mixtral ? "block_sparse_moe." : "mlp.");
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const std::string& n = m.tensors[i].name;
    HfTensor h;
    h.tensor = int(i);
    if (!expert.empty()) {
      const std::string pre = moe + "experts." + expert + ".";
      if (n == "gate_proj" || n == "up_proj") {
        h.name = pre + (mixtral ? (n == "gate_proj" ? "w1" : "w3") : n) + ".weight";
        h.shape = {Ie, C};
      } else {
        h.name = pre + (mixtral ? "w2" : "down_proj") + ".weight", h.shape = {C, Ie};
      }
    } else if (n == "router") {
      h.name = moe + "gate.weight", h.shape = {E_, C};
    } else if (n == "shared_gate_proj" || n == "shared_up_proj") {
      h.name = moe + "shared_expert." + n.substr(7) + ".weight", h.shape = {Is, C};
    } else if (n == "shared_down_proj") {
      h.name = moe + "shared_expert.down_proj.weight", h.shape = {C, Is};
    } else if (n == "shared_expert_gate") {
      h.name = moe + "shared_expert_gate.weight", h.shape = {1, C};
    } else {
      STRATA_CHECK(hf_tensor(block, n, &h), "mixture tensor without a Hugging Face name");
    }
    out.push_back(std::move(h));
  }
  return out;
}

class MixtralBlocks final : public MoeBlocks {
 public:
  static constexpr const char* kType = "mixtral";
  static constexpr uint64_t kInitStream = 0x3131a;
  static Status check(const ModelConfig& mc) {
    STRATA_RETURN_IF_ERROR(check_moe(mc), "");
    if (mc.shared_expert_intermediate_size != 0) {
      return invalid_argument(
          "model.shared_expert_intermediate_size: mixtral has no shared expert (qwen2_moe has); "
          "set it to 0");
    }
    if (!mc.norm_topk_prob) {
      return invalid_argument(
          "model.norm_topk_prob: mixtral always renormalizes its top-k weights; set it to true "
          "(or use qwen2_moe)");
    }
    return Status::ok();
  }
  using MoeBlocks::MoeBlocks;
};

class Qwen2MoeBlocks final : public MoeBlocks {
 public:
  static constexpr const char* kType = "qwen2_moe";
  static constexpr uint64_t kInitStream = 0x3232a;
  static Status check(const ModelConfig& mc) { return check_moe(mc); }
  using MoeBlocks::MoeBlocks;
};

}  // namespace

Result<std::unique_ptr<Architecture>> create_moe(const ModelConfig& config) {
  if (config.type == "mixtral") return DecoderArchitecture<MixtralBlocks>::create(config);
  return DecoderArchitecture<Qwen2MoeBlocks>::create(config);
}

namespace {

// A mixture's config.json: Llama's keys, then Mixtral's num_local_experts (its experts' width is
// intermediate_size; its top-k always renormalized) or Qwen2-MoE's num_experts,
// moe_intermediate_size, shared expert and norm_topk_prob (every layer sparse).
Status moe_hf_read(const HfConfigIn& in, const std::string& arch, ModelConfig* m,
                   HfShapeExtras* extras) {
  STRATA_RETURN_IF_ERROR(llama_hf_read(in, arch, m, extras), "");
  const nlohmann::json& c = in.json();
  const bool mixtral = arch == "MixtralForCausalLM", qwen3 = arch == "Qwen3MoeForCausalLM";
  m->type = mixtral ? "mixtral" : "qwen2_moe";
  // Qwen3-MoE's checkpoints say num_experts; transformers 5 writes num_local_experts for it.
  const char* experts =
      mixtral || (qwen3 && !in.has("num_experts")) ? "num_local_experts" : "num_experts";
  STRATA_RETURN_IF_ERROR(in.get_int(experts, -1, &m->num_experts), "");
  STRATA_RETURN_IF_ERROR(in.get_int("num_experts_per_tok", 2, &m->num_experts_per_tok), "");
  const char* coef = "router_aux_loss_coef";
  if (in.has(coef)) {
    if (!c[coef].is_number() || !(c[coef].get<double>() >= 0)) {
      return in.bad(coef, fmt::format("{} is not a number >= 0", c[coef].dump()));
    }
    m->router_aux_loss_coef = c[coef].get<double>();
  }
  if (mixtral) {
    m->norm_topk_prob = true;
    if (c.contains("router_jitter_noise") && c["router_jitter_noise"].is_number() &&
        c["router_jitter_noise"].get<double>() != 0.0) {
      return in.bad("router_jitter_noise",
                    fmt::format("{}: strata's router does not jitter its input; set it to 0",
                                c["router_jitter_noise"].dump()));
    }
    return Status::ok();
  }
  if (!qwen3) {
    m->attention_bias = true;  // qkv_bias, true unless said otherwise
    STRATA_RETURN_IF_ERROR(in.get_bool("qkv_bias", true, &m->attention_bias), "");
  }
  STRATA_RETURN_IF_ERROR(in.get_int("moe_intermediate_size", -1, &m->moe_intermediate_size), "");
  if (!qwen3 && c.contains("shared_expert_intermediate_size") &&
      c["shared_expert_intermediate_size"] != 0) {
    STRATA_RETURN_IF_ERROR(
        in.get_int("shared_expert_intermediate_size", 0, &m->shared_expert_intermediate_size), "");
  }
  STRATA_RETURN_IF_ERROR(in.get_bool("norm_topk_prob", false, &m->norm_topk_prob), "");
  int step = 1;
  STRATA_RETURN_IF_ERROR(in.get_int("decoder_sparse_step", 1, &step), "");
  if (step != 1 || (c.contains("mlp_only_layers") && c["mlp_only_layers"].is_array() &&
                    !c["mlp_only_layers"].empty())) {
    return in.bad(step != 1 ? "decoder_sparse_step" : "mlp_only_layers",
                  "strata's qwen2_moe has a mixture in every layer (decoder_sparse_step 1, no "
                  "mlp_only_layers)");
  }
  return Status::ok();
}

void moe_hf_write(const ModelConfig& m, nlohmann::json* out) {
  nlohmann::json& c = *out;
  const bool mixtral = m.type == "mixtral", qwen3 = !mixtral && m.qk_norm;
  c["architectures"] = {mixtral ? "MixtralForCausalLM"
                        : qwen3 ? "Qwen3MoeForCausalLM"
                                : "Qwen2MoeForCausalLM"};
  c["model_type"] = mixtral ? "mixtral" : qwen3 ? "qwen3_moe" : "qwen2_moe";
  llama_hf_write(m, out);
  c["num_experts_per_tok"] = m.num_experts_per_tok;
  c["router_aux_loss_coef"] = m.router_aux_loss_coef;
  c["output_router_logits"] = false;
  const int expert_width =
      m.moe_intermediate_size > 0 ? m.moe_intermediate_size : m.intermediate_size;
  if (mixtral) {
    c["num_local_experts"] = m.num_experts;
    c["intermediate_size"] = expert_width;
    c["router_jitter_noise"] = 0.0;
    c["sliding_window"] = nullptr;
    return;
  }
  c["num_experts"] = m.num_experts;
  c["moe_intermediate_size"] = expert_width;
  c["norm_topk_prob"] = m.norm_topk_prob;
  if (qwen3) {
    c.erase("num_local_experts");  // transformers 5's spelling of num_experts, if the base had it
    c["attention_bias"] = m.attention_bias;
  } else {
    c["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
    c["qkv_bias"] = m.attention_bias;
  }
  c["decoder_sparse_step"] = 1;
  c["mlp_only_layers"] = nlohmann::json::array();
  c["use_sliding_window"] = false;
  c["sliding_window"] = nullptr;
}

// Llama's keys, and the mixture's: Mixtral counts its experts in num_local_experts.
std::string moe_hf_key(const std::string& type, const std::string& strata_key) {
  if (strata_key == "model.num_experts") {
    return type == "mixtral" ? "num_local_experts" : "num_experts";
  }
  for (const char* k : {"num_experts_per_tok", "moe_intermediate_size",
                        "shared_expert_intermediate_size", "router_aux_loss_coef"}) {
    if (strata_key == std::string("model.") + k) return k;
  }
  return llama_hf_key(strata_key);
}

}  // namespace

namespace {

// A mixture's family: Llama's block with experts, read and written by moe_hf_read/write.
ModelFamily moe_family(const char* type, std::vector<std::string> hf_architectures) {
  return {
      .types = {type},
      .hf_architectures = std::move(hf_architectures),
      .create = create_moe,
      .lora_default_targets = {"q_proj", "v_proj"},
      .hf_read = moe_hf_read,
      .hf_write = moe_hf_write,
      .hf_key = moe_hf_key,
      .hf_embedding = "model.embed_tokens.weight",
  };
}

}  // namespace

const ModelFamily& mixtral_family() {
  static const ModelFamily kFamily = moe_family("mixtral", {"MixtralForCausalLM"});
  return kFamily;
}

const ModelFamily& qwen2_moe_family() {
  // Qwen3-MoE: Qwen2-MoE's mixture without the shared expert, Qwen3's attention (qk_norm).
  static const ModelFamily kFamily =
      moe_family("qwen2_moe", {"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"});
  return kFamily;
}

}  // namespace strata
