// config.json of Hugging Face model directories as strata's ModelConfig (src/hf/hf_config.h):
// Llama 3.1 (GQA, llama3 rope scaling, untied), Qwen2 (q/k/v biases), Qwen3 (query/key norms,
// wider heads), Mistral Nemo's wider heads, Phi-3 (packed tensors), GPT-2, and the refusals
// (Mistral's short sliding window, unknown architectures, context past max positions).
#include "src/hf/hf_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "tests/test_util.h"

namespace strata {
namespace {

std::string dir_with(const std::string& name, const std::string& config) {
  const std::string d = test::temp_dir("strata_hfcfg", name);
  std::ofstream(d + "/config.json") << config;
  return d;
}

TEST(HfConfig, Llama31) {
  auto m = model_config_from_hf(
      dir_with("llama", R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
        "intermediate_size":176,"vocab_size":300,"max_position_embeddings":128,
        "rms_norm_eps":1e-5,"rope_theta":500000.0,"tie_word_embeddings":false,
        "hidden_act":"silu","torch_dtype":"bfloat16",
        "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
          "high_freq_factor":4.0,"original_max_position_embeddings":64}})"),
      0);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_EQ(m->type, "llama");
  EXPECT_EQ(m->n_embd, 64);
  EXPECT_EQ(m->num_key_value_heads, 2);
  EXPECT_EQ(m->intermediate_size, 176);
  EXPECT_EQ(m->context, 128);
  EXPECT_EQ(m->padded_vocab_size, 320);
  EXPECT_FALSE(m->tied_embeddings);
  EXPECT_EQ(m->dtype, DType::kBF16);
  EXPECT_EQ(m->rope_theta, 500000.0);
  EXPECT_EQ(m->rope_scaling.type, "llama3");
  EXPECT_EQ(m->rope_scaling.original_max_position_embeddings, 64.0);
  EXPECT_TRUE(create_architecture(*m).is_ok());
}

TEST(HfConfig, Qwen2AndGpt2) {
  auto q = model_config_from_hf(
      dir_with("qwen", R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":64,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
        "intermediate_size":96,"vocab_size":300,"max_position_embeddings":256,
        "tie_word_embeddings":true,"use_sliding_window":false,"sliding_window":32,
        "torch_dtype":"float32"})"),
      64);
  ASSERT_TRUE(q.is_ok()) << q.status().to_string();
  EXPECT_TRUE(q->attention_bias);
  EXPECT_TRUE(q->tied_embeddings);
  EXPECT_EQ(q->context, 64);
  auto g = model_config_from_hf(
      dir_with("gpt2", R"({"architectures":["GPT2LMHeadModel"],"n_embd":32,"n_layer":2,
        "n_head":2,"vocab_size":100,"n_positions":64,"activation_function":"gelu_new"})"),
      0);
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  EXPECT_EQ(g->type, "gpt2");
  EXPECT_EQ(g->context, 64);
  EXPECT_TRUE(g->tied_embeddings);
  EXPECT_TRUE(create_architecture(*g).is_ok());
}

