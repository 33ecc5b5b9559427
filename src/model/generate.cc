#include "src/model/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "src/base/rng.h"
#include "src/checkpoint/checkpoint.h"
#include "src/hf/hf_adapter.h"
#include "src/hf/hf_checkpoint.h"
#include "src/model/decoder.h"
#include "src/model/llama.h"
#include "strata/kernels.h"

namespace strata {
namespace {

// out[r] = sum_c w[r * cols + c] * x[c] (+ b[r]), r < rows: a [rows, cols] weight times x.
void matvec(const float* w, const float* b, const float* x, int rows, int cols, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* row = w + size_t(r) * size_t(cols);
    double s = 0;
    for (int c = 0; c < cols; ++c) s += double(row[c]) * double(x[c]);
    out[r] = float(s + (b ? double(b[r]) : 0.0));
  }
}

void rms_norm(const float* x, const float* w, double eps, int n, float* out) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float r = float(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void layer_norm(const float* x, const float* w, const float* b, double eps, int n, float* out) {
  double mean = 0, var = 0;
  for (int i = 0; i < n; ++i) mean += x[i];
  mean /= n;
  for (int i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  const double r = 1.0 / std::sqrt(var / n + eps);
  for (int i = 0; i < n; ++i) out[i] = float((x[i] - mean) * r) * w[i] + b[i];
}

// Causal attention of one query head over the cached keys/values of positions [0, T).
// k and v are [T, stride] with this head's hs values at `offset`.
void attend(const float* q, const std::vector<float>& k, const std::vector<float>& v, int T,
            int stride, int offset, int hs, float* out) {
  std::vector<double> p(size_t(T), 0.0);
  const double scale = 1.0 / std::sqrt(double(hs));
  double mx = -INFINITY;
  for (int t = 0; t < T; ++t) {
    const float* kt = k.data() + size_t(t) * stride + offset;
    double s = 0;
    for (int i = 0; i < hs; ++i) s += double(q[i]) * double(kt[i]);
    p[size_t(t)] = s * scale;
    mx = std::max(mx, p[size_t(t)]);
  }
  double sum = 0;
  for (double& x : p) sum += (x = std::exp(x - mx));
  for (int i = 0; i < hs; ++i) {
    double o = 0;
    for (int t = 0; t < T; ++t) o += p[size_t(t)] * double(v[size_t(t) * stride + offset + i]);
    out[i] = float(o / sum);
  }
}

// Module m's tensor `name` in the weights.
const float* tensor(const Architecture& arch, const std::vector<std::vector<float>>& w, int m,
                    const char* name) {
  for (const TensorSpec& t : arch.layout().modules[size_t(m)].tensors) {
    if (t.name == name) return w[size_t(m)].data() + t.offset;
  }
  STRATA_CHECK(false, "a tensor the decoder reads is missing from the module");
  return nullptr;
}

class DecoderBase : public Decoder {
 public:
  int position() const override { return pos_; }
  int context() const override { return T_; }
  int vocab_size() const override { return V_; }

 protected:
  DecoderBase(const Architecture& arch, std::vector<std::vector<float>> w, int L, int T, int V,
              int kv_width)
      : arch_(arch), w_(std::move(w)), T_(T), V_(V), kv_(kv_width) {
    k_.assign(size_t(L), std::vector<float>(size_t(T) * size_t(kv_width)));
    v_.assign(size_t(L), std::vector<float>(size_t(T) * size_t(kv_width)));
  }
  Status check(int32_t token) const {
    if (pos_ >= T_) {
      return invalid_argument(fmt::format(
          "generate: {} tokens fill the model's context (model.context {}); shorten the prompt "
          "or --max-new-tokens, or raise model.context",
          pos_, T_));
    }
    if (token < 0 || token >= V_) {
      return invalid_argument(
          fmt::format("generate: token {} is outside the vocabulary ({})", token, V_));
    }
    return Status::ok();
  }
  const float* t(int m, const char* name) const { return tensor(arch_, w_, m, name); }

  const Architecture& arch_;
  std::vector<std::vector<float>> w_;
  int T_, V_, kv_;
  int pos_ = 0;
  std::vector<std::vector<float>> k_, v_;  // per layer: [T, kv_] keys and values
  std::vector<float> logits_;
};

class LlamaDecoder final : public DecoderBase {
 public:
  explicit LlamaDecoder(const Architecture& arch, std::vector<std::vector<float>> w)
      : DecoderBase(arch, std::move(w), arch.shape().n_layer, arch.shape().context,
                    arch.shape().vocab_size,
                    arch.shape().num_key_value_heads * (arch.shape().n_embd / arch.shape().n_head)),
        s_(arch.shape()),
        mods_{s_.n_layer, s_.tied_embeddings},
        hs_(s_.n_embd / s_.n_head),
        eps_(float(s_.rms_norm_eps)) {
    inv_freq_.resize(size_t(hs_ / 2));
    rope_inv_freq(llama_rope(s_), hs_, inv_freq_.data());
  }

  Result<const std::vector<float>*> step(int32_t token) override {
    STRATA_RETURN_IF_ERROR(check(token), "");
    const int C = s_.n_embd, hs = hs_, NH = s_.n_head, KVH = s_.num_key_value_heads, Q = NH * hs,
              I = s_.intermediate_size;
    std::vector<float> x(t(mods_.embedding(), "embed_tokens") + size_t(token) * C,
                         t(mods_.embedding(), "embed_tokens") + size_t(token + 1) * C);
    std::vector<float> h(static_cast<size_t>(C)), q(static_cast<size_t>(Q)),
        att(static_cast<size_t>(Q)), o(static_cast<size_t>(C));
    std::vector<float> g(static_cast<size_t>(I)), u(static_cast<size_t>(I));
    for (int l = 0; l < s_.n_layer; ++l) {
      const int m = mods_.block(l);
      rms_norm(x.data(), t(m, "input_layernorm"), eps_, C, h.data());
      float* k = k_[size_t(l)].data() + size_t(pos_) * kv_;
      float* v = v_[size_t(l)].data() + size_t(pos_) * kv_;
      const bool bias = s_.attention_bias;
      matvec(t(m, "q_proj"), bias ? t(m, "q_bias") : nullptr, h.data(), Q, C, q.data());
      matvec(t(m, "k_proj"), bias ? t(m, "k_bias") : nullptr, h.data(), kv_, C, k);
      matvec(t(m, "v_proj"), bias ? t(m, "v_bias") : nullptr, h.data(), kv_, C, v);
      for (int head = 0; head < NH; ++head) rotate(q.data() + head * hs);
      for (int head = 0; head < KVH; ++head) rotate(k + head * hs);
      for (int head = 0; head < NH; ++head) {
        attend(q.data() + head * hs, k_[size_t(l)], v_[size_t(l)], pos_ + 1, kv_,
               (head / (NH / KVH)) * hs, hs, att.data() + head * hs);
      }
      matvec(t(m, "o_proj"), nullptr, att.data(), C, Q, o.data());
      for (int i = 0; i < C; ++i) x[size_t(i)] += o[size_t(i)];
      rms_norm(x.data(), t(m, "post_attention_layernorm"), eps_, C, h.data());
      matvec(t(m, "gate_proj"), nullptr, h.data(), I, C, g.data());
      matvec(t(m, "up_proj"), nullptr, h.data(), I, C, u.data());
      for (int i = 0; i < I; ++i) {
        const float a = g[size_t(i)];
        g[size_t(i)] = a / (1.0f + std::exp(-a)) * u[size_t(i)];  // silu(gate) * up
      }
      matvec(t(m, "down_proj"), nullptr, g.data(), C, I, o.data());
      for (int i = 0; i < C; ++i) x[size_t(i)] += o[size_t(i)];
    }
    rms_norm(x.data(), t(mods_.final_norm(), "norm"), eps_, C, h.data());
    logits_.resize(size_t(V_));
    const float* head =
        s_.tied_embeddings ? t(mods_.embedding(), "embed_tokens") : t(mods_.head(), "lm_head");
    matvec(head, nullptr, h.data(), V_, C, logits_.data());
    ++pos_;
    return &logits_;
  }

 private:
  // Hugging Face's rotate_half: pair (i, i + hs/2) turns by pos * inv_freq[i].
  void rotate(float* x) const {
    const int half = hs_ / 2;
    for (int i = 0; i < half; ++i) {
      const double a = double(pos_) * inv_freq_[size_t(i)];
      const float c = float(std::cos(a)), s = float(std::sin(a));
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c - x2 * s;
      x[i + half] = x2 * c + x1 * s;
    }
  }

  ModelConfig s_;
  DecoderModules mods_;
  int hs_;
  float eps_;
  std::vector<double> inv_freq_;
};

class GptDecoder final : public DecoderBase {
 public:
  explicit GptDecoder(const Architecture& arch, std::vector<std::vector<float>> w)
      : DecoderBase(arch, std::move(w), arch.shape().n_layer, arch.shape().context,
                    arch.shape().vocab_size, arch.shape().n_embd),
        s_(arch.shape()),
        mods_{s_.n_layer, s_.tied_embeddings} {}

  Result<const std::vector<float>*> step(int32_t token) override {
    STRATA_RETURN_IF_ERROR(check(token), "");
    const int C = s_.n_embd, NH = s_.n_head, hs = C / NH;
    const int E = mods_.embedding();
    const size_t c = static_cast<size_t>(C);
    std::vector<float> x(c), h(c), qkv(3 * c), att(c), o(c), f(4 * c);
    const float* wte = t(E, "wte") + size_t(token) * C;
    const float* wpe = t(E, "wpe") + size_t(pos_) * C;
    for (int i = 0; i < C; ++i) x[size_t(i)] = wte[i] + wpe[i];
    for (int l = 0; l < s_.n_layer; ++l) {
      const int m = mods_.block(l);
      layer_norm(x.data(), t(m, "ln1w"), t(m, "ln1b"), 1e-5, C, h.data());
      matvec(t(m, "qkvw"), t(m, "qkvb"), h.data(), 3 * C, C, qkv.data());
      std::copy(qkv.begin() + C, qkv.begin() + 2 * C, k_[size_t(l)].begin() + size_t(pos_) * C);
      std::copy(qkv.begin() + 2 * C, qkv.end(), v_[size_t(l)].begin() + size_t(pos_) * C);
      for (int head = 0; head < NH; ++head) {
        attend(qkv.data() + head * hs, k_[size_t(l)], v_[size_t(l)], pos_ + 1, C, head * hs, hs,
               att.data() + head * hs);
      }
      matvec(t(m, "attprojw"), t(m, "attprojb"), att.data(), C, C, o.data());
      for (int i = 0; i < C; ++i) x[size_t(i)] += o[size_t(i)];
      layer_norm(x.data(), t(m, "ln2w"), t(m, "ln2b"), 1e-5, C, h.data());
      matvec(t(m, "fcw"), t(m, "fcb"), h.data(), 4 * C, C, f.data());
      for (float& a : f) {  // GELU, tanh approximation (gelu_new)
        const double z = a;
        a = float(0.5 * z * (1.0 + std::tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))));
      }
      matvec(t(m, "fcprojw"), t(m, "fcprojb"), f.data(), C, 4 * C, o.data());
      for (int i = 0; i < C; ++i) x[size_t(i)] += o[size_t(i)];
    }
    layer_norm(x.data(), t(mods_.final_norm(), "lnfw"), t(mods_.final_norm(), "lnfb"), 1e-5, C,
               h.data());
    logits_.resize(size_t(V_));
    const float* head = s_.tied_embeddings ? t(E, "wte") : t(mods_.head(), "lm_head");
    matvec(head, nullptr, h.data(), V_, C, logits_.data());
    ++pos_;
    return &logits_;
  }

 private:
  ModelConfig s_;
  DecoderModules mods_;
};

}  // namespace

