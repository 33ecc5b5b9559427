// A token file's loss mask (chat / SFT data, tools/prepare_data.py --chat) and the packing of
// conversations into training windows.
//
// The mask is a sidecar file, <token file>.mask (data.loss_mask "auto" reads it when it exists):
//   a 256 x int32 little-endian header: [0] magic 20261125, [1] version 1, [2] token count,
//   [3] CRC-32 (IEEE, zlib.crc32) of the token file's token bytes (after an llm.c header, or the
//   whole raw file), [4] CRC-32 of the mask bytes that follow, [5] conversations; the rest 0;
//   then one byte per token: bit 0 (kMaskLoss) = the token is a loss target (the prediction of
//   token i from the tokens before it counts: an assistant turn's), bit 1 (kMaskStart) = the
//   token starts a conversation (token 0 always does); the other bits are 0.
// A mask that does not match its tokens (another count, another token file, a corrupt byte) is
// an error naming the mask file and what differs, before anything trains.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata {

constexpr uint8_t kMaskLoss = 1;
constexpr uint8_t kMaskStart = 2;
constexpr int32_t kMaskMagic = 20261125;
constexpr int32_t kMaskVersion = 1;

// Checks `bytes`, the content of mask file `path`, against `tokens` tokens whose bytes' CRC-32
// is `token_crc` (`token_path` names them in errors). Returns one byte per token.
Result<std::vector<uint8_t>> parse_loss_mask(const std::vector<char>& bytes,
                                             const std::string& path, const std::string& token_path,
                                             size_t tokens, uint32_t token_crc);

// A training window of a masked corpus: tokens [off, off + len), len <= T + 1: inputs
// [off, off + len - 1) (padded to T), targets [off + 1, off + len) where their kMaskLoss bit is
// set (the rest, and the padding, are ignored: -1); `targets` counts them.
struct PackedWindow {
  size_t off = 0;
  uint32_t len = 0;
  uint32_t targets = 0;
};

// Packs the conversations of mask[begin, end) into windows of T inputs: each window starts at
// a conversation start and holds the whole conversations that fit in T + 1 tokens; a
// conversation longer than that is cut into windows of T targets each (each piece sees only
// itself). Windows without any loss target are left out (they add nothing to the loss).
std::vector<PackedWindow> pack_windows(const std::vector<uint8_t>& mask, size_t begin, size_t end,
                                       int T);

}  // namespace strata
