#include "src/model/llama.h"

#include <fmt/format.h>

#include "src/model/decoder_architecture.h"
#include "src/model/llama_blocks.h"

namespace strata {

RopeParams llama_rope(const ModelConfig& mc) {
  RopeParams rope;
  rope.theta = mc.rope_theta;
  if (mc.rope_scaling.type == "llama3") {
    rope.llama3 = true;
    rope.factor = mc.rope_scaling.factor;
    rope.low_freq_factor = mc.rope_scaling.low_freq_factor;
    rope.high_freq_factor = mc.rope_scaling.high_freq_factor;
    rope.original_max_position = mc.rope_scaling.original_max_position_embeddings;
  }
  return rope;
}

Status LlamaBlocks::check_attention(const ModelConfig& mc) {
  if (!mc.rope_scaling.type.empty() && mc.rope_scaling.type != "none" &&
      mc.rope_scaling.type != "llama3") {
    return invalid_argument(
        fmt::format("model.rope_scaling.type: \"{}\" is not supported (use llama3, or none)",
                    mc.rope_scaling.type));
  }
  if (mc.n_head % mc.num_key_value_heads != 0) {
    return invalid_argument(
        fmt::format("model.num_key_value_heads: {} does not divide model.n_head {}",
                    mc.num_key_value_heads, mc.n_head));
  }
  const int hs = mc.n_embd / mc.n_head;
  if (hs % 2 != 0 || hs / 2 > kMaxRopePairs) {
    return invalid_argument(fmt::format(
        "model.n_head: head size n_embd/n_head = {} must be even and <= {} for rotary positions",
        hs, 2 * kMaxRopePairs));
  }
  if (!(float(mc.rms_norm_eps) > 0.0f)) {
    return invalid_argument(fmt::format("model.rms_norm_eps: {} must be > 0", mc.rms_norm_eps));
  }
  const RopeParams rope = llama_rope(mc);
  if (!(rope.theta > 1.0)) {
    return invalid_argument(fmt::format("model.rope_theta: {} must be > 1", mc.rope_theta));
  }
  if (rope.llama3 && !(rope.factor > 0 && rope.high_freq_factor > rope.low_freq_factor &&
                       rope.low_freq_factor > 0 && rope.original_max_position > 0)) {
    return invalid_argument(
        "model.rope_scaling: llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor "
        "and original_max_position_embeddings > 0");
  }
  return Status::ok();
}

std::vector<HfTensor> LlamaBlocks::hf_tensors(const ModuleSpec& m) const {
  std::vector<HfTensor> out;
  const std::string block =
      m.name.rfind("block.", 0) == 0 ? "model.layers." + m.name.substr(6) + "." : std::string();
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    HfTensor h;
    h.tensor = int(i);
    STRATA_CHECK(hf_tensor(block, m.tensors[i].name, &h),
                 "llama tensor without a Hugging Face name");
    out.push_back(std::move(h));
  }
  return out;
}

bool LlamaBlocks::hf_tensor(const std::string& block, const std::string& n, HfTensor* h) const {
  const int64_t C = s_.n_embd, V = s_.vocab_size, I = s_.intermediate_size,
                Q = int64_t(s_.n_head) * hs(), KV = int64_t(s_.num_key_value_heads) * hs();
  if (n == "embed_tokens") {
    h->name = "model.embed_tokens.weight", h->shape = {V, C};
  } else if (n == "norm") {
    h->name = "model.norm.weight", h->shape = {C};
  } else if (n == "lm_head") {
    h->name = "lm_head.weight", h->shape = {V, C};
  } else if (n == "input_layernorm" || n == "post_attention_layernorm") {
    h->name = block + n + ".weight", h->shape = {C};
  } else if (n == "q_proj") {
    h->name = block + "self_attn.q_proj.weight", h->shape = {Q, C};
  } else if (n == "k_proj" || n == "v_proj") {
    h->name = block + "self_attn." + n + ".weight", h->shape = {KV, C};
  } else if (n == "q_bias") {
    h->name = block + "self_attn.q_proj.bias", h->shape = {Q};
  } else if (n == "k_bias" || n == "v_bias") {
    h->name = block + "self_attn." + n.substr(0, 1) + "_proj.bias", h->shape = {KV};
  } else if (n == "o_proj") {
    h->name = block + "self_attn.o_proj.weight", h->shape = {C, Q};
  } else if (n == "gate_proj" || n == "up_proj") {
    h->name = block + "mlp." + n + ".weight", h->shape = {I, C};
  } else if (n == "down_proj") {
    h->name = block + "mlp.down_proj.weight", h->shape = {C, I};
  } else {
    return false;
  }
  return true;
}

Result<std::unique_ptr<Architecture>> create_llama(const ModelConfig& config) {
  return DecoderArchitecture<LlamaBlocks>::create(config);
}

}  // namespace strata
