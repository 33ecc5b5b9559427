#include "src/model/llama.h"

#include <fmt/format.h>

#include <algorithm>

#include "src/model/decoder_architecture.h"
#include "src/model/family.h"
#include "src/model/llama_blocks.h"

namespace strata {

RopeParams llama_rope(const ModelConfig& mc) {
  RopeParams rope;
  rope.theta = mc.rope_theta;
  if (mc.rope_scaling.type == "llama3") {
    rope.llama3 = true;
    rope.factor = mc.rope_scaling.factor;
    rope.low_freq_factor = mc.rope_scaling.low_freq_factor;
    rope.high_freq_factor = mc.rope_scaling.high_freq_factor;
    rope.original_max_position = mc.rope_scaling.original_max_position_embeddings;
  }
  return rope;
}

Status LlamaBlocks::check_attention(const ModelConfig& mc) {
  if (!mc.rope_scaling.type.empty() && mc.rope_scaling.type != "none" &&
      mc.rope_scaling.type != "llama3") {
    return invalid_argument(
        fmt::format("model.rope_scaling.type: \"{}\" is not supported (use llama3, or none)",
                    mc.rope_scaling.type));
  }
  if (mc.n_head % mc.num_key_value_heads != 0) {
    return invalid_argument(
        fmt::format("model.num_key_value_heads: {} does not divide model.n_head {}",
                    mc.num_key_value_heads, mc.n_head));
  }
  const int hs = mc.head_dim > 0 ? mc.head_dim : mc.n_embd / mc.n_head;
  if (hs % 2 != 0 || hs / 2 > kMaxRopePairs) {
    return invalid_argument(
        fmt::format("{}: the head size {} must be even and <= {} for rotary positions",
                    mc.head_dim > 0 ? "model.head_dim" : "model.n_head (head size n_embd/n_head)",
                    hs, 2 * kMaxRopePairs));
  }
  if (!(float(mc.rms_norm_eps) > 0.0f)) {
    return invalid_argument(fmt::format("model.rms_norm_eps: {} must be > 0", mc.rms_norm_eps));
  }
  const RopeParams rope = llama_rope(mc);
  if (!(rope.theta > 1.0)) {
    return invalid_argument(fmt::format("model.rope_theta: {} must be > 1", mc.rope_theta));
  }
  if (rope.llama3 && !(rope.factor > 0 && rope.high_freq_factor > rope.low_freq_factor &&
                       rope.low_freq_factor > 0 && rope.original_max_position > 0)) {
    return invalid_argument(
        "model.rope_scaling: llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor "
        "and original_max_position_embeddings > 0");
  }
  return Status::ok();
}

std::vector<HfTensor> LlamaBlocks::hf_tensors(const ModuleSpec& m) const {
  std::vector<HfTensor> out;
  const std::string block =
      m.name.rfind("block.", 0) == 0 ? "model.layers." + m.name.substr(6) + "." : std::string();
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    HfTensor h;
    h.tensor = int(i);
    STRATA_CHECK(hf_tensor(block, m.tensors[i].name, &h),
                 "llama tensor without a Hugging Face name");
    out.push_back(std::move(h));
  }
  return out;
}

