// The key table's model section: model.* (the families' shapes, from config.json or given) and
// the lora section (key_table_builder.h).
#include "src/config/key_table_builder.h"

namespace strata::config_internal::table {

void TableBuilder::add_model_keys() {
  // --- strata: model ----------------------------------------------------------------------------
  group("strata: model");
  add(F("model.type", Enum(model_type_values()), STRATA_M(model.type), model_type_doc()));
  add(F("model.from_pretrained", Str(), STRATA_M(model.from_pretrained),
        "a Hugging Face model directory (config.json + model.safetensors or its sharded index): "
        "shape from config.json, initial weights from the safetensors; the model section may "
        "then hold only from_pretrained and context"));
  add(F("model.n_layer", Int(1, 4096), STRATA_M(model.n_layer), "transformer blocks"));
  add(F("model.n_head", Int(1, 4096), STRATA_M(model.n_head), "attention heads"));
  add(F("model.n_embd", Int(1, 1 << 20), STRATA_M(model.n_embd),
        "hidden size, divisible by n_head"));
  add(F("model.vocab_size", Int(1, 1 << 24), STRATA_M(model.vocab_size),
        "tokens in the vocabulary"));
  add(F("model.padded_vocab_size", Int(0, 1 << 24), STRATA_M(model.padded_vocab_size),
        "embedding rows, >= vocab_size; 0/auto: vocab_size rounded up to 64", nullptr, kAuto));
  add(F("model.context", Int(1, 1 << 24), STRATA_M(model.context), "maximum sequence length"));
  add(F("model.tied_embeddings", Bool(), STRATA_M(model.tied_embeddings),
        "share token embedding and output head"));
  add(F("model.intermediate_size", Int(0, 1 << 24), STRATA_M(model.intermediate_size),
        "llama: SwiGLU MLP width (required for llama)"));
  add(F("model.num_key_value_heads", Int(0, 4096), STRATA_M(model.num_key_value_heads),
        "llama: key/value heads (grouped-query attention), divides n_head; 0: n_head"));
  add(F("model.rope_theta", Real(1, kInf, true, true), STRATA_M(model.rope_theta),
        "llama: rotary embedding base"));
  add(F("model.rms_norm_eps", Real(0, 1, true, false), STRATA_M(model.rms_norm_eps),
        "llama: RMSNorm epsilon"));
  add(F("model.attention_bias", Bool(), STRATA_M(model.attention_bias),
        "llama: q/k/v projection biases (Qwen2)"));
  add(F("model.head_dim", Int(0, 1024), STRATA_M(model.head_dim),
        "llama: a head's width (n_head x head_dim wide attention; Qwen3); 0/auto: n_embd / n_head",
        nullptr, kAuto));
  add(F(
      "model.pad_token_id", Int(-1, 1 << 24), STRATA_M(model.pad_token_id),
      "llama family and mixtures: the token whose embedding row takes no gradient "
      "(transformers' nn.Embedding padding_idx, read from config.json's pad_token_id); -1: none"));
  add(F("model.qk_norm", Bool(), STRATA_M(model.qk_norm),
        "llama: an RMSNorm over each query and key head before the rotary positions (Qwen3)"));
  add(F("model.rope_scaling.type", Enum("none|llama3"), STRATA_M(model.rope_scaling.type),
        "llama: rotary frequency scaling (llama3: Llama 3.1's)"));
  add(F("model.rope_scaling.factor", Real(0, kInf, true, true), STRATA_M(model.rope_scaling.factor),
        "llama3 scaling: low-frequency divisor"));
  add(F("model.rope_scaling.low_freq_factor", Real(0, kInf, true, true),
        STRATA_M(model.rope_scaling.low_freq_factor), "llama3 scaling"));
  add(F("model.rope_scaling.high_freq_factor", Real(0, kInf, true, true),
        STRATA_M(model.rope_scaling.high_freq_factor), "llama3 scaling, > low_freq_factor"));
  add(F("model.rope_scaling.original_max_position_embeddings", Real(1, kInf, false, true),
        STRATA_M(model.rope_scaling.original_max_position_embeddings),
        "llama3 scaling: the context the model was pre-trained at"));

  add(F("model.num_experts", Int(0, 1 << 16), STRATA_M(model.num_experts),
        "mixtral/qwen2_moe: routed experts per layer"));
  add(F("model.num_experts_per_tok", Int(1, 1 << 16), STRATA_M(model.num_experts_per_tok),
        "mixtral/qwen2_moe: experts each token is routed to (top-k), <= num_experts"));
  add(F("model.moe_intermediate_size", Int(0, 1 << 24), STRATA_M(model.moe_intermediate_size),
        "mixtral/qwen2_moe: an expert's SwiGLU width; 0: intermediate_size"));
  add(F("model.shared_expert_intermediate_size", Int(0, 1 << 24),
        STRATA_M(model.shared_expert_intermediate_size),
        "qwen2_moe: the shared expert's SwiGLU width (its output gated by a sigmoid); 0: none"));
  add(F("model.norm_topk_prob", Bool(), STRATA_M(model.norm_topk_prob),
        "mixtral/qwen2_moe: renormalize the top-k routing probabilities to sum to 1"));
  add(F("model.router_aux_loss_coef", Real(0, kInf, false, true),
        STRATA_M(model.router_aux_loss_coef),
        "mixtral/qwen2_moe: weight of the load-balancing loss added in training (reported apart)"));
  // --- LoRA (PEFT's LoraConfig) ---------------------------------------------------------------
  group("LoRA adapters (PEFT's LoraConfig keys)");
  add(F("lora.r", Int(1, 65536), STRATA_M(model.lora.r),
        "adapter rank; giving any lora.* key (but base_quantization and double_quant) turns "
        "adapters on and freezes the whole base"));
  add(F("lora.lora_alpha", Real(0, kInf, true, true), STRATA_M(model.lora.alpha),
        "scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)"));
  add(F("lora.use_rslora", Bool(), STRATA_M(model.lora.use_rslora),
        "rank-stabilized LoRA: scaling = lora_alpha / sqrt(r)"));
  add(F("lora.lora_dropout", Real(0, 1, false, true), STRATA_M(model.lora.dropout),
        "dropout on each adapter's input in training (PEFT's lora_B(lora_A(dropout(x)))), masks "
        "drawn from train.seed, the step and the site, so a resumed run is exact"));
  add(F(
      "lora.target_modules", StrOrList(),
      [](Config& c, const json& v) {
        LoraConfig& l = c.model.lora;
        l.target_modules.clear();
        l.target_pattern.clear();
        if (v.is_string()) {
          l.target_pattern = v.get<std::string>();
        } else {
          l.target_modules = v.get<std::vector<std::string>>();
        }
        l.target_modules_none = v.is_array() && v.empty();
      },
      [](const Config& c) -> json {
        const LoraConfig& l = c.model.lora;
        return l.target_pattern.empty() ? json(l.target_modules) : json(l.target_pattern);
      },
      "linear layers to adapt, as PEFT reads it: a list of names, each a layer's name or its "
      "last parts (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; GPT-2: c_attn "
      "c_proj c_fc), or a string: \"all-linear\" (every linear layer but the output head) or a "
      "regular expression matched against a layer's whole name (model.layers.0.self_attn.q_proj, "
      "as re.fullmatch); []: PEFT's default (q_proj, v_proj; c_attn), or none beside "
      "lora.target_parameters (PEFT's target_modules=[])"));
  add(F("lora.target_parameters", StrList(), STRATA_M(model.lora.target_parameters),
        "the mixtures' routed experts, fused parameters PEFT reaches by name (mixtral, qwen2_moe: "
        "experts.gate_up_proj, experts.down_proj, or their last parts): per expert an adapter of "
        "rank r (PEFT's ParamWrapper: lora_A [E*r, in], lora_B [out, r*E]); needs "
        "lora.lora_dropout 0, as PEFT",
        nullptr, 0, "[]"));
  add(F("lora.bias", Enum("none|all|lora_only"), STRATA_M(model.lora.bias),
        "which biases train: none (PEFT's default); all and lora_only are refused (the base is "
        "frozen whole: train without the lora section to train biases)"));
  add(F("lora.modules_to_save", StrList(), STRATA_M(model.lora.modules_to_save),
        "modules trained whole beside the adapters (PEFT's): only [] (a non-empty list is "
        "refused: train without the lora section to train whole modules)",
        nullptr, 0, "[]"));
  add(F("lora.base_quantization", Enum("none|int8|nf4"), STRATA_M(model.lora.base_quantization),
        "how the frozen base's linear-layer weights are stored, moved and read: none (model "
        "dtype), int8 (1 byte + an fp32 scale per row), nf4 (QLoRA's NormalFloat: 0.5 byte + an "
        "fp32 absmax per 64); dequantized on the device per block just before use"));
  add(F("lora.double_quant", Bool(), STRATA_M(model.lora.double_quant),
        "nf4's absmax quantized again (bitsandbytes' bnb_4bit_use_double_quant): not implemented "
        "(true is refused)"));
}

}  // namespace strata::config_internal::table
