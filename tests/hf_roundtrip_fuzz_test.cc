// The Hugging Face round trip on shapes drawn at random: a model config from a seed — GPT-2,
// Llama (grouped-query attention, Qwen2's q/k/v biases, Llama 3.1's rope scaling, tied or untied
// embeddings), Mixtral and Qwen2-MoE (a shared expert or none), of drawn depth, width, heads,
// MLP widths and vocabulary (a multiple of 64 or not: padded rows) — with weights bf16 holds
// exactly, written by HfCheckpointWriter (one file, or shards of a drawn size) and read back
// through model.from_pretrained: its config.json gives the same model config, field by field,
// and every module's weights come back bit for bit (the padded vocabulary rows, which no
// Hugging Face tensor holds, as zeros). Seeds 1..kCases run in ctest; more on demand:
//   STRATA_HF_FUZZ_CASES=500 STRATA_HF_FUZZ_SEED=1000 build/tests/hf_roundtrip_fuzz_test
//     --gtest_filter='HfRoundTripExplore.*'
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "src/hf/hf_checkpoint.h"
#include "src/hf/hf_export.h"
#include "src/model/architecture.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tests/schedule_fuzz.h"
#include "tests/test_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kCases = 24;

// The model section of a config (tiny-cpu's, model replaced), drawn from `seed`.
json draw_model(uint64_t seed) {
  test::Draw d(seed);
  const std::string type =
      d.pick<std::string>({"gpt2", "llama", "llama", "mixtral", "qwen2_moe", "phi3"});
  const int head_dim = d.pick<int>({8, 16, 32});
  const int n_head = d.pick<int>({1, 2, 4, 6});
  json m = {{"type", type},
            {"n_layer", 1 + d.below(3)},
            {"n_head", n_head},
            {"n_embd", n_head * head_dim},
            {"vocab_size", d.pick<int>({64, 100, 256, 257, 300})},
            {"context", d.pick<int>({16, 32, 64})}};
  if (type != "gpt2") {
    std::vector<int> kv;  // divisors of n_head
    for (int k = 1; k <= n_head; ++k) {
      if (n_head % k == 0) kv.push_back(k);
    }
    m["num_key_value_heads"] = d.pick<int>(kv);
    m["intermediate_size"] = d.pick<int>({32, 48, 96, 100});
    m["tied_embeddings"] = d.coin();
    m["rope_theta"] = d.pick<double>({10000.0, 500000.0, 1000000.0});
    m["rms_norm_eps"] = d.pick<double>({1e-5, 1e-6});
    if (type == "llama") {
      m["attention_bias"] = d.coin(30);
      if (d.coin(30)) {
        m["rope_scaling"] = {{"type", "llama3"},
                             {"factor", d.pick<double>({8.0, 32.0})},
                             {"low_freq_factor", 1.0},
                             {"high_freq_factor", 4.0},
                             {"original_max_position_embeddings", 8192.0}};
      }
      // Qwen3's attention: query/key norms, heads wider than n_embd / n_head.
      m["qk_norm"] = d.coin(30);
      if (d.coin(30)) m["head_dim"] = 2 * head_dim;
      if (d.coin(30)) m["pad_token_id"] = d.below(m["vocab_size"].get<int>());
    } else if (type != "phi3") {  // Phi-3: Llama's shape, its tensors packed
      m["num_experts"] = 2 + d.below(4);
      m["num_experts_per_tok"] = 1 + d.below(2);
      m["moe_intermediate_size"] = d.pick<int>({16, 32, 40});
      m["norm_topk_prob"] = type == "mixtral" || d.coin();  // Mixtral always renormalizes
      if (type == "qwen2_moe" && d.coin(70)) {
        m["shared_expert_intermediate_size"] = d.pick<int>({32, 64});
      }
      if (type == "qwen2_moe") m["attention_bias"] = d.coin(70);
      // Qwen3-MoE: no shared expert, query/key norms, maybe wider heads.
      if (type == "qwen2_moe" && !m.contains("shared_expert_intermediate_size") && d.coin(50)) {
        m["qk_norm"] = true;
        if (d.coin(50)) m["head_dim"] = 2 * head_dim;
      }
    }
  } else {
    m["tied_embeddings"] = true;  // GPT-2 ties them
  }
  return m;
}

