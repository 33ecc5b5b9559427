#include "src/train/loss_mask.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "strata/checksum.h"

namespace strata {

Result<LossMask> parse_loss_mask(const std::vector<char>& bytes, const std::string& path,
                                 const std::string& token_path, size_t tokens, uint32_t token_crc) {
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
  if (h[6] != kMaskPlain && h[6] != kMaskPreference) {
    return corrupt(fmt::format(
        "{}: unknown kind {} at header offset 24 (0: conversations, 1: preference pairs); {}", path,
        h[6], fix));
  }
  LossMask out;
  out.preference = h[6] == kMaskPreference;
  std::vector<uint8_t>& mask = out.bytes;
  mask.assign(bytes.begin() + 1024, bytes.end());
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
  if (out.preference) {
    size_t starts = 0;
    for (uint8_t m : mask) starts += (m & kMaskStart) ? 1 : 0;
    if (h[5] < 0 || h[5] % 2 != 0) {
      return corrupt(
          fmt::format("{}: preference pairs (header offset 24) but {} conversations (offset 20), "
                      "an odd count: each pair is a chosen and a rejected sequence; {}",
                      path, h[5], fix));
    }
    if (starts != size_t(h[5])) {
      return corrupt(
          fmt::format("{}: the header says {} conversations (offset 20) but the mask starts {}; "
                      "preference pairs need them to agree; {}",
                      path, h[5], starts, fix));
    }
  }
  return out;
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

std::vector<PreferencePair> preference_pairs(const std::vector<uint8_t>& mask, size_t begin,
                                             size_t end, int T, size_t* left_out) {
  std::vector<PreferencePair> out;
  std::vector<PackedWindow> seq;  // the current pair's sequences
  const size_t span = size_t(T) + 1;
  for (size_t pos = begin; pos < end;) {
    size_t next = pos + 1;
    while (next < end && !(mask[next] & kMaskStart)) ++next;
    PackedWindow w{pos, uint32_t(std::min(next - pos, span)), 0};
    for (size_t i = pos + 1; i < pos + w.len; ++i) w.targets += mask[i] & kMaskLoss;
    seq.push_back(w);
    if (seq.size() == 2) {
      if (seq[0].targets > 0 && seq[1].targets > 0) {
        out.push_back({seq[0], seq[1]});
      } else {
        ++*left_out;
      }
      seq.clear();
    }
    pos = next;
  }
  STRATA_CHECK(seq.empty(), "preference_pairs: the range holds an odd number of conversations");
  return out;
}

}  // namespace strata