bool LlamaBlocks::hf_tensor(const std::string& block, const std::string& n, HfTensor* h) const {
  const int64_t C = s_.n_embd, V = s_.vocab_size, I = s_.intermediate_size,
                Q = int64_t(s_.n_head) * hs(), KV = int64_t(s_.num_key_value_heads) * hs();
  if (n == "embed_tokens") {
    h->name = "model.embed_tokens.weight", h->shape = {V, C};
  } else if (n == "norm") {
    h->name = "model.norm.weight", h->shape = {C};
  } else if (n == "lm_head") {
    h->name = "lm_head.weight", h->shape = {V, C};
  } else if (n == "input_layernorm" || n == "post_attention_layernorm") {
    h->name = block + n + ".weight", h->shape = {C};
  } else if (n == "q_proj") {
    h->name = block + "self_attn.q_proj.weight", h->shape = {Q, C};
  } else if (n == "k_proj" || n == "v_proj") {
    h->name = block + "self_attn." + n + ".weight", h->shape = {KV, C};
  } else if (n == "q_bias") {
    h->name = block + "self_attn.q_proj.bias", h->shape = {Q};
  } else if (n == "k_bias" || n == "v_bias") {
    h->name = block + "self_attn." + n.substr(0, 1) + "_proj.bias", h->shape = {KV};
  } else if (n == "qkv_proj") {  // Phi-3's q|k|v
    h->name = block + "self_attn.qkv_proj.weight", h->shape = {Q + 2 * KV, C};
  } else if (n == "gate_up_proj") {  // ... and gate|up
    h->name = block + "mlp.gate_up_proj.weight", h->shape = {2 * I, C};
  } else if (n == "q_norm" || n == "k_norm") {
    h->name = block + "self_attn." + n + ".weight", h->shape = {hs()};
  } else if (n == "o_proj") {
    h->name = block + "self_attn.o_proj.weight", h->shape = {C, Q};
  } else if (n == "gate_proj" || n == "up_proj") {
    h->name = block + "mlp." + n + ".weight", h->shape = {I, C};
  } else if (n == "down_proj") {
    h->name = block + "mlp.down_proj.weight", h->shape = {C, I};
  } else {
    return false;
  }
  return true;
}

namespace {

// Phi-3 (Phi3ForCausalLM: Phi-3, Phi-4): Llama's block whose checkpoints hold q|k|v as one
// qkv_proj and gate|up as one gate_up_proj, the packed weights strata computes with.
class Phi3Blocks final : public LlamaBlocks {
 public:
  static constexpr const char* kType = "phi3";
  static constexpr uint64_t kInitStream = 0x11a3b;
  static Status check(const ModelConfig& mc) {
    STRATA_RETURN_IF_ERROR(LlamaBlocks::check(mc), "");
    if (mc.attention_bias || mc.qk_norm) {
      return invalid_argument(
          "model.attention_bias, model.qk_norm: a phi3 model has neither (set both to false, or "
          "use model.type llama)");
    }
    return Status::ok();
  }
  using LlamaBlocks::LlamaBlocks;
};

}  // namespace

Result<std::unique_ptr<Architecture>> create_llama(const ModelConfig& config) {
  if (config.type == "phi3") return DecoderArchitecture<Phi3Blocks>::create(config);
  return DecoderArchitecture<LlamaBlocks>::create(config);
}

