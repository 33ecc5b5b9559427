// Training data: a token corpus, a held-out tail for eval, and deterministic batches.
//
// Sources (DataConfig.source / .format):
//   "synthetic"   built-in corpus with learnable structure (no download): a sparse random
//                 Markov chain over the vocabulary plus periodic copies of earlier tokens, so a
//                 small model can drive the loss from ln(V) towards ~1.3 nats.
//   uint16/uint32 raw little-endian token ids.
//   llmc          llm.c's .bin: 256 x int32 header (magic, version, token count), then the
//                 tokens: magic 20240520 version 1 uint16 (GPT-2), magic 20240801 version 7
//                 uint32 (Llama 3's 128,256-token vocabulary; tools/prepare_data.py writes it).
//   text          any file, tokenized byte-level (token = byte, vocab 256).
//   auto          by extension/header: llm.c magic -> llmc, .u16/.u32 -> raw, else text.
// Batches are a pure function of (seed, step, micro-step, rank): resuming at step s yields
// exactly the batches an uninterrupted run would have seen, without saving loader state.
//
// Held out: data.eval_source's file when set, else the data.eval_fraction tail of data.source.
// A loss mask (src/train/loss_mask.h: <file>.mask beside a token file, data.loss_mask "auto")
// makes a split "packed": its windows start at conversation starts and hold whole
// conversations (pack_windows), targets outside the assistant turns are -1 (ignored by the
// loss: transformers' labels = -100), and the loss is the mean over the targets that count.
// With data.packing "sequence" (the default) a packed window's batches also carry positions,
// so that each conversation attends only to itself; "window" attends across the window.
//
// Preference data (DPO: a mask whose header says preference pairs, tools/prepare_data.py
// --format preference) is not packed: each pair is its chosen sequence and its rejected one,
// each one conversation cut at seq_len + 1 tokens (its end dropped, as TRL truncates a
// completion), a row of its own; a batch of B rows holds B / 2 pairs, row 2j the chosen
// sequence of pair j and row 2j + 1 its rejected one. A pair in which either sequence keeps no
// loss target is left out (logged once). The held-out split is pairs too: data.eval_source must
// hold pairs as well, and the data.eval_fraction tail starts at a pair.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/train/loss_mask.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata {

// Whether every row of a [B, T] batch's positions counts 0, 1, ..., T - 1 (each row one
// conversation, or the piece of one, then its padding): attention per conversation is then
// plain causal attention, the same bits without positions, and the trainer passes none (on a
// GPU the dense attention runs on cuDNN's fused kernels; with positions, on the own kernels).
bool positions_are_plain(const int32_t* positions, int B, int T);

class Dataset {
 public:
  // Loads or generates the corpus (and data.eval_source, and the loss masks); checks every
  // token id against vocab_size. A masked split is packed into windows of cfg.seq_len inputs.
  static Result<Dataset> load(const DataConfig& cfg, int vocab_size, uint64_t seed);

  // Fills tokens/targets [B*T] for one training micro-batch: B windows at random offsets of
  // the training split; targets are the inputs shifted by one. Each window is a function of
  // (seed, step, micro, global row) with global row = rank * B + b, so N ranks with B rows
  // each see exactly the windows one rank with N*B rows sees (data parallelism keeps the
  // global batch).
  // preference(): B is even (a broken invariant otherwise); rows 2j and 2j + 1 are the chosen
  // and rejected sequences of the training pair drawn for global pair rank * (B / 2) + j (the
  // same invariance over ranks), padded as a packed window is, targets -1 outside the mask.
  // positions (nullptr: not wanted) receives each token's position in its conversation when
  // train_positions() (packed per sequence); else it is left untouched.
  void train_batch(uint64_t seed, int64_t step, int micro, int rank, int B, int T, int32_t* tokens,
                   int32_t* targets, int32_t* positions = nullptr) const;
  // Eval batch i (0-based) of B consecutive windows from the held-out split (wraps around);
  // rank r of `world` takes rows [r*B, (r+1)*B) of the global batch of world*B windows.
  // preference(): B even, rows 2j and 2j + 1 are held-out pair
  // (i * world * (B / 2) + rank * (B / 2) + j) mod eval_pairs().
  // positions: as train_batch's, when eval_positions().
  void eval_batch(int i, int B, int T, int32_t* tokens, int32_t* targets, int rank = 0,
                  int world = 1, int32_t* positions = nullptr) const;

