// libFuzzer target: a PEFT adapter's adapter_config.json as strata reads it before an adapter
// directory's tensors are used (src/hf/adapter_config.h; `--adapter` directories, export
// --adapter's guard). Input: byte 0 picks what the model expects (r, lora_alpha / r, the
// target modules); the rest is adapter_config.json.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "src/hf/adapter_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const int kR[] = {1, 4, 8, 64};
  static const float kScaling[] = {2.0f, 1.0f, 0.5f, 16.0f};
  strata::AdapterExpectation want;
  want.r = kR[data[0] & 3];
  want.scaling = kScaling[(data[0] >> 2) & 3];
  want.target_modules =
      (data[0] & 16) ? std::set<std::string>{"q_proj", "v_proj"} : std::set<std::string>{"c_attn"};
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const strata::Status st = strata::check_adapter_config(text, "adapter_config.json", want);
  // A refusal names the file it refuses.
  if (!st.is_ok() && st.message().find("adapter_config.json") == std::string::npos) {
    std::fprintf(stderr, "fuzz_adapter_config: an error without the path: %s\n",
                 st.message().c_str());
    std::abort();
  }
  return 0;
}