// LlamaForCausalLM's config.json and the models of its shape (Mistral, Qwen2, Qwen3; the
// mixtures add their keys): sizes, head_dim, rms_norm_eps, the rope (transformers 5's
// rope_parameters or rope_theta + rope_scaling; llama3 scaling or none), tied embeddings, q/k/v
// biases (Qwen2: always), the query/key norms (Qwen3: always). An activation other than silu
// and other rope scalings are refused.
Status llama_hf_read(const HfConfigIn& in, const std::string& arch, ModelConfig* m,
                     HfShapeExtras* extras) {
  const nlohmann::json& c = in.json();
  m->type = "llama";
  STRATA_RETURN_IF_ERROR(in.get_int("hidden_size", -1, &m->n_embd), "");
  STRATA_RETURN_IF_ERROR(in.get_int("num_hidden_layers", -1, &m->n_layer), "");
  STRATA_RETURN_IF_ERROR(in.get_int("num_attention_heads", -1, &m->n_head), "");
  STRATA_RETURN_IF_ERROR(in.get_int("num_key_value_heads", m->n_head, &m->num_key_value_heads), "");
  STRATA_RETURN_IF_ERROR(in.get_int("intermediate_size", -1, &m->intermediate_size), "");
  STRATA_RETURN_IF_ERROR(in.get_int("vocab_size", -1, &m->vocab_size), "");
  STRATA_RETURN_IF_ERROR(in.get_int("max_position_embeddings", 2048, &extras->max_positions), "");
  STRATA_RETURN_IF_ERROR(in.get_real("rms_norm_eps", 1e-6, &m->rms_norm_eps), "");
  // transformers 5 writes rope_theta and the scaling into one "rope_parameters" object;
  // earlier versions write rope_theta and rope_scaling.
  const char* rope_key = c.contains("rope_parameters") && c["rope_parameters"].is_object()
                             ? "rope_parameters"
                             : "rope_scaling";
  if (std::string(rope_key) == "rope_parameters" && c[rope_key].contains("rope_theta")) {
    if (!c[rope_key]["rope_theta"].is_number()) {
      return in.bad("rope_parameters.rope_theta", "not a number");
    }
    m->rope_theta = c[rope_key]["rope_theta"].get<double>();
  } else {
    STRATA_RETURN_IF_ERROR(in.get_real("rope_theta", 10000.0, &m->rope_theta), "");
  }
  STRATA_RETURN_IF_ERROR(in.get_bool("tie_word_embeddings", false, &m->tied_embeddings), "");
  STRATA_RETURN_IF_ERROR(in.get_bool("attention_bias", false, &m->attention_bias), "");
  if (arch == "Qwen2ForCausalLM") m->attention_bias = true;  // Qwen2 always has q/k/v biases
  // Qwen3 normalizes every query and key head.
  m->qk_norm = arch == "Qwen3ForCausalLM" || arch == "Qwen3MoeForCausalLM";
  // pad_token_id: the embedding's padding_idx (its row takes no gradient); null or absent: none.
  if (in.has("pad_token_id")) {
    const nlohmann::json& pad = c["pad_token_id"];
    if (!pad.is_number_integer()) {
      return in.bad("pad_token_id",
                    fmt::format("{} is not an integer (a token id, or null for none)", pad.dump()));
    }
    const bool in_vocab = pad.is_number_unsigned()
                              ? pad.get<uint64_t>() < uint64_t(m->vocab_size)
                              : pad.get<int64_t>() >= 0 && pad.get<int64_t>() < m->vocab_size;
    if (!in_vocab) {
      return in.bad("pad_token_id", fmt::format("{} is not a token of the vocabulary (vocab_size "
                                                "{}): transformers' embedding refuses it too",
                                                pad.dump(), m->vocab_size));
    }
    m->pad_token_id = pad.get<int>();
  }
  // A rotary embedding over part of each head (transformers reads partial_rotary_factor, at the
  // top or in rope_parameters, for every model; Phi-4-mini's is 0.75): strata rotates it all.
  for (const char* where : {"", "rope_parameters"}) {
    if (*where && !(c.contains(where) && c[where].is_object())) continue;
    const nlohmann::json& obj = *where ? c[where] : c;
    if (!obj.contains("partial_rotary_factor") || obj["partial_rotary_factor"].is_null()) continue;
    const nlohmann::json& f = obj["partial_rotary_factor"];
    if (!(f.is_number() && f.get<double>() == 1.0)) {
      return in.bad("partial_rotary_factor",
                    fmt::format("{}: strata rotates every dimension of a head (1.0)", f.dump()));
    }
  }
  // head_dim: kept only where it differs from hidden_size / num_attention_heads (0 = that).
  if (c.contains("head_dim") && !c["head_dim"].is_null()) {
    int hd = 0;
    STRATA_RETURN_IF_ERROR(in.get_int("head_dim", -1, &hd), "");
    if (hd < 1) return in.bad("head_dim", fmt::format("{} is not a positive width", hd));
    if (m->n_head < 1 || int64_t(hd) * m->n_head != m->n_embd) m->head_dim = hd;
  }
  if (c.contains("hidden_act") && c["hidden_act"] != "silu") {
    return in.bad("hidden_act", fmt::format("{} is not silu (SwiGLU)", c["hidden_act"].dump()));
  }
  if (c.contains(rope_key) && !c[rope_key].is_null()) {
    const nlohmann::json& r = c[rope_key];
    const std::string where = std::string(rope_key) + ".";
    if (!r.is_object()) return in.bad(rope_key, fmt::format("{} is not an object", r.dump()));
    std::string type;
    STRATA_RETURN_IF_ERROR(in.get_string(r, where, "type", "default", &type), "");
    STRATA_RETURN_IF_ERROR(in.get_string(r, where, "rope_type", type, &type), "");
    if (type == "llama3") {
      m->rope_scaling.type = "llama3";
      auto& rs = m->rope_scaling;
      STRATA_RETURN_IF_ERROR(in.get_real(r, where, "factor", 8.0, &rs.factor), "");
      STRATA_RETURN_IF_ERROR(in.get_real(r, where, "low_freq_factor", 1.0, &rs.low_freq_factor),
                             "");
      STRATA_RETURN_IF_ERROR(in.get_real(r, where, "high_freq_factor", 4.0, &rs.high_freq_factor),
                             "");
      STRATA_RETURN_IF_ERROR(in.get_real(r, where, "original_max_position_embeddings", 8192.0,
                                         &rs.original_max_position_embeddings),
                             "");
    } else if (type != "default") {
      return in.bad(rope_key, fmt::format("rope type \"{}\" is not supported (llama3 is)", type));
    }
  }
  // Mistral's and Phi-3's attention is windowed (where sliding_window is set); Qwen2's when
  // use_sliding_window says so.
  bool use_sliding_window = false;
  if (arch == "Qwen2ForCausalLM" || arch == "Qwen2MoeForCausalLM" || arch == "Qwen3ForCausalLM" ||
      arch == "Qwen3MoeForCausalLM") {
    STRATA_RETURN_IF_ERROR(in.get_bool("use_sliding_window", false, &use_sliding_window), "");
  }
  extras->sliding = arch == "MistralForCausalLM" || arch == "MixtralForCausalLM" ||
                    arch == "Phi3ForCausalLM" || use_sliding_window;
  return Status::ok();
}

