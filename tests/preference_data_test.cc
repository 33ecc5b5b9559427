// Preference data (DPO): a loss mask whose header says preference pairs (src/train/loss_mask.h,
// tools/prepare_data.py --format preference) read as pairs of rows, chosen then rejected, each
// one conversation cut at T + 1 tokens; pairs without a loss target on either side left out;
// batches the same over ranks; the held-out split by pairs, its batches wrapping; every pair in
// order (pair_batch); the header's kind and pair count checked; a held-out file of another kind
// refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "src/train/data.h"
#include "src/train/loss_mask.h"
#include "strata/checksum.h"
#include "tests/sft_util.h"
#include "tests/test_util.h"

namespace strata {
namespace {

constexpr int kVocab = 256;

// A corpus of preference pairs: conversation 2k is pair k's chosen sequence, 2k + 1 its
// rejected one; starts[c] is conversation c's first token.
struct Pairs {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<size_t> starts;

  // A pair: a prompt of `prompt` tokens then a reply of `chosen` loss targets, and (a prompt of
  // `rejected_prompt`, default `prompt`) then a reply of `rejected` loss targets; each pair's
  // tokens its own (from `base`).
  void add(int prompt, int chosen, int rejected, int base, int rejected_prompt = -1) {
    starts.push_back(tokens.size());
    test::append_conversation(prompt, chosen, base, kVocab, &tokens, &mask);
    starts.push_back(tokens.size());
    test::append_conversation(rejected_prompt < 0 ? prompt : rejected_prompt, rejected, base + 3,
                              kVocab, &tokens, &mask);
  }
  size_t end(size_t c) const { return c + 1 < starts.size() ? starts[c + 1] : tokens.size(); }
  std::string write(const std::string& path) const {
    return test::write_masked(path, tokens, mask, kMaskPreference);
  }
};

// `n` pairs of varied lengths (all within a window of T = 32).
Pairs some_pairs(int n) {
  Pairs p;
  for (int k = 0; k < n; ++k) p.add(3 + k % 5, 2 + k % 4, 1 + (k * 7) % 6, 11 * k + 1);
  return p;
}

DataConfig data_config(const std::string& source, int T, double eval_fraction) {
  DataConfig dc;
  dc.source = source;
  dc.seq_len = T;
  dc.eval_fraction = eval_fraction;
  return dc;
}

// Row [T] of conversation `c` as the contract says, computed here from the corpus: its first
// min(length, T + 1) tokens, inputs padded with 0, targets the next tokens where the mask marks
// a loss target within the cut, -1 elsewhere.
void expect_row(const Pairs& p, size_t c, int T, const int32_t* tk, const int32_t* tg,
                const std::string& what) {
  const size_t a = p.starts[c], len = std::min(p.end(c) - a, size_t(T) + 1);
  for (size_t t = 0; t < size_t(T); ++t) {
    ASSERT_EQ(tk[t], t < len ? p.tokens[a + t] : 0) << what << " conversation " << c << " t " << t;
    const bool target = t + 1 < len && (p.mask[a + t + 1] & kMaskLoss);
    ASSERT_EQ(tg[t], target ? p.tokens[a + t + 1] : -1)
        << what << " conversation " << c << " t " << t;
  }
}

// The pair (k) whose chosen sequence row [T] starts with: rows are told apart by their first
// two tokens (each pair's tokens its own).
int pair_of(const Pairs& p, const int32_t* row) {
  for (size_t c = 0; c < p.starts.size(); c += 2) {
    if (p.tokens[p.starts[c]] == row[0] && p.tokens[p.starts[c] + 1] == row[1]) return int(c / 2);
  }
  return -1;
}

int64_t counted(const std::vector<int32_t>& targets) {
  return std::count_if(targets.begin(), targets.end(), [](int32_t y) { return y >= 0; });
}

// A mask file's bytes: the header (kind, conversations) and `mask`; the token CRC-32 0.
std::vector<char> mask_file(const std::vector<uint8_t>& mask, int32_t conversations, int32_t kind) {
  int32_t h[256] = {kMaskMagic, kMaskVersion, int32_t(mask.size()), 0};
  h[4] = int32_t(crc32_ieee(0, mask.data(), mask.size()));
  h[5] = conversations;
  h[6] = kind;
  std::vector<char> bytes(sizeof h + mask.size());
  std::memcpy(bytes.data(), h, sizeof h);
  std::memcpy(bytes.data() + sizeof h, mask.data(), mask.size());
  return bytes;
}

TEST(PreferenceMask, HeaderKindAndPairCountAreChecked) {
  const Pairs p = some_pairs(2);  // 4 conversations
  const size_t n = p.mask.size();
  auto plain = parse_loss_mask(mask_file(p.mask, 4, kMaskPlain), "p.mask", "p.bin", n, 0);
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  EXPECT_FALSE(plain->preference);
  EXPECT_EQ(plain->bytes, p.mask);
  auto pairs = parse_loss_mask(mask_file(p.mask, 4, kMaskPreference), "p.mask", "p.bin", n, 0);
  ASSERT_TRUE(pairs.is_ok()) << pairs.status().to_string();
  EXPECT_TRUE(pairs->preference);
  EXPECT_EQ(pairs->bytes, p.mask);
  // An odd count of conversations: refused for pairs; a plain mask's count stays unread.
  std::vector<uint8_t> three(p.mask.begin(), p.mask.begin() + std::ptrdiff_t(p.starts[3]));
  EXPECT_TRUE(
      parse_loss_mask(mask_file(three, 3, kMaskPlain), "p.mask", "p.bin", three.size(), 0).is_ok());
  struct Case {
    std::vector<char> bytes;
    size_t tokens;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {mask_file(three, 3, kMaskPreference), three.size(), "3 conversations (offset 20), an odd"},
      {mask_file(p.mask, 6, kMaskPreference), n,
       "says 6 conversations (offset 20) but the mask "
       "starts 4"},
      {mask_file(p.mask, 4, 2), n, "unknown kind 2 at header offset 24"},
      {mask_file(p.mask, 4, -1), n, "unknown kind -1 at header offset 24"},
  };
  for (const Case& c : cases) {
    auto m = parse_loss_mask(c.bytes, "p.mask", "p.bin", c.tokens, 0);
    ASSERT_FALSE(m.is_ok()) << c.expect;
    EXPECT_NE(m.status().message().find("p.mask: "), std::string::npos) << m.status().message();
    EXPECT_NE(m.status().message().find(c.expect), std::string::npos) << m.status().message();
  }
  // Through Dataset::load: the mask file named.
  const std::string dir = test::temp_dir("strata_pref", "kind");
  const std::string path = test::write_masked(dir + "/k.bin", p.tokens, p.mask, 5);
  auto d = Dataset::load(data_config(path, 32, 0.0), kVocab, 1);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find(path + ".mask: unknown kind 5"), std::string::npos)
      << d.status().message();
}

// Every pair in order: rows 2j and 2j + 1 the chosen and rejected sequences of pair j, each its
// own row; wrapping past the last pair.
TEST(PreferenceData, PairsInOrderChosenThenRejected) {
  const std::string dir = test::temp_dir("strata_pref", "order");
  const Pairs p = some_pairs(6);
  auto d = Dataset::load(data_config(p.write(dir + "/p.bin"), 32, 0.0), kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_TRUE(d->preference());
  EXPECT_TRUE(d->masked());
  EXPECT_FALSE(d->train_positions());
  EXPECT_FALSE(d->eval_positions());
  EXPECT_EQ(d->train_pairs(), 6u);
  EXPECT_EQ(d->eval_pairs(), 0u);
  EXPECT_EQ(d->train_windows(), 12u);
  EXPECT_NE(d->description().find("6 preference pairs"), std::string::npos) << d->description();
  EXPECT_NE(d->description().find("6 training, 0 held out"), std::string::npos) << d->description();
  const int T = 32;
  std::vector<int32_t> tk(12 * T), tg(12 * T);
  d->pair_batch(false, 0, 12, T, tk.data(), tg.data());
  for (size_t r = 0; r < 12; ++r) expect_row(p, r, T, &tk[r * T], &tg[r * T], "all pairs");
  d->pair_batch(false, 4, 6, T, tk.data(), tg.data());  // pairs 4, 5, then 0
  const size_t want[6] = {8, 9, 10, 11, 0, 1};
  for (size_t r = 0; r < 6; ++r) expect_row(p, want[r], T, &tk[r * T], &tg[r * T], "wrapped");
}

// data.loss_mask "none" reads a preference file as plain tokens (next-token loss everywhere, no
// pairs), and the data line says so and how to train DPO on it.
TEST(PreferenceData, MaskNotReadSaysItIsAPreferenceFile) {
  const std::string dir = test::temp_dir("strata_pref", "nomask");
  const Pairs p = some_pairs(4);
  DataConfig dc = data_config(p.write(dir + "/p.bin"), 32, 0.0);
  dc.loss_mask = "none";
  auto d = Dataset::load(dc, kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_FALSE(d->preference());
  EXPECT_FALSE(d->masked());
  EXPECT_NE(d->description().find("a preference file trained as plain text"), std::string::npos)
      << d->description();
  EXPECT_NE(d->description().find("data.loss_mask \"auto\" trains DPO"), std::string::npos);
}

// A sequence longer than T + 1 tokens is cut (its end dropped); a pair in which either side
// keeps no loss target is left out, and said so.
TEST(PreferenceData, SequencesCutAtTPlusOnePairsWithoutTargetsLeftOut) {
  const int T = 8;
  Pairs p;
  p.add(4, 10, 2, 1);      // chosen 14 tokens: cut at 9, 5 targets left
  p.add(12, 3, 3, 30);     // the prompt fills both windows: left out
  p.add(7, 1, 5, 60);      // rejected 12 tokens: 2 targets left
  p.add(4, 2, 3, 90, 9);   // the rejected side's prompt fills its window: left out
  p.add(8, 1, 1, 120, 8);  // each side's only target is the window's last token
  const std::string dir = test::temp_dir("strata_pref", "cut");
  auto d = Dataset::load(data_config(p.write(dir + "/p.bin"), T, 0.0), kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->train_pairs(), 3u);
  EXPECT_NE(d->description().find("2 left out"), std::string::npos) << d->description();
  size_t left_out = 0;
  const std::vector<PreferencePair> pairs =
      preference_pairs(p.mask, 0, p.mask.size(), T, &left_out);
  EXPECT_EQ(left_out, 2u);
  ASSERT_EQ(pairs.size(), 3u);
  EXPECT_EQ(pairs[0].chosen.off, p.starts[0]);
  EXPECT_EQ(pairs[0].chosen.len, 9u);
  EXPECT_EQ(pairs[0].chosen.targets, 5u);
  EXPECT_EQ(pairs[0].rejected.len, 6u);
  EXPECT_EQ(pairs[0].rejected.targets, 2u);
  EXPECT_EQ(pairs[1].chosen.off, p.starts[4]);
  EXPECT_EQ(pairs[1].rejected.len, 9u);
  EXPECT_EQ(pairs[1].rejected.targets, 2u);
  EXPECT_EQ(pairs[2].chosen.targets, 1u);
  EXPECT_EQ(pairs[2].rejected.targets, 1u);
  std::vector<int32_t> tk(6 * T), tg(6 * T);
  d->pair_batch(false, 0, 6, T, tk.data(), tg.data());
  const size_t kept[6] = {0, 1, 4, 5, 8, 9};
  for (size_t r = 0; r < 6; ++r) expect_row(p, kept[r], T, &tk[r * T], &tg[r * T], "kept");
  EXPECT_EQ(counted(tg), 5 + 2 + 1 + 2 + 1 + 1);
  // No pair left: an error naming the file and data.seq_len.
  Pairs none;
  none.add(12, 3, 3, 1);
  const std::string path = none.write(dir + "/none.bin");
  auto e = Dataset::load(data_config(path, T, 0.0), kVocab, 1);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find(path + ".mask leaves no preference pair"), std::string::npos)
      << e.status().message();
  EXPECT_NE(e.status().message().find("data.seq_len"), std::string::npos) << e.status().message();
}

// N ranks with B rows each see the rows one rank with N * B rows sees; each row pair is one
// pair's chosen then rejected sequence; the counts are the rows' targets; positions untouched.
TEST(PreferenceData, RanksSeeWhatOneRankSees) {
  const std::string dir = test::temp_dir("strata_pref", "ranks");
  const Pairs p = some_pairs(40);
  auto d = Dataset::load(data_config(p.write(dir + "/p.bin"), 32, 0.2), kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  const int T = 32, B = 4;
  std::vector<int32_t> one_tk(2 * B * T), one_tg(2 * B * T), tk(2 * B * T), tg(2 * B * T);
  std::vector<int32_t> positions(2 * B * T, -7);
  for (int step = 0; step < 4; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      d->train_batch(9, step, micro, 0, 2 * B, T, one_tk.data(), one_tg.data(), positions.data());
      int64_t by_ranks = 0;
      for (int rank = 0; rank < 2; ++rank) {
        d->train_batch(9, step, micro, rank, B, T, &tk[size_t(rank) * B * T],
                       &tg[size_t(rank) * B * T], positions.data());
        by_ranks += d->train_batch_targets(9, step, micro, rank, B, T);
      }
      EXPECT_EQ(tk, one_tk) << "step " << step << " micro " << micro;
      EXPECT_EQ(tg, one_tg) << "step " << step << " micro " << micro;
      EXPECT_EQ(by_ranks, counted(one_tg));
      EXPECT_EQ(d->train_batch_targets(9, step, micro, 0, 2 * B, T), counted(one_tg));
      for (size_t r = 0; r < size_t(2 * B); r += 2) {
        const int k = pair_of(p, &one_tk[r * T]);
        ASSERT_GE(k, 0) << "row " << r << " starts no chosen sequence";
        expect_row(p, size_t(2 * k), T, &one_tk[r * T], &one_tg[r * T], "chosen");
        expect_row(p, size_t(2 * k + 1), T, &one_tk[(r + 1) * T], &one_tg[(r + 1) * T], "rejected");
        EXPECT_LT(size_t(k), d->train_pairs()) << "a held-out pair in a training batch";
      }
    }
  }
  EXPECT_TRUE(std::all_of(positions.begin(), positions.end(), [](int32_t x) { return x == -7; }));
}

// data.eval_fraction's tail starts at a pair; eval batch i of each rank holds pairs
// (i * world * B/2 + rank * B/2 + j) mod eval_pairs(), wrapping; its counts are its targets.
TEST(PreferenceData, HeldOutTailByPairsEvalBatchesWrap) {
  const std::string dir = test::temp_dir("strata_pref", "eval");
  const Pairs p = some_pairs(31);
  auto d = Dataset::load(data_config(p.write(dir + "/p.bin"), 32, 0.17), kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  const size_t split = d->train_tokens();
  const auto at = std::find(p.starts.begin(), p.starts.end(), split);
  ASSERT_NE(at, p.starts.end()) << "the tail starts inside a conversation";
  const size_t first = size_t(at - p.starts.begin());
  EXPECT_EQ(first % 2, 0u) << "the tail starts at a rejected sequence";
  EXPECT_EQ(d->train_pairs(), first / 2);
  EXPECT_EQ(d->train_pairs() + d->eval_pairs(), 31u);
  const size_t P = d->eval_pairs();
  ASSERT_GT(P, 2u);
  const int T = 32, B = 4, world = 2;
  EXPECT_EQ(d->eval_windows(T), 2 * P);
  std::vector<int32_t> tk(B * T), tg(B * T), want_tk(2 * T), want_tg(2 * T);
  for (int i = 0; i < 4; ++i) {  // 16 pairs: past the held-out ones
    int64_t n = 0;
    for (int rank = 0; rank < world; ++rank) {
      d->eval_batch(i, B, T, tk.data(), tg.data(), rank, world);
      n += counted(tg);
      for (int j = 0; j < B / 2; ++j) {
        const size_t pair = (size_t(i) * world * 2 + size_t(rank) * 2 + size_t(j)) % P;
        expect_row(p, first + 2 * pair, T, &tk[size_t(2 * j) * T], &tg[size_t(2 * j) * T],
                   "eval chosen");
        expect_row(p, first + 2 * pair + 1, T, &tk[size_t(2 * j + 1) * T],
                   &tg[size_t(2 * j + 1) * T], "eval rejected");
        d->pair_batch(true, pair, 2, T, want_tk.data(), want_tg.data());
        EXPECT_TRUE(std::equal(want_tk.begin(), want_tk.end(), tk.begin() + 2 * j * T));
      }
    }
    EXPECT_EQ(d->eval_batch_targets(i, B, T, world), n) << "batch " << i;
  }
}

// data.eval_source must be of data.source's kind: pairs with pairs, plain with plain.
TEST(PreferenceData, EvalSourceOfAnotherKindIsRefused) {
  const std::string dir = test::temp_dir("strata_pref", "eval_source");
  const std::string pairs = some_pairs(10).write(dir + "/pairs.bin");
  const std::string held = some_pairs(4).write(dir + "/held.bin");
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  test::chat_corpus(20, kVocab, 3, &tokens, &mask);
  const std::string plain = test::write_masked(dir + "/plain.bin", tokens, mask);
  for (const auto& [source, eval_source] :
       std::vector<std::pair<std::string, std::string>>{{pairs, plain}, {plain, pairs}}) {
    DataConfig dc = data_config(source, 32, 0.1);
    dc.eval_source = eval_source;
    auto d = Dataset::load(dc, kVocab, 1);
    ASSERT_FALSE(d.is_ok()) << source << " " << eval_source;
    const std::string& m = d.status().message();
    EXPECT_NE(m.find("data.eval_source: '" + eval_source + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("data.source '" + source + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("--format preference"), std::string::npos) << m;
  }
  DataConfig dc = data_config(pairs, 32, 0.1);
  dc.eval_source = held;
  auto d = Dataset::load(dc, kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_TRUE(d->preference());
  EXPECT_EQ(d->train_pairs(), 10u);
  EXPECT_EQ(d->eval_pairs(), 4u);
}

}  // namespace
}  // namespace strata
