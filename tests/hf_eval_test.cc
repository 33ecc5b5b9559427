// `strata eval` (evaluate(), src/train/trainer.h) against transformers: the fixtures under
// tests/fixtures/hf/ carry a token corpus and transformers' mean next-token loss over its
// windows (tools/make_hf_fixtures.py); strata's fp32 eval must give it within 1e-5 relative.
// Then: the same number wherever the weights live, a checkpoint evaluates as its Hugging Face
// export does, and a corpus too short for one window is an error that says so.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/hf/hf_export.h"
#include "src/hf/safetensors.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata {
namespace {

using json = nlohmann::json;

std::string fixture(const std::string& name) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/" + name;
}

// Reference tensor `key` of fixture `name` as fp32.
std::vector<float> reference(const std::string& name, const std::string& key) {
  auto f = SafetensorsFile::open(fixture(name) + "/reference.safetensors");
  EXPECT_TRUE(f.is_ok()) << f.status().to_string();
  if (!f.is_ok()) return {};
  for (const SafetensorsTensor& t : (*f)->tensors()) {
    if (t.name != key) continue;
    std::vector<float> v(t.numel());
    EXPECT_TRUE((*f)->read_as(t, DType::kF32, v.data()).is_ok());
    return v;
  }
  ADD_FAILURE() << name << ": no " << key << " in reference.safetensors";
  return {};
}

// `tokens` as a raw uint32 token file in `dir`; returns its path.
std::string write_u32(const std::string& dir, const std::vector<float>& tokens) {
  const std::string path = dir + "/corpus.u32";
  std::ofstream f(path, std::ios::binary);
  for (float t : tokens) {
    const uint32_t v = uint32_t(t);
    f.write(reinterpret_cast<const char*>(&v), 4);
  }
  return path;
}

