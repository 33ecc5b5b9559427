// Packed sequences that do not see each other: a window of several conversations with their
// positions (ModelRunner::begin_batch) gives each token the loss, and the model every gradient,
// that the same conversations give run one by one as separate sequences, for GPT-2 (learned
// positions), Llama (rotary) and a mixture of experts, with kept and recomputed activations;
// the data's positions (Dataset, data.packing) and strata eval's loss on a packed chat file
// equal to the sum over its conversations alone. Kernel level (every attention backend against
// a scalar reference with positions): flash_attention_test, cuda_emu_kernels_test.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "src/train/data.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/log.h"
#include "tests/sft_util.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

constexpr int kVocab = 256;

ModelConfig model(const std::string& type) {
  ModelConfig m;
  m.type = type;
  m.n_layer = 2;
  m.n_head = 4;
  m.n_embd = 64;
  m.vocab_size = kVocab;
  m.context = 64;
  m.dtype = DType::kF32;
  if (type != "gpt2") {
    m.intermediate_size = 96;
    m.num_key_value_heads = 2;
  }
  if (type == "mixtral") {
    m.num_experts = 4;
    m.num_experts_per_tok = 2;
    m.intermediate_size = 48;
    m.tied_embeddings = false;
    // The load-balancing loss is a function of the micro-batch's whole routing: a packed
    // window's is not the sum of its conversations'. Without it a token's gradient is its own.
    m.router_aux_loss_coef = 0.0;
  }
  return m;
}

// The parameters of `arch` (seeded init) and fp32 gradient buffers on a CPU device, and one
// runner per batch shape; run() does one training pass and adds to the gradients.
class Harness {
 public:
  explicit Harness(const Architecture& arch) : arch_(arch) {
    auto d = create_cpu_device({.capacity = size_t{256} << 20, .threads = 2});
    EXPECT_TRUE(d.is_ok()) << d.status().to_string();
    dev_ = std::move(d).value();
    Stream& s = dev_->compute_stream();
    const ModelLayout& lay = arch.layout();
    for (size_t m = 0; m < lay.modules.size(); ++m) {
      const size_t n = lay.modules[m].numel;
      std::vector<float> w(n);
      arch.init_range(int(m), 1234, 0, n, w.data());
      void* p = *dev_->allocate(n * 4, "test.params");
      dev_->copy_h2d(s, p, w.data(), n * 4);
      auto* g = static_cast<float*>(*dev_->allocate(n * 4, "test.grads"));
      dev_->memset_zero(s, g, n * 4);
      EXPECT_TRUE(dev_->synchronize(s).is_ok());
      params_.push_back(p);
      grads_.push_back(g);
    }
  }
  ~Harness() {
    for (size_t i = 0; i < params_.size(); ++i) {
      dev_->release(const_cast<void*>(params_[i]));
      dev_->release(grads_[i]);
    }
  }

  // One training pass of B rows of T tokens (positions may be null); dloss as MicroBatch's.
  // Returns the per-token losses; the gradients accumulate.
  std::vector<float> run(int B, int T, const std::vector<int32_t>& tokens,
                         const std::vector<int32_t>& targets, const int32_t* positions, float dloss,
                         ActivationMode mode = ActivationMode::kKeep) {
    std::vector<float> losses(size_t(B) * T);
    auto runner = arch_.create_runner(*dev_, B, T, DType::kF32, mode, nullptr);
    EXPECT_TRUE(runner.is_ok()) << runner.status().to_string();
    if (!runner.is_ok()) return losses;
    const ModuleBindings bound{params_, grads_};
    const MicroBatch mb{dloss, losses.data()};
    (*runner)->begin_batch(tokens.data(), targets.data(), positions);
    for (const ProgramOp& op : arch_.program(Pass::kTrain).ops) {
      if (op.kind == ProgramOp::kCompute) (*runner)->compute(op, bound, mb);
    }
    EXPECT_TRUE(dev_->synchronize(dev_->compute_stream()).is_ok());
    EXPECT_TRUE((*runner)->status().is_ok());
    return losses;
  }

