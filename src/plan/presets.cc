// The planner's model presets (strata plan --model): GPT-2/3, Llama, Qwen, Mistral and
// mixtures of experts with their Hugging Face config.json shapes.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "src/plan/plan.h"

namespace strata {
namespace {

struct Preset {
  const char* name;
  const char* type;
  int layers, width, heads, vocab, context;
  int kv_heads, intermediate;  // llama
  bool tied, qkv_bias;
  double rope_theta;
  const char* note;
  // mixtures of experts (type mixtral / qwen2_moe): experts per layer, top-k, an expert's width,
  // the shared expert's (0: none), whether the top-k weights are renormalized
  int experts = 0, top_k = 0, expert_width = 0, shared_width = 0;
  bool norm_topk = true;
  // Qwen3's attention: a head's width (0: width / heads) and the query/key norms
  int head_dim = 0;
  bool qk_norm = false;
};

// GPT shapes from the GPT-2 release and the GPT-3 paper (Table 2.1). Llama-family shapes from
// their Hugging Face config.json (meta-llama/Llama-2-*-hf, Meta-Llama-3-*, Llama-3.1-405B,
// Qwen/Qwen2.5-*, Qwen/Qwen3-*, microsoft/phi-4, mistralai/Mistral-7B-v0.1); the parameter counts
// they give are the published ones exactly (Plan.PresetParamCounts). context: the longest sequence
// strata trains them at as the checkpoint defines them (Mistral: its 4096-token sliding window;
// strata's attention is full, so no more).
constexpr Preset kPresets[] = {
    {"gpt2-124m", "gpt2", 12, 768, 12, 50257, 1024, 0, 0, true, false, 0, ""},
    {"gpt2-350m", "gpt2", 24, 1024, 16, 50257, 1024, 0, 0, true, false, 0, ""},
    {"gpt2-774m", "gpt2", 36, 1280, 20, 50257, 1024, 0, 0, true, false, 0, ""},
    {"gpt2-1.5b", "gpt2", 48, 1600, 25, 50257, 1024, 0, 0, true, false, 0, ""},
    {"gpt3-6.7b", "gpt2", 32, 4096, 32, 50257, 2048, 0, 0, true, false, 0, ""},
    {"gpt3-13b", "gpt2", 40, 5140, 40, 50257, 2048, 0, 0, true, false, 0, ""},
    {"gpt3-175b", "gpt2", 96, 12288, 96, 50257, 2048, 0, 0, true, false, 0, ""},
    {"llama2-7b", "llama", 32, 4096, 32, 32000, 4096, 32, 11008, false, false, 1e4, ""},
    {"llama2-13b", "llama", 40, 5120, 40, 32000, 4096, 40, 13824, false, false, 1e4, ""},
    {"llama2-70b", "llama", 80, 8192, 64, 32000, 4096, 8, 28672, false, false, 1e4, ""},
    {"llama3-8b", "llama", 32, 4096, 32, 128256, 8192, 8, 14336, false, false, 5e5, ""},
    {"llama3-70b", "llama", 80, 8192, 64, 128256, 8192, 8, 28672, false, false, 5e5, ""},
    {"llama3.1-405b", "llama", 126, 16384, 128, 128256, 131072, 8, 53248, false, false, 5e5,
     "context 131072 (rope_scaling llama3); --seq picks the trained length"},
    {"qwen2.5-7b", "llama", 28, 3584, 28, 152064, 32768, 4, 18944, false, true, 1e6, ""},
    {"qwen2.5-72b", "llama", 80, 8192, 64, 152064, 32768, 8, 29568, false, true, 1e6, ""},
    // Qwen3's dense models: heads 128 wide (an attention of 2048 in Qwen3-0.6B's width 1024),
    // query/key norms; context 40960 as their config.json's max_position_embeddings.
    {"qwen3-0.6b", "llama", 28, 1024, 16, 151936, 40960, 8,    3072, true,
     false,        1e6,     "", 0,    0,  0,      0,     true, 128,  true},
    {"qwen3-8b", "llama", 36, 4096, 32, 151936, 40960, 8,    12288, false,
     false,      1e6,     "", 0,    0,  0,      0,     true, 128,   true},
    {"qwen3-32b", "llama", 64, 5120, 64, 151936, 40960, 8,    25600, false,
     false,       1e6,     "", 0,    0,  0,      0,     true, 128,   true},
    // Phi-4 (microsoft/phi-4): Llama's block, its checkpoint's q|k|v and gate|up packed.
    {"phi4-14b", "phi3", 40, 5120, 40, 100352, 16384, 10, 17920, false, false, 2.5e5, ""},
    {"mistral-7b", "llama", 32, 4096, 32, 32000, 4096, 8, 14336, false, false, 1e4,
     "context 4096: Mistral's sliding window (strata's attention is full)"},
    // Mixtures of experts (mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1, Qwen/Qwen3-30B-A3B):
    // 46.7B (12.9B active per token), 140.6B (39.2B active), 30.5B (3.3B active) as published;
    // FLOPs per token count the active experts only.
    {"mixtral-8x7b", "mixtral", 32, 4096, 32, 32000, 32768, 8, 14336, false, false, 1e6, "", 8, 2,
     14336},
    {"mixtral-8x22b", "mixtral", 56, 6144, 48, 32768, 65536, 8, 16384, false, false, 1e6, "", 8, 2,
     16384},
    // Qwen3-MoE: qwen2_moe without a shared expert, Qwen3's attention (heads 128 wide, an
    // attention of 4096 in the width 2048; query/key norms).
    {"qwen3-30b-a3b", "qwen2_moe", 48, 2048, 32, 151936, 40960, 4,    6144, false,
     false,           1e6,         "", 128,  8,  768,    0,     true, 128,  true},
};

}  // namespace

PlanModel gpt_model(std::string name, int layers, int width, int heads, int vocab, int context,
                    bool tied_embeddings) {
  PlanModel m{std::move(name), ModelConfig{}, ""};
  m.shape.type = "gpt2";
  m.shape.n_layer = layers;
  m.shape.n_embd = width;
  m.shape.n_head = heads;
  m.shape.vocab_size = vocab;
  m.shape.context = context;
  m.shape.tied_embeddings = tied_embeddings;
  return m;
}

Result<PlanModel> model_preset(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name != p.name) continue;
    PlanModel m = gpt_model(p.name, p.layers, p.width, p.heads, p.vocab, p.context, p.tied);
    m.note = p.note;
    m.shape.type = p.type;
    m.shape.num_key_value_heads = p.kv_heads;
    m.shape.intermediate_size = p.intermediate;
    m.shape.attention_bias = p.qkv_bias;
    m.shape.head_dim = p.head_dim;
    m.shape.qk_norm = p.qk_norm;
    if (p.rope_theta > 0) m.shape.rope_theta = p.rope_theta;
    m.shape.num_experts = p.experts;
    if (p.experts > 0) {
      m.shape.num_experts_per_tok = p.top_k;
      m.shape.moe_intermediate_size = p.expert_width;
      m.shape.shared_expert_intermediate_size = p.shared_width;
      m.shape.norm_topk_prob = p.norm_topk;
    }
    return m;
  }
  std::string known;
  for (const auto& p : kPresets) known += std::string(known.empty() ? "" : ", ") + p.name;
  return not_found(
      fmt::format("--model {}: unknown preset; known: {} (or give --layers "
                  "--width --heads --vocab --context)",
                  name, known));
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> v;
  for (const auto& p : kPresets) v.push_back(p.name);
  return v;
}

uint64_t model_params(const ModelConfig& shape) {
  auto arch = create_architecture(shape);
  return arch.is_ok() ? uint64_t((*arch)->layout().num_params()) : 0;
}

}  // namespace strata
