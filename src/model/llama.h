// Llama (and the models that share its shape: Mistral, Qwen2, TinyLlama, SmolLM): a block
// definition of the decoder skeleton (src/model/decoder.h). L pre-norm blocks: RMSNorm (eps from
// model.rms_norm_eps), grouped-query attention (NH query heads, KVH key/value heads) with rotary
// positions (RopeParams: model.rope_theta, model.rope_scaling.*), and a SwiGLU MLP of width
// I = model.intermediate_size. No biases, except q/k/v biases when model.attention_bias
// (Qwen2). No learned positions. The output head is its own matrix unless
// model.tied_embeddings.
//
// Modules, in forward order: "embedding" (embed_tokens [Vp,C]), "block.<i>", "final_norm"
// (norm [C]) and "head" (lm_head [Vp,C]) when embeddings are not tied. Block tensors, in flat
// buffer order (hs = C/NH, W = (NH + 2*KVH)*hs):
//   input_layernorm [C], q_proj [NH*hs,C], k_proj [KVH*hs,C], v_proj [KVH*hs,C],
//   (q_bias [NH*hs], k_bias [KVH*hs], v_bias [KVH*hs] when attention_bias), o_proj [C,NH*hs],
//   post_attention_layernorm [C], gate_proj [I,C], up_proj [I,C], down_proj [C,I]
// The names are Hugging Face's (model.layers.<i>.self_attn.q_proj.weight, ...). q_proj, k_proj
// and v_proj are adjacent, so together they are the [W,C] weight of ONE matmul whose output is
// the packed qkv of Kernels::attention_gqa_forward; gate_proj and up_proj likewise make the
// [2I,C] weight whose output is SwiGLU's packed input. The program is the skeleton's.
//
// Initialization (Hugging Face's LlamaPreTrainedModel): every matrix normal(0, 0.02), norms'
// weights one, biases zero; the vocabulary's padding rows (V..Vp-1) zero.
#pragma once

#include <memory>

#include "src/model/architecture.h"
#include "strata/kernels.h"

namespace strata {

// The rotary positions of `config`: model.rope_theta and model.rope_scaling (llama3 or none).
RopeParams llama_rope(const ModelConfig& config);

// Llama at `config`'s shape (model.type llama). Errors name the model.* key.
Result<std::unique_ptr<Architecture>> create_llama(const ModelConfig& config);

}  // namespace strata
