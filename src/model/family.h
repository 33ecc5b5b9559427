// A model family: what the engine knows of it beyond its block definition's compute — the
// model.type names it answers to, how its Architecture is built, the linear layers LoRA adapts
// by default, and how it reads and writes transformers' config.json. Each family defines itself
// in its block file (gpt2.cc, llama.cc, moe.cc); model_families() is the one list of them, so a
// new family is its block file, its fixtures and one line there. src/hf/hf_config.cc reads and
// writes config.json through these, and create_architecture() builds from them.
//
// Thread safety: the families are immutable static objects.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata {

// A typed reader over a config.json object: a present key of the wrong type is an error naming
// the file and the key; an absent (or null) key takes the default given.
class HfConfigIn {
 public:
  HfConfigIn(const nlohmann::json& c, std::string path) : c_(c), path_(std::move(path)) {}
  const nlohmann::json& json() const { return c_; }
  bool has(const char* key) const { return c_.contains(key) && !c_[key].is_null(); }
  // "<path>: <key>: <why>", kInvalidArgument.
  Status bad(const std::string& key, const std::string& why) const;
  // A size or a count, 1 .. 2^31-1; `dflt` < 0: the key is required.
  Status get_int(const char* key, int dflt, int* out) const;
  // A positive number (epsilons, rope bases and factors) of `obj` (a nested object, named
  // `where` + key in errors).
  Status get_real(const nlohmann::json& obj, const std::string& where, const char* key, double dflt,
                  double* out) const;
  Status get_real(const char* key, double dflt, double* out) const {
    return get_real(c_, "", key, dflt, out);
  }
  Status get_string(const nlohmann::json& obj, const std::string& where, const char* key,
                    const std::string& dflt, std::string* out) const;
  Status get_bool(const char* key, bool dflt, bool* out) const;

 private:
  const nlohmann::json& c_;
  std::string path_;
};

// What a family's config.json reader found besides the ModelConfig's fields.
struct HfShapeExtras {
  int max_positions = 0;  // max_position_embeddings / n_positions: the longest context
  bool sliding = false;   // its attention is windowed where config.json's sliding_window says
};

struct ModelFamily {
  std::vector<std::string> types;             // model.type values; the first is the name
  std::vector<std::string> hf_architectures;  // config.json "architectures"[0] values it reads
  Result<std::unique_ptr<Architecture>> (*create)(const ModelConfig& config) = nullptr;
  std::vector<std::string> lora_default_targets;  // lora.target_modules when not given
  // Reads the shape of a checkpoint of architecture `arch` (one of hf_architectures) into `m`
  // (model.type included); errors name the file and the key, and the fix.
  Status (*hf_read)(const HfConfigIn& in, const std::string& arch, ModelConfig* m,
                    HfShapeExtras* extras) = nullptr;
  // Writes `m`'s shape into `c` (architectures and model_type included), as transformers
  // reads it back; `c` already holds the source checkpoint's other keys, dtype and vocab_size.
  void (*hf_write)(const ModelConfig& m, nlohmann::json* c) = nullptr;
  // The config.json key a strata model.* key comes from for model.type `type` ("" none).
  std::string (*hf_key)(const std::string& type, const std::string& strata_key) = nullptr;
  const char* hf_embedding = "";  // the embedding's tensor name (a tied head is compared to it)
};

// Every family, in a fixed order.
const std::vector<const ModelFamily*>& model_families();
// The family model.type `type` names / config.json architecture `arch` is, nullptr for none.
const ModelFamily* family_for_type(const std::string& type);
const ModelFamily* family_for_hf_architecture(const std::string& arch);
// "gpt2, llama, mixtral, qwen2_moe" / "GPT2LMHeadModel, LlamaForCausalLM, ...": for errors.
std::string family_type_names();
std::string family_hf_architecture_names();

// The families' own definitions (their block files).
const ModelFamily& gpt2_family();       // src/model/gpt2.cc
const ModelFamily& llama_family();      // src/model/llama.cc
const ModelFamily& phi3_family();       // src/model/llama.cc
const ModelFamily& mixtral_family();    // src/model/moe.cc
const ModelFamily& qwen2_moe_family();  // src/model/moe.cc

// Llama's config.json reading and writing, which the mixtures built on its block extend.
Status llama_hf_read(const HfConfigIn& in, const std::string& arch, ModelConfig* m,
                     HfShapeExtras* extras);
void llama_hf_write(const ModelConfig& m, nlohmann::json* c);
std::string llama_hf_key(const std::string& strata_key);

}  // namespace strata