Result<std::vector<std::vector<float>>> load_master_weights(const Architecture& arch,
                                                            const ModelConfig& model,
                                                            const std::string& checkpoint) {
  const ModelLayout& layout = arch.layout();
  std::vector<std::vector<float>> w(layout.modules.size());
  for (size_t m = 0; m < w.size(); ++m) w[m].assign(layout.modules[m].numel, 0.0f);
  if (checkpoint.empty()) {
    if (model.from_pretrained.empty()) {
      return invalid_argument(
          "generate: no weights: give --checkpoint (a strata checkpoint or run directory) or a "
          "config with model.from_pretrained");
    }
    STRATA_ASSIGN_OR_RETURN(auto hf, HfCheckpointReader::open(model.from_pretrained, arch),
                            "generate");
    for (size_t m = 0; m < w.size(); ++m) {
      STRATA_RETURN_IF_ERROR(hf->read_module(int(m), w[m].data()), "generate");
    }
    return w;
  }
  if (arch.lora() != nullptr) {
    // A LoRA checkpoint holds the adapters alone: the base comes from model.from_pretrained
    // with the adapters merged in, exactly as `strata export` writes the model.
    STRATA_RETURN_IF_ERROR(merged_lora_modules(checkpoint, model, arch,
                                               [&](int m, const float* values) {
                                                 std::copy(values, values + w[size_t(m)].size(),
                                                           w[size_t(m)].begin());
                                                 return Status::ok();
                                               }),
                           "generate");
    return w;
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> files, checkpoint_files(checkpoint), "generate");
  std::vector<float> slice;
  for (const std::string& f : files) {
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(f), "generate");
    if (meta.model_shape != arch.shape_string() || meta.modules.size() != w.size()) {
      return invalid_argument(fmt::format(
          "generate: {} holds a model of shape \"{}\", but the config describes \"{}\"; give "
          "the config the checkpoint was trained with",
          f, meta.model_shape, arch.shape_string()));
    }
    auto staging = [&](size_t i, CheckpointBuffers* out) -> Status {
      slice.assign(meta.modules[i].numel, 0.0f);
      *out = {slice.data(), nullptr, nullptr, 4};
      return Status::ok();
    };
    auto sink = [&](size_t i, const CheckpointBuffers&) -> Status {
      const CheckpointModule& cm = meta.modules[i];
      if (cm.offset + cm.numel > w[i].size()) {
        return corrupt(fmt::format("{}: module {} elements [{}, {}) past its {} elements", f,
                                   cm.name, cm.offset, cm.offset + cm.numel, w[i].size()));
      }
      std::copy(slice.begin(), slice.begin() + ptrdiff_t(cm.numel),
                w[i].begin() + ptrdiff_t(cm.offset));
      return Status::ok();
    };
    STRATA_RETURN_IF_ERROR(read_checkpoint(f, staging, sink), "generate");
  }
  return w;
}

