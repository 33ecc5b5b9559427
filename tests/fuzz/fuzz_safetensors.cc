// libFuzzer target: the safetensors reader (src/hf/safetensors.h). Input: the file.
// Besides "no crash", it checks what open() promises of a file it accepts, so a header whose
// numbers wrap around (an element count times the dtype size overflowing 64 bits, offsets past
// the end) is found even when nothing crashes: every tensor's bytes are its elements times its
// dtype's size, computed without overflow; every tensor lies inside the file; no two non-empty
// tensors overlap; find() returns each tensor by name. Tensors up to 1 MiB are then read and
// converted to fp32.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "src/hf/safetensors.h"
#include "strata/log.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_safetensors: accepted a file that breaks: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = (strata::set_log_level(strata::LogLevel::kOff), true);
  (void)quiet;
  strata::fuzz::MemFile mf(data, size);
  if (!mf.ok()) return 0;
  auto f = strata::SafetensorsFile::open(mf.path());
  if (!f.is_ok()) return 0;
  const auto& ts = (*f)->tensors();
  uint64_t end_of_previous = 0;
  for (const strata::SafetensorsTensor& t : ts) {
    unsigned __int128 n = 1;
    for (int64_t d : t.shape) {
      require(d >= 0, "a negative dimension");
      n *= uint64_t(d);
      require(n >> 64 == 0, "an element count past 2^64");
    }
    require(uint64_t(n) == t.numel(), "numel() disagrees with the shape");
    const unsigned __int128 bytes = n * strata::dtype_size(t.dtype);
    require(bytes == t.bytes, "bytes != elements x dtype size (overflow?)");
    require(t.offset >= 8 && t.offset <= size && t.bytes <= size - t.offset,
            "a tensor outside the file");
    if (t.bytes > 0) {
      require(t.offset >= end_of_previous, "overlapping tensors");
      end_of_previous = t.offset + t.bytes;
    }
    require((*f)->find(t.name) != nullptr, "find() misses a tensor");
    if (t.bytes <= (1u << 20)) {
      std::vector<unsigned char> raw(t.bytes);
      require((*f)->read(t, raw.data()).is_ok(), "reading an accepted tensor failed");
      std::vector<float> as_f32(t.numel());
      require((*f)->read_as(t, strata::DType::kF32, as_f32.data()).is_ok(),
              "converting an accepted tensor failed");
    }
  }
  return 0;
}
