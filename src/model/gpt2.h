// GPT-2: a block definition of the decoder skeleton (src/model/decoder.h). L pre-norm blocks
// (LayerNorm with bias, multi-head attention over a packed qkv projection, GELU MLP of width 4C,
// biases everywhere), learned positions, and an output projection tied to the token embedding
// unless model.tied_embeddings is false.
//
// Modules, in forward order: "embedding" (wte [Vp,C], wpe [maxT,C]), "block.<i>" (12 tensors),
// "final_norm" (lnfw, lnfb), and "head" (lm_head [Vp,C]) when embeddings are not tied.
// Block tensor order inside the flat buffer, with shapes (C channels):
//   ln1w [C], ln1b [C], qkvw [3C,C], qkvb [3C], attprojw [C,C], attprojb [C],
//   ln2w [C], ln2b [C], fcw [4C,C], fcb [4C], fcprojw [C,4C], fcprojb [C]
// The program is the skeleton's (decoder_programs).
//
// Initialization (GPT-2's): normal(0, 0.02), wpe 0.01; projections feeding the residual stream
// (attprojw, fcprojw) std 0.02/sqrt(2L); norms' weights one, biases zero; the vocabulary's
// padding rows (V..Vp-1) zero. Hugging Face names: GPT2LMHeadModel's
// ("transformer.h.<i>.attn.c_attn.weight", or without the "transformer." prefix); its Conv1D
// weights are stored transposed; wpe holds model.context rows (a checkpoint's further positions
// are not read).
#pragma once

#include <memory>

#include "src/model/architecture.h"

namespace strata {

// GPT-2 at `config`'s shape (model.type gpt2). Errors name the model.* key.
Result<std::unique_ptr<Architecture>> create_gpt2(const ModelConfig& config);

}  // namespace strata
