// Chat (SFT) corpora for tests: an llm.c token file and its loss mask (src/train/loss_mask.h),
// written as tools/prepare_data.py --chat (or --format preference) writes them.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "src/train/loss_mask.h"
#include "strata/checksum.h"

namespace strata::test {

// `tokens` as an llm.c uint16 token file at `path` and `mask` as `path`.mask, its header's kind
// (word 6) `kind`. Returns `path`.
inline std::string write_masked(const std::string& path, const std::vector<int32_t>& tokens,
                                const std::vector<uint8_t>& mask, int32_t kind = kMaskPlain) {
  std::vector<uint16_t> t(tokens.begin(), tokens.end());
  int32_t h[256] = {20240520, 1, int32_t(t.size())};
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(h), sizeof h)
      .write(reinterpret_cast<const char*>(t.data()), std::streamsize(t.size() * 2));
  int32_t m[256] = {kMaskMagic, kMaskVersion, int32_t(t.size())};
  m[3] = int32_t(crc32_ieee(0, t.data(), t.size() * 2));
  m[4] = int32_t(crc32_ieee(0, mask.data(), mask.size()));
  for (uint8_t b : mask) m[5] += (b & kMaskStart) ? 1 : 0;
  m[6] = kind;
  std::ofstream(path + ".mask", std::ios::binary)
      .write(reinterpret_cast<const char*>(m), sizeof m)
      .write(reinterpret_cast<const char*>(mask.data()), std::streamsize(mask.size()));
  return path;
}

// `n` conversations of random tokens below `vocab`: each a prompt of 3..12 tokens below
// 3/4 vocab then an assistant reply of 2..10 tokens (its loss targets) in [3/4 vocab, +16),
// each a function of a prompt token, so that a model can learn them; a conversation's first
// token is marked as its start.
inline void chat_corpus(int n, int vocab, uint64_t seed, std::vector<int32_t>* tokens,
                        std::vector<uint8_t>* mask) {
  std::mt19937_64 rng(seed);
  for (int c = 0; c < n; ++c) {
    const int prompt = 3 + int(rng() % 10), reply = 2 + int(rng() % 9);
    const size_t first = tokens->size();
    for (int i = 0; i < prompt; ++i) {
      tokens->push_back(int32_t(rng() % uint64_t(vocab * 3 / 4)));
      mask->push_back(i == 0 ? kMaskStart : 0);
    }
    for (int i = 0; i < reply; ++i) {
      tokens->push_back(vocab * 3 / 4 + (*tokens)[first + size_t(i % prompt)] % 16);
      mask->push_back(kMaskLoss);
    }
  }
}

// One conversation appended to tokens/mask: `prompt` tokens then `reply` loss targets, token i
// (base + 7 i) % vocab, its first token marked as its start.
inline void append_conversation(int prompt, int reply, int base, int vocab,
                                std::vector<int32_t>* tokens, std::vector<uint8_t>* mask) {
  for (int i = 0; i < prompt + reply; ++i) {
    tokens->push_back((base + 7 * i) % vocab);
    mask->push_back(i == 0 ? kMaskStart : i >= prompt ? kMaskLoss : 0);
  }
}

}  // namespace strata::test