// Qwen3: query/key norms and heads wider than hidden_size / num_attention_heads (Qwen3-0.6B's
// 16 x 128 in 1024); Mistral Nemo's wider heads without the norms. A head_dim equal to the
// quotient reads as 0 (the same model as before). The norms and wider heads are the llama
// family's: GPT-2 and the mixtures refuse them, naming the keys.
TEST(HfConfig, Qwen3AndWiderHeads) {
  auto q = model_config_from_hf(
      dir_with("qwen3", R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":64,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
        "intermediate_size":96,"vocab_size":300,"max_position_embeddings":256,
        "tie_word_embeddings":true,"use_sliding_window":false,"sliding_window":null,
        "attention_bias":false,"rope_theta":1000000.0,"torch_dtype":"bfloat16"})"),
      0);
  ASSERT_TRUE(q.is_ok()) << q.status().to_string();
  EXPECT_EQ(q->type, "llama");
  EXPECT_TRUE(q->qk_norm);
  EXPECT_EQ(q->head_dim, 32);
  EXPECT_FALSE(q->attention_bias);
  auto arch = create_architecture(*q);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  // q_proj [128, 64], o_proj [64, 128], the norms 32 wide.
  bool q_norm = false;
  for (const HfTensor& h : (*arch)->hf_tensors(1)) {
    if (h.name == "model.layers.0.self_attn.q_proj.weight") {
      EXPECT_EQ(h.shape, (std::vector<int64_t>{128, 64}));
    }
    if (h.name == "model.layers.0.self_attn.o_proj.weight") {
      EXPECT_EQ(h.shape, (std::vector<int64_t>{64, 128}));
    }
    if (h.name == "model.layers.0.self_attn.q_norm.weight") {
      EXPECT_EQ(h.shape, (std::vector<int64_t>{32}));
      q_norm = true;
    }
  }
  EXPECT_TRUE(q_norm);
  // The export says Qwen3 again, with its head_dim.
  const auto out = nlohmann::json::parse(hf_config_json(*q));
  EXPECT_EQ(out["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(out["model_type"], "qwen3");
  EXPECT_EQ(out["head_dim"], 32);
  EXPECT_EQ(out["attention_bias"], false);
  auto n = model_config_from_hf(
      dir_with("nemo", R"({"architectures":["MistralForCausalLM"],"hidden_size":80,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
        "intermediate_size":96,"vocab_size":300,"max_position_embeddings":64})"),
      0);
  ASSERT_TRUE(n.is_ok()) << n.status().to_string();
  EXPECT_FALSE(n->qk_norm);
  EXPECT_EQ(n->head_dim, 32);
  EXPECT_TRUE(create_architecture(*n).is_ok());
  auto same = model_config_from_hf(
      dir_with("same", R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,
        "num_hidden_layers":2,"num_attention_heads":4,"head_dim":16,
        "intermediate_size":96,"vocab_size":300,"max_position_embeddings":64})"),
      0);
  ASSERT_TRUE(same.is_ok()) << same.status().to_string();
  EXPECT_EQ(same->head_dim, 0);
  EXPECT_FALSE(same->qk_norm);
  // transformers rotates only part of each head under partial_rotary_factor, for every model.
  auto partial = model_config_from_hf(
      dir_with("qwen3_partial", R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":64,
        "num_hidden_layers":2,"num_attention_heads":4,"head_dim":32,"intermediate_size":96,
        "vocab_size":300,"max_position_embeddings":64,"partial_rotary_factor":0.5})"),
      0);
  ASSERT_FALSE(partial.is_ok());
  EXPECT_NE(partial.status().message().find("partial_rotary_factor: 0.5"), std::string::npos)
      << partial.status().message();
  ModelConfig gpt;
  gpt.qk_norm = true;
  auto g = create_architecture(gpt);
  ASSERT_FALSE(g.is_ok());
  EXPECT_NE(g.status().message().find("model.qk_norm"), std::string::npos) << g.status().message();
  ModelConfig mix = *q;
  mix.type = "mixtral";
  mix.num_experts = 4;
  auto x = create_architecture(mix);
  ASSERT_FALSE(x.is_ok());
  EXPECT_NE(x.status().message().find("model.qk_norm, model.head_dim"), std::string::npos)
      << x.status().message();
}

// Phi-3 (Phi-3, Phi-4): Llama's block with q|k|v and gate|up stored packed (qkv_proj,
// gate_up_proj); its sliding window bounds model.context as Mistral's does; a partial rotary
// embedding (Phi-4-mini), longrope (the 128k models) and training dropouts are refused by key.
TEST(HfConfig, Phi3) {
  const std::string phi3 = R"({"architectures":["Phi3ForCausalLM"],"hidden_size":64,
      "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
      "intermediate_size":96,"vocab_size":300,"max_position_embeddings":4096,
      "sliding_window":2047,"rope_theta":10000.0,"resid_pdrop":0.0,"embd_pdrop":0.0,
      "attention_dropout":0.0,"tie_word_embeddings":false,"torch_dtype":"bfloat16"})";
  auto m = model_config_from_hf(dir_with("phi3", phi3), 2047);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_EQ(m->type, "phi3");
  auto arch = create_architecture(*m);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  std::vector<std::string> names;
  for (const HfTensor& h : (*arch)->hf_tensors(1)) names.push_back(h.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight"}));
  const auto out = nlohmann::json::parse(hf_config_json(*m));
  EXPECT_EQ(out["architectures"][0], "Phi3ForCausalLM");
  EXPECT_EQ(out["model_type"], "phi3");
  auto refused = [&](const std::string& tag, const std::string& key, const std::string& value,
                     int context) {
    nlohmann::json c = nlohmann::json::parse(phi3);
    if (!value.empty()) c[key] = nlohmann::json::parse(value);
    auto r = model_config_from_hf(dir_with(tag, c.dump()), context);
    ASSERT_FALSE(r.is_ok()) << tag;
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  };
  refused("phi3_window", "sliding_window", "", 4096);
  refused("phi3_partial", "partial_rotary_factor", "0.75", 2047);
  refused("phi3_dropout", "resid_pdrop", "0.1", 2047);
  refused("phi3_pad", "pad_token_id", "300", 2047);  // past the vocabulary
  refused("phi3_pad_string", "pad_token_id", "\"15\"", 2047);
  refused("phi3_pad_float", "pad_token_id", "15.0", 2047);
  refused("phi3_pad_huge", "pad_token_id", "18446744073709551615", 2047);
  refused("phi3_longrope", "rope_scaling",
          R"({"type":"longrope","short_factor":[1.0],"long_factor":[1.0]})", 2047);
}

