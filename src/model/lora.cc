#include "src/model/lora.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <regex>

#include "src/model/decoder.h"
#include "src/model/family.h"

namespace strata {

std::vector<std::string> lora_default_targets(const std::string& type) {
  const ModelFamily* family = family_for_type(type);
  return family ? family->lora_default_targets : std::vector<std::string>{};
}

namespace {

bool site_matches(const std::string& site, const std::string& target) {
  if (site == target) return true;
  return site.size() > target.size() && site[site.size() - target.size() - 1] == '.' &&
         site.compare(site.size() - target.size(), target.size(), target) == 0;
}

}  // namespace

namespace {

std::string joined_names(const std::vector<LoraSite>& sites, const std::string& prefix) {
  std::string names;
  for (const LoraSite& s : sites) names += (names.empty() ? "" : ", ") + prefix + s.name;
  return names;
}

// Which of `sites` lora.target_modules selects (PEFT's check_target_module_exists).
Result<std::vector<bool>> select_sites(const LoraConfig& lora, const std::string& type,
                                       const std::vector<LoraSite>& sites,
                                       const std::vector<std::string>& prefixes) {
  std::vector<bool> chosen(sites.size(), false);
  // PEFT's target_modules=[] beside target_parameters: the experts alone.
  if (lora.target_modules_none && !lora.target_parameters.empty()) return chosen;
  if (lora.target_pattern == "all-linear") {
    chosen.assign(sites.size(), true);  // the output head is no block's site
    return chosen;
  }
  if (!lora.target_pattern.empty()) {
    std::regex re;
    try {
      re = std::regex(lora.target_pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return invalid_argument(
          fmt::format("lora.target_modules: \"{}\" is not a valid regular expression ({})",
                      lora.target_pattern, e.what()));
    }
    bool any = false;
    for (size_t l = 0; l < prefixes.size(); ++l) {
      for (size_t i = 0; i < sites.size(); ++i) {
        const bool m = std::regex_match(prefixes[l] + sites[i].name, re);
        if (l == 0) chosen[i] = m;
        any |= m;
        if (m != chosen[i]) {
          return invalid_argument(fmt::format(
              "lora.target_modules: \"{}\" matches {} but not {} (or the reverse): strata "
              "adapts the same linear layers in every block; give a pattern that selects the "
              "same layers in each",
              lora.target_pattern, prefixes[0] + sites[i].name, prefixes[l] + sites[i].name));
        }
      }
    }
    if (!any) {
      return invalid_argument(fmt::format(
          "lora.target_modules: the pattern \"{}\" matches no linear layer of this {} model (a "
          "string is a regular expression matched against a layer's whole name, as PEFT's "
          "re.fullmatch, or \"all-linear\"; give a list such as [\"q_proj\"] for names); its "
          "first block's linear layers are {}",
          lora.target_pattern, type, joined_names(sites, prefixes.empty() ? "" : prefixes[0])));
    }
    return chosen;
  }
  const std::vector<std::string> targets =
      lora.target_modules.empty() ? lora_default_targets(type) : lora.target_modules;
  for (const std::string& t : targets) {
    bool any = false;
    for (size_t i = 0; i < sites.size(); ++i) {
      if (site_matches(sites[i].name, t)) chosen[i] = any = true;
    }
    if (!any) {
      return invalid_argument(fmt::format(
          "lora.target_modules: \"{}\" is not a linear layer of this {} model; its blocks' "
          "linear layers are {}",
          t, type, joined_names(sites, "")));
    }
  }
  return chosen;
}

// Which of the expert parameters `params` lora.target_parameters selects (PEFT matches a
// parameter's full name, or its end after a ".").
Result<std::vector<bool>> select_parameters(const LoraConfig& lora, const std::string& type,
                                            const std::vector<LoraSite>& params) {
  std::vector<bool> chosen(params.size(), false);
  if (lora.target_parameters.empty()) return chosen;
  if (params.empty()) {
    return invalid_argument(fmt::format(
        "lora.target_parameters: a {} model has no fused expert parameters (target_parameters "
        "reaches the routed experts of mixtral and qwen2_moe); adapt its linear layers with "
        "lora.target_modules and remove lora.target_parameters",
        type));
  }
  if (lora.dropout != 0) {
    return invalid_argument(fmt::format(
        "lora.lora_dropout {:g} with lora.target_parameters: an expert parameter's adapter is "
        "added to its weight, where no dropout of the input can act (PEFT refuses it too); set "
        "lora.lora_dropout to 0 or remove lora.target_parameters",
        lora.dropout));
  }
  for (const std::string& t : lora.target_parameters) {
    bool any = false;
    for (size_t i = 0; i < params.size(); ++i) {
      if (site_matches(params[i].name, t)) chosen[i] = any = true;
    }
    if (!any) {
      return invalid_argument(fmt::format(
          "lora.target_parameters: \"{}\" is not an expert parameter of this {} model; its "
          "blocks' are {}",
          t, type, joined_names(params, "")));
    }
  }
  return chosen;
}

}  // namespace

Result<LoraLayout> lora_layout(const LoraConfig& lora, const std::string& type,
                               const std::vector<LoraSite>& all_sites,
                               const std::vector<std::string>& block_prefixes) {
  LoraLayout out;
  if (!lora.enabled) return out;
  std::vector<LoraSite> sites, params;
  for (const LoraSite& s : all_sites) (s.experts > 0 ? params : sites).push_back(s);
  if (sites.empty()) {
    return invalid_argument(fmt::format(
        "lora: adapters on a {} model are not supported (its blocks have no adapter sites); "
        "remove the lora section",
        type));
  }
  if (lora.r < 1) {
    return invalid_argument(fmt::format("lora.r: {} must be >= 1", lora.r));
  }
  // The adapters' update is multiplied by lora_alpha / r (/ sqrt(r) with use_rslora): 0 learns
  // nothing, and past kMaxLoraScaling one step moves the model by that many times the learning
  // rate (it trains a dead model without a word).
  const double scaling = lora.scaling();
  if (!(scaling > 0) || !(scaling <= kMaxLoraScaling)) {
    return invalid_argument(fmt::format(
        "lora.lora_alpha {:g} / {} = scaling {:g}: the adapters' update is multiplied by it, so "
        "it must be in (0, {:g}]; PEFT's usual lora_alpha is r to 2r (scaling 1 to 2)",
        lora.alpha,
        lora.use_rslora ? fmt::format("sqrt(lora.r {})", lora.r) : fmt::format("lora.r {}", lora.r),
        scaling, kMaxLoraScaling));
  }
  if (!(lora.dropout >= 0 && lora.dropout < 1)) {
    return invalid_argument(fmt::format("lora.lora_dropout: {} must be in [0, 1)", lora.dropout));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<bool> chosen, select_sites(lora, type, sites, block_prefixes),
                          "");
  STRATA_ASSIGN_OR_RETURN(std::vector<bool> chosen_params, select_parameters(lora, type, params),
                          "");
  out.r = lora.r;
  out.scaling = lora.scaling();
  out.dropout = float(lora.dropout);
  out.all_sites = true;
  for (size_t i = 0; i < sites.size(); ++i) {
    out.all_sites = out.all_sites && chosen[i];
    if (!chosen[i]) continue;
    LoraLayout::Target t;
    t.site = sites[i];
    t.a = out.numel;
    out.numel += size_t(lora.r) * size_t(t.site.in);
    t.b = out.numel;
    out.numel += size_t(t.site.out) * size_t(lora.r);
    out.max_width = std::max(out.max_width, t.site.width);
    out.max_in = std::max(out.max_in, t.site.in);
    out.targets.push_back(std::move(t));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!chosen_params[i]) continue;
    LoraLayout::Target t;
    t.site = params[i];
    const size_t E = size_t(t.site.experts), r = size_t(lora.r);
    STRATA_CHECK(out.experts.empty() || out.experts[0].site.experts == t.site.experts,
                 "expert parameters of one block with different expert counts");
    t.a = out.numel;
    out.numel += E * r * size_t(t.site.in);
    t.b = out.numel;
    out.numel += size_t(t.site.out) * r * E;
    out.expert_b += size_t(t.site.out) * r * E;
    out.max_width = std::max(out.max_width, t.site.out);
    out.experts.push_back(std::move(t));
  }
  if (!out.experts.empty()) {
    const size_t E = size_t(out.experts[0].site.experts);
    out.eye.assign(E * E, 0.0f);
    for (size_t e = 0; e < E; ++e) out.eye[e * E + e] = 1.0f;
  }
  return out;
}

Status lora_check_backend(const LoraLayout& layout, const Kernels& kernels) {
  if (layout.empty() || layout.dropout == 0 || kernels.supports(KernelOp::kDropout, {}).supported) {
    return Status::ok();
  }
  return unavailable(fmt::format(
      "lora.lora_dropout: {:g} needs the dropout op, which this device's backend does not have "
      "(the CPU and CUDA backends have it); set lora.lora_dropout to 0 on this device, or train "
      "on the CPU backend",
      layout.dropout));
}

uint64_t lora_dropout_key(uint64_t micro_key, int layer, int target) {
  return dropout_mix(dropout_mix(micro_key + uint64_t(uint32_t(layer))) +
                     uint64_t(uint32_t(target)));
}

void lora_tensors(const LoraLayout& layout, ModuleSpec& m) {
  for (const LoraLayout::Target& t : layout.targets) {
    // PEFT: kaiming_uniform_(A, a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / in).
    const float bound = 1.0f / std::sqrt(float(t.site.in));
    m.tensors.push_back(
        {t.site.name + ".lora_A", t.a, size_t(layout.r) * size_t(t.site.in), kInitUniform, bound});
    m.tensors.push_back(
        {t.site.name + ".lora_B", t.b, size_t(t.site.out) * size_t(layout.r), kInitZeros, 0.0f});
  }
  for (const LoraLayout::Target& t : layout.experts) {
    // ParamWrapper's lora_A is an nn.Linear(in, r * E): the same kaiming_uniform_ bound.
    const size_t rE = size_t(layout.r) * size_t(t.site.experts);
    const float bound = 1.0f / std::sqrt(float(t.site.in));
    m.tensors.push_back(
        {t.site.name + ".lora_A", t.a, rE * size_t(t.site.in), kInitUniform, bound});
    m.tensors.push_back({t.site.name + ".lora_B", t.b, size_t(t.site.out) * rE, kInitZeros, 0.0f});
  }
  m.numel = layout.numel;
}

Result<BaseQuantKind> lora_base_quant_kind(const LoraConfig& lora, const std::string& type,
                                           const LoraLayout& layout,
                                           const std::vector<LoraSite>& sites) {
  STRATA_ASSIGN_OR_RETURN(BaseQuantKind kind, parse_base_quantization(lora.base_quantization), "");
  if (kind == BaseQuantKind::kNone) return kind;
  if (layout.empty()) {
    return invalid_argument(fmt::format(
        "lora.base_quantization: {} quantizes a frozen LoRA base, but the model has no adapters; "
        "configure the lora section's adapters or set lora.base_quantization to none",
        lora.base_quantization));
  }
  if (sites.empty()) {
    return invalid_argument(fmt::format(
        "lora.base_quantization: {} is not implemented for model.type {} (its blocks list no "
        "linear layers to quantize); set it to none",
        lora.base_quantization, type));
  }
  return kind;
}

BaseQuant lora_base_quant(BaseQuantKind kind, const ModuleSpec& block,
                          const std::vector<LoraSite>& sites) {
  std::vector<QuantWeight> weights;
  std::vector<int> seen;
  for (const LoraSite& s : sites) {
    // The experts' weights live in their own modules, which stay in the model dtype.
    if (s.experts > 0 || std::find(seen.begin(), seen.end(), s.matmul) != seen.end()) continue;
    seen.push_back(s.matmul);
    weights.push_back({tensor_offset(block, s.weight), size_t(s.width), size_t(s.in)});
  }
  return base_quant_layout(kind, block.numel, std::move(weights));
}

std::string lora_describe(const LoraLayout& L, int n_layer) {
  if (L.empty()) return "";
  std::string names;
  for (const LoraLayout::Target& t : L.targets) names += (names.empty() ? "" : ",") + t.site.name;
  for (const LoraLayout::Target& t : L.experts) {
    names +=
        fmt::format("{}{} (x{} experts)", names.empty() ? "" : ",", t.site.name, t.site.experts);
  }
  return fmt::format("; frozen, with LoRA r={} alpha/r={:g} on {}: {:.3f}M trainable", L.r,
                     L.scaling, names, double(L.numel) * n_layer / 1e6);
}

std::string lora_shape_string(const LoraLayout& L) {
  if (L.empty()) return "";
  std::string s = fmt::format(" lora r={} scaling={}", L.r, L.scaling);
  for (const LoraLayout::Target& t : L.targets) s += " " + t.site.name;
  for (const LoraLayout::Target& t : L.experts) s += " " + t.site.name;
  return s;
}

std::vector<HfTensor> lora_hf_tensors(const LoraLayout& L, const std::string& prefix) {
  std::vector<HfTensor> out;
  int i = 0;
  for (const LoraLayout::Target& t : L.targets) {
    const std::string base = "base_model.model." + prefix + t.site.name;
    out.push_back({base + ".lora_A.weight", "", i++, {L.r, t.site.in}});
    out.push_back({base + ".lora_B.weight", "", i++, {t.site.out, L.r}});
  }
  for (size_t j = 0; j < L.experts.size(); ++j) {
    // PEFT wraps the experts' module once per targeted parameter, in its parameter order: the
    // ones after this on the same module sit outside it, each adding a "base_layer.".
    const LoraSite& site = L.experts[j].site;
    const std::string module = site.name.substr(0, site.name.rfind('.'));
    std::string path = "base_model.model." + prefix + module + ".";
    for (size_t k = j + 1; k < L.experts.size(); ++k) {
      const std::string& n = L.experts[k].site.name;
      if (n.substr(0, n.rfind('.')) == module) path += "base_layer.";
    }
    const int64_t rE = int64_t(L.r) * site.experts;
    out.push_back({path + "lora_A.weight", "", i++, {rE, site.in}});
    out.push_back({path + "lora_B.weight", "", i++, {site.out, rE}});
  }
  return out;
}

void lora_merge(const LoraLayout& L, const ModuleSpec& block, const float* adapter, float* w) {
  const size_t r = size_t(L.r);
  for (const LoraLayout::Target& t : L.targets) {
    const size_t in = size_t(t.site.in);
    float* W = w + tensor_offset(block, t.site.weight) + size_t(t.site.col0) * in;
    const float* A = adapter + t.a;
    const float* B = adapter + t.b;
    for (size_t o = 0; o < size_t(t.site.out); ++o) {
      for (size_t i = 0; i < in; ++i) {
        double d = 0;
        for (size_t k = 0; k < r; ++k) d += double(B[o * r + k]) * double(A[k * in + i]);
        W[o * in + i] += float(double(L.scaling) * d);
      }
    }
  }
}

void lora_merge_expert(const LoraLayout& L, int e, const ModuleSpec& expert, const float* adapter,
                       float* w) {
  const size_t r = size_t(L.r);
  for (const LoraLayout::Target& t : L.experts) {
    const size_t in = size_t(t.site.in), E = size_t(t.site.experts);
    float* W = w + tensor_offset(expert, t.site.weight);
    const float* A = adapter + t.a + size_t(e) * r * in;  // A_e: rows e*r ..
    const float* B = adapter + t.b;                       // B_e[o, k] = B[o, k*E + e]
    for (size_t o = 0; o < size_t(t.site.out); ++o) {
      for (size_t i = 0; i < in; ++i) {
        double d = 0;
        for (size_t k = 0; k < r; ++k) {
          d += double(B[o * r * E + k * E + size_t(e)]) * double(A[k * in + i]);
        }
        W[o * in + i] += float(double(L.scaling) * d);
      }
    }
  }
}

void LoraRun::carve(Carver& c, size_t N, size_t es) {
  const size_t r = size_t(layout->r), W = size_t(layout->max_width);
  u = c.take(N * r * es);
  du = c.take(N * r * es);
  bpad = c.take(W * r * es);
  bf32 = c.take_f32(W * r);
  delta = c.take(N * W * es);
  if (layout->dropout > 0) {
    xd = c.take(N * size_t(layout->max_in) * es);
    dxd = c.take(N * size_t(layout->max_in) * es);
  }
  if (!layout->experts.empty()) {
    const size_t E = size_t(layout->experts[0].site.experts);
    size_t widest = 0;
    for (const LoraLayout::Target& t : layout->experts)
      widest = std::max(widest, size_t(t.site.out));
    eye = c.take_f32(E * E);
    ed = c.take_f32(E * E);
    eb32 = c.take_f32(widest * r * E);
    ebt = c.take(layout->expert_b * es);
    edbt = c.take_f32(layout->expert_b);
  }
}

namespace {

const char* at(const void* p, size_t elems, size_t es) {
  return static_cast<const char*>(p) + elems * es;
}

// run.bpad = s * B scattered into rows [col0, col0 + out) of a zero [width, r] matrix.
void scatter_b(const DecoderStep& st, const LoraRun& run, const LoraLayout::Target& t) {
  const LoraLayout& L = *run.layout;
  const size_t r = size_t(L.r), es = st.es(), n = size_t(t.site.out) * r;
  st.zero(run.bpad, size_t(t.site.width) * r * es);
  st.k->cast(*st.s, run.bf32, DType::kF32, at(run.p, t.b, es), st.dt, n);
  st.k->scale(*st.s, run.bf32, L.scaling, n);
  st.k->cast(*st.s, static_cast<char*>(run.bpad) + size_t(t.site.col0) * r * es, st.dt, run.bf32,
             DType::kF32, n);
}

// Whether this pass drops the adapters' input (training with lora_dropout > 0).
bool dropping(const DecoderStep& st, const LoraRun& run) {
  return run.layout->dropout > 0 && st.dropout_key != 0;
}

// The adapter input of target `i`: x, or run.xd = dropout(x) with the site's mask.
const void* adapter_input(const DecoderStep& st, const LoraRun& run, size_t i, const void* x) {
  if (!dropping(st, run)) return x;
  const LoraLayout& L = *run.layout;
  st.k->dropout(*st.s, st.dt, run.xd, x, st.N() * size_t(L.targets[i].site.in), L.dropout,
                lora_dropout_key(st.dropout_key, st.layer, int(i)));
  return run.xd;
}

}  // namespace

void lora_forward(const DecoderStep& st, const LoraRun& run, int matmul, const void* x, void* y) {
  if (run.layout == nullptr) return;
  const LoraLayout& L = *run.layout;
  Kernels& k = *st.k;
  const int N = int(st.N()), r = L.r;
  const size_t es = st.es();
  for (size_t i = 0; i < L.targets.size(); ++i) {
    const LoraLayout::Target& t = L.targets[i];
    if (t.site.matmul != matmul) continue;
    const void* xin = adapter_input(st, run, i, x);
    k.matmul_forward(*st.s, st.dt, run.u, xin, at(run.p, t.a, es), nullptr, N, t.site.in, r);
    scatter_b(st, run, t);
    k.matmul_forward(*st.s, st.dt, run.delta, run.u, run.bpad, nullptr, N, r, t.site.width);
    k.add_inplace(*st.s, st.dt, y, run.delta, size_t(N) * size_t(t.site.width));
  }
}

void lora_backward(const DecoderStep& st, const LoraRun& run, int matmul, const void* x,
                   const void* dy, void* dx) {
  if (run.layout == nullptr) return;
  const LoraLayout& L = *run.layout;
  Kernels& k = *st.k;
  const int N = int(st.N()), r = L.r;
  const size_t es = st.es();
  for (size_t i = 0; i < L.targets.size(); ++i) {
    const LoraLayout::Target& t = L.targets[i];
    if (t.site.matmul != matmul) continue;
    const size_t W = size_t(t.site.width), nb = size_t(t.site.out) * size_t(r);
    const void* xin = adapter_input(st, run, i, x);
    k.matmul_forward(*st.s, st.dt, run.u, xin, at(run.p, t.a, es), nullptr, N, t.site.in, r);
    scatter_b(st, run, t);
    // du = dy (s B_pad); d(s B_pad) = dy^T u, of which the site's rows, times s, are dB.
    st.zero(run.du, size_t(N) * size_t(r) * es);
    st.zero(run.bf32, W * size_t(r) * 4);
    k.matmul_backward(*st.s, st.dt, run.du, run.bf32, nullptr, dy, run.u, run.bpad, N, r, int(W),
                      /*accumulate=*/true);
    float* db = run.bf32 + size_t(t.site.col0) * size_t(r);
    k.scale(*st.s, db, L.scaling, nb);
    k.add_inplace(*st.s, DType::kF32, run.g + t.b, db, nb);
    if (xin == x) {
      // dA += du^T x, dx += du A.
      k.matmul_backward(*st.s, st.dt, dx, run.g + t.a, nullptr, run.du, x, at(run.p, t.a, es), N,
                        t.site.in, r, /*accumulate=*/true);
      continue;
    }
    // dA += du^T xd; dxd = du A; dx += dropout(dxd), the forward's mask.
    const size_t nx = size_t(N) * size_t(t.site.in);
    st.zero(run.dxd, nx * es);
    k.matmul_backward(*st.s, st.dt, run.dxd, run.g + t.a, nullptr, run.du, xin, at(run.p, t.a, es),
                      N, t.site.in, r, /*accumulate=*/true);
    k.dropout(*st.s, st.dt, run.dxd, run.dxd, nx, L.dropout,
              lora_dropout_key(st.dropout_key, st.layer, int(i)));
    k.add_inplace(*st.s, st.dt, dx, run.dxd, nx);
  }
}

}  // namespace strata

