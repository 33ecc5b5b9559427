// Shared by the LoRA tests: the Hugging Face fixtures and a LoRA config over one of them.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/config.h"
#include "tests/hf_test_util.h"
#include "tests/test_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata::test {

using json = nlohmann::json;

// configs/tiny-cpu.json with model.from_pretrained = `base`, fp32, and `lora` as its lora
// section, then `extra` overrides.
inline Result<Config> lora_config(const std::string& base, const json& lora,
                                  std::vector<std::string> extra = {}) {
  json doc = json::parse(read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"));
  doc.erase("model");
  doc["model"] = {{"from_pretrained", base}, {"context", 16}};
  doc["scheduler"]["params"]["warmup_num_steps"] = 1;
  if (!lora.is_null()) doc["lora"] = lora;
  extra.insert(extra.begin(), "bf16.enabled=false");
  return parse_config(doc.dump(), "<lora test>", extra);
}

// The base fixture a LoRA fixture adapts: "mixtral-experts" (lora-mixtral-experts) adapts
// mixtral.
inline std::string fixture_base(const std::string& name) {
  const std::string tail = "-experts";
  const bool experts =
      name.size() > tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  return experts ? name.substr(0, name.size() - tail.size()) : name;
}

// The fixture's lora section: what tools/make_lora_fixtures.py gave peft.
inline json fixture_lora(const std::string& base) {
  if (base == "mixtral-experts") {
    return {{"r", 4},
            {"lora_alpha", 8},
            {"target_modules", {"q_proj", "k_proj", "v_proj", "o_proj"}},
            {"target_parameters", {"experts.gate_up_proj", "experts.down_proj"}}};
  }
  if (base == "qwen2-moe-experts") {
    return {{"r", 4},
            {"lora_alpha", 8},
            {"target_modules", {"q_proj", "v_proj"}},
            {"target_parameters", {"gate_up_proj"}}};
  }
  if (base == "phi3") {
    return {{"r", 4},
            {"lora_alpha", 8},
            {"target_modules", {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}}};
  }
  if (base == "gpt2")
    return {{"r", 4}, {"lora_alpha", 8}, {"target_modules", {"c_attn", "c_proj", "c_fc"}}};
  if (base == "mixtral" || base == "qwen3-moe") {  // the attention: no shared expert
    return {
        {"r", 4}, {"lora_alpha", 8}, {"target_modules", {"q_proj", "k_proj", "v_proj", "o_proj"}}};
  }
  if (base == "qwen2-moe") {
    return {{"r", 4},
            {"lora_alpha", 8},
            {"target_modules",
             {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "shared_expert_gate"}}};
  }
  return {{"r", 4},
          {"lora_alpha", 8},
          {"target_modules",
           {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}};
}

}  // namespace strata::test