// The config.json an export writes: both transformers spellings of the dtype and the rope
// (transformers 5's dtype and rope_parameters, the older torch_dtype, rope_theta and
// rope_scaling), GPT-2's n_positions kept at the checkpoint's when the model trained at a
// shorter context, and what it writes reads back as the same model.
TEST(HfConfig, ExportedConfigHasBothSpellings) {
  const std::string llama = dir_with("llama_out", R"({"architectures":["LlamaForCausalLM"],
        "hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
        "intermediate_size":176,"vocab_size":300,"max_position_embeddings":128,
        "rope_theta":500000.0,"torch_dtype":"bfloat16","bos_token_id":7,
        "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
          "high_freq_factor":4.0,"original_max_position_embeddings":64}})");
  auto m = model_config_from_hf(llama, 32);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  m->from_pretrained = llama;
  const nlohmann::json c = nlohmann::json::parse(hf_config_json(*m));
  EXPECT_EQ(c["dtype"], "bfloat16");
  EXPECT_EQ(c["torch_dtype"], "bfloat16");
  EXPECT_EQ(c["rope_theta"], 500000.0);
  EXPECT_EQ(c["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(c["rope_parameters"]["rope_type"], "llama3");
  EXPECT_EQ(c["rope_parameters"]["rope_theta"], 500000.0);
  EXPECT_EQ(c["rope_parameters"]["factor"], 8.0);
  EXPECT_EQ(c["max_position_embeddings"], 128) << "the checkpoint's, not model.context's 32";
  EXPECT_EQ(c["bos_token_id"], 7);
  const std::string back = dir_with("llama_back", c.dump());
  auto again = model_config_from_hf(back, 32);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(again->rope_scaling.factor, 8.0);
  EXPECT_EQ(again->rope_theta, 500000.0);

  const std::string gpt2 = dir_with("gpt2_out", R"({"architectures":["GPT2LMHeadModel"],
        "n_embd":32,"n_layer":2,"n_head":2,"vocab_size":100,"n_positions":1024})");
  auto g = model_config_from_hf(gpt2, 256);
  ASSERT_TRUE(g.is_ok());
  g->from_pretrained = gpt2;
  const nlohmann::json gc = nlohmann::json::parse(hf_config_json(*g));
  EXPECT_EQ(gc["n_positions"], 1024) << "the stored table's rows, not model.context's 256";
  EXPECT_EQ(gc["dtype"], "float32");
  g->from_pretrained.clear();  // a model trained from scratch: its own context
  EXPECT_EQ(nlohmann::json::parse(hf_config_json(*g))["n_positions"], 256);
}

