// A PEFT adapter's adapter_config.json, as strata reads it: before any tensor of an adapter
// directory is used (HfAdapterReader::open), its config must describe the adapters this model
// has (model.lora): peft_type "LORA", plain LoRA (no use_dora, no use_rslora), r and lora_alpha
// / r the model's, target_modules the model's adapted sites.
//
// The text is the file's bytes, whatever they are (a truncated copy, another tool's JSON, a
// document nested 100,000 deep): every failure is a Status naming `path` and what is wrong,
// never a crash or an exception. Thread-safe (no shared state).
#pragma once

#include <set>
#include <string>

#include "strata/status.h"

namespace strata {

// What the model's lora section makes of an adapter (LoraLayout: r, scaling = lora_alpha / r,
// the adapted sites' last names, "q_proj").
struct AdapterExpectation {
  int r = 0;
  float scaling = 0;
  std::set<std::string> target_modules;
};

// OK when `text` (adapter_config.json's contents, read from `path`) describes adapters as
// `want` says. kInvalidArgument otherwise, naming `path`, the value found (cut to 40
// characters) and the config key to set.
Status check_adapter_config(const std::string& text, const std::string& path,
                            const AdapterExpectation& want);

}  // namespace strata