namespace strata {
namespace {

// Expert target `t`'s part of run.ebt / run.edbt (elements): the targets before it, in order.
size_t expert_b_offset(const LoraLayout& L, const LoraLayout::Target& t) {
  size_t off = 0;
  for (const LoraLayout::Target& u : L.experts) {
    if (&u == &t) break;
    off += size_t(u.site.out) * size_t(L.r) * size_t(u.site.experts);
  }
  return off;
}

const LoraLayout::Target* expert_target(const LoraLayout& L, int matmul) {
  for (const LoraLayout::Target& t : L.experts) {
    if (t.site.matmul == matmul) return &t;
  }
  return nullptr;
}

}  // namespace

void lora_experts_prepare(const DecoderStep& st, const LoraRun& run) {
  if (run.layout == nullptr || run.layout->experts.empty()) return;
  const LoraLayout& L = *run.layout;
  Kernels& k = *st.k;
  const int E = L.experts[0].site.experts;
  const size_t es = st.es();
  st.dev->copy_h2d(*st.s, run.eye, L.eye.data(), L.eye.size() * 4);
  for (const LoraLayout::Target& t : L.experts) {
    const size_t off = expert_b_offset(L, t), OR = size_t(t.site.out) * size_t(L.r);
    // B [out, r*E] read as [out*r, E]; its transpose [E, out*r] = I B^T holds B_e per row.
    float* bt32 = run.edbt + off;  // staging: edbt is zeroed below before any gradient
    k.cast(*st.s, run.eb32, DType::kF32, at(run.p, t.b, es), st.dt, OR * size_t(E));
    k.matmul_forward(*st.s, DType::kF32, bt32, run.eye, run.eb32, nullptr, E, E, int(OR));
    k.scale(*st.s, bt32, L.scaling, OR * size_t(E));
    k.cast(*st.s, static_cast<char*>(run.ebt) + off * es, st.dt, bt32, DType::kF32, OR * size_t(E));
  }
  st.zero(run.edbt, L.expert_b * 4);
}

void lora_expert_forward(const DecoderStep& st, const LoraRun& run, int matmul, int e, int n,
                         const void* x, void* y) {
  if (run.layout == nullptr || n == 0) return;
  const LoraLayout& L = *run.layout;
  const LoraLayout::Target* t = expert_target(L, matmul);
  if (t == nullptr) return;
  Kernels& k = *st.k;
  const int r = L.r, in = t->site.in, out = t->site.out;
  const size_t es = st.es(), OR = size_t(out) * size_t(r);
  const char* be = static_cast<const char*>(run.ebt) + (expert_b_offset(L, *t) + e * OR) * es;
  k.matmul_forward(*st.s, st.dt, run.u, x, at(run.p, t->a + size_t(e) * r * in, es), nullptr, n, in,
                   r);
  k.matmul_forward(*st.s, st.dt, run.delta, run.u, be, nullptr, n, r, out);
  k.add_inplace(*st.s, st.dt, y, run.delta, size_t(n) * size_t(out));
}

void lora_expert_backward(const DecoderStep& st, const LoraRun& run, int matmul, int e, int n,
                          const void* x, const void* dy, void* dx) {
  if (run.layout == nullptr || run.g == nullptr || n == 0) return;
  const LoraLayout& L = *run.layout;
  const LoraLayout::Target* t = expert_target(L, matmul);
  if (t == nullptr) return;
  Kernels& k = *st.k;
  const int r = L.r, in = t->site.in, out = t->site.out;
  const size_t es = st.es(), OR = size_t(out) * size_t(r), off = expert_b_offset(L, *t) + e * OR;
  const void* ae = at(run.p, t->a + size_t(e) * r * in, es);
  k.matmul_forward(*st.s, st.dt, run.u, x, ae, nullptr, n, in, r);
  // du = dy (s B_e); d(s B_e) += dy^T u; dA_e += du^T x; dx += du A_e.
  st.zero(run.du, size_t(n) * size_t(r) * es);
  k.matmul_backward(*st.s, st.dt, run.du, run.edbt + off, nullptr, dy, run.u,
                    static_cast<const char*>(run.ebt) + off * es, n, r, out,
                    /*accumulate=*/true);
  k.matmul_backward(*st.s, st.dt, dx, run.g + t->a + size_t(e) * r * in, nullptr, run.du, x, ae, n,
                    in, r, /*accumulate=*/true);
}

void lora_experts_finish(const DecoderStep& st, const LoraRun& run) {
  if (run.layout == nullptr || run.layout->experts.empty() || run.g == nullptr) return;
  const LoraLayout& L = *run.layout;
  Kernels& k = *st.k;
  const int E = L.experts[0].site.experts;
  for (const LoraLayout::Target& t : L.experts) {
    const size_t off = expert_b_offset(L, t), OR = size_t(t.site.out) * size_t(L.r);
    // dB_e = s d(s B_e), [E, out*r]; lora_B's gradient [out*r, E] += its transpose (dweight of
    // the identity's matmul: dB^T I).
    k.scale(*st.s, run.edbt + off, L.scaling, OR * size_t(E));
    st.zero(run.ed, size_t(E) * size_t(E) * 4);
    k.matmul_backward(*st.s, DType::kF32, run.ed, run.g + t.b, nullptr, run.edbt + off, run.eye,
                      run.eb32, E, E, int(OR), /*accumulate=*/true);
  }
}

}  // namespace strata