TEST(HfConfig, RefusalsNameTheKeyAndTheFix) {
  auto expect = [](const Result<ModelConfig>& r, const std::string& a, const std::string& b) {
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().to_string().find(a), std::string::npos) << r.status().to_string();
    EXPECT_NE(r.status().to_string().find(b), std::string::npos) << r.status().to_string();
  };
  const std::string mistral = R"({"architectures":["MistralForCausalLM"],"hidden_size":64,
      "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
      "intermediate_size":96,"vocab_size":300,"max_position_embeddings":4096,
      "sliding_window":1024})";
  expect(model_config_from_hf(dir_with("mistral", mistral), 2048), "sliding_window",
         "model.context <= 1024");
  EXPECT_TRUE(model_config_from_hf(dir_with("mistral_ok", mistral), 1024).is_ok());
  expect(model_config_from_hf(dir_with("arch", R"({"architectures":["BertModel"]})"), 0),
         "architectures", "BertModel");
  expect(model_config_from_hf(
             dir_with("ctx", R"({"architectures":["GPT2LMHeadModel"],"n_embd":32,"n_layer":2,
               "n_head":2,"vocab_size":100,"n_positions":64})"),
             128),
         "model.context", "max_position_embeddings 64");
  expect(model_config_from_hf("/nonexistent", 0), "/nonexistent/config.json", "from_pretrained");
}

// Values of the wrong type or range (found by tests/fuzz/fuzz_hf_config and by reading the
// reader while writing it): each threw an uncaught nlohmann::type_error (abort), overflowed an
// int (UBSan), or was accepted wrapped; now each is an error naming the file and the key.
TEST(HfConfig, MalformedValuesAreErrorsNamingTheKey) {
  const std::string base = R"("architectures":["LlamaForCausalLM"],"hidden_size":64,
      "num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":96,"vocab_size":300,
      "max_position_embeddings":128)";
  struct Case {
    std::string name, extra, key, why;
  };
  const std::vector<Case> cases = {
      {"rope_not_object", R"("rope_scaling":5)", "rope_scaling", "not an object"},
      {"rope_type_number", R"("rope_scaling":{"rope_type":3})", "rope_scaling.rope_type",
       "not a string"},
      {"rope_factor_string", R"("rope_scaling":{"rope_type":"llama3","factor":"8"})",
       "rope_scaling.factor", "not a number"},
      {"rope_factor_zero", R"("rope_scaling":{"type":"llama3","factor":0})", "rope_scaling.factor",
       "not positive"},
      {"dtype_number", R"("torch_dtype":16)", "torch_dtype", "not a string"},
      {"eps_zero", R"("rms_norm_eps":0)", "rms_norm_eps", "not positive"},
      {"theta_negative", R"("rope_theta":-1.0)", "rope_theta", "not positive"},
      {"size_negative", R"("hidden_size":-64)", "hidden_size", "1 to 2147483647"},
      {"size_zero", R"("num_attention_heads":0)", "num_attention_heads", "1 to 2147483647"},
      {"size_wraps", R"("hidden_size":4294967360)", "hidden_size", "4294967360"},
      {"vocab_max", R"("vocab_size":2147483647)", "vocab_size", "too large to pad"},
  };
  for (const Case& k : cases) {
    // A later duplicate key replaces the earlier one (nlohmann keeps the last).
    auto r = model_config_from_hf(dir_with(k.name, "{" + base + "," + k.extra + "}"), 0);
    ASSERT_FALSE(r.is_ok()) << k.name << " was accepted";
    const std::string msg = r.status().to_string();
    EXPECT_NE(msg.find("config.json: " + k.key + ": "), std::string::npos) << k.name << ": " << msg;
    EXPECT_NE(msg.find(k.why), std::string::npos) << k.name << ": " << msg;
  }
  // Qwen2's use_sliding_window must be true/false.
  auto q = model_config_from_hf(
      dir_with("qwen_sliding", "{" + base + R"(,"architectures":["Qwen2ForCausalLM"],
               "use_sliding_window":"yes"})"),
      0);
  ASSERT_FALSE(q.is_ok());
  EXPECT_NE(q.status().to_string().find("use_sliding_window"), std::string::npos);
  // A sliding window beyond int still compares as the number it is (no wrap to a short window).
  EXPECT_TRUE(model_config_from_hf(
                  dir_with("mistral_wide", "{" + base + R"(,"architectures":["MistralForCausalLM"],
               "sliding_window":4294967296})"),
                  0)
                  .is_ok());
  // 100,000 nested arrays: refused by the depth check, naming the file.
  auto d =
      model_config_from_hf(dir_with("deep", "{" + base + R"(,"x":)" + std::string(100000, '[') +
                                                std::string(100000, ']') + "}"),
                           0);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().to_string().find("config.json: JSON nested deeper than 64 levels"),
            std::string::npos)
      << d.status().to_string();
}

}  // namespace
}  // namespace strata
