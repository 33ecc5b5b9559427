// Mixtures of experts on Llama's block (src/model/llama_blocks.h): model.type mixtral
// (MixtralForCausalLM) and qwen2_moe (Qwen2MoeForCausalLM). A block is Llama's attention, then,
// in place of the dense MLP, a router and E = model.num_experts SwiGLU experts of width
// Ie = model.moe_intermediate_size (0: model.intermediate_size):
//   p      = softmax(x R^T)                  router [E, C], probabilities per token, fp32
//   top    = the K = model.num_experts_per_tok largest p (ties: the lower expert), weights
//            p / sum(top p) when model.norm_topk_prob (Mixtral always), else p
//   out    = sum over the token's K experts e of weight_e * down_e(silu(gate_e x) * up_e x)
//            (+ sigmoid(x . g) * shared(x): qwen2_moe's shared expert of width
//            model.shared_expert_intermediate_size, and its gate g [C])
// No capacity limit: every token reaches its K experts (no token is dropped), as transformers.
// The load-balancing loss is transformers' load_balancing_loss_func over all L layers of a
// micro-batch of N tokens: aux = E * sum_e (count_e / (L N)) * (psum_e / (L N)), count_e the
// top-K picks of expert e and psum_e its summed probabilities over every layer and token.
// Training adds router_aux_loss_coef * aux per micro-batch (weighted like the micro-batch's
// share of the step's tokens); MicroBatch::aux_loss_out reports aux apart from the loss.
//
// Modules: "embedding", then per block "block.<i>" (Llama's attention tensors, then router
// [E,C]; qwen2_moe with a shared expert: shared_gate_proj [Is,C], shared_up_proj [Is,C],
// shared_down_proj [C,Is], shared_expert_gate [C]) followed by its E experts
// "block.<i>.expert.<e>" (gate_proj [Ie,C], up_proj [Ie,C], down_proj [C,Ie]), "final_norm",
// "head". Each expert is its own module: its own homes in the tiers, optimizer state, prefetch
// and ZeRO-3 shard. The program acquires a block's experts together with the block, all of them
// on every micro-batch (decoder_programs): which experts a token picks is known only once the
// router has run on the device, and every rank must make the same collectives in the same
// order; an expert that receives no token computes nothing and drains a zero gradient.
//
// Compute touches only the routed tokens: after the router's matmul the compute stream is
// synchronized, the host picks the top-K (and builds each expert's token list), and each
// expert gathers its rows, runs its SwiGLU on them and scatter-adds its weighted output
// (Kernels::gather_rows / scatter_add_rows / row_dots). The backward synchronizes once more
// to turn the experts' weight gradients into the router's logits' gradient on the host.
//
// Hugging Face names (as transformers 5 saves them, one tensor per expert):
//   mixtral   model.layers.<i>.block_sparse_moe.gate.weight, ...experts.<e>.w1 (gate), w3 (up),
//             w2 (down)
//   qwen2_moe model.layers.<i>.mlp.gate.weight, mlp.experts.<e>.{gate,up,down}_proj.weight,
//             mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1,C]
#pragma once

#include <memory>

#include "src/model/architecture.h"

namespace strata {

// A mixture at `config`'s shape (model.type mixtral or qwen2_moe). Errors name the model.* key.
Result<std::unique_ptr<Architecture>> create_moe(const ModelConfig& config);

}  // namespace strata
