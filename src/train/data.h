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
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/status.h"

namespace strata {

class Dataset {
 public:
  // Loads or generates the corpus; checks every token id against vocab_size.
  static Result<Dataset> load(const DataConfig& cfg, int vocab_size, uint64_t seed);

  // Fills tokens/targets [B*T] for one training micro-batch: B windows at random offsets of
  // the training split; targets are the inputs shifted by one. Each window is a function of
  // (seed, step, micro, global row) with global row = rank * B + b, so N ranks with B rows
  // each see exactly the windows one rank with N*B rows sees (data parallelism keeps the
  // global batch).
  void train_batch(uint64_t seed, int64_t step, int micro, int rank, int B, int T, int32_t* tokens,
                   int32_t* targets) const;
  // Eval batch i (0-based) of B consecutive windows from the held-out split (wraps around);
  // rank r of `world` takes rows [r*B, (r+1)*B) of the global batch of world*B windows.
  void eval_batch(int i, int B, int T, int32_t* tokens, int32_t* targets, int rank = 0,
                  int world = 1) const;

  size_t train_tokens() const { return split_; }
  size_t eval_tokens() const { return tokens_.size() - split_; }
  const std::string& description() const { return description_; }

 private:
  std::vector<int32_t> tokens_;
  size_t split_ = 0;  // tokens_[0, split_) train, [split_, end) eval
  std::string description_;
};

}  // namespace strata