  // preference(): rows 2j and 2j + 1 are the chosen and rejected sequences of the split's pair
  // (first_pair + j) mod its pairs, j < B / 2 (B even): every pair in order, as the reference
  // model's log-probabilities are computed once per pair.
  void pair_batch(bool eval_split, size_t first_pair, int B, int T, int32_t* tokens,
                  int32_t* targets) const;

  size_t train_tokens() const { return split_; }
  size_t eval_tokens() const { return tokens_.size() - split_; }
  const std::string& description() const { return description_; }

  // Whether a loss mask applies (to either split): the loss is then the mean over the targets
  // that count, which the counts below give (without a mask, every target counts).
  bool masked() const { return train_packed_ || eval_packed_; }
  // Whether both splits are preference pairs (the training split's mask says so; a held-out
  // file must then hold pairs too), and their pairs (those kept: a loss target on both sides).
  bool preference() const { return preference_; }
  size_t train_pairs() const { return train_pairs_.size(); }
  size_t eval_pairs() const { return eval_pairs_.size(); }
  // The training pair that train_batch(seed, step, micro, ...) puts in global pair row
  // `pair_row` (rank * (B / 2) + j): its index among the train_pairs().
  size_t train_pair(uint64_t seed, int64_t step, int micro, size_t pair_row) const {
    return pick(seed, step, micro, pair_row, train_pairs_.size());
  }
  bool train_packed() const { return train_packed_; }
  bool eval_packed() const { return eval_packed_; }
  // Whether a split's batches come with positions: packed, with data.packing "sequence". Each
  // conversation of a window then attends only to itself (ModelRunner::begin_batch's
  // positions); position p of a window's token counts from its conversation's first token
  // (the window's first token is 0, also for the later pieces of a cut conversation); the
  // padding after the last conversation continues its count. Never for preference pairs (a row
  // is one sequence: plain positions).
  bool train_positions() const { return train_packed_ && per_sequence_ && !preference_; }
  bool eval_positions() const { return eval_packed_ && per_sequence_ && !preference_; }
  // Packed: the windows with a target; preference: the rows of the pairs (2 * train_pairs()).
  size_t train_windows() const {
    return preference_ ? 2 * train_pairs_.size() : train_windows_.size();
  }
  // Targets that count in train_batch(seed, step, micro, rank, B, T)'s rows.
  int64_t train_batch_targets(uint64_t seed, int64_t step, int micro, int rank, int B, int T) const;
  // Eval windows of T inputs (packed, or (eval_tokens - 1) / T consecutive ones; preference: the
  // rows of the pairs, window 2p + s side s of pair p), and the targets that count in window w /
  // in eval_batch(i)'s rows of every rank.
  size_t eval_windows(int T) const;
  int64_t eval_window_targets(size_t w, int T) const;
  int64_t eval_batch_targets(int i, int B, int T, int world) const;

 private:
  // Window w of the split: its tokens at `off`, `len` of them (<= T + 1), into the rows.
  void fill_window(size_t off, size_t len, int T, int32_t* tokens, int32_t* targets) const;
  // The positions of the window at `off` (see train_positions()).
  void fill_positions(size_t off, size_t len, int T, int32_t* positions) const;
  // A preference pair into two rows (tokens and targets [2*T]).
  void fill_pair(const PreferencePair& p, int T, int32_t* tokens, int32_t* targets) const;
  // The rest of load() for preference data: the splits' pairs, their checks, the log line.
  [[nodiscard]] Status load_pairs(const DataConfig& cfg);
  // Row `row`'s draw in [0, n) for (seed, step, micro).
  static size_t pick(uint64_t seed, int64_t step, int micro, uint64_t row, size_t n);

  std::vector<int32_t> tokens_;
  std::vector<uint8_t> mask_;  // per token kMaskLoss | kMaskStart when masked(), else empty
  size_t split_ = 0;           // tokens_[0, split_) train, [split_, end) eval
  bool train_packed_ = false, eval_packed_ = false;
  bool per_sequence_ = false;                               // data.packing == "sequence"
  std::vector<PackedWindow> train_windows_, eval_windows_;  // packed splits' windows
  bool preference_ = false;                                 // both splits preference pairs
  std::vector<PreferencePair> train_pairs_, eval_pairs_;
  std::string description_;
};

}  // namespace strata
