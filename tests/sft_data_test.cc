// Chat (SFT) data: the loss mask beside a token file (src/train/loss_mask.h), the packing of
// conversations into windows, the masked batches and their target counts, data.eval_source,
// a mask that does not match its tokens refused before training, and a held-out loss that falls
// when a model trains on the assistant turns. (transformers' loss with labels = -100 on the same
// tokens: tools/check_sft_loss.py, ctest sft_loss_transformers; ranks: zero3_test's
// MaskedLossIsTheGlobalMean.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "src/train/data.h"
#include "src/train/loss_mask.h"
#include "src/train/trainer.h"
#include "tests/sft_util.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

// The optimizer's swap files in the test's own directory (tiny-cpu's runs/swap is shared by
// every test that ctest runs beside this one: a second run there is refused as in use).
std::string own_swap(const std::string& dir) {
  return "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"";
}

constexpr int kVocab = 256;  // configs/tiny-cpu.json's

DataConfig data_config(const std::string& source, int T = 64) {
  DataConfig dc;
  dc.source = source;
  dc.seq_len = T;
  dc.eval_fraction = 0.2;
  return dc;
}

// A chat corpus of `conversations` (test::chat_corpus) written as `dir`/`name` and its mask.
struct ChatFile {
  std::string path;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
};

ChatFile chat_file(const std::string& dir, const std::string& name, int conversations,
                   uint64_t seed) {
  ChatFile c;
  test::chat_corpus(conversations, kVocab, seed, &c.tokens, &c.mask);
  c.path = test::write_masked(dir + "/" + name, c.tokens, c.mask);
  return c;
}

// Mask bytes of the windows' tokens, conversation by conversation: lengths 5 and 4 fit one
// window of T = 8 inputs (9 tokens) whole; the third (12 tokens) is cut into two windows.
TEST(PackWindows, WholeConversationsPerWindowLongOnesCut) {
  std::vector<uint8_t> mask(21, kMaskLoss);
  mask[0] = mask[5] = mask[9] = kMaskStart;  // starts carry no loss (a prompt's first token)
  const std::vector<PackedWindow> w = pack_windows(mask, 0, mask.size(), 8);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].off, 0u);
  EXPECT_EQ(w[0].len, 9u);      // tokens 0..8: both conversations
  EXPECT_EQ(w[0].targets, 7u);  // 1..8 but the start at 5
  EXPECT_EQ(w[1].off, 9u);
  EXPECT_EQ(w[1].len, 9u);  // tokens 9..17: the long one's first T + 1
  EXPECT_EQ(w[1].targets, 8u);
  EXPECT_EQ(w[2].off, 17u);  // its token 17 is the next piece's first input, not a target twice
  EXPECT_EQ(w[2].len, 4u);
  EXPECT_EQ(w[2].targets, 3u);
  // A window without a loss target is left out.
  std::vector<uint8_t> prompts(mask.size(), 0);
  prompts[0] = prompts[9] = kMaskStart;
  prompts[12] = kMaskLoss;
  const std::vector<PackedWindow> one = pack_windows(prompts, 0, prompts.size(), 8);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].off, 9u);
}

