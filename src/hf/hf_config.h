// A Hugging Face model directory's config.json as strata's ModelConfig.
//
// Architectures read (config.json "architectures"[0]), each by its model family
// (src/model/family.h: the family's block file reads and writes its keys; this file does what
// every family shares: the file, the context, the sliding window, the dtype, the tied head):
//   LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM -> model.type llama
//   MixtralForCausalLM -> mixtral, Qwen2MoeForCausalLM -> qwen2_moe
//   GPT2LMHeadModel                                         -> model.type gpt2
// Shapes: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
// intermediate_size, vocab_size, max_position_embeddings, rms_norm_eps, rope_theta,
// rope_scaling (rope_type/type "llama3" or "default"), attention_bias (Qwen2: always q/k/v
// biases), tie_word_embeddings (false when the weights hold an lm_head.weight that differs from
// the embedding, as transformers loads them, with a warning), torch_dtype (bfloat16, float16,
// float32); GPT-2's n_embd, n_layer, n_head, n_positions, layer_norm_epsilon. Refused with an error
// naming the file and the key, and what to do: a sliding-window attention (Mistral, Qwen2 with
// use_sliding_window) whose window is shorter than the context, a head_dim other than hidden_size /
// num_attention_heads, an activation other than silu (Llama) or gelu_new (GPT-2), a rope scaling
// other than llama3, a GPT-2 layer_norm_epsilon other than 1e-5.
#pragma once

#include <string>

#include "strata/config.h"
#include "strata/status.h"

namespace strata {

// The ModelConfig of `dir`/config.json. `context` > 0 sets model.context (it may not exceed
// max_position_embeddings); 0 takes max_position_embeddings.
Result<ModelConfig> model_config_from_hf(const std::string& dir, int context);

// The config.json key model_config_from_hf reads strata's `strata_key` ("model.n_layer") from
// for a model of `type` (gpt2, llama, mixtral or qwen2_moe): "num_hidden_layers", Mixtral's
// "num_local_experts" for model.num_experts; "" when none does.
std::string hf_config_key(const std::string& type, const std::string& strata_key);

// The config.json that describes `model` to transformers (the inverse of the above): a llama
// with q/k/v biases as Qwen2ForCausalLM (Llama's attention_bias also biases o_proj), other
// llamas (Mistral's too: its weights are Llama's) as LlamaForCausalLM, gpt2 as
// GPT2LMHeadModel with n_positions = model.context; dtype and torch_dtype are model.dtype, the
// rope both as transformers 5's rope_parameters and as rope_theta + rope_scaling.
// When model.from_pretrained names a directory, the keys of its config.json that describe
// neither shape nor dtype (token ids, ...) are kept, and so are a llama's
// max_position_embeddings and GPT-2's n_positions when they exceed model.context (the export
// writes GPT-2's whole stored position table).
std::string hf_config_json(const ModelConfig& model);

}  // namespace strata