uint64_t decoder_bytes(const Architecture& arch) {
  // Keys and values of num_key_value_heads heads (n_head for GPT-2) per layer and position.
  const ModelConfig& s = arch.shape();
  const uint64_t kv_width = uint64_t(s.num_key_value_heads) * uint64_t(s.n_embd / s.n_head);
  return uint64_t(arch.layout().num_params()) * 4 +
         2 * uint64_t(s.n_layer) * uint64_t(s.context) * kv_width * 4;
}

Result<std::unique_ptr<Decoder>> Decoder::create(const Architecture& arch,
                                                 std::vector<std::vector<float>> weights) {
  if (arch.name() == "llama") {
    return std::unique_ptr<Decoder>(new LlamaDecoder(arch, std::move(weights)));
  }
  if (arch.name() == "gpt2") {
    return std::unique_ptr<Decoder>(new GptDecoder(arch, std::move(weights)));
  }
  return invalid_argument(
      fmt::format("generate: model.type {} has no decoder (llama, gpt2 do)", arch.name()));
}

int32_t pick_token(const std::vector<float>& logits, double temperature, double top_p,
                   double uniform) {
  const size_t V = logits.size();
  if (temperature <= 0) {
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)]; });
  std::vector<double> p(V);
  const double mx = double(logits[size_t(order[0])]);
  double sum = 0;
  for (size_t i = 0; i < V; ++i) {
    sum += (p[i] = std::exp((double(logits[size_t(order[i])]) - mx) / temperature));
  }
  // The nucleus: the most likely tokens until their mass reaches top_p (at least one).
  size_t keep = 0;
  double mass = 0;
  while (keep < V && (keep == 0 || mass < top_p * sum)) mass += p[keep++];
  double r = uniform * mass;
  for (size_t i = 0; i < keep; ++i) {
    if ((r -= p[i]) < 0) return order[i];
  }
  return order[keep - 1];
}

Result<std::vector<int32_t>> generate(Decoder& decoder, const std::vector<int32_t>& prompt,
                                      const SampleOptions& options) {
  if (prompt.empty()) return invalid_argument("generate: the prompt has no tokens");
  const std::vector<float>* logits = nullptr;
  for (int32_t tok : prompt) {
    STRATA_ASSIGN_OR_RETURN(logits, decoder.step(tok), "the prompt");
  }
  std::vector<int32_t> out;
  Rng rng(options.seed, 0x6e6e);  // the same seed draws the same tokens
  while (int(out.size()) < options.max_new_tokens) {
    const int32_t tok = pick_token(*logits, options.temperature, options.top_p, rng.uniform());
    out.push_back(tok);
    if (std::find(options.stop.begin(), options.stop.end(), tok) != options.stop.end()) break;
    if (int(out.size()) == options.max_new_tokens || decoder.position() >= decoder.context()) {
      break;
    }
    STRATA_ASSIGN_OR_RETURN(logits, decoder.step(tok), "generating");
  }
  return out;
}

}  // namespace strata
