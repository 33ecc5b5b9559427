// Text generation for a quick look at a model (`strata generate`): the model's own forward — the
// program its Architecture runs in training and eval (architecture.h) — on a device (the CPU
// backend, or CUDA) over its weights held on that device in fp32, one token at a time, and
// greedy / temperature + top-p sampling. Every model type generates (GPT-2, Llama / Mistral /
// Qwen2, Mixtral, Qwen2-MoE): nothing here names a model's parts.
//
// Two ways to the next token's logits, the same tokens (HfGenerate.* in tests/
// hf_compare_test.cc):
//   cached     Architecture::create_kv_decoder: each layer's keys and values stay on the device,
//              the prompt runs as one forward over its tokens and each further token as one
//              token's forward. Where the kernels have KernelOp::kAttentionDecode.
//   window     otherwise (or when asked): a runner of one sequence of model.context tokens
//              (create_runner, strata.activations recompute) runs the eval program over the
//              whole window so far for each token, and its head's logits (MicroBatch::
//              logits_out) give the last position's.
// Token for token the greedy decode is transformers' (the fixtures' greedy.json, written by
// transformers in fp32).
//
// Memory (decoder_bytes): on the device, every parameter in fp32, the activations of one
// sequence of model.context tokens and the cache (2 x layers x context x key/value width fp32);
// on the host, the fp32 weights as they are read, each module freed once it is on the device.
// A quick look, not a serving engine.
//
// Thread safety: a Decoder is used by one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata {

// How a Decoder computes (see the top of this file).
enum class DecodePath : uint8_t {
  kAuto,    // the cache where the kernels support it, else the window
  kCached,  // the cache; kUnavailable where the kernels lack it
  kWindow,  // the whole window each token
};

// What a decoder of `arch` on `path` allocates, for a check before anything is: `host`, the
// fp32 weights of every module as the reader holds them before they reach the device; `device`,
// the weights in fp32 and the path's state: the cached decoder's activations and cache
// (kv_decoder_bytes; kAuto counts it where the architecture has one), or the window runner's
// activations for one sequence of model.context tokens.
struct DecoderBytes {
  uint64_t host = 0;
  uint64_t device = 0;
};
DecoderBytes decoder_bytes(const Architecture& arch, DecodePath path = DecodePath::kAuto);

class Decoder {
 public:
  virtual ~Decoder() = default;
  // A decoder for `arch` (which must outlive it) on `device` (likewise) over `weights`, every
  // module's fp32 master weights (moved in: each module's host copy is freed once it is on the
  // device). A LoRA architecture's weights are the base with the adapters merged in (what
  // load_master_weights gives): they run on the same model without adapters.
  static Result<std::unique_ptr<Decoder>> create(const Architecture& arch, Device& device,
                                                 std::vector<std::vector<float>> weights,
                                                 DecodePath path = DecodePath::kAuto);
  // Runs `tokens` (at least one) at the next positions and returns the logits of the token
  // after the last (vocab_size of them). An error past the context or for a token outside the
  // vocabulary (nothing run).
  virtual Result<const std::vector<float>*> run(std::span<const int32_t> tokens) = 0;
  Result<const std::vector<float>*> step(int32_t token) { return run({&token, 1}); }
  virtual int position() const = 0;  // tokens run so far
  virtual int context() const = 0;   // the most positions (model.context)
  virtual int vocab_size() const = 0;
  virtual bool cached() const = 0;  // which path runs: the cache (true) or the window
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

// Runs `prompt` through `decoder` (one call), then generates up to max_new_tokens (fewer at a
// stop token or at the context's end). Returns the generated tokens (the prompt not included).
Result<std::vector<int32_t>> generate(Decoder& decoder, const std::vector<int32_t>& prompt,
                                      const SampleOptions& options);

}  // namespace strata
