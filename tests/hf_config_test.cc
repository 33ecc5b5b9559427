// config.json of Hugging Face model directories as strata's ModelConfig (src/hf/hf_config.h):
// Llama 3.1 (GQA, llama3 rope scaling, untied), Qwen2 (q/k/v biases), GPT-2, and the refusals
// (Mistral's short sliding window, unknown architectures, context past max positions).
#include "src/hf/hf_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

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

}  // namespace
}  // namespace strata
