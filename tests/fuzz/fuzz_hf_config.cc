// libFuzzer target: a Hugging Face model directory's config.json (src/hf/hf_config.h).
// Input: byte 0 picks model.context (0 = max_position_embeddings, or 1, 64, 4096 ...), the rest
// is config.json, written to a directory of this process's own under $TMPDIR (the reader takes
// a directory).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "src/hf/hf_config.h"
#include "strata/log.h"

namespace {

std::string g_dir;

void remove_model_dir() {
  ::unlink((g_dir + "/config.json").c_str());
  ::rmdir(g_dir.c_str());
}

std::string model_dir() {
  const char* tmp = std::getenv("TMPDIR");
  g_dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/strata-fuzz-hf-XXXXXX";
  if (::mkdtemp(g_dir.data()) == nullptr) std::abort();
  std::atexit(remove_model_dir);
  return g_dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = (strata::set_log_level(strata::LogLevel::kOff), true);
  (void)quiet;
  static const std::string dir = model_dir();
  static const std::string path = dir + "/config.json";
  if (size < 1) return 0;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 1 && std::fwrite(data + 1, 1, size - 1, f) != size - 1) std::abort();
  std::fclose(f);
  static const int kContexts[] = {0, 1, 64, 4096, 131072, -1, 2147483647, 8};
  auto m = strata::model_config_from_hf(dir, kContexts[data[0] & 7]);
  if (m.is_ok()) {
    // What the reader promises of a config it accepts.
    if (m->n_embd < 1 || m->n_layer < 1 || m->n_head < 1 || m->vocab_size < 1 || m->context < 1 ||
        m->padded_vocab_size < m->vocab_size) {
      std::fprintf(stderr, "fuzz_hf_config: accepted a non-positive size\n");
      std::abort();
    }
  }
  return 0;
}