// configs/tiny-cpu.json with model.from_pretrained = `model_dir` (context 16, fp32), data.source
// = `corpus`, micro-batches of 4 windows, train.checkpoint_dir in `dir`, and `extra`.
Result<Config> eval_config(const std::string& model_dir, const std::string& corpus,
                           const std::string& dir, std::vector<std::string> extra = {}) {
  json doc =
      json::parse(test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"));
  doc["model"] = {{"from_pretrained", model_dir}, {"context", 16}};
  doc["data"] = {{"source", corpus}};
  doc["train_batch_size"] = 4;
  doc["train_micro_batch_size_per_gpu"] = 4;
  doc["gradient_accumulation_steps"] = 1;
  doc["bf16"]["enabled"] = false;
  doc["scheduler"]["params"]["warmup_num_steps"] = 1;
  doc["train"]["checkpoint_dir"] = dir + "/ckpt";
  doc["device"]["memory_limit"] = "64MiB";
  doc["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  doc["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
  return parse_config(doc.dump(), "<hf eval test>", extra);
}

double must_eval(const Config& cfg, const std::string& checkpoint = "") {
  EvalOptions o;
  o.checkpoint = checkpoint;
  auto r = evaluate(cfg, o);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? r->loss : NAN;
}

class HfEval : public ::testing::TestWithParam<const char*> {};

// E = 87 tokens, T = 16: windows at 0, 16, ..., 64 (64 + 17 <= 87; 80 + 17 > 87), five of them
// in two micro-batches of 4, the second's last three rows wrapping around and not counted.
TEST_P(HfEval, LossMatchesTransformers) {
  const std::string name = GetParam();
  const std::string dir = test::temp_dir("strata_hf_eval", name);
  const std::vector<float> corpus = reference(name, "eval_tokens");
  const std::vector<float> want = reference(name, "eval_loss");
  ASSERT_EQ(corpus.size(), 87u);
  ASSERT_EQ(want.size(), 1u);
  auto cfg = eval_config(fixture(name), write_u32(dir, corpus), dir);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  EvalOptions o;
  auto r = evaluate(*cfg, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->windows, 5);
  EXPECT_EQ(r->tokens, 80);
  EXPECT_EQ(r->corpus_tokens, 87);
  EXPECT_NEAR(r->loss, want[0], 1e-5 * want[0]) << name;
  EXPECT_DOUBLE_EQ(r->perplexity, std::exp(r->loss));
  // Nothing is written for an eval.
  EXPECT_FALSE(std::filesystem::exists(dir + "/ckpt"));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfEval,
                         ::testing::Values("llama", "llama3", "qwen2", "qwen3", "phi3", "gpt2",
                                           "llama-bf16"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

// The same loss bit for bit with the parameters on the device, in host memory or on NVMe, and
// with block inputs recomputed or offloaded.
TEST(HfEvalPlacement, EveryPlacementGivesTheSameLoss) {
  const std::string dir = test::temp_dir("strata_hf_eval", "placement");
  std::filesystem::create_directories(dir + "/swap");
  const std::string corpus = write_u32(dir, reference("llama", "eval_tokens"));
  double first = NAN;
  for (const char* where : {"none", "cpu", "nvme"}) {
    for (const char* acts : {"keep", "offload"}) {
      auto cfg =
          eval_config(fixture("llama"), corpus, dir,
                      {std::string("zero_optimization.offload_param.device=\"") + where + "\"",
                       std::string("zero_optimization.offload_optimizer.device=\"") + where + "\"",
                       "zero_optimization.offload_param.nvme_path=\"" + dir + "/swap\"",
                       "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"",
                       std::string("strata.activations=\"") + acts + "\""});
      ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
      const double loss = must_eval(*cfg);
      if (std::isnan(first)) first = loss;
      EXPECT_EQ(loss, first) << where << " " << acts;
    }
  }
}

// Train 3 steps from the fixture, evaluate the checkpoint (a run directory's latest works too),
// export it, and evaluate the export as model.from_pretrained: the same loss (fp32 weights
// round-trip exactly), and not the initial one.
TEST(HfEvalCheckpoint, EvaluatesAsItsExport) {
  const std::string dir = test::temp_dir("strata_hf_eval", "checkpoint");
  const std::string corpus = write_u32(dir, reference("llama", "eval_tokens"));
  auto cfg = eval_config(fixture("llama"), "synthetic", dir,
                         {"train.steps=3", "train.eval_interval=0", "steps_per_print=1000",
                          "data.synthetic_tokens=4096"});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  TrainResult tr = test::must_train(*cfg);
  ASSERT_FALSE(tr.last_checkpoint.empty());
  cfg->data.source = corpus;
  const double initial = must_eval(*cfg);
  const double trained = must_eval(*cfg, tr.last_checkpoint);
  EXPECT_GT(std::fabs(trained - initial), 1e-4) << "the checkpoint's weights were not used";
  ASSERT_TRUE(export_checkpoint(tr.last_checkpoint, cfg->model, dir + "/hf").is_ok());
  auto exported = eval_config(dir + "/hf", corpus, dir);
  ASSERT_TRUE(exported.is_ok()) << exported.status().to_string();
  EXPECT_EQ(must_eval(*exported), trained);
  // A checkpoint of another model is refused, naming the difference.
  auto other = eval_config(fixture("qwen2"), corpus, dir);
  ASSERT_TRUE(other.is_ok());
  auto r = evaluate(*other, EvalOptions{tr.last_checkpoint});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("differs from the config's"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("give the config it was trained with"), std::string::npos)
      << r.status().message();
}

TEST(HfEvalErrors, CorpusShorterThanOneWindow) {
  const std::string dir = test::temp_dir("strata_hf_eval", "short");
  std::vector<float> corpus = reference("llama", "eval_tokens");
  corpus.resize(16);  // T tokens: no target for the last input
  const std::string path = write_u32(dir, corpus);
  auto cfg = eval_config(fixture("llama"), path, dir);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto r = evaluate(*cfg, EvalOptions{});
  ASSERT_FALSE(r.is_ok());
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("data.source: " + path + " holds 16 tokens"), std::string::npos) << m;
  EXPECT_NE(m.find("at least T + 1 = 17"), std::string::npos) << m;
  // T + 1 tokens make one window.
  corpus = reference("llama", "eval_tokens");
  corpus.resize(17);
  cfg->data.source = write_u32(dir, corpus);
  auto one = evaluate(*cfg, EvalOptions{});
  ASSERT_TRUE(one.is_ok()) << one.status().to_string();
  EXPECT_EQ(one->windows, 1);
  EXPECT_EQ(one->tokens, 16);
}

}  // namespace
}  // namespace strata