// A llama with query/key norms as Qwen3ForCausalLM, one with q/k/v biases as Qwen2ForCausalLM
// (Llama's attention_bias also biases o_proj), other llamas (Mistral's too: its weights are
// Llama's) as LlamaForCausalLM.
void llama_hf_write(const ModelConfig& m, nlohmann::json* out) {
  nlohmann::json& c = *out;
  if (m.type == "phi3") {
    c["architectures"] = {"Phi3ForCausalLM"};
    c["model_type"] = "phi3";
    // A base's window is kept (strata trained within it: model.context <= sliding_window).
    if (!c.contains("sliding_window")) c["sliding_window"] = nullptr;
  }
  const bool qwen3 = m.type == "llama" && m.qk_norm;
  const bool qwen2 = m.type == "llama" && m.attention_bias && !qwen3;
  if (m.type == "llama") {
    c["architectures"] = {qwen3   ? "Qwen3ForCausalLM"
                          : qwen2 ? "Qwen2ForCausalLM"
                                  : "LlamaForCausalLM"};
    c["model_type"] = qwen3 ? "qwen3" : qwen2 ? "qwen2" : "llama";
  }
  c["hidden_size"] = m.n_embd;
  c["num_hidden_layers"] = m.n_layer;
  c["num_attention_heads"] = m.n_head;
  c["num_key_value_heads"] = m.num_key_value_heads > 0 ? m.num_key_value_heads : m.n_head;
  c["head_dim"] = m.head_dim > 0 ? m.head_dim : m.n_embd / m.n_head;
  c["intermediate_size"] = m.intermediate_size;
  // Rotary positions have no weights: a model trained at a shorter context keeps the length
  // its checkpoint had.
  c["max_position_embeddings"] =
      std::max<int64_t>(m.context, c.value("max_position_embeddings", int64_t(0)));
  c["rms_norm_eps"] = m.rms_norm_eps;
  if (m.pad_token_id >= 0) c["pad_token_id"] = m.pad_token_id;
  c["rope_theta"] = m.rope_theta;
  c["hidden_act"] = "silu";
  c["initializer_range"] = 0.02;
  c["use_cache"] = true;
  if (qwen2 || qwen3) {
    c["use_sliding_window"] = false;
    c["sliding_window"] = nullptr;
    if (qwen3) c["attention_bias"] = m.attention_bias;
  } else if (m.type == "llama" || m.type == "phi3") {
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
  }
  // The rope in both spellings: transformers 5's "rope_parameters" (rope_theta inside), and
  // rope_theta + rope_scaling for the versions before.
  nlohmann::json rope = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
  if (m.rope_scaling.type == "llama3") {
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", m.rope_scaling.factor},
                         {"low_freq_factor", m.rope_scaling.low_freq_factor},
                         {"high_freq_factor", m.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings",
                          int64_t(m.rope_scaling.original_max_position_embeddings)}};
    rope = c["rope_scaling"];
    rope["rope_theta"] = m.rope_theta;
  } else {
    c["rope_scaling"] = nullptr;
  }
  c["rope_parameters"] = rope;
}

