// The process's memory: /proc/self/status and the malloc heap's bound (process_memory.h).
#include "src/train/process_memory.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "strata/log.h"

namespace strata {

size_t proc_status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(f, line)) {
    if (line.compare(0, n, key) == 0)
      return size_t(std::strtoull(line.c_str() + n, nullptr, 10)) * 1024;
  }
  return 0;
}

void bound_malloc_heap() {
#ifdef M_MMAP_THRESHOLD
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") ||
      (tunables && std::strstr(tunables, "mmap_threshold"))) {
    return;
  }
  constexpr int kMmapThreshold = 1 << 20;
  if (mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1) {
    log_warn("trainer: mallopt(M_MMAP_THRESHOLD) failed; the malloc heap may hold freed pages");
  }
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") ||
      (tunables && std::strstr(tunables, "trim_threshold"))) {
    return;
  }
  constexpr int kTrimThreshold = 8 << 20;
  mallopt(M_TRIM_THRESHOLD, kTrimThreshold);  // fails only where the first did (ASan's malloc)
#endif
}

}  // namespace strata
