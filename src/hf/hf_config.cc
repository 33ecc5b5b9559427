#include "src/hf/hf_config.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "src/base/json_text.h"
#include "src/hf/safetensors.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;

// Whether the checkpoint in `dir` holds a `head` tensor whose values differ from `embedding`'s,
// read from the files HfCheckpointReader reads (model.safetensors, else the index's shards).
// False when either is absent or cannot be read: the reader reports those.
bool head_differs(const std::string& dir, const std::string& head, const std::string& embedding) {
  // The file that holds each tensor, as HfCheckpointReader::open picks the files.
  std::string head_file, embedding_file;
  const std::string single = dir + "/model.safetensors";
  struct stat st {};
  if (::stat(single.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    head_file = embedding_file = single;
  } else {
    auto map = read_safetensors_index(dir + "/model.safetensors.index.json");
    if (!map.is_ok() || !map->count(head) || !map->count(embedding)) return false;
    head_file = dir + "/" + map->at(head);
    embedding_file = dir + "/" + map->at(embedding);
  }
  auto fh = SafetensorsFile::open(head_file);
  auto fe = SafetensorsFile::open(embedding_file);
  if (!fh.is_ok() || !fe.is_ok()) return false;
  const SafetensorsTensor* h = (*fh)->find(head);
  const SafetensorsTensor* e = (*fe)->find(embedding);
  if (!h || !e) return false;
  if (h->shape != e->shape) return true;
  // Compared as fp32 values, a chunk at a time (a distinct head differs in its first chunk).
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<float> x, y;
  for (size_t first = 0; first < h->numel(); first += kChunk) {
    const size_t n = std::min<size_t>(kChunk, h->numel() - first);
    x.resize(n);
    y.resize(n);
    if (!(*fh)->read_as(tensor_elements(*h, first, n), DType::kF32, x.data()).is_ok() ||
        !(*fe)->read_as(tensor_elements(*e, first, n), DType::kF32, y.data()).is_ok()) {
      return false;
    }
    if (std::memcmp(x.data(), y.data(), n * sizeof(float)) != 0) return true;
  }
  return false;
}

}  // namespace

