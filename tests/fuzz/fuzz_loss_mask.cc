// libFuzzer target: the loss-mask sidecar's parser (parse_loss_mask), the packing of
// conversations into windows (pack_windows) and the split of preference pairs
// (preference_pairs). Input: byte 0 picks the window length T (1..64), byte 1 whether the
// header's mask CRC is set right before parsing (so that most inputs reach the checks after
// it); the rest is the mask file. The token count and token CRC the parser is
// given are the header's own, so the count and token-CRC checks pass and the body is parsed.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "src/train/loss_mask.h"
#include "strata/checksum.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int T = 1 + data[0] % 64;
  const bool fix_crc = data[1] & 1;
  std::vector<char> bytes(data + 2, data + size);
  size_t tokens = bytes.size() > 1024 ? bytes.size() - 1024 : 0;
  uint32_t token_crc = 0;
  if (bytes.size() >= 1024) {
    int32_t h[256];
    std::memcpy(h, bytes.data(), sizeof(h));
    tokens = static_cast<uint32_t>(h[2]);
    token_crc = uint32_t(h[3]);
    if (fix_crc) {
      const uint32_t crc = strata::crc32_ieee(0, bytes.data() + 1024, bytes.size() - 1024);
      std::memcpy(bytes.data() + 4 * 4, &crc, 4);
    }
  }
  auto parsed = strata::parse_loss_mask(bytes, "fuzz.mask", "fuzz.bin", tokens, token_crc);
  if (parsed.is_ok()) {
    const std::vector<uint8_t>& mask = parsed->bytes;
    const auto windows = strata::pack_windows(mask, 0, mask.size(), T);
    for (const auto& w : windows) {
      if (w.off + w.len > mask.size() || w.len > uint32_t(T) + 1 || w.targets == 0) {
        __builtin_trap();
      }
    }
    // A mask accepted as preference pairs splits into them (an even count of conversations).
    if (parsed->preference) {
      size_t left_out = 0;
      const auto pairs = strata::preference_pairs(mask, 0, mask.size(), T, &left_out);
      for (const auto& p : pairs) {
        for (const auto& w : {p.chosen, p.rejected}) {
          if (w.off + w.len > mask.size() || w.len > uint32_t(T) + 1 || w.targets == 0) {
            __builtin_trap();
          }
        }
      }
    }
  }
  // The packer on any bytes: it sees only masks the parser accepted, which need not hold the
  // conversation-start bit at token 0; it must not read outside [begin, end) either way.
  std::vector<uint8_t> raw(data + 2, data + size);
  if (!raw.empty()) {
    const size_t begin = data[1] % raw.size();
    for (const auto& w : strata::pack_windows(raw, begin, raw.size(), T)) {
      if (w.off < begin || w.off + w.len > raw.size() || w.len > uint32_t(T) + 1) {
        __builtin_trap();
      }
    }
  }
  return 0;
}
