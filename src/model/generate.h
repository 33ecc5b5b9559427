// Text generation for a quick look at a model (`strata generate`): a CPU decoder with a KV cache
// over the model's fp32 master weights, one token at a time, and greedy / temperature + top-p
// sampling.
//
// The decoder runs the forward of the architecture the weights belong to, as transformers
// computes it (plain loops, fp32 values, double sums; the llm.c habit: a reader can follow it):
//   llama (Llama, Mistral, Qwen2): RMSNorm, q/k/v (+ biases), rotary positions (rope_inv_freq,
//     the kernels' one formula, llama3 scaling included), grouped-query attention over the
//     cache, o_proj, SwiGLU MLP, final RMSNorm, the head (tied: the embedding);
//   gpt2: token + position embeddings, LayerNorm, fused q/k/v with bias, attention, GELU (tanh)
//     MLP, final LayerNorm, the tied head.
// Token for token it gives transformers' greedy decode (HfGenerate.GreedyMatchesTransformers in
// tests/hf_compare_test.cc, against the fixtures' greedy.json, written by transformers).
//
// Memory: the whole model's fp32 master weights (4 bytes a parameter) plus the cache (2 x
// layers x context x key/value width floats): a quick look, not a serving engine.
//
// Thread safety: a Decoder is used by one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata {

// Every module's fp32 master weights: from a strata checkpoint (a file, or a sharded
// checkpoint's manifest: the shards' slices put together), or, when `checkpoint` is "", from
// model.from_pretrained. The checkpoint's model must be `arch`'s (checked, naming both shapes).
// A LoRA run's checkpoint (arch has adapters) holds only the adapters: its weights are the base
// with the adapters merged in (merged_lora_modules, what `strata export` writes), so generate
// gives the merged export's tokens.
Result<std::vector<std::vector<float>>> load_master_weights(const Architecture& arch,
                                                            const ModelConfig& model,
                                                            const std::string& checkpoint);

// The host memory a decoder of `arch` holds: every module's fp32 master weights (what
// load_master_weights allocates) and its cache (2 x layers x context x key/value width floats,
// what Decoder::create allocates). For a check before either allocates.
uint64_t decoder_bytes(const Architecture& arch);

class Decoder {
 public:
  virtual ~Decoder() = default;
  // A decoder for `arch` (llama or gpt2; which must outlive it) over `weights` (moved in).
  static Result<std::unique_ptr<Decoder>> create(const Architecture& arch,
                                                 std::vector<std::vector<float>> weights);
  // Runs `token` at the next position (cached keys and values of the earlier ones) and returns
  // the logits of the next token (vocab_size of them). An error past the context.
  virtual Result<const std::vector<float>*> step(int32_t token) = 0;
  virtual int position() const = 0;  // tokens run so far
  virtual int context() const = 0;   // the most positions (model.context)
  virtual int vocab_size() const = 0;
};

struct SampleOptions {
  int max_new_tokens = 64;
  double temperature = 0.0;  // 0: greedy (the first largest logit)
  double top_p = 1.0;        // nucleus: the fewest most likely tokens whose mass reaches top_p
  uint64_t seed = 0;
  std::vector<int32_t> stop;  // stop after generating one of these (EOS)
};

// The token `logits` pick: argmax when temperature is 0, else a draw (`uniform` in [0, 1)) from
// softmax(logits / temperature) restricted to the top-p nucleus.
int32_t pick_token(const std::vector<float>& logits, double temperature, double top_p,
                   double uniform);

// Runs `prompt` through `decoder`, then generates up to max_new_tokens (fewer at a stop token
// or at the context's end). Returns the generated tokens (the prompt not included).
Result<std::vector<int32_t>> generate(Decoder& decoder, const std::vector<int32_t>& prompt,
                                      const SampleOptions& options);

}  // namespace strata
