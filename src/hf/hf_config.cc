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
#include "src/model/family.h"
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
  const HfConfigIn cfg(c, path);
  if (!c.contains("architectures") || !c["architectures"].is_array() ||
      c["architectures"].empty() || !c["architectures"][0].is_string()) {
    return cfg.bad("architectures", "missing (expected e.g. [\"LlamaForCausalLM\"])");
  }
  const std::string arch = c["architectures"][0].get<std::string>();
  const ModelFamily* family = family_for_hf_architecture(arch);
  if (arch == "OlmoeForCausalLM") {
    return cfg.bad("architectures",
                   fmt::format("\"{}\" normalizes its queries and keys over all heads at once, "
                               "which strata's attention does not (Qwen3's per-head q_norm and "
                               "k_norm it does); MixtralForCausalLM, Qwen2MoeForCausalLM and "
                               "Qwen3MoeForCausalLM are the mixtures it trains",
                               arch));
  }
  if (family == nullptr) {
    return cfg.bad("architectures", fmt::format("\"{}\" is not one strata trains ({})", arch,
                                                family_hf_architecture_names()));
  }
  ModelConfig m;
  HfShapeExtras extras;
  STRATA_RETURN_IF_ERROR(family->hf_read(cfg, arch, &m, &extras), "");
  const int max_pos = extras.max_positions;
  if (context > max_pos) {
    return invalid_argument(
        fmt::format("model.context: {} exceeds the checkpoint's max_position_embeddings {} ({})",
                    context, max_pos, path));
  }
  m.context = context > 0 ? context : max_pos;
  // Sliding-window attention would need a banded mask strata does not have.
  if (extras.sliding && c.contains("sliding_window") && c["sliding_window"].is_number_integer() &&
      c["sliding_window"].get<double>() < m.context) {  // double: any integer compares right
    const std::string w = c["sliding_window"].dump();
    return cfg.bad("sliding_window",
                   fmt::format("{} is shorter than the context {}: strata's attention is full "
                               "causal; set model.context <= {} to train this model exactly",
                               w, m.context, w));
  }
  // "dtype" from transformers 5 on, "torch_dtype" before.
  const char* dt_key = c.contains("dtype") ? "dtype" : "torch_dtype";
  std::string dt;
  STRATA_RETURN_IF_ERROR(cfg.get_string(c, "", dt_key, "float32", &dt), "");
  if (dt == "bfloat16") {
    m.dtype = DType::kBF16;
  } else if (dt == "float16") {
    m.dtype = DType::kF16;
  } else if (dt == "float32") {
    m.dtype = DType::kF32;
  } else {
    return cfg.bad(dt_key, fmt::format("\"{}\" is not bfloat16, float16 or float32", dt));
  }
  // transformers ties the head to the embedding only when the weights agree: a checkpoint with
  // its own, different lm_head.weight is loaded untied, whatever config.json says.
  const char* embedding = family->hf_embedding;
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
    return cfg.bad("vocab_size",
                   fmt::format("{} is too large to pad to a multiple of 64", m.vocab_size));
  }
  m.padded_vocab_size = int(padded);
  return m;
}

std::string hf_config_key(const std::string& type, const std::string& strata_key) {
  const ModelFamily* family = family_for_type(type);
  return family ? family->hf_key(type, strata_key) : "";
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
  const ModelFamily* family = family_for_type(m.type);
  STRATA_CHECK(family != nullptr, "hf_config_json: a model.type no family has");
  family->hf_write(m, &c);
  return c.dump(2) + "\n";
}

}  // namespace strata