Result<ModelConfig> model_config_from_hf(const std::string& dir, int context) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  if (!in) {
    return not_found(fmt::format(
        "{}: cannot open (model.from_pretrained must name a Hugging Face model directory)", path));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  Result<json> parsed = parse_json_text(text, path);
  if (!parsed.is_ok()) return corrupt(parsed.status().message());
  json c = std::move(parsed).value();
  if (!c.is_object()) return corrupt(path + ": not a JSON object");
  auto bad = [&](const std::string& key, const std::string& why) {
    return invalid_argument(fmt::format("{}: {}: {}", path, key, why));
  };
  // Typed getters: a present key of the wrong type is an error; an absent one takes `dflt`.
  // Every integer read is a size or a count: 1 .. 2^31-1 (a larger one must not wrap into int).
  auto get_int = [&](const char* key, int dflt, int* out) -> Status {
    if (!c.contains(key) || c[key].is_null()) {
      if (dflt < 0) return bad(key, "missing");
      *out = dflt;
      return Status::ok();
    }
    const json& v = c[key];
    if (!v.is_number_integer()) return bad(key, "not an integer");
    // (nlohmann parses a non-negative literal as unsigned, a negative one as signed.)
    const bool in_range = v.is_number_unsigned()
                              ? v.get<uint64_t>() >= 1 && v.get<uint64_t>() <= uint64_t(INT_MAX)
                              : v.get<int64_t>() >= 1 && v.get<int64_t>() <= INT_MAX;
    if (!in_range) {
      return bad(key, fmt::format("{} is not a size strata takes (1 to {})", v.dump(), INT_MAX));
    }
    *out = v.get<int>();
    return Status::ok();
  };
  // Epsilons, rope bases and factors: positive.
  auto real_in = [&](const json& obj, const std::string& where, const char* key, double dflt,
                     double* out) -> Status {
    if (!obj.contains(key) || obj[key].is_null()) {
      *out = dflt;
      return Status::ok();
    }
    if (!obj[key].is_number()) return bad(where + key, "not a number");
    *out = obj[key].get<double>();
    if (!(*out > 0)) return bad(where + key, fmt::format("{} is not positive", obj[key].dump()));
    return Status::ok();
  };
  auto get_real = [&](const char* key, double dflt, double* out) -> Status {
    return real_in(c, "", key, dflt, out);
  };
  auto get_string = [&](const json& obj, const std::string& where, const char* key,
                        const std::string& dflt, std::string* out) -> Status {
    if (!obj.contains(key) || obj[key].is_null()) {
      *out = dflt;
      return Status::ok();
    }
    if (!obj[key].is_string()) {
      return bad(where + key, fmt::format("{} is not a string", obj[key].dump()));
    }
    *out = obj[key].get<std::string>();
    return Status::ok();
  };
  auto get_bool = [&](const char* key, bool dflt, bool* out) -> Status {
    if (!c.contains(key) || c[key].is_null()) {
      *out = dflt;
      return Status::ok();
    }
    if (!c[key].is_boolean()) return bad(key, "not true/false");
    *out = c[key].get<bool>();
    return Status::ok();
  };

  // A mixture's keys (src/model/moe.h): Mixtral's num_local_experts (its experts' width is
  // intermediate_size; its top-k always renormalized), Qwen2-MoE's num_experts,
  // moe_intermediate_size, shared expert and norm_topk_prob (every layer sparse).
  auto read_moe = [&](const std::string& arch, ModelConfig* m) -> Status {
    const bool mixtral = arch == "MixtralForCausalLM";
    STRATA_RETURN_IF_ERROR(
        get_int(mixtral ? "num_local_experts" : "num_experts", -1, &m->num_experts), "");
    STRATA_RETURN_IF_ERROR(get_int("num_experts_per_tok", 2, &m->num_experts_per_tok), "");
    const char* coef = "router_aux_loss_coef";
    if (c.contains(coef) && !c[coef].is_null()) {
      if (!c[coef].is_number() || !(c[coef].get<double>() >= 0)) {
        return bad(coef, fmt::format("{} is not a number >= 0", c[coef].dump()));
      }
      m->router_aux_loss_coef = c[coef].get<double>();
    }
    if (mixtral) {
      m->norm_topk_prob = true;
      if (c.contains("router_jitter_noise") && c["router_jitter_noise"].is_number() &&
          c["router_jitter_noise"].get<double>() != 0.0) {
        return bad("router_jitter_noise",
                   fmt::format("{}: strata's router does not jitter its input; set it to 0",
                               c["router_jitter_noise"].dump()));
      }
      return Status::ok();
    }
    m->attention_bias = true;  // qkv_bias, true unless said otherwise
    STRATA_RETURN_IF_ERROR(get_bool("qkv_bias", true, &m->attention_bias), "");
    STRATA_RETURN_IF_ERROR(get_int("moe_intermediate_size", -1, &m->moe_intermediate_size), "");
    if (c.contains("shared_expert_intermediate_size") &&
        c["shared_expert_intermediate_size"] != 0) {
      STRATA_RETURN_IF_ERROR(
          get_int("shared_expert_intermediate_size", 0, &m->shared_expert_intermediate_size), "");
    }
    STRATA_RETURN_IF_ERROR(get_bool("norm_topk_prob", false, &m->norm_topk_prob), "");
    int step = 1;
    STRATA_RETURN_IF_ERROR(get_int("decoder_sparse_step", 1, &step), "");
    if (step != 1 || (c.contains("mlp_only_layers") && c["mlp_only_layers"].is_array() &&
                      !c["mlp_only_layers"].empty())) {
      return bad(step != 1 ? "decoder_sparse_step" : "mlp_only_layers",
                 "strata's qwen2_moe has a mixture in every layer (decoder_sparse_step 1, no "
                 "mlp_only_layers)");
    }
    return Status::ok();
  };

  if (!c.contains("architectures") || !c["architectures"].is_array() ||
      c["architectures"].empty() || !c["architectures"][0].is_string()) {
    return bad("architectures", "missing (expected e.g. [\"LlamaForCausalLM\"])");
  }
  const std::string arch = c["architectures"][0].get<std::string>();
  ModelConfig m;
  int max_pos = 0;
  if (arch == "GPT2LMHeadModel") {
    m.type = "gpt2";
    STRATA_RETURN_IF_ERROR(get_int("n_embd", -1, &m.n_embd), "");
    STRATA_RETURN_IF_ERROR(get_int("n_layer", -1, &m.n_layer), "");
    STRATA_RETURN_IF_ERROR(get_int("n_head", -1, &m.n_head), "");
    STRATA_RETURN_IF_ERROR(get_int("vocab_size", -1, &m.vocab_size), "");
    STRATA_RETURN_IF_ERROR(get_int("n_positions", 1024, &max_pos), "");
    m.tied_embeddings = true;
    double eps = 1e-5;
    STRATA_RETURN_IF_ERROR(get_real("layer_norm_epsilon", 1e-5, &eps), "");
    if (std::fabs(eps - 1e-5) > 1e-12) {
      return bad("layer_norm_epsilon", fmt::format("{} is not 1e-5, the only one strata's "
                                                   "layernorm has",
                                                   eps));
    }
    if (c.contains("n_inner") && !c["n_inner"].is_null() && c["n_inner"] != 4 * m.n_embd) {
      return bad("n_inner", fmt::format("{} is not 4 * n_embd, the MLP width strata's GPT-2 has",
                                        c["n_inner"].dump()));
    }
    for (const char* k : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"}) {
      if (c.value(k, false) == true) {
        return bad(k, "true is not supported (strata's attention scales by 1/sqrt(head size))");
      }
    }
    if (c.contains("scale_attn_weights") && c["scale_attn_weights"] == false) {
      return bad("scale_attn_weights", "false is not supported");
    }
    STRATA_RETURN_IF_ERROR(get_bool("tie_word_embeddings", true, &m.tied_embeddings), "");
    if (c.contains("activation_function") && c["activation_function"] != "gelu_new") {
      return bad("activation_function",
                 fmt::format("{} is not gelu_new (GPT-2's tanh GELU, the one strata has)",
                             c["activation_function"].dump()));
    }
  } else if (arch == "LlamaForCausalLM" || arch == "MistralForCausalLM" ||
             arch == "Qwen2ForCausalLM" || arch == "MixtralForCausalLM" ||
             arch == "Qwen2MoeForCausalLM") {
    m.type = arch == "MixtralForCausalLM"    ? "mixtral"
             : arch == "Qwen2MoeForCausalLM" ? "qwen2_moe"
                                             : "llama";
    STRATA_RETURN_IF_ERROR(get_int("hidden_size", -1, &m.n_embd), "");
    STRATA_RETURN_IF_ERROR(get_int("num_hidden_layers", -1, &m.n_layer), "");
    STRATA_RETURN_IF_ERROR(get_int("num_attention_heads", -1, &m.n_head), "");
    STRATA_RETURN_IF_ERROR(get_int("num_key_value_heads", m.n_head, &m.num_key_value_heads), "");
    STRATA_RETURN_IF_ERROR(get_int("intermediate_size", -1, &m.intermediate_size), "");
    STRATA_RETURN_IF_ERROR(get_int("vocab_size", -1, &m.vocab_size), "");
    STRATA_RETURN_IF_ERROR(get_int("max_position_embeddings", 2048, &max_pos), "");
    STRATA_RETURN_IF_ERROR(get_real("rms_norm_eps", 1e-6, &m.rms_norm_eps), "");
    // transformers 5 writes rope_theta and the scaling into one "rope_parameters" object;
    // earlier versions write rope_theta and rope_scaling.
    const char* rope_key = c.contains("rope_parameters") && c["rope_parameters"].is_object()
                               ? "rope_parameters"
                               : "rope_scaling";
    if (std::string(rope_key) == "rope_parameters" && c[rope_key].contains("rope_theta")) {
      if (!c[rope_key]["rope_theta"].is_number())
        return bad("rope_parameters.rope_theta", "not a number");
      m.rope_theta = c[rope_key]["rope_theta"].get<double>();
    } else {
      STRATA_RETURN_IF_ERROR(get_real("rope_theta", 10000.0, &m.rope_theta), "");
    }
    STRATA_RETURN_IF_ERROR(get_bool("tie_word_embeddings", false, &m.tied_embeddings), "");
    STRATA_RETURN_IF_ERROR(get_bool("attention_bias", false, &m.attention_bias), "");
    if (arch == "Qwen2ForCausalLM") m.attention_bias = true;  // Qwen2 always has q/k/v biases
    if (m.type != "llama") STRATA_RETURN_IF_ERROR(read_moe(arch, &m), "");
    if (c.contains("head_dim") && !c["head_dim"].is_null() && m.n_head > 0 &&
        c["head_dim"] != m.n_embd / m.n_head) {
      return bad("head_dim", fmt::format("{} differs from hidden_size / num_attention_heads = {}; "
                                         "strata's llama needs them equal",
                                         c["head_dim"].dump(), m.n_embd / m.n_head));
    }
    if (c.contains("hidden_act") && c["hidden_act"] != "silu") {
      return bad("hidden_act", fmt::format("{} is not silu (SwiGLU)", c["hidden_act"].dump()));
    }
    if (c.contains(rope_key) && !c[rope_key].is_null()) {
      const json& r = c[rope_key];
      const std::string where = std::string(rope_key) + ".";
      if (!r.is_object()) {
        return bad(rope_key, fmt::format("{} is not an object", r.dump()));
      }
      std::string type;
      STRATA_RETURN_IF_ERROR(get_string(r, where, "type", "default", &type), "");
      STRATA_RETURN_IF_ERROR(get_string(r, where, "rope_type", type, &type), "");
      if (type == "llama3") {
        m.rope_scaling.type = "llama3";
        auto& rs = m.rope_scaling;
        STRATA_RETURN_IF_ERROR(real_in(r, where, "factor", 8.0, &rs.factor), "");
        STRATA_RETURN_IF_ERROR(real_in(r, where, "low_freq_factor", 1.0, &rs.low_freq_factor), "");
        STRATA_RETURN_IF_ERROR(real_in(r, where, "high_freq_factor", 4.0, &rs.high_freq_factor),
                               "");
        STRATA_RETURN_IF_ERROR(real_in(r, where, "original_max_position_embeddings", 8192.0,
                                       &rs.original_max_position_embeddings),
                               "");
      } else if (type != "default") {
        return bad(rope_key, fmt::format("rope type \"{}\" is not supported (llama3 is)", type));
      }
    }
  } else if (arch == "Qwen3MoeForCausalLM" || arch == "OlmoeForCausalLM") {
    return bad("architectures",
               fmt::format("\"{}\" normalizes its queries and keys (q_norm, k_norm), which "
                           "strata's attention does not; MixtralForCausalLM and "
                           "Qwen2MoeForCausalLM are the mixtures it trains",
                           arch));
  } else {
    return bad("architectures",
               fmt::format("\"{}\" is not one strata trains (LlamaForCausalLM, "
                           "MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, "
                           "Qwen2MoeForCausalLM, GPT2LMHeadModel)",
                           arch));
  }
  if (context > max_pos) {
    return invalid_argument(
        fmt::format("model.context: {} exceeds the checkpoint's max_position_embeddings {} ({})",
                    context, max_pos, path));
  }
  m.context = context > 0 ? context : max_pos;
  // Sliding-window attention would need a banded mask strata does not have.
  bool use_sliding_window = false;
  if (arch == "Qwen2ForCausalLM" || arch == "Qwen2MoeForCausalLM") {
    STRATA_RETURN_IF_ERROR(get_bool("use_sliding_window", false, &use_sliding_window), "");
  }
  const bool sliding =
      arch == "MistralForCausalLM" || arch == "MixtralForCausalLM" || use_sliding_window;
  if (sliding && c.contains("sliding_window") && c["sliding_window"].is_number_integer() &&
      c["sliding_window"].get<double>() < m.context) {  // double: any integer compares right
    const std::string w = c["sliding_window"].dump();
    return bad("sliding_window",
               fmt::format("{} is shorter than the context {}: strata's attention is full "
                           "causal; set model.context <= {} to train this model exactly",
                           w, m.context, w));
  }
  // "dtype" from transformers 5 on, "torch_dtype" before.
  const char* dt_key = c.contains("dtype") ? "dtype" : "torch_dtype";
  std::string dt;
  STRATA_RETURN_IF_ERROR(get_string(c, "", dt_key, "float32", &dt), "");
  if (dt == "bfloat16") {
    m.dtype = DType::kBF16;
  } else if (dt == "float16") {
    m.dtype = DType::kF16;
  } else if (dt == "float32") {
    m.dtype = DType::kF32;
  } else {
    return bad(dt_key, fmt::format("\"{}\" is not bfloat16, float16 or float32", dt));
  }
  // transformers ties the head to the embedding only when the weights agree: a checkpoint with
  // its own, different lm_head.weight is loaded untied, whatever config.json says.
  const char* embedding = m.type == "gpt2" ? "transformer.wte.weight" : "model.embed_tokens.weight";
  if (m.tied_embeddings && head_differs(dir, "lm_head.weight", embedding)) {
    log_warn(
        "{}: tie_word_embeddings is true, but the weights hold an lm_head.weight that differs "
        "from {}; the model is trained untied, as transformers loads it (set "
        "tie_word_embeddings to false there to silence this)",
        path, embedding);
    m.tied_embeddings = false;
  }
  const int64_t padded = (int64_t{m.vocab_size} + 63) / 64 * 64;
  if (padded > INT_MAX) {
    return bad("vocab_size",
               fmt::format("{} is too large to pad to a multiple of 64", m.vocab_size));
  }
  m.padded_vocab_size = int(padded);
  return m;
}

