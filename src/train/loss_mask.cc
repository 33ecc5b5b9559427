#include "src/train/loss_mask.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "strata/checksum.h"

namespace strata {

Result<std::vector<uint8_t>> parse_loss_mask(const std::vector<char>& bytes,
                                             const std::string& path, const std::string& token_path,
                                             size_t tokens, uint32_t token_crc) {
  const std::string fix = fmt::format(
      "rewrite it with tools/prepare_data.py --chat (with the token file), or set "
      "data.loss_mask = \"none\" to train on every token");
  if (bytes.size() < 1024) {
    return corrupt(
        fmt::format("{}: a loss mask needs a 1024-byte header, the file has {} bytes; {}", path,
                    bytes.size(), fix));
  }
  int32_t h[256];
  std::memcpy(h, bytes.data(), sizeof(h));
  if (h[0] != kMaskMagic) {
    return corrupt(fmt::format("{}: not a strata loss mask (magic {} at offset 0, expected {}); {}",
                               path, h[0], kMaskMagic, fix));
  }
  if (h[1] != kMaskVersion) {
    return corrupt(
        fmt::format("{}: loss mask version {} at offset 4; this strata reads version {}; {}", path,
                    h[1], kMaskVersion, fix));
  }
  const size_t count = static_cast<uint32_t>(h[2]);
  if (count != tokens) {
    return corrupt(
        fmt::format("{}: the mask is for {} tokens (header offset 8) but {} holds {}; {}", path,
                    count, token_path, tokens, fix));
  }
  if (bytes.size() != 1024 + count) {
    return corrupt(
        fmt::format("{}: the header says {} mask bytes but the file holds {} after the "
                    "header (it is {}); {}",
                    path, count, bytes.size() - 1024,
                    bytes.size() < 1024 + count ? "truncated" : "longer than it says", fix));
  }
  if (static_cast<uint32_t>(h[3]) != token_crc) {
    return corrupt(fmt::format(
        "{}: written for other tokens than {}'s (token CRC-32 {:08x} in the header at offset 12, "
        "the file's is {:08x}); {}",
        path, token_path, static_cast<uint32_t>(h[3]), token_crc, fix));
  }
  const uint32_t crc = crc32_ieee(0, bytes.data() + 1024, count);
  if (static_cast<uint32_t>(h[4]) != crc) {
    return corrupt(
        fmt::format("{}: corrupt: its mask bytes' CRC-32 is {:08x}, the header (offset "
                    "16) says {:08x}; {}",
                    path, crc, static_cast<uint32_t>(h[4]), fix));
  }
  const std::vector<uint8_t> mask(bytes.begin() + 1024, bytes.end());
  for (size_t i = 0; i < count; ++i) {
    if (mask[i] & ~(kMaskLoss | kMaskStart)) {
      return corrupt(
          fmt::format("{}: byte {} at offset {} (token {}) has bits other than loss (1) "
                      "and conversation start (2); {}",
                      path, mask[i], 1024 + i, i, fix));
    }
  }
  if (count > 0 && !(mask[0] & kMaskStart)) {
    return corrupt(fmt::format(
        "{}: token 0 (offset 1024) does not start a conversation (bit 2 clear); {}", path, fix));
  }
  return mask;
}

std::vector<PackedWindow> pack_windows(const std::vector<uint8_t>& mask, size_t begin, size_t end,
                                       int T) {
  std::vector<PackedWindow> out;
  const size_t span = size_t(T) + 1;
  size_t pos = begin;
  while (pos + 1 < end) {
    const size_t limit = std::min(pos + span, end);
    size_t stop = limit;  // the window holds tokens [pos, stop)
    size_t next = limit;
    if (limit < end) {
      // The last conversation start in (pos, limit]: the window ends before it.
      size_t s = limit;
      while (s > pos && !(mask[s] & kMaskStart)) --s;
      if (s > pos) {
        stop = next = s;
      } else {
        next = pos + size_t(T);  // one conversation longer than the window: cut it
      }
    }
    PackedWindow w{pos, uint32_t(stop - pos), 0};
    for (size_t i = pos + 1; i < stop; ++i) w.targets += mask[i] & kMaskLoss;
    if (w.targets > 0) out.push_back(w);
    pos = next;
  }
  return out;
}

}  // namespace strata
