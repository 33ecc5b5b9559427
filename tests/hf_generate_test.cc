// strata generate's decoder (src/model/generate.h) on the Hugging Face fixtures: the model's own
// forward on a device, with the key/value cache and over the whole window, against
// transformers' greedy decode. Built twice: on the CPU backend (hf_generate_test) and on the
// CUDA backend under the emulation (hf_generate_emu_test, tests/cuda_emu.cmake).
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/hf/master_weights.h"
#include "src/model/architecture.h"
#include "src/model/generate.h"
#include "strata/config.h"
#include "strata/device.h"
#include "tests/hf_test_util.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::config_for;
using test::fixture;

// The backend under test: CUDA under the emulation, else the CPU.
std::unique_ptr<Device> open_device() {
#ifdef STRATA_CUDA_EMU
  auto d = create_cuda_device({.reserve = 0, .capacity = size_t{256} << 20});
#else
  auto d = create_cpu_device({.capacity = size_t{256} << 20});
#endif
  EXPECT_TRUE(d.is_ok()) << d.status().to_string();
  return d.is_ok() ? std::move(*d) : nullptr;
}

// A decoder of fixture `name` (model.from_pretrained) on `dev`.
std::unique_ptr<Decoder> decoder_for(Device& dev, const std::string& name, DecodePath path,
                                     std::unique_ptr<Architecture>* arch) {
  auto cfg = config_for({{"from_pretrained", fixture(name)}});
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  if (!cfg.is_ok()) return nullptr;
  auto a = create_architecture(cfg->model);
  EXPECT_TRUE(a.is_ok()) << a.status().to_string();
  if (!a.is_ok()) return nullptr;
  *arch = std::move(*a);
  auto w = load_master_weights(**arch, cfg->model, "");
  EXPECT_TRUE(w.is_ok()) << w.status().to_string();
  if (!w.is_ok()) return nullptr;
  auto dec = Decoder::create(**arch, dev, std::move(*w), path);
  EXPECT_TRUE(dec.is_ok()) << dec.status().to_string();
  return dec.is_ok() ? std::move(*dec) : nullptr;
}

struct Greedy {
  std::vector<int32_t> prompt, ids;
};
Greedy greedy_of(const std::string& name) {
  const json g = json::parse(test::read_file(fixture(name) + "/greedy.json"));
  return {g["prompt_ids"].get<std::vector<int32_t>>(), g["ids"].get<std::vector<int32_t>>()};
}

// The CPU emulation of CUDA runs every fixture in minutes; there one dense and one mixture.
std::vector<std::string> fixtures() {
#ifdef STRATA_CUDA_EMU
  return {"llama", "mixtral"};
#else
  return {"llama",      "llama3",  "qwen2",     "qwen3",     "gpt2",
          "llama-bf16", "mixtral", "qwen2-moe", "qwen3-moe", "phi3"};
#endif
}

// Greedy, token for token against transformers' greedy decode of each fixture (greedy.json: 20
// tokens after "the model writes", written by tools/make_hf_fixtures.py), from
// model.from_pretrained, with the cache and over the whole window; the bf16 fixture and the
// mixtures included.
TEST(HfGenerate, GreedyMatchesTransformers) {
  auto dev = open_device();
  ASSERT_NE(dev, nullptr);
  for (const std::string& name : fixtures()) {
    for (DecodePath path : {DecodePath::kCached, DecodePath::kWindow}) {
      SCOPED_TRACE(name + (path == DecodePath::kCached ? " cached" : " window"));
      std::unique_ptr<Architecture> arch;
      auto dec = decoder_for(*dev, name, path, &arch);
      ASSERT_NE(dec, nullptr);
      EXPECT_EQ(dec->cached(), path == DecodePath::kCached);
      const Greedy g = greedy_of(name);
      SampleOptions opt;
      opt.max_new_tokens = int(g.ids.size());
      auto out = generate(*dec, g.prompt, opt);
      ASSERT_TRUE(out.is_ok()) << out.status().to_string();
      EXPECT_EQ(*out, g.ids);
      EXPECT_EQ(dec->position(), int(g.prompt.size() + g.ids.size()) - 1);
    }
  }
}

// Sampling with a seed: the cached path and the window draw the same tokens, the same seed the
// same tokens again, and another seed others; the context's end stops generation on both.
TEST(HfGenerate, SampledCachedEqualsWindow) {
  auto dev = open_device();
  ASSERT_NE(dev, nullptr);
  const std::string name = fixtures().back();  // a mixture
  const Greedy g = greedy_of(name);
  SampleOptions opt;
  opt.max_new_tokens = 1000;  // more than the context (32) holds
  opt.temperature = 1.5;
  opt.top_p = 0.95;
  opt.seed = 7;
  auto sample = [&](DecodePath path, uint64_t seed) {
    std::unique_ptr<Architecture> arch;
    auto dec = decoder_for(*dev, name, path, &arch);
    EXPECT_NE(dec, nullptr);
    if (!dec) return std::vector<int32_t>();
    SampleOptions o = opt;
    o.seed = seed;
    auto out = generate(*dec, g.prompt, o);
    EXPECT_TRUE(out.is_ok()) << out.status().to_string();
    EXPECT_EQ(dec->position(), dec->context()) << "runs up to the context's end";
    return out.is_ok() ? *out : std::vector<int32_t>();
  };
  const std::vector<int32_t> cached = sample(DecodePath::kCached, 7);
  EXPECT_EQ(cached.size(), 32u - g.prompt.size() + 1) << "stops at model.context (32)";
  EXPECT_EQ(sample(DecodePath::kWindow, 7), cached);
  EXPECT_EQ(sample(DecodePath::kCached, 7), cached);
  EXPECT_NE(sample(DecodePath::kCached, 8), cached);
}