  // The accumulated gradients, module by module; then zeroes them.
  std::vector<std::vector<float>> take_grads() {
    Stream& s = dev_->compute_stream();
    std::vector<std::vector<float>> out;
    for (size_t m = 0; m < grads_.size(); ++m) {
      std::vector<float> g(arch_.layout().modules[m].numel);
      dev_->copy_d2h(s, g.data(), grads_[m], g.size() * 4);
      EXPECT_TRUE(dev_->synchronize(s).is_ok());
      dev_->memset_zero(s, grads_[m], g.size() * 4);
      out.push_back(std::move(g));
    }
    EXPECT_TRUE(dev_->synchronize(s).is_ok());
    return out;
  }

 private:
  const Architecture& arch_;
  std::unique_ptr<Device> dev_;
  std::vector<const void*> params_;
  std::vector<float*> grads_;
};

double rel_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  double d = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    n += double(ref[i]) * ref[i];
  }
  return std::sqrt(d) / std::max(std::sqrt(n), 1e-30);
}

class PackedModel : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }
};

// Conversations of 9, 14, 1 and 6 tokens packed into one window of T = 34 (4 tokens of padding
// after the last, continuing its positions, as Dataset fills them), against each run alone
// (T = its length, positions 0..len-1 by default). A token's loss and each gradient are the
// same computation in another summation order (the attention's GEMMs over a longer key range
// holding zeros, the weight gradients summed over one batch instead of four), so they agree to
// fp32 rounding: per-token losses within 1e-5 relative, each module's gradient within 1e-5 in
// relative norm. The padding's and the boundaries' targets are -1 in both.
TEST_P(PackedModel, WindowEqualsTheConversationsRunAlone) {
  const ModelConfig cfg = model(GetParam());
  auto arch = create_architecture(cfg);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  Harness h(**arch);
  const std::vector<int> lengths = {9, 14, 1, 6};
  const int T = 34;
  std::mt19937_64 rng(42);
  std::vector<int32_t> tok(T, 0), tgt(T, -1), pos(T, 0);
  int off = 0;
  for (int len : lengths) {
    for (int i = 0; i < len; ++i) {
      tok[size_t(off + i)] = int32_t(rng() % kVocab);
      pos[size_t(off + i)] = i;
    }
    // Targets: the next token of the same conversation (every third one ignored, as prompts).
    for (int i = 0; i + 1 < len; ++i) {
      if (i % 3 != 2) tgt[size_t(off + i)] = tok[size_t(off + i + 1)];
    }
    off += len;
  }
  for (int t = off; t < T; ++t) pos[size_t(t)] = pos[size_t(t - 1)] + 1;  // padding
  const float dloss = 1.0f / 20.0f;

  const std::vector<float> packed = h.run(1, T, tok, tgt, pos.data(), dloss);
  const auto packed_grads = h.take_grads();
  std::vector<float> alone(size_t(T), 0.0f);
  off = 0;
  for (int len : lengths) {
    const std::vector<int32_t> t(tok.begin() + off, tok.begin() + off + len);
    const std::vector<int32_t> y(tgt.begin() + off, tgt.begin() + off + len);
    const std::vector<float> l = h.run(1, len, t, y, nullptr, dloss);
    for (int i = 0; i < len; ++i) alone[size_t(off + i)] = l[size_t(i)];
    off += len;
  }
  const auto alone_grads = h.take_grads();
  for (int t = 0; t < off; ++t) {
    EXPECT_NEAR(packed[size_t(t)], alone[size_t(t)], 1e-5 * std::fabs(alone[size_t(t)]) + 1e-7)
        << "token " << t;
  }
  ASSERT_EQ(packed_grads.size(), alone_grads.size());
  for (size_t m = 0; m < packed_grads.size(); ++m) {
    double norm = 0;
    for (float g : alone_grads[m]) norm += double(g) * g;
    ASSERT_GT(norm, 0.0) << "module " << m << " got no gradient: the test shows nothing";
    EXPECT_LT(rel_diff(packed_grads[m], alone_grads[m]), 1e-5) << "module " << m;
  }

  // Without positions the same window attends across the conversations: the later ones'
  // losses move (the check above is not vacuous).
  const std::vector<float> window = h.run(1, T, tok, tgt, nullptr, dloss);
  h.take_grads();
  double moved = 0;
  for (int t = lengths[0]; t < off; ++t) moved += std::fabs(window[size_t(t)] - packed[size_t(t)]);
  EXPECT_GT(moved, 1e-3);

  // Recomputed activations rerun each block's forward with the batch's positions: the same bits.
  const std::vector<float> rec =
      h.run(1, T, tok, tgt, pos.data(), dloss, ActivationMode::kRecompute);
  const auto rec_grads = h.take_grads();
  EXPECT_EQ(rec, packed);
  for (size_t m = 0; m < rec_grads.size(); ++m) {
    EXPECT_EQ(rec_grads[m], packed_grads[m]) << "module " << m << " under recompute";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, PackedModel, ::testing::Values("gpt2", "llama", "mixtral"));

// --- the data ---------------------------------------------------------------------------------

// Conversations of 5, 4 and 12 tokens in windows of T = 8 inputs (pack_windows: the first two
// share a window, the third is cut in two pieces).
struct SmallChat {
  std::string path;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
};
SmallChat small_chat(const std::string& dir) {
  SmallChat c;
  c.mask.assign(21, kMaskLoss);
  c.mask[0] = c.mask[5] = c.mask[9] = kMaskStart;
  for (int i = 0; i < 21; ++i) c.tokens.push_back(int32_t(3 + 5 * i) % kVocab);
  c.path = test::write_masked(dir + "/small.bin", c.tokens, c.mask);
  return c;
}

// data.packing "sequence": positions restart at each conversation start, a cut conversation's
// later piece starts at 0, the padding continues the last count; "window" gives none (the
// trainer passes no positions: one causal window, positions 0..T-1).
TEST(PackedData, PositionsRestartAtEachConversation) {
  const SmallChat c = small_chat(test::temp_dir("strata_packing", "data"));
  DataConfig dc;
  dc.source = c.path;
  dc.seq_len = 8;
  dc.eval_source = c.path;  // every window is also an eval window, in order
  auto d = Dataset::load(dc, kVocab, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  ASSERT_TRUE(d->train_positions());
  ASSERT_TRUE(d->eval_positions());
  ASSERT_EQ(d->eval_windows(8), 3u);
  std::vector<int32_t> tk(24), tg(24), pos(24, -7);
  d->eval_batch(0, 3, 8, tk.data(), tg.data(), 0, 1, pos.data());
  const std::vector<int32_t> want = {0, 1, 2, 3, 4, 0, 1, 2,   // conversations of 5 and 4 (cut)
                                     0, 1, 2, 3, 4, 5, 6, 7,   // the long one's first piece
                                     0, 1, 2, 3, 4, 5, 6, 7};  // its second piece, then padding
  EXPECT_EQ(pos, want);
  // Training rows carry the same positions as their window.
  std::vector<int32_t> ttk(8), ttg(8), tpos(8, -7);
  d->train_batch(1, 0, 0, 0, 1, 8, ttk.data(), ttg.data(), tpos.data());
  for (int w = 0; w < 3; ++w) {
    if (ttk[0] == tk[size_t(w) * 8] && ttk[1] == tk[size_t(w) * 8 + 1]) {
      EXPECT_EQ(tpos, std::vector<int32_t>(want.begin() + w * 8, want.begin() + w * 8 + 8));
    }
  }

  dc.packing = "window";
  auto win = Dataset::load(dc, kVocab, 1);
  ASSERT_TRUE(win.is_ok()) << win.status().to_string();
  EXPECT_FALSE(win->train_positions());
  EXPECT_FALSE(win->eval_positions());
  std::vector<int32_t> untouched(24, -7);
  win->eval_batch(0, 3, 8, tk.data(), tg.data(), 0, 1, untouched.data());
  EXPECT_EQ(untouched, std::vector<int32_t>(24, -7));

  // A plain corpus (no mask) has no positions whatever data.packing says.
  DataConfig plain;
  plain.source = "synthetic";
  plain.synthetic_tokens = 4096;
  auto p = Dataset::load(plain, kVocab, 1);
  ASSERT_TRUE(p.is_ok());
  EXPECT_FALSE(p->train_positions());
}

// strata eval on a file that packs two conversations into one window: per sequence, its loss
// sum is the sum of each conversation's evaluated alone (fp32: each token's loss is the same
// computation up to rounding); per window the second conversation sees the first and differs.
TEST(PackedEval, LossIsTheSumOverTheConversationsAlone) {
  const std::string dir = test::temp_dir("strata_packing", "eval");
  const auto conversation = [](int prompt, int reply, int base, std::vector<int32_t>* tokens,
                               std::vector<uint8_t>* mask) {
    test::append_conversation(prompt, reply, base, kVocab, tokens, mask);
  };
  std::vector<int32_t> both, a, b;
  std::vector<uint8_t> both_mask, a_mask, b_mask;
  conversation(12, 9, 5, &a, &a_mask);
  conversation(10, 20, 11, &b, &b_mask);
  conversation(12, 9, 5, &both, &both_mask);
  conversation(10, 20, 11, &both, &both_mask);
  const std::string both_file = test::write_masked(dir + "/both.bin", both, both_mask);
  const std::string a_file = test::write_masked(dir + "/a.bin", a, a_mask);
  const std::string b_file = test::write_masked(dir + "/b.bin", b, b_mask);
  for (const char* type : {"gpt2", "llama"}) {
    SCOPED_TRACE(type);
    std::vector<std::string> ov = {"bf16.enabled=false",
                                   "train_batch_size=1",
                                   "train_micro_batch_size_per_gpu=1",
                                   "gradient_accumulation_steps=1",
                                   "data.seq_len=64",
                                   "zero_optimization.offload_optimizer.device=\"cpu\""};
    if (std::string(type) == "llama") {
      for (const char* s :
           {"model.type=\"llama\"", "model.num_key_value_heads=2", "model.intermediate_size=256"}) {
        ov.push_back(s);
      }
    }
    Config cfg = test::tiny_cpu(dir, ov);
    const auto eval_of = [&](const std::string& file, const char* packing) {
      Config one = cfg;
      one.data.source = file;
      one.data.eval_source = file;
      one.data.packing = packing;
      auto r = evaluate(one, EvalOptions{});
      EXPECT_TRUE(r.is_ok()) << r.status().to_string();
      return r.is_ok() ? std::make_pair(r->loss * double(r->tokens), r->tokens)
                       : std::make_pair(0.0, int64_t{0});
    };
    const auto [sum_a, n_a] = eval_of(a_file, "sequence");
    const auto [sum_b, n_b] = eval_of(b_file, "sequence");
    const auto [sum, n] = eval_of(both_file, "sequence");
    const auto [sum_window, n_window] = eval_of(both_file, "window");
    ASSERT_EQ(n_a, 9);
    ASSERT_EQ(n_b, 20);
    ASSERT_EQ(n, 29);
    ASSERT_EQ(n_window, 29);
    EXPECT_NEAR(sum, sum_a + sum_b, 1e-5 * (sum_a + sum_b));
    EXPECT_GT(std::fabs(sum_window - (sum_a + sum_b)), 1e-4 * (sum_a + sum_b))
        << "per window, the second conversation attends to the first";
  }
}

// Training on chat data packed per sequence: two micro-batches' forwards grouped on two
// activation slots (each its own positions), recomputed activations, stopped after step 3 and
// resumed: the uninterrupted one-slot, kept-activation run's losses and weights bit for bit.
// Packing per window trains to other numbers (the positions reach the model).
TEST(PackedTrain, GroupedRecomputedAndResumedFollowTheStraightRun) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_packing", "train");
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  test::chat_corpus(400, kVocab, 5, &tokens, &mask);
  const std::string file = test::write_masked(dir + "/chat.bin", tokens, mask);
  const std::vector<std::string> base = {"train.steps=6",
                                         "scheduler.params.warmup_num_steps=2",
                                         "train_batch_size=4",
                                         "train_micro_batch_size_per_gpu=2",
                                         "gradient_accumulation_steps=2",
                                         "data.source=\"" + file + "\"",
                                         "zero_optimization.offload_optimizer.device=\"cpu\"",
                                         "zero_optimization.offload_param.device=\"cpu\"",
                                         "zero_optimization.stage3_prefetch_bucket_size=0",
                                         "strata.optimizer.defer=\"always\""};
  auto with = [&](const std::string& sub, std::vector<std::string> more) {
    std::vector<std::string> ov = base;
    ov.insert(ov.end(), more.begin(), more.end());
    return test::tiny_cpu(dir + "/" + sub, ov);
  };
  const TrainResult straight = test::must_train(
      with("straight", {"strata.grouped_forwards=1", "strata.activations=\"keep\""}));
  Config grouped =
      with("grouped", {"strata.grouped_forwards=2", "strata.activations=\"recompute\""});
  grouped.train.checkpoint_interval = 3;
  TrainOptions stop;
  stop.stop_at_step = 3;
  const TrainResult r1 = test::must_train(grouped, stop);
  EXPECT_TRUE(r1.stopped_early);
  TrainOptions again;
  again.resume = "latest";
  const TrainResult r2 = test::must_train(grouped, again);
  ASSERT_EQ(straight.losses.size(), 6u);
  ASSERT_EQ(r1.losses.size(), 3u);
  ASSERT_EQ(r2.losses.size(), 3u);
  for (size_t s = 0; s < 3; ++s) {
    EXPECT_EQ(r1.losses[s], straight.losses[s]) << "step " << s + 1;
    EXPECT_EQ(r2.losses[s], straight.losses[3 + s]) << "step " << 4 + s;
  }
  EXPECT_EQ(r2.weights_crc, straight.weights_crc);
  EXPECT_EQ(r2.forward_group, 2);

  const TrainResult window =
      test::must_train(with("window", {"data.packing=\"window\"", "strata.grouped_forwards=1"}));
  ASSERT_EQ(window.losses.size(), 6u);
  EXPECT_NE(window.losses[0], straight.losses[0]);
  std::filesystem::remove_all(dir);
}

// Conversations longer than half a window sit one to a window: every row's positions count
// 0..T-1 and the trainer passes none (on a GPU the attention then runs on cuDNN's kernels), the
// same bits as packing per window; short ones share windows and are masked per conversation.
TEST(PackedTrain, OneConversationARowRunsPlainAttentionBitForBit) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_packing", "plain_rows");
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  for (int c = 0; c < 60; ++c)
    test::append_conversation(20 + c % 7, 25 + c % 5, c, kVocab, &tokens, &mask);
  const std::string longs = test::write_masked(dir + "/long.bin", tokens, mask);
  tokens.clear();
  mask.clear();
  test::chat_corpus(400, kVocab, 5, &tokens, &mask);
  const std::string shorts = test::write_masked(dir + "/short.bin", tokens, mask);
  auto run = [&](const std::string& sub, const std::string& file, const std::string& packing) {
    return test::must_train(test::tiny_cpu(
        dir + "/" + sub, {"train.steps=3", "scheduler.params.warmup_num_steps=2",
                          "gradient_accumulation_steps=2", "train_batch_size=8",
                          "data.source=\"" + file + "\"", "data.packing=\"" + packing + "\""}));
  };
  const TrainResult seq = run("long-sequence", longs, "sequence");
  const TrainResult win = run("long-window", longs, "window");
  ASSERT_EQ(seq.losses.size(), 3u);
  EXPECT_EQ(seq.losses, win.losses);
  EXPECT_EQ(seq.weights_crc, win.weights_crc);
  EXPECT_EQ(seq.micro_batches_with_positions, 6);
  EXPECT_EQ(seq.micro_batches_per_sequence, 0);
  EXPECT_EQ(win.micro_batches_with_positions, 0);  // per window: no positions at all
  const TrainResult mixed = run("short-sequence", shorts, "sequence");
  EXPECT_EQ(mixed.micro_batches_with_positions, 6);
  EXPECT_EQ(mixed.micro_batches_per_sequence, 6);
  std::filesystem::remove_all(dir);
}

TEST(Positions, PlainOnlyWhereEveryRowCountsFromZero) {
  const std::vector<int32_t> plain = {0, 1, 2, 3, 0, 1, 2, 3};
  EXPECT_TRUE(positions_are_plain(plain.data(), 2, 4));
  std::vector<int32_t> cut = plain;
  cut[6] = 0;  // a second conversation in row 1
  EXPECT_FALSE(positions_are_plain(cut.data(), 2, 4));
  const std::vector<int32_t> shifted = {1, 2, 3, 4};
  EXPECT_FALSE(positions_are_plain(shifted.data(), 1, 4));
}

}  // namespace
}  // namespace strata
