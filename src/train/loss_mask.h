// A token file's loss mask (chat / SFT data, tools/prepare_data.py --chat; preference pairs,
// --format preference) and the packing of conversations into training windows.
//
// The mask is a sidecar file, <token file>.mask (data.loss_mask "auto" reads it when it exists):
//   a 256 x int32 little-endian header: [0] magic 20261125, [1] version 1, [2] token count,
//   [3] CRC-32 (IEEE, zlib.crc32) of the token file's token bytes (after an llm.c header, or the
//   whole raw file), [4] CRC-32 of the mask bytes that follow, [5] conversations, [6] the kind:
//   0 plain conversations, 1 preference pairs (kMaskPreference); the rest 0;
//   then one byte per token: bit 0 (kMaskLoss) = the token is a loss target (the prediction of
//   token i from the tokens before it counts: an assistant turn's), bit 1 (kMaskStart) = the
//   token starts a conversation (token 0 always does); the other bits are 0.
// Preference pairs (DPO's data): conversation 2k is pair k's chosen sequence, 2k + 1 its
// rejected one; [5] is then even and counts the conversation starts. A file written before the
// kind existed has 0 there and reads as plain conversations.
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
constexpr int32_t kMaskPlain = 0;       // header word 6: conversations
constexpr int32_t kMaskPreference = 1;  // header word 6: conversations in (chosen, rejected) pairs

// A parsed mask: one byte per token, and whether its conversations are preference pairs.
struct LossMask {
  std::vector<uint8_t> bytes;
  bool preference = false;
};

// Checks `bytes`, the content of mask file `path`, against `tokens` tokens whose bytes' CRC-32
// is `token_crc` (`token_path` names them in errors). An unknown kind (header word 6), and for
// preference pairs an odd conversation count or one the conversation starts do not match, is an
// error naming the file and the value.
Result<LossMask> parse_loss_mask(const std::vector<char>& bytes, const std::string& path,
                                 const std::string& token_path, size_t tokens, uint32_t token_crc);

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

// A preference pair's two sequences, each one conversation as a window (not packed with others).
struct PreferencePair {
  PackedWindow chosen, rejected;
};

// The preference pairs of mask[begin, end) (`begin` a chosen sequence's start, the
// conversations in pairs): each sequence is its conversation cut at T + 1 tokens (its end
// dropped, as TRL truncates a completion's end), its targets those left. A pair in which either
// sequence has no loss target left is left out and counted in *left_out.
std::vector<PreferencePair> preference_pairs(const std::vector<uint8_t>& mask, size_t begin,
                                             size_t end, int T, size_t* left_out);

}  // namespace strata
