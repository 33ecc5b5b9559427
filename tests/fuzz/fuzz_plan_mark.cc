// libFuzzer target: `strata plan`'s check of an existing output file for its own mark before it
// replaces it (tools/plan_mark.h: strata.written_by in a --write-config config, the magic of a
// --json report, the mark in an --svg chart). Input: byte 0 picks the flag; the rest is the
// file.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tools/plan_mark.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const char* kFlags[] = {"--write-config", "--json", "--svg", "--write-config"};
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  (void)strata::written_by_plan(kFlags[data[0] & 3], text);
  return 0;
}