std::string llama_hf_key(const std::string& strata_key) {
  static const std::pair<const char*, const char*> kKeys[] = {
      {"model.n_layer", "num_hidden_layers"},
      {"model.n_head", "num_attention_heads"},
      {"model.n_embd", "hidden_size"},
      {"model.vocab_size", "vocab_size"},
      {"model.padded_vocab_size", "vocab_size"},
      {"model.context", "max_position_embeddings"},
      {"model.intermediate_size", "intermediate_size"},
      {"model.num_key_value_heads", "num_key_value_heads"},
      {"model.head_dim", "head_dim"},
      {"model.rope_theta", "rope_theta"},
      {"model.rms_norm_eps", "rms_norm_eps"},
      {"model.rope_scaling.factor", "rope_scaling.factor"},
      {"model.rope_scaling.low_freq_factor", "rope_scaling.low_freq_factor"},
      {"model.rope_scaling.high_freq_factor", "rope_scaling.high_freq_factor"},
      {"model.rope_scaling.original_max_position_embeddings",
       "rope_scaling.original_max_position_embeddings"},
  };
  for (const auto& [k, v] : kKeys) {
    if (strata_key == k) return v;
  }
  return "";
}

const ModelFamily& llama_family() {
  static const ModelFamily kFamily{
      .types = {"llama"},
      .hf_architectures = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM"},
      .create = create_llama,
      .lora_default_targets = {"q_proj", "v_proj"},
      .hf_read = llama_hf_read,
      .hf_write = llama_hf_write,
      .hf_key = [](const std::string&, const std::string& k) { return llama_hf_key(k); },
      .hf_embedding = "model.embed_tokens.weight",
  };
  return kFamily;
}

namespace {

// Phi3ForCausalLM's config.json: Llama's keys (a partial rotary embedding, Phi-4-mini's, is
// refused there); the dropouts transformers trains with (attention_dropout, resid_pdrop,
// embd_pdrop) are refused, as is longrope (Phi-3's 128k models) by the rope's own check.
Status phi3_hf_read(const HfConfigIn& in, const std::string& arch, ModelConfig* m,
                    HfShapeExtras* extras) {
  STRATA_RETURN_IF_ERROR(llama_hf_read(in, arch, m, extras), "");
  m->type = "phi3";
  const nlohmann::json& c = in.json();
  for (const char* key : {"attention_dropout", "resid_pdrop", "embd_pdrop"}) {
    if (c.contains(key) && !c[key].is_null() &&
        !(c[key].is_number() && c[key].get<double>() == 0.0)) {
      return in.bad(
          key, fmt::format("{}: strata trains without dropout here; set it to 0.0", c[key].dump()));
    }
  }
  return Status::ok();
}

}  // namespace

const ModelFamily& phi3_family() {
  static const ModelFamily kFamily{
      .types = {"phi3"},
      .hf_architectures = {"Phi3ForCausalLM"},
      .create = create_llama,
      .lora_default_targets = {"qkv_proj"},  // PEFT's for phi3
      .hf_read = phi3_hf_read,
      .hf_write = llama_hf_write,
      .hf_key = [](const std::string&, const std::string& k) { return llama_hf_key(k); },
      .hf_embedding = "model.embed_tokens.weight",
  };
  return kFamily;
}

}  // namespace strata
