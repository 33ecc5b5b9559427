// libFuzzer target: the checkpoint reader (header, metadata, payload checksum, streaming into
// buffers), the shard-manifest reader, and the resume checks against a fixed run.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "src/checkpoint/checkpoint.h"
#include "src/train/resume_check.h"
#include "strata/log.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = (strata::set_log_level(strata::LogLevel::kOff), true);
  (void)quiet;
  strata::fuzz::MemFile f(data, size);
  if (!f.ok()) return 0;
  const std::string path = f.path();
  (void)strata::read_shard_manifest(path);
  auto meta = strata::read_checkpoint_meta(path);
  if (meta.is_ok()) {
    // Buffers as the metadata asks (the reader checked that the file holds them all).
    std::vector<float> master;
    std::vector<char> m, v;
    auto staging = [&](size_t i, strata::CheckpointBuffers* out) {
      const size_t n = meta->modules[i].numel;
      const size_t mb = meta->moment_dtype == "bf16" ? 2 : 4;
      master.assign(n, 0.0f);
      m.assign(n * mb, 0);
      v.assign(n * mb, 0);
      *out = {master.data(), m.data(), v.data(), mb};
      return strata::Status::ok();
    };
    auto sink = [](size_t, const strata::CheckpointBuffers&) { return strata::Status::ok(); };
    (void)strata::read_checkpoint(path, staging, sink);
  }
  strata::CheckpointMeta mine;
  mine.model_shape = "L=1 NH=1 C=4 V=8 Vp=8 T=4 tied=1";
  mine.moment_dtype = "fp32";
  mine.optimizer_state = "adam";
  mine.modules = {{"embedding", 64}, {"block.0", 200}, {"final_norm", 8}};
  (void)strata::check_resume(path, mine, 100);
  return 0;
}