Result<Config> config_of(const json& model) {
  json doc =
      json::parse(test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"));
  doc["model"] = model;
  return parse_config(doc.dump(), "<hf fuzz>", {});
}

// Runs seed: false when the drawn shape is refused (the config, or the architecture).
bool run_case(uint64_t seed) {
  const json model = draw_model(seed);
  const bool verbose = std::getenv("STRATA_HF_FUZZ_VERBOSE") != nullptr;
  auto cfg = config_of(model);
  if (!cfg.is_ok()) {
    if (verbose) std::printf("refused: %s\n", cfg.status().message().c_str());
    return false;
  }
  auto arch = create_architecture(cfg->model);
  if (!arch.is_ok()) {
    if (verbose) std::printf("refused: %s\n", arch.status().message().c_str());
    return false;
  }
  SCOPED_TRACE("seed " + std::to_string(seed) + ": " + model.dump());
  const ModelLayout& lay = (*arch)->layout();
  // Random weights bf16 holds exactly (k / 1024, |k| < 256: 8 significant bits).
  test::Draw d(seed + 7);
  std::vector<std::vector<float>> master(lay.modules.size());
  for (size_t m = 0; m < lay.modules.size(); ++m) {
    master[m].resize(lay.modules[m].numel);
    for (float& x : master[m]) x = float(d.below(511) - 255) / 1024.0f;
  }
  const std::string out = test::temp_dir("strata_hf_fuzz", std::to_string(seed));
  HfExportOptions options;
  if (d.coin()) options.shard_bytes = uint64_t(4096) << d.below(6);  // 4 KiB .. 128 KiB shards
  auto w = HfCheckpointWriter::create(out, cfg->model, **arch, options);
  EXPECT_TRUE(w.is_ok()) << w.status().to_string();
  if (!w.is_ok()) return true;
  for (size_t m = 0; m < lay.modules.size(); ++m) {
    Status st = (*w)->write_module(int(m), master[m].data());
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    if (!st.is_ok()) return true;
  }
  Status fin = (*w)->finish();
  EXPECT_TRUE(fin.is_ok()) << fin.to_string();
  if (!fin.is_ok()) return true;

  // Its config.json: the same model.
  auto again = config_of({{"from_pretrained", out}, {"context", cfg->model.context}});
  EXPECT_TRUE(again.is_ok()) << again.status().to_string();
  if (!again.is_ok()) return true;
  const ModelConfig& a = cfg->model;
  const ModelConfig& b = again->model;
  EXPECT_EQ(b.type == "gpt" ? "gpt2" : b.type, a.type);
  EXPECT_EQ(b.n_layer, a.n_layer);
  EXPECT_EQ(b.n_head, a.n_head);
  EXPECT_EQ(b.n_embd, a.n_embd);
  EXPECT_EQ(b.vocab_size, a.vocab_size);
  EXPECT_EQ(b.tied_embeddings, a.tied_embeddings);
  if (a.type != "gpt2") {
    // A mixture's MLPs are its experts: Mixtral's config.json has their width only.
    if (a.num_experts == 0) {
      EXPECT_EQ(b.intermediate_size, a.intermediate_size);
    }
    EXPECT_EQ(b.num_key_value_heads ? b.num_key_value_heads : b.n_head,
              a.num_key_value_heads ? a.num_key_value_heads : a.n_head);
    EXPECT_EQ(b.rope_theta, a.rope_theta);
    EXPECT_EQ(b.rms_norm_eps, a.rms_norm_eps);
    EXPECT_EQ(b.attention_bias, a.attention_bias);
    EXPECT_EQ(b.rope_scaling.type, a.rope_scaling.type);
    if (a.rope_scaling.type != "none") {
      EXPECT_EQ(b.rope_scaling.factor, a.rope_scaling.factor);
      EXPECT_EQ(b.rope_scaling.low_freq_factor, a.rope_scaling.low_freq_factor);
      EXPECT_EQ(b.rope_scaling.high_freq_factor, a.rope_scaling.high_freq_factor);
      EXPECT_EQ(b.rope_scaling.original_max_position_embeddings,
                a.rope_scaling.original_max_position_embeddings);
    }
    EXPECT_EQ(b.num_experts, a.num_experts);
    if (a.num_experts > 0) {
      EXPECT_EQ(b.num_experts_per_tok, a.num_experts_per_tok);
      EXPECT_EQ(b.moe_intermediate_size ? b.moe_intermediate_size : b.intermediate_size,
                a.moe_intermediate_size ? a.moe_intermediate_size : a.intermediate_size);
      EXPECT_EQ(b.shared_expert_intermediate_size, a.shared_expert_intermediate_size);
      EXPECT_EQ(b.norm_topk_prob, a.norm_topk_prob);
    }
  }
  auto arch2 = create_architecture(b);
  EXPECT_TRUE(arch2.is_ok()) << arch2.status().to_string();
  if (!arch2.is_ok()) return true;
  EXPECT_EQ((*arch2)->shape_string(), (*arch)->shape_string());
  if ((*arch2)->layout().modules.size() != lay.modules.size()) return true;

  // Its weights: every module's bit for bit.
  auto r = HfCheckpointReader::open(out, **arch2);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  if (!r.is_ok()) return true;
  for (size_t m = 0; m < lay.modules.size(); ++m) {
    // What the module's Hugging Face tensors hold: each its tensor's first elements (a token
    // table's rows up to vocab_size; the padded rows are strata's alone, read back as zeros).
    std::vector<bool> held(lay.modules[m].numel, false);
    for (const HfTensor& h : (*arch)->hf_tensors(int(m))) {
      size_t n = 1;
      for (int64_t x : h.shape) n *= size_t(x);
      const size_t at = lay.modules[m].tensors[size_t(h.tensor)].offset;
      for (size_t i = at; i < at + n && i < held.size(); ++i) held[i] = true;
    }
    std::vector<float> back(lay.modules[m].numel, -99.0f);
    Status st = (*r)->read_module(int(m), back.data());
    EXPECT_TRUE(st.is_ok()) << lay.modules[m].name << ": " << st.to_string();
    size_t differ = 0, first = SIZE_MAX;
    for (size_t i = 0; i < back.size(); ++i) {
      if (back[i] != (held[i] ? master[m][i] : 0.0f)) {
        ++differ;
        first = std::min(first, i);
      }
    }
    EXPECT_EQ(differ, 0u) << lay.modules[m].name << ": " << differ << " of " << back.size()
                          << " elements differ, the first at " << first;
  }
  fs::remove_all(out);
  return true;
}

class HfRoundTrip : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { set_log_level(LogLevel::kError); }
};

TEST_P(HfRoundTrip, ExportThenImportGivesTheSameModel) {
  EXPECT_TRUE(test::run_first_accepted(100 * uint64_t(GetParam()), 100, run_case))
      << "no shape from seed " << 100 * GetParam() << " was accepted: the drawing is broken";
}

INSTANTIATE_TEST_SUITE_P(Seeds, HfRoundTrip, ::testing::Range(1, kCases + 1));

TEST(HfRoundTripExplore, Explore) {
  set_log_level(LogLevel::kError);
  test::Explored e;
  if (!test::explore_seeds("STRATA_HF_FUZZ", run_case, &e)) {
    GTEST_SKIP() << "set STRATA_HF_FUZZ_CASES (and STRATA_HF_FUZZ_SEED) to run";
  }
  std::printf("%d shapes round-tripped, %d refused\n", e.ran, e.refused);
}

}  // namespace
}  // namespace strata
