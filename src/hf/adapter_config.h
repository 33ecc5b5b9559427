// A PEFT adapter's adapter_config.json, as strata reads it: before any tensor of an adapter
// directory is used (HfAdapterReader::open), its config must describe the adapters this model
// has (model.lora): peft_type "LORA" (no DoRA; rsLoRA's use_rslora read), r and the scaling
// (lora_alpha / r, or / sqrt(r) with use_rslora) the model's, target_modules the model's
// adapted sites (a list of names, "all-linear", or the config's own pattern), target_parameters
// the model's adapted expert parameters (lora.target_parameters), and nothing
// strata's adapters cannot hold (bias, modules_to_save, lora_bias, layers_to_transform,
// rank_pattern, alpha_pattern); lora_dropout is checked, not compared.
//
// The text is the file's bytes, whatever they are (a truncated copy, another tool's JSON, a
// document nested 100,000 deep): every failure is a Status naming `path` and what is wrong,
// never a crash or an exception. Thread-safe (no shared state).
#pragma once

#include <set>
#include <string>

#include "strata/status.h"

namespace strata {

// What the model's lora section makes of an adapter (LoraLayout: r, scaling, the adapted
// sites' last names, "q_proj"; whether it adapts every linear layer, its target pattern).
struct AdapterExpectation {
  int r = 0;
  float scaling = 0;
  std::set<std::string> target_modules;
  bool all_sites = false;      // lora.target_modules "all-linear"
  std::string target_pattern;  // lora.target_modules as a pattern string; "" for a list
  // The adapted expert parameters' names in a block ("mlp.experts.gate_up_proj"): the
  // adapter's target_parameters (absent: none) must select exactly these, each of its names
  // the whole name or its last parts.
  std::set<std::string> target_parameters;
};

// OK when `text` (adapter_config.json's contents, read from `path`) describes adapters as
// `want` says. kInvalidArgument otherwise, naming `path`, the value found (cut to 40
// characters) and the config key to set.
Status check_adapter_config(const std::string& text, const std::string& path,
                            const AdapterExpectation& want);

}  // namespace strata