// Every row of a masked batch starts at a conversation start; its targets are the tokens that
// follow where the mask says so, -1 elsewhere; the counts the trainer divides by are theirs.
TEST(SftData, BatchesStartAtConversationsAndCountTheirTargets) {
  const ChatFile c = chat_file(test::temp_dir("strata_sft", "batches"), "chat.bin", 300, 7);
  const std::vector<int32_t>& tokens = c.tokens;
  const std::vector<uint8_t>& mask = c.mask;
  auto d = Dataset::load(data_config(c.path), kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  ASSERT_TRUE(d->masked());
  EXPECT_NE(d->description().find("loss mask"), std::string::npos) << d->description();
  const int B = 4, T = 64;
  std::vector<int32_t> tk(B * T), tg(B * T);
  for (int step = 0; step < 5; ++step) {
    d->train_batch(1, step, 0, 0, B, T, tk.data(), tg.data());
    int64_t counted = 0;
    for (int b = 0; b < B; ++b) {
      // Find the row in the corpus: it starts where a conversation does.
      size_t off = 0;
      for (; off + 1 < tokens.size(); ++off) {
        if ((mask[off] & kMaskStart) && tokens[off] == tk[b * T] &&
            tokens[off + 1] == tk[b * T + 1]) {
          break;
        }
      }
      ASSERT_LT(off + 1, tokens.size()) << "row " << b << " does not start a conversation";
      for (int t = 0; t < T; ++t) {
        const int32_t y = tg[size_t(b) * T + t];
        if (y < 0) continue;
        ++counted;
        ASSERT_LT(off + t + 1, tokens.size());
        EXPECT_TRUE(mask[off + t + 1] & kMaskLoss) << "row " << b << " target " << t;
        EXPECT_EQ(y, tokens[off + t + 1]);
      }
    }
    EXPECT_EQ(counted, d->train_batch_targets(1, step, 0, 0, B, T));
    EXPECT_GT(counted, 0);
  }
  // The eval windows hold every held-out conversation once (each fits a window whole): their
  // targets are the split's loss tokens.
  int64_t held_out = 0;
  for (size_t i = d->train_tokens(); i < tokens.size(); ++i) held_out += mask[i] & kMaskLoss;
  int64_t windows = 0;
  for (size_t w = 0; w < d->eval_windows(T); ++w) windows += d->eval_window_targets(w, T);
  EXPECT_EQ(windows, held_out);
  EXPECT_TRUE(mask[d->train_tokens()] & kMaskStart) << "the held-out tail starts a conversation";
}

// A mask that does not match its tokens is an error naming the mask file and what differs;
// data.loss_mask = "none" trains on every token instead.
TEST(SftData, BadMaskFilesAreRefusedNamingTheFile) {
  const std::string dir = test::temp_dir("strata_sft", "bad_masks");
  const ChatFile c = chat_file(dir, "chat.bin", 20, 3);
  const std::vector<int32_t>& tokens = c.tokens;
  const std::vector<uint8_t>& mask = c.mask;
  const std::string& path = c.path;
  const std::string good = test::read_file(path + ".mask");
  struct Case {
    const char* what;
    std::string bytes;
    std::vector<std::string> expect;
  };
  auto with = [&](size_t at, const void* v, size_t n) {
    std::string b = good;
    std::memcpy(&b[at], v, n);
    return b;
  };
  const int32_t two = 2, count = int32_t(tokens.size()) + 1, magic = 1234;
  std::vector<uint8_t> other_bits = mask;
  other_bits[4] |= 8;
  std::vector<uint8_t> no_start = mask;
  no_start[0] = 0;
  std::vector<int32_t> other_tokens = tokens;
  other_tokens[3] = (other_tokens[3] + 1) % kVocab;
  std::vector<Case> cases = {
      {"truncated",
       good.substr(0, good.size() - 1),
       {"truncated", "holds " + std::to_string(tokens.size() - 1)}},
      {"header only", good.substr(0, 100), {"1024-byte header", "100 bytes"}},
      {"magic", with(0, &magic, 4), {"not a strata loss mask", "magic 1234 at offset 0"}},
      {"version", with(4, &two, 4), {"version 2 at offset 4", "reads version 1"}},
      {"count",
       with(8, &count, 4),
       {"for " + std::to_string(count) + " tokens (header offset 8)",
        "holds " + std::to_string(tokens.size())}},
      {"flipped byte",
       [&] {
         std::string b = good;
         b[1024 + 5] ^= 1;
         return b;
       }(),
       {"corrupt", "CRC-32"}},
  };
  for (const Case& c : cases) {
    std::ofstream(path + ".mask", std::ios::binary | std::ios::trunc) << c.bytes;
    auto d = Dataset::load(data_config(path), kVocab, 1);
    ASSERT_FALSE(d.is_ok()) << c.what;
    const std::string& m = d.status().message();
    EXPECT_NE(m.find(path + ".mask"), std::string::npos) << c.what << ": " << m;
    for (const std::string& e : c.expect)
      EXPECT_NE(m.find(e), std::string::npos) << c.what << ": " << m;
    EXPECT_NE(m.find("prepare_data.py --chat"), std::string::npos) << m;
  }
  // Rewritten masks with a valid CRC: bits that mean nothing, token 0 not a start, and the mask
  // of other tokens (the token file rewritten, the mask left over).
  test::write_masked(dir + "/bits.bin", tokens, other_bits);
  test::write_masked(dir + "/start.bin", tokens, no_start);
  test::write_masked(dir + "/other.bin", other_tokens, mask);
  std::filesystem::copy_file(path, dir + "/other.bin",
                             std::filesystem::copy_options::overwrite_existing);
  for (const auto& [file, expect] : std::vector<std::pair<std::string, std::string>>{
           {"bits.bin", "at offset 1028 (token 4) has bits other than"},
           {"start.bin", "token 0 (offset 1024) does not start a conversation"},
           {"other.bin", "written for other tokens than " + dir + "/other.bin"}}) {
    auto d = Dataset::load(data_config(dir + "/" + file), kVocab, 1);
    ASSERT_FALSE(d.is_ok()) << file;
    EXPECT_NE(d.status().message().find(expect), std::string::npos) << d.status().message();
  }
  // Before training, through the trainer; and "none" reads the tokens alone.
  auto cfg =
      test::tiny_cpu(dir, {own_swap(dir), "train.steps=1", "scheduler.params.warmup_num_steps=1",
                           "data.source=\"" + dir + "/other.bin\""});
  Status s = test::train_status(cfg);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(dir + "/other.bin.mask"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("data.loss_mask"), std::string::npos) << s.message();
  DataConfig none = data_config(dir + "/other.bin");
  none.loss_mask = "none";
  auto ok = Dataset::load(none, kVocab, 1);
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_FALSE(ok->masked());
  EXPECT_NE(ok->description().find("not read (data.loss_mask = \"none\")"), std::string::npos)
      << ok->description();
}

// data.eval_source: the eval runs on that file, not on the tail of data.source; strata eval
// evaluates it.
// Found by fuzz_loss_mask: the mask of zero tokens (a header alone) copied from a null pointer.
TEST(SftData, MaskOfNoTokensParsesToNothing) {
  std::vector<char> header(1024, 0);
  const int32_t h[3] = {kMaskMagic, kMaskVersion, 0};
  std::memcpy(header.data(), h, sizeof(h));
  auto m = parse_loss_mask(header, "empty.mask", "empty.bin", 0, 0);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_TRUE(m->bytes.empty());
  EXPECT_FALSE(m->preference);
  EXPECT_TRUE(pack_windows(m->bytes, 0, 0, 8).empty());
}

TEST(SftData, EvalSourceIsTheHeldOutFile) {
  const std::string dir = test::temp_dir("strata_sft", "eval_source");
  const std::string a = chat_file(dir, "a.bin", 200, 1).path;
  const std::string b = chat_file(dir, "b.bin", 200, 2).path;
  const ChatFile held_file = chat_file(dir, "held.bin", 40, 3);
  const std::string& held = held_file.path;
  DataConfig dc = data_config(a);
  dc.eval_source = held;
  auto d = Dataset::load(dc, kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  auto only_a = Dataset::load(data_config(a), kVocab, 1);
  ASSERT_TRUE(only_a.is_ok());
  EXPECT_EQ(d->train_tokens(), only_a->train_tokens() + only_a->eval_tokens());  // all of a
  auto only_held = Dataset::load(data_config(held), kVocab, 1);
  ASSERT_TRUE(only_held.is_ok());
  EXPECT_EQ(d->eval_tokens(), only_held->train_tokens() + only_held->eval_tokens());
  // Step 0's eval: the same on two different training files with the same eval_source, and
  // not the training file's tail.
  int run = 0;
  auto eval_at_0 = [&](const std::string& source, const std::string& eval_source) {
    const std::string d = dir + "/run" + std::to_string(run++);
    auto cfg =
        test::tiny_cpu(d, {own_swap(d), "train.steps=1", "train.eval_interval=1",
                           "scheduler.params.warmup_num_steps=1", "data.source=\"" + source + "\"",
                           "data.eval_source=\"" + eval_source + "\""});
    TrainResult r = test::must_train(cfg);
    return r.eval_losses.empty() ? NAN : r.eval_losses.front().second;
  };
  const double on_a = eval_at_0(a, held), on_b = eval_at_0(b, held), tail = eval_at_0(a, "");
  EXPECT_EQ(on_a, on_b);
  EXPECT_NE(on_a, tail);
  // strata eval: data.eval_source when set, as if it were data.source.
  auto cfg = test::tiny_cpu(
      dir, {own_swap(dir), "data.source=\"" + a + "\"", "data.eval_source=\"" + held + "\""});
  auto with_held = evaluate(cfg, EvalOptions{});
  ASSERT_TRUE(with_held.is_ok()) << with_held.status().to_string();
  cfg.data.source = held;
  cfg.data.eval_source = "";
  auto direct = evaluate(cfg, EvalOptions{});
  ASSERT_TRUE(direct.is_ok()) << direct.status().to_string();
  EXPECT_EQ(with_held->loss, direct->loss);
  EXPECT_EQ(with_held->tokens, direct->tokens);
  // The tokens counted are the held-out file's loss targets.
  int64_t loss_tokens = 0;
  for (uint8_t m : held_file.mask) loss_tokens += m & kMaskLoss;
  EXPECT_EQ(direct->tokens, loss_tokens);
}

// An eval that takes every held-out window (data.eval_batches at or past the batches that hold
// them) gives strata eval's loss: the last batch's rows that wrap to the start are computed but
// not counted (they had counted the first windows twice), on a plain held-out file and on a
// chat one (its targets the assistant tokens).
TEST(HeldOutEval, EveryWindowIsStrataEvalsLoss) {
  const std::string dir = test::temp_dir("strata_sft", "whole_eval");
  const std::string train_file = chat_file(dir, "train.bin", 200, 21).path;
  // 13 windows of T = 64 (tiny-cpu's context), fewer than 4 batches of 4 hold.
  std::vector<uint16_t> plain(13 * 64 + 1);
  for (size_t i = 0; i < plain.size(); ++i) plain[i] = uint16_t((i * 37 + i / 5) % kVocab);
  const std::string plain_file = dir + "/held.u16";
  std::ofstream(plain_file, std::ios::binary)
      .write(reinterpret_cast<const char*>(plain.data()), std::streamsize(plain.size() * 2));
  const std::string chat = chat_file(dir, "held.bin", 30, 22).path;
  int run = 0;
  for (const std::string& held : {plain_file, chat}) {
    SCOPED_TRACE(held);
    const std::string d = dir + "/run" + std::to_string(run++);
    const Config cfg = test::tiny_cpu(
        d, {own_swap(d), "train.steps=1", "train.eval_interval=1",
            "scheduler.params.warmup_num_steps=1", "data.eval_batches=1000",
            "data.source=\"" + train_file + "\"", "data.eval_source=\"" + held + "\""});
    auto data = Dataset::load(cfg.data, cfg.model.vocab_size, cfg.train.seed);
    ASSERT_TRUE(data.is_ok()) << data.status().to_string();
    const size_t windows = data->eval_windows(cfg.model.context);
    const size_t rows = size_t(cfg.train_micro_batch_size_per_gpu);
    ASSERT_NE(windows % rows, 0u) << "the last batch must wrap for this test to mean anything";
    const TrainResult r = test::must_train(cfg);
    ASSERT_FALSE(r.eval_losses.empty());
    auto e = evaluate(cfg, EvalOptions{});  // the initial weights: step 0's eval
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    EXPECT_EQ(r.eval_losses.front().second, e->loss);
  }
}

// Fine-tuning on chat data: the held-out loss on the assistant turns falls (the replies copy
// their prompts, which a model learns), and it is the masked mean (a plain eval of the same
// tokens differs).
TEST(SftTrain, HeldOutLossOnAssistantTurnsFalls) {
  const std::string dir = test::temp_dir("strata_sft", "train");
  const std::string train_file = chat_file(dir, "train.bin", 600, 11).path;
  const std::string held = chat_file(dir, "held.bin", 60, 12).path;
  auto cfg = test::tiny_cpu(
      dir, {own_swap(dir), "train.steps=40", "train.eval_interval=20",
            "data.source=\"" + train_file + "\"", "data.eval_source=\"" + held + "\""});
  TrainResult r = test::must_train(cfg);
  ASSERT_EQ(r.eval_losses.size(), 3u);
  EXPECT_LT(r.eval_losses.back().second, r.eval_losses.front().second - 0.3)
      << r.eval_losses.front().second << " -> " << r.eval_losses.back().second;
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
  auto masked = evaluate(cfg, EvalOptions{r.last_checkpoint});
  cfg.data.loss_mask = "none";
  auto plain = evaluate(cfg, EvalOptions{r.last_checkpoint});
  ASSERT_TRUE(masked.is_ok() && plain.is_ok());
  EXPECT_NE(masked->loss, plain->loss);
  EXPECT_LT(masked->tokens, plain->tokens);
}

// Gradient accumulation: the step's loss is the sum of every micro-batch's assistant-token
// losses over their total count (transformers' Trainer: num_items_in_batch over the
// accumulated micro-batches), not the mean of per-micro-batch means. Two conversations that
// pack into a window each, one with 3 assistant tokens and one with 40: the 4 micro-batches of
// one row pick among them, and each window's summed loss comes from strata eval on it alone.
TEST(SftTrain, AccumulatedLossIsTheMeanOverAllAssistantTokens) {
  const std::string dir = test::temp_dir("strata_sft", "accumulation");
  const auto conversation = [](int prompt, int reply, int base, std::vector<int32_t>* tokens,
                               std::vector<uint8_t>* mask) {
    test::append_conversation(prompt, reply, base, kVocab, tokens, mask);
  };
  std::vector<int32_t> both, a, b;
  std::vector<uint8_t> both_mask, a_mask, b_mask;
  conversation(20, 3, 5, &a, &a_mask);
  conversation(10, 40, 11, &b, &b_mask);
  conversation(20, 3, 5, &both, &both_mask);
  conversation(10, 40, 11, &both, &both_mask);
  const std::string train_file = test::write_masked(dir + "/both.bin", both, both_mask);
  const std::string a_file = test::write_masked(dir + "/a.bin", a, a_mask);
  const std::string b_file = test::write_masked(dir + "/b.bin", b, b_mask);
  auto cfg =
      test::tiny_cpu(dir, {own_swap(dir), "train.steps=1", "scheduler.params.warmup_num_steps=1",
                           "train_batch_size=4", "train_micro_batch_size_per_gpu=1",
                           "gradient_accumulation_steps=4", "data.source=\"" + train_file + "\"",
                           "data.eval_source=\"" + a_file + "\""});
  // Each window's loss sum at the initial weights (the step's losses are taken before its
  // update): strata eval of the window alone (the same tokens, padding and positions).
  double sum[2], count[2];
  for (int w = 0; w < 2; ++w) {
    Config one = cfg;
    one.data.source = w == 0 ? a_file : b_file;
    one.data.eval_source = "";
    auto r = evaluate(one, EvalOptions{});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    count[w] = double(r->tokens);
    sum[w] = r->loss * count[w];
  }
  ASSERT_EQ(count[0], 3);
  ASSERT_EQ(count[1], 40);
  // The windows the step's 4 micro-batches take (a pure function of the seed and step).
  DataConfig dc = data_config(train_file);
  dc.eval_source = a_file;
  auto d = Dataset::load(dc, kVocab, cfg.train.seed);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  double want_sum = 0, want_count = 0, mean_of_means = 0;
  int picked[2] = {0, 0};
  for (int micro = 0; micro < 4; ++micro) {
    std::vector<int32_t> tk(64), tg(64);
    d->train_batch(cfg.train.seed, 0, micro, 0, 1, 64, tk.data(), tg.data());
    const int w = tk[0] == a[0] ? 0 : 1;
    ASSERT_EQ(tk[0], w == 0 ? a[0] : b[0]);
    ++picked[w];
    want_sum += sum[w];
    want_count += count[w];
    mean_of_means += sum[w] / count[w] / 4;
  }
  ASSERT_GT(picked[0], 0) << "the seed picks one window only: the test shows nothing";
  ASSERT_GT(picked[1], 0) << "the seed picks one window only: the test shows nothing";
  TrainResult r = test::must_train(cfg);
  ASSERT_EQ(r.losses.size(), 1u);
  EXPECT_NEAR(r.losses[0], want_sum / want_count, 1e-5 * want_sum / want_count);
  EXPECT_GT(std::fabs(r.losses[0] - mean_of_means), 1e-3)
      << "indistinguishable from the mean of per-micro-batch means";
}

}  // namespace
}  // namespace strata
