#include "src/model/lora.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "src/model/decoder.h"

namespace strata {

std::vector<std::string> lora_default_targets(const std::string& type) {
  if (type == "gpt2" || type == "gpt") return {"c_attn"};
  return {"q_proj", "v_proj"};
}

namespace {

bool site_matches(const std::string& site, const std::string& target) {
  if (site == target) return true;
  return site.size() > target.size() && site[site.size() - target.size() - 1] == '.' &&
         site.compare(site.size() - target.size(), target.size(), target) == 0;
}

}  // namespace

Result<LoraLayout> lora_layout(const LoraConfig& lora, const std::string& type,
                               const std::vector<LoraSite>& sites) {
  LoraLayout out;
  if (!lora.enabled) return out;
  if (sites.empty()) {
    return invalid_argument(fmt::format(
        "lora: adapters on a {} model are not supported (its blocks have no adapter sites); "
        "remove the lora section",
        type));
  }
  if (lora.r < 1) {
    return invalid_argument(fmt::format("lora.r: {} must be >= 1", lora.r));
  }
  // The adapters' update is multiplied by lora_alpha / r: 0 learns nothing, and past
  // kMaxLoraScaling one step moves the model by that many times the learning rate (it trains
  // a dead model without a word).
  const double scaling = lora.scaling();
  if (!(scaling > 0) || !(scaling <= kMaxLoraScaling)) {
    return invalid_argument(fmt::format(
        "lora.lora_alpha {:g} / lora.r {} = scaling {:g}: the adapters' update is multiplied by "
        "it, so it must be in (0, {:g}]; PEFT's usual lora_alpha is r to 2r (scaling 1 to 2)",
        lora.alpha, lora.r, scaling, kMaxLoraScaling));
  }
  const std::vector<std::string> targets =
      lora.target_modules.empty() ? lora_default_targets(type) : lora.target_modules;
  std::vector<bool> chosen(sites.size(), false);
  for (const std::string& t : targets) {
    bool any = false;
    for (size_t i = 0; i < sites.size(); ++i) {
      if (site_matches(sites[i].name, t)) chosen[i] = any = true;
    }
    if (!any) {
      std::string names;
      for (const LoraSite& s : sites) names += (names.empty() ? "" : ", ") + s.name;
      return invalid_argument(fmt::format(
          "lora.target_modules: \"{}\" is not a linear layer of this {} model; its blocks' "
          "linear layers are {}",
          t, type, names));
    }
  }
  out.r = lora.r;
  out.scaling = lora.scaling();
  for (size_t i = 0; i < sites.size(); ++i) {
    if (!chosen[i]) continue;
    LoraLayout::Target t;
    t.site = sites[i];
    t.a = out.numel;
    out.numel += size_t(lora.r) * size_t(t.site.in);
    t.b = out.numel;
    out.numel += size_t(t.site.out) * size_t(lora.r);
    out.max_width = std::max(out.max_width, t.site.width);
    out.targets.push_back(std::move(t));
  }
  return out;
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
    if (std::find(seen.begin(), seen.end(), s.matmul) != seen.end()) continue;
    seen.push_back(s.matmul);
    weights.push_back({tensor_offset(block, s.weight), size_t(s.width), size_t(s.in)});
  }
  return base_quant_layout(kind, block.numel, std::move(weights));
}

std::string lora_describe(const LoraLayout& L, int n_layer) {
  if (L.empty()) return "";
  std::string names;
  for (const LoraLayout::Target& t : L.targets) names += (names.empty() ? "" : ",") + t.site.name;
  return fmt::format("; frozen, with LoRA r={} alpha/r={:g} on {}: {:.3f}M trainable", L.r,
                     L.scaling, names, double(L.numel) * n_layer / 1e6);
}

std::string lora_shape_string(const LoraLayout& L) {
  if (L.empty()) return "";
  std::string s = fmt::format(" lora r={} scaling={}", L.r, L.scaling);
  for (const LoraLayout::Target& t : L.targets) s += " " + t.site.name;
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

void LoraRun::carve(Carver& c, size_t N, size_t es) {
  const size_t r = size_t(layout->r), W = size_t(layout->max_width);
  u = c.take(N * r * es);
  du = c.take(N * r * es);
  bpad = c.take(W * r * es);
  bf32 = c.take_f32(W * r);
  delta = c.take(N * W * es);
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

}  // namespace

void lora_forward(const DecoderStep& st, const LoraRun& run, int matmul, const void* x, void* y) {
  if (run.layout == nullptr) return;
  const LoraLayout& L = *run.layout;
  Kernels& k = *st.k;
  const int N = int(st.N()), r = L.r;
  const size_t es = st.es();
  for (const LoraLayout::Target& t : L.targets) {
    if (t.site.matmul != matmul) continue;
    k.matmul_forward(*st.s, st.dt, run.u, x, at(run.p, t.a, es), nullptr, N, t.site.in, r);
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
  for (const LoraLayout::Target& t : L.targets) {
    if (t.site.matmul != matmul) continue;
    const size_t W = size_t(t.site.width), nb = size_t(t.site.out) * size_t(r);
    k.matmul_forward(*st.s, st.dt, run.u, x, at(run.p, t.a, es), nullptr, N, t.site.in, r);
    scatter_b(st, run, t);
    // du = dy (s B_pad); d(s B_pad) = dy^T u, of which the site's rows, times s, are dB.
    st.zero(run.du, size_t(N) * size_t(r) * es);
    st.zero(run.bf32, W * size_t(r) * 4);
    k.matmul_backward(*st.s, st.dt, run.du, run.bf32, nullptr, dy, run.u, run.bpad, N, r, int(W));
    float* db = run.bf32 + size_t(t.site.col0) * size_t(r);
    k.scale(*st.s, db, L.scaling, nb);
    k.add_inplace(*st.s, DType::kF32, run.g + t.b, db, nb);
    // dA += du^T x, dx += du A.
    k.matmul_backward(*st.s, st.dt, dx, run.g + t.a, nullptr, run.du, x, at(run.p, t.a, es), N,
                      t.site.in, r);
  }
}

}  // namespace strata
