// libFuzzer target: `strata trace replay`'s reader of a recorded access trace (Trace::from_jsonl,
// JSON lines: a header, then one access a line) and, for a trace it accepts, one replay step of
// each policy against a small cache (src/tiers/trace.h). Input: the file.
#include <cstddef>
#include <cstdint>
#include <string>

#include "src/tiers/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto t = strata::Trace::from_jsonl(text);
  if (!t.is_ok()) return 0;
  strata::ReplayOptions o;
  o.capacity = 1 << 20;
  o.bandwidth = 25e9;
  o.prefetch_bytes = 1 << 19;
  o.steps = 1;
  for (auto p :
       {strata::CachePolicy::kLru, strata::CachePolicy::kBelady, strata::CachePolicy::kStrata}) {
    (void)strata::replay(*t, p, o);
  }
  return 0;
}