std::string hf_config_key(const std::string& type, const std::string& strata_key) {
  static const std::map<std::string, std::pair<const char*, const char*>> kKeys = {
      // strata key: {llama's, gpt2's}
      {"model.n_layer", {"num_hidden_layers", "n_layer"}},
      {"model.n_head", {"num_attention_heads", "n_head"}},
      {"model.n_embd", {"hidden_size", "n_embd"}},
      {"model.vocab_size", {"vocab_size", "vocab_size"}},
      {"model.padded_vocab_size", {"vocab_size", "vocab_size"}},
      {"model.context", {"max_position_embeddings", "n_positions"}},
      {"model.intermediate_size", {"intermediate_size", ""}},
      {"model.num_key_value_heads", {"num_key_value_heads", ""}},
      {"model.rope_theta", {"rope_theta", ""}},
      {"model.rms_norm_eps", {"rms_norm_eps", ""}},
      {"model.rope_scaling.factor", {"rope_scaling.factor", ""}},
      {"model.rope_scaling.low_freq_factor", {"rope_scaling.low_freq_factor", ""}},
      {"model.rope_scaling.high_freq_factor", {"rope_scaling.high_freq_factor", ""}},
      {"model.rope_scaling.original_max_position_embeddings",
       {"rope_scaling.original_max_position_embeddings", ""}},
  };
  // A mixture's keys (read_moe): Mixtral counts its experts in num_local_experts.
  if (strata_key == "model.num_experts") {
    return type == "mixtral" ? "num_local_experts" : type == "qwen2_moe" ? "num_experts" : "";
  }
  for (const char* k : {"num_experts_per_tok", "moe_intermediate_size",
                        "shared_expert_intermediate_size", "router_aux_loss_coef"}) {
    if (strata_key == std::string("model.") + k && (type == "mixtral" || type == "qwen2_moe")) {
      return k;
    }
  }
  auto it = kKeys.find(strata_key);
  if (it == kKeys.end()) return "";
  return type == "gpt2" ? it->second.second : it->second.first;
}

