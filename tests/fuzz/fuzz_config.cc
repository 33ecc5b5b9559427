// libFuzzer target: the config parser, file text and `--set` overrides.
// Input: the config text, then NUL-separated `--set` values ("path=value").
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/log.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = (strata::set_log_level(strata::LogLevel::kOff), true);
  (void)quiet;
  const std::string all(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t nul = all.find('\0', start);
    parts.push_back(all.substr(start, nul == std::string::npos ? nul : nul - start));
    if (nul == std::string::npos) break;
    start = nul + 1;
  }
  const std::string text = parts.front();
  parts.erase(parts.begin());
  const int world = 1 + int(size % 3);
  auto cfg = strata::parse_config(text, "<fuzz>", parts, world);
  if (cfg.is_ok()) {
    (void)cfg->train_batch_size;
  } else {
    (void)cfg.status().message().size();
  }
  (void)strata::parse_size(text);
  return 0;
}
