// libFuzzer target: the machine-profile reader (`strata probe` output the planner reads).
// Input: byte 0 picks median or fastest rates; the rest is the JSON.
#include <cstddef>
#include <cstdint>
#include <string>

#include "src/plan/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto p = strata::parse_machine_profile(text, "<fuzz>", (data[0] & 1) != 0);
  if (p.is_ok()) (void)strata::gemm_rate_at(*p, 256, 512);
  return 0;
}