std::string hf_config_json(const ModelConfig& m) {
  json c = json::object();
  if (!m.from_pretrained.empty()) {
    std::ifstream in(m.from_pretrained + "/config.json");
    std::stringstream ss;
    ss << in.rdbuf();
    json base = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    if (base.is_object()) {
      // What strata writes below, in either transformers spelling, is strata's to say.
      for (const char* k : {"dtype", "torch_dtype", "rope_parameters", "rope_scaling", "rope_theta",
                            "architectures", "model_type", "transformers_version"}) {
        base.erase(k);
      }
      c = std::move(base);
    }
  }
  // Both spellings: "dtype" (transformers 5 on), "torch_dtype" (the versions before).
  c["dtype"] = m.dtype == DType::kBF16  ? "bfloat16"
               : m.dtype == DType::kF16 ? "float16"
                                        : "float32";
  c["torch_dtype"] = c["dtype"];
  c["vocab_size"] = m.vocab_size;
  c["tie_word_embeddings"] = m.tied_embeddings;
  if (m.type == "llama" || m.type == "mixtral" || m.type == "qwen2_moe") {
    const bool mixtral = m.type == "mixtral", qwen2_moe = m.type == "qwen2_moe";
    const bool qwen2 = m.type == "llama" && m.attention_bias;
    c["architectures"] = {mixtral     ? "MixtralForCausalLM"
                          : qwen2_moe ? "Qwen2MoeForCausalLM"
                          : qwen2     ? "Qwen2ForCausalLM"
                                      : "LlamaForCausalLM"};
    c["model_type"] = mixtral ? "mixtral" : qwen2_moe ? "qwen2_moe" : qwen2 ? "qwen2" : "llama";
    c["hidden_size"] = m.n_embd;
    c["num_hidden_layers"] = m.n_layer;
    c["num_attention_heads"] = m.n_head;
    c["num_key_value_heads"] = m.num_key_value_heads > 0 ? m.num_key_value_heads : m.n_head;
    c["head_dim"] = m.n_embd / m.n_head;
    c["intermediate_size"] = m.intermediate_size;
    // Rotary positions have no weights: a model trained at a shorter context keeps the length
    // its checkpoint had.
    c["max_position_embeddings"] =
        std::max<int64_t>(m.context, c.value("max_position_embeddings", int64_t(0)));
    c["rms_norm_eps"] = m.rms_norm_eps;
    c["rope_theta"] = m.rope_theta;
    c["hidden_act"] = "silu";
    c["initializer_range"] = 0.02;
    c["use_cache"] = true;
    if (mixtral || qwen2_moe) {
      c["num_experts_per_tok"] = m.num_experts_per_tok;
      c["router_aux_loss_coef"] = m.router_aux_loss_coef;
      c["output_router_logits"] = false;
    }
    if (mixtral) {
      c["num_local_experts"] = m.num_experts;
      c["intermediate_size"] =
          m.moe_intermediate_size > 0 ? m.moe_intermediate_size : m.intermediate_size;
      c["router_jitter_noise"] = 0.0;
      c["sliding_window"] = nullptr;
    } else if (qwen2_moe) {
      c["num_experts"] = m.num_experts;
      c["moe_intermediate_size"] =
          m.moe_intermediate_size > 0 ? m.moe_intermediate_size : m.intermediate_size;
      c["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
      c["norm_topk_prob"] = m.norm_topk_prob;
      c["qkv_bias"] = m.attention_bias;
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = json::array();
      c["use_sliding_window"] = false;
      c["sliding_window"] = nullptr;
    } else if (qwen2) {
      c["use_sliding_window"] = false;
      c["sliding_window"] = nullptr;
    } else {
      c["attention_bias"] = false;
      c["mlp_bias"] = false;
    }
    // The rope in both spellings: transformers 5's "rope_parameters" (rope_theta inside), and
    // rope_theta + rope_scaling for the versions before.
    json rope = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
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
  } else {
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
  return c.dump(2) + "\n";
}

}  // namespace strata
