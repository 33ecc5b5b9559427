// model.type llama through the trainer: a tiny Llama (grouped-query attention, untied head,
// llama3 rope scaling, q/k/v biases in one case) learns, and trains to the same losses and
// weights bit for bit whether its state lives on the device, in host memory or on NVMe, under
// every activation mode.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "src/model/llama.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;

// configs/tiny-cpu.json's job with a tiny Llama in place of its GPT, and overrides.
Config tiny_llama(const std::string& dir, const std::vector<std::string>& extra) {
  return test::tiny_cpu(
      dir,
      {"train.steps=30", "device.memory_limit=\"256MiB\"",
       "zero_optimization.offload_param.device=\"none\"",
       "zero_optimization.offload_optimizer.device=\"none\"", "model.type=\"llama\"",
       "model.n_layer=3", "model.n_head=4", "model.num_key_value_heads=2", "model.n_embd=64",
       "model.intermediate_size=176", "model.tied_embeddings=false", "model.rope_theta=500000",
       "model.rope_scaling.type=\"llama3\"",
       "model.rope_scaling.original_max_position_embeddings=16", "model.rms_norm_eps=1e-6",
       "model.context=32"},
      extra);
}

TEST(LlamaArchitecture, LayoutProgramAndPlan) {
  Config c = tiny_llama(test::temp_dir("strata_llama", "layout"), {});
  auto arch = create_architecture(c.model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  const ModelLayout& l = (*arch)->layout();
  ASSERT_EQ(l.modules.size(), 6u);  // embedding, 3 blocks, final_norm, head
  EXPECT_EQ(l.modules[0].name, "embedding");
  EXPECT_EQ(l.modules[4].name, "final_norm");
  EXPECT_EQ(l.modules[5].name, "head");
  // C=64, hs=16, W=(4+2*2)*16=128, I=176: 64 + 128*64 + 64*64 + 64 + 3*176*64 per block.
  EXPECT_EQ(l.modules[1].numel, size_t(64 + 128 * 64 + 64 * 64 + 64 + 3 * 176 * 64));
  EXPECT_EQ(l.modules[0].numel, size_t(256 * 64));
  // The activation plan grows with the batch and shrinks under recompute.
  const auto keep = (*arch)->activation_plan(4, 32, DType::kBF16, ActivationMode::kKeep);
  const auto rec = (*arch)->activation_plan(4, 32, DType::kBF16, ActivationMode::kRecompute);
  EXPECT_LT(rec.bytes, keep.bytes);
  EXPECT_GT((*arch)->flops_per_token(32, ActivationMode::kKeep).forward, 0.0);
}

TEST(LlamaArchitecture, BadShapesNameTheirKey) {
  auto bad = [](std::vector<std::string> ov, const std::string& key) {
    Config c = tiny_llama(test::temp_dir("strata_llama", "bad"), ov);
    auto a = create_architecture(c.model);
    ASSERT_FALSE(a.is_ok()) << key;
    EXPECT_NE(a.status().to_string().find(key), std::string::npos) << a.status().to_string();
  };
  bad({"model.num_key_value_heads=3"}, "model.num_key_value_heads");
  bad({"model.intermediate_size=0"}, "model.intermediate_size");
}

TEST(LlamaTrain, PlacementsAndActivationModesTrainBitIdentically) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_llama", "placements");
  const std::string swap = "\"" + dir + "/swap\"";
  fs::create_directories(dir + "/swap");
  struct Case {
    std::string name;
    std::vector<std::string> ov;
  };
  std::vector<Case> cases = {
      {"all on device", {}},
      {"params in host", {"zero_optimization.offload_param.device=\"cpu\""}},
      {"params and optimizer on nvme",
       {"zero_optimization.offload_param.device=\"nvme\"",
        "zero_optimization.offload_param.nvme_path=" + swap,
        "zero_optimization.offload_optimizer.device=\"nvme\"",
        "zero_optimization.offload_optimizer.nvme_path=" + swap}},
      {"recompute", {"strata.activations=\"recompute\""}},
      {"offload activations, params in host",
       {"strata.activations=\"offload\"", "zero_optimization.offload_param.device=\"cpu\""}},
  };
  TrainResult ref;
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    TrainOptions o;
    o.progress = false;
    auto r = train(tiny_llama(dir + "/" + std::to_string(i), cases[i].ov), o);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    ASSERT_EQ(r->losses.size(), 30u);
    if (i == 0) {
      ref = *r;
      EXPECT_LT(ref.losses.back(), ref.losses.front() - 0.5) << "a tiny Llama should learn";
      continue;
    }
    for (size_t s = 0; s < ref.losses.size(); ++s) {
      ASSERT_EQ(r->losses[s], ref.losses[s]) << "loss differs at step " << s + 1;  // bit for bit
    }
    EXPECT_EQ(r->weights_crc, ref.weights_crc) << "final weights differ";
  }
  fs::remove_all(dir);
}

TEST(LlamaTrain, QkvBiasesAndTiedEmbeddingsTrain) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_llama", "qwen");
  TrainOptions o;
  o.progress = false;
  auto r = train(tiny_llama(dir, {"model.attention_bias=true", "model.tied_embeddings=true",
                                  "model.rope_scaling.type=\"none\"", "model.rope_theta=1000000"}),
                 o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_LT(r->losses.back(), r->losses.front() - 0.5);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
