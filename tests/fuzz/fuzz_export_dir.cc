// libFuzzer target: what an export reads of the directory it is about to write
// (src/hf/export_dir.h check_export_owner): the lineage marker .strata-export.json, a PEFT
// adapter's adapter_config.json, a model's config.json. Input: byte 0 picks the writer (merged
// or adapter, its run_id, --force) and which files are there; the rest is the three files'
// contents, separated by NUL bytes (marker, adapter_config.json, config.json).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "src/hf/export_dir.h"
#include "strata/log.h"

namespace {

std::string g_dir;
const char* kFiles[] = {".strata-export.json", "adapter_config.json", "config.json",
                        "model.safetensors"};

void remove_dir() {
  for (const char* f : kFiles) ::unlink((g_dir + "/" + f).c_str());
  ::rmdir(g_dir.c_str());
}

std::string export_dir() {
  const char* tmp = std::getenv("TMPDIR");
  g_dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/strata-fuzz-export-XXXXXX";
  if (::mkdtemp(g_dir.data()) == nullptr) std::abort();
  std::atexit(remove_dir);
  return g_dir;
}

void put(const std::string& path, std::string_view text) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (!text.empty() && std::fwrite(text.data(), 1, text.size(), f) != text.size()) std::abort();
  std::fclose(f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = (strata::set_log_level(strata::LogLevel::kOff), true);
  (void)quiet;
  static const std::string dir = export_dir();
  if (size < 1) return 0;
  const uint8_t pick = data[0];
  std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  // Files 0..2 from the input's NUL-separated parts, each there when its bit of `pick` is set;
  // model.safetensors (empty) when bit 3 is.
  for (int i = 0; i < 3; ++i) {
    const size_t nul = rest.find('\0');
    const std::string_view part = rest.substr(0, nul);
    rest = nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);
    const std::string path = dir + "/" + kFiles[i];
    if (pick & (1 << i)) {
      put(path, part);
    } else {
      ::unlink(path.c_str());
    }
  }
  const std::string weights = dir + "/" + kFiles[3];
  if (pick & 8) {
    put(weights, "");
  } else {
    ::unlink(weights.c_str());
  }
  strata::ExportTarget t;
  t.dir = dir;
  t.key = "--adapter";
  t.run_id = (pick & 16) ? "run-a" : "";
  t.adapter = (pick & 32) != 0;
  t.force = (pick & 64) != 0;
  t.force_hint = " (or --force)";
  const strata::Status st = strata::check_export_owner(t);
  if (!st.is_ok() && st.message().find(dir) == std::string::npos) {
    std::fprintf(stderr, "fuzz_export_dir: an error without the directory: %s\n",
                 st.message().c_str());
    std::abort();
  }
  return 0;
}