// A run past the context, an empty run and a token outside the vocabulary are refused, and
// nothing is run: the decoder goes on from where it was.
TEST(HfGenerate, RefusesWhatDoesNotFit) {
  auto dev = open_device();
  ASSERT_NE(dev, nullptr);
  for (DecodePath path : {DecodePath::kCached, DecodePath::kWindow}) {
    std::unique_ptr<Architecture> arch;
    auto dec = decoder_for(*dev, "qwen2", path, &arch);
    ASSERT_NE(dec, nullptr);
    std::vector<int32_t> long_prompt(33, 5);
    auto r = dec->run(long_prompt);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("model.context 32"), std::string::npos)
        << r.status().message();
    EXPECT_FALSE(dec->run({}).is_ok());
    r = dec->step(100);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("outside the vocabulary (100)"), std::string::npos);
    EXPECT_EQ(dec->position(), 0);
    const Greedy g = greedy_of("qwen2");
    SampleOptions opt;
    opt.max_new_tokens = int(g.ids.size());
    auto out = generate(*dec, g.prompt, opt);
    ASSERT_TRUE(out.is_ok()) << out.status().to_string();
    EXPECT_EQ(*out, g.ids);
  }
}

#ifndef STRATA_CUDA_EMU
// From a strata checkpoint (train.steps 1 at lr 1e-12: the fixture's weights up to rounding):
// the same tokens; a checkpoint of another model is refused naming both shapes.
TEST(HfGenerate, FromACheckpoint) {
  const std::string dir = test::temp_dir("strata_hf_generate", "ckpt");
  fs::create_directories(dir + "/swap");
  auto cfg = config_for(
      {{"from_pretrained", fixture("qwen2")}},
      {"train.checkpoint_dir=\"" + dir + "/ckpt\"", "train.steps=1", "train.eval_interval=0",
       "optimizer.params.lr=1e-12", "device.memory_limit=\"64MiB\"",
       "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\""});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  TrainResult r = test::must_train(*cfg);
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok());
  auto w = load_master_weights(**arch, cfg->model, r.last_checkpoint);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  auto dev = open_device();
  ASSERT_NE(dev, nullptr);
  auto dec = Decoder::create(**arch, *dev, std::move(*w));
  ASSERT_TRUE(dec.is_ok()) << dec.status().to_string();
  EXPECT_TRUE((*dec)->cached()) << "the CPU backend has the cache's attention";
  const Greedy g = greedy_of("qwen2");
  SampleOptions opt;
  opt.max_new_tokens = int(g.ids.size());
  auto out = generate(**dec, g.prompt, opt);
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  EXPECT_EQ(*out, g.ids);
  auto other = config_for({{"from_pretrained", fixture("llama")}});
  ASSERT_TRUE(other.is_ok());
  auto arch2 = create_architecture(other->model);
  ASSERT_TRUE(arch2.is_ok());
  auto bad = load_master_weights(**arch2, other->model, r.last_checkpoint);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("holds a model of shape"), std::string::npos);
}

// Sampling: temperature 0 is the first largest logit; top_p keeps the fewest most likely
// tokens whose probability reaches it; a draw walks the nucleus in order of probability.
TEST(HfGenerate, PickToken) {
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 2.0f, -1.0f};
  EXPECT_EQ(pick_token(logits, 0.0, 1.0, 0.7), 1);
  for (double u : {0.0, 0.5, 0.999}) EXPECT_EQ(pick_token(logits, 1.0, 0.01, u), 1);
  // p = [0.054, 0.397, 0.397, 0.146, 0.007]: the nucleus at 0.85 is {1, 2, 3} (0.794 < 0.85),
  // at 0.6 {1, 2}.
  EXPECT_EQ(pick_token(logits, 1.0, 0.85, 0.0), 1);
  EXPECT_EQ(pick_token(logits, 1.0, 0.85, 0.5), 2);
  EXPECT_EQ(pick_token(logits, 1.0, 0.85, 0.999), 3);
  EXPECT_EQ(pick_token(logits, 1.0, 0.6, 0.999), 2);
  // A high temperature flattens: the last token becomes reachable.
  EXPECT_EQ(pick_token(logits, 100.0, 1.0, 0.9999), 4);
}
#endif

}  // namespace
}  // namespace strata
