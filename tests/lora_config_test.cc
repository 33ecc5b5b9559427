// The lora section as PEFT's LoraConfig reads it (src/model/lora.h): the errors that name their
// key (a target the model lacks, r < 1, dropout 1, bias, modules_to_save), target_modules as
// PEFT reads it (names, "all-linear", a regular expression), use_rslora's scaling,
// adapter_config.json both ways and of any shape, an adapter saved for another base refused by
// name, and the training FLOPs of a frozen base.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "src/hf/adapter_config.h"
#include "src/hf/hf_adapter.h"
#include "src/hf/hf_export.h"
#include "src/model/architecture.h"
#include "src/model/lora.h"
#include "strata/config.h"
#include "tests/lora_util.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using json = nlohmann::json;
using test::fixture;
using test::fixture_lora;
using test::lora_config;

// ---- what can go wrong ------------------------------------------------------------------------

Status arch_status(Result<Config> cfg) {
  if (!cfg.is_ok()) return cfg.status();
  return create_architecture(cfg->model).status();
}

TEST(LoraConfig, BadSectionsAreRefusedNamingTheKey) {
  struct Bad {
    json lora;
    const char* base;
    const char* names;
  };
  const Bad cases[] = {
      {{{"target_modules", {"q_proj", "c_attn"}}}, "llama", "lora.target_modules"},
      {{{"target_modules", {"q_proj"}}}, "gpt2", "lora.target_modules"},
      {{{"r", 0}}, "llama", "lora.r"},
      {{{"r", -4}}, "llama", "lora.r"},
      {{{"lora_dropout", 1.0}}, "llama", "lora.lora_dropout"},
      {{{"lora_dropout", -0.1}}, "llama", "lora.lora_dropout"},
      {{{"bias", "all"}}, "llama", "lora.bias"},
      {{{"bias", "lora_only"}}, "gpt2", "lora.bias"},
      {{{"bias", "some"}}, "gpt2", "lora.bias"},
      {{{"modules_to_save", {"lm_head"}}}, "llama", "lora.modules_to_save"},
      {{{"target_modules", "q_proj"}}, "llama", "lora.target_modules"},
      {{{"target_modules", ".*layers\\.0\\..*q_proj"}}, "llama", "lora.target_modules"},
      {{{"target_modules", "(unclosed"}}, "llama", "lora.target_modules"},
      {{{"use_rslora", "yes"}}, "llama", "lora.use_rslora"},
      {{{"rank", 8}}, "llama", "lora.rank"},
  };
  for (const Bad& b : cases) {
    const Status s = arch_status(lora_config(fixture(b.base), b.lora));
    EXPECT_FALSE(s.is_ok()) << b.lora.dump();
    EXPECT_NE(s.message().find(b.names), std::string::npos) << s.message();
  }
  // "c_attn" on GPT-2 names the layers it has.
  const Status s = arch_status(lora_config(fixture("gpt2"), {{"target_modules", {"q_proj"}}}));
  EXPECT_NE(s.message().find("attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj"), std::string::npos)
      << s.message();
  // A pattern that matches nothing says what a string means and lists the full names.
  const Status p = arch_status(lora_config(fixture("llama"), {{"target_modules", "q_proj"}}));
  EXPECT_NE(p.message().find("re.fullmatch"), std::string::npos) << p.message();
  EXPECT_NE(p.message().find("model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj"),
            std::string::npos)
      << p.message();
  // PEFT's defaults: q_proj and v_proj; c_attn.
  auto cfg = lora_config(fixture("llama"), json::object({{"r", 2}}));
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok());
  ASSERT_EQ((*arch)->lora()->targets.size(), 2u);
  EXPECT_EQ((*arch)->lora()->targets[0].site.name, "self_attn.q_proj");
  EXPECT_EQ((*arch)->lora()->targets[1].site.name, "self_attn.v_proj");
}

// The adapted sites' names of `base` with lora section `lora`.
std::vector<std::string> adapted(const std::string& base, const json& lora) {
  auto cfg = lora_config(fixture(base), lora);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  if (!cfg.is_ok()) return {};
  auto arch = create_architecture(cfg->model);
  EXPECT_TRUE(arch.is_ok()) << arch.status().to_string();
  if (!arch.is_ok()) return {};
  std::vector<std::string> out;
  for (const LoraLayout::Target& t : (*arch)->lora()->targets) out.push_back(t.site.name);
  return out;
}

TEST(LoraConfig, TargetModulesAsPeftReadsThem) {
  using V = std::vector<std::string>;
  const V llama_all = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                       "mlp.down_proj"};
  // "all-linear": every linear layer but the output head.
  EXPECT_EQ(adapted("llama", {{"target_modules", "all-linear"}}), llama_all);
  EXPECT_EQ(adapted("gpt2", {{"target_modules", "all-linear"}}),
            (V{"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}));
  // A string is a regular expression over the whole name (re.fullmatch).
  EXPECT_EQ(
      adapted("llama", {{"target_modules", "model\\.layers\\.\\d+\\.self_attn\\.(q|v)_proj"}}),
      (V{"self_attn.q_proj", "self_attn.v_proj"}));
  EXPECT_EQ(adapted("llama", {{"target_modules", ".*(down|up)_proj"}}),
            (V{"mlp.up_proj", "mlp.down_proj"}));
  EXPECT_EQ(adapted("gpt2", {{"target_modules", ".*mlp\\.c_proj"}}), (V{"mlp.c_proj"}));
  // A list: names matched as the whole name or its last parts.
  EXPECT_EQ(adapted("gpt2", {{"target_modules", {"c_proj"}}}), (V{"attn.c_proj", "mlp.c_proj"}));
  EXPECT_EQ(adapted("gpt2", {{"target_modules", {"mlp.c_proj"}}}), (V{"mlp.c_proj"}));
  // The string form survives the config's round trip (plan writes configs back).
  auto cfg = lora_config(fixture("llama"), {{"target_modules", ".*q_proj"}});
  ASSERT_TRUE(cfg.is_ok());
  EXPECT_EQ(cfg->model.lora.target_pattern, ".*q_proj");
  EXPECT_TRUE(cfg->model.lora.target_modules.empty());
}

// lora.target_parameters as PEFT reads it: the mixtures' routed experts, their fused
// parameters matched by their whole name or its last parts, never by target_modules or
// "all-linear"; PEFT's tensor names (a wrapper per parameter on mlp.experts, the last
// outermost) and shapes (lora_A [E*r, in], lora_B [out, r*E]); refused with lora_dropout, on a
// model without experts and for a name that matches none, each naming the keys.
TEST(LoraConfig, TargetParametersReachTheRoutedExperts) {
  auto experts_of = [](const std::string& base, const json& lora) {
    std::vector<std::string> out;
    auto cfg = lora_config(fixture(base), lora);
    EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    if (!cfg.is_ok()) return out;
    auto arch = create_architecture(cfg->model);
    EXPECT_TRUE(arch.is_ok()) << arch.status().to_string();
    if (!arch.is_ok()) return out;
    for (const LoraLayout::Target& t : (*arch)->lora()->experts) out.push_back(t.site.name);
    return out;
  };
  using V = std::vector<std::string>;
  const V both = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  EXPECT_EQ(experts_of("mixtral", {{"target_parameters", {"experts.down_proj", "gate_up_proj"}}}),
            both);
  EXPECT_EQ(experts_of("qwen2-moe", {{"target_parameters", {"mlp.experts.down_proj"}}}),
            V{"mlp.experts.down_proj"});
  EXPECT_EQ(experts_of("mixtral", {{"target_modules", "all-linear"}}), V{});
  EXPECT_EQ(adapted("qwen2-moe", {{"target_modules", ".*proj"}}).size(), 7u);
  // Only the experts with target_modules' default beside them (PEFT fills q_proj, v_proj too);
  // target_modules [] given: the experts alone (PEFT's target_modules=[]), but without
  // target_parameters [] is the default still.
  EXPECT_EQ(adapted("mixtral", {{"target_parameters", {"experts.down_proj"}}}),
            (V{"self_attn.q_proj", "self_attn.v_proj"}));
  EXPECT_EQ(adapted("mixtral", {{"target_modules", json::array()},
                                {"target_parameters", {"experts.down_proj"}}}),
            V{});
  EXPECT_EQ(experts_of("mixtral", {{"target_modules", json::array()},
                                   {"target_parameters", {"experts.down_proj"}}}),
            V{"mlp.experts.down_proj"});
  EXPECT_EQ(adapted("mixtral", {{"target_modules", json::array()}}),
            (V{"self_attn.q_proj", "self_attn.v_proj"}));

  auto cfg = lora_config(fixture("mixtral"), {{"r", 2}, {"target_parameters", both}});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  const ModelConfig& mc = (*arch)->shape();
  const int64_t E = mc.num_experts, C = mc.n_embd, I = mc.intermediate_size;
  const ModelLayout& lay = (*arch)->layout();
  std::vector<HfTensor> names = (*arch)->hf_adapter_tensors(int(lay.modules.size()) - 1);
  ASSERT_EQ(names.size(), 8u);
  const std::string pre = "base_model.model.model.layers." + std::to_string(mc.n_layer - 1) + ".";
  EXPECT_EQ(names[4].name, pre + "mlp.experts.base_layer.lora_A.weight");
  EXPECT_EQ(names[4].shape, (std::vector<int64_t>{2 * E, C}));
  EXPECT_EQ(names[5].name, pre + "mlp.experts.base_layer.lora_B.weight");
  EXPECT_EQ(names[5].shape, (std::vector<int64_t>{2 * I, 2 * E}));
  EXPECT_EQ(names[6].name, pre + "mlp.experts.lora_A.weight");
  EXPECT_EQ(names[6].shape, (std::vector<int64_t>{2 * E, I}));
  EXPECT_EQ(names[7].name, pre + "mlp.experts.lora_B.weight");
  EXPECT_EQ(names[7].shape, (std::vector<int64_t>{C, 2 * E}));
  // The adapter module holds them: each layer's q, v and the experts' A and B.
  EXPECT_EQ(lay.modules.back().numel,
            size_t(2 * (C + C) + 2 * (C + C / 2) + 2 * E * (C + 2 * I) + 2 * E * (I + C)));
  // One parameter alone is the outermost wrapper.
  cfg = lora_config(fixture("mixtral"), {{"target_parameters", {"gate_up_proj"}}});
  ASSERT_TRUE(cfg.is_ok());
  arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok());
  names = (*arch)->hf_adapter_tensors(int((*arch)->layout().modules.size()) - 1);
  ASSERT_EQ(names.size(), 6u);
  EXPECT_EQ(names[4].name, pre + "mlp.experts.lora_A.weight");

  struct Bad {
    json lora;
    const char* base;
    std::vector<const char*> names;
  };
  const Bad cases[] = {
      {{{"target_parameters", {"experts.gate_up_proj"}}, {"lora_dropout", 0.1}},
       "mixtral",
       {"lora.lora_dropout", "lora.target_parameters"}},
      {{{"target_parameters", {"experts.w1"}}},
       "mixtral",
       {"lora.target_parameters", "mlp.experts.gate_up_proj, mlp.experts.down_proj"}},
      {{{"target_parameters", {"gate_up_proj"}}}, "llama", {"lora.target_parameters"}},
  };
  for (const Bad& b : cases) {
    const Status st = arch_status(lora_config(fixture(b.base), b.lora));
    EXPECT_FALSE(st.is_ok()) << b.lora.dump();
    for (const char* n : b.names) {
      EXPECT_NE(st.message().find(n), std::string::npos) << n << ": " << st.message();
    }
  }
}

// An adapter directory's target_parameters must select the model's adapted expert parameters:
// peft's own fixture loads; one without them (or with others) is refused naming the key.
TEST(LoraConfig, AdapterTargetParametersMustBeTheModels) {
  auto open_with = [](const json& lora) {
    auto cfg = lora_config(fixture("mixtral"), lora);
    EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    auto arch = create_architecture(cfg->model);
    EXPECT_TRUE(arch.is_ok()) << arch.status().to_string();
    return HfAdapterReader::open(fixture("lora-mixtral-experts"), **arch).status();
  };
  EXPECT_TRUE(open_with(fixture_lora("mixtral-experts")).is_ok());
  json only_down = fixture_lora("mixtral-experts");
  only_down["target_parameters"] = {"down_proj"};
  Status st = open_with(only_down);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("lora.target_parameters"), std::string::npos) << st.message();
  json none = fixture_lora("mixtral-experts");
  none.erase("target_parameters");
  st = open_with(none);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("target_parameters"), std::string::npos) << st.message();
  // export --adapter of the experts alone writes what peft saves for them (target_modules [],
  // the parameters with their module) and reads back.
  const std::string dir = test::temp_dir("strata_lora", "experts_alone");
  auto cfg = lora_config(fixture("qwen2-moe"), {{"target_modules", json::array()},
                                                {"target_parameters", {"mlp.experts.down_proj"}}});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  ASSERT_TRUE(write_hf_adapter(dir + "/a", **arch, "base", [&](int m, float* out) {
                const size_t n = (*arch)->layout().modules[size_t(m)].numel;
                for (size_t i = 0; i < n; ++i) out[i] = float(i % 7) * 0.1f;
                return Status::ok();
              }).is_ok());
  const json written = json::parse(test::read_file(dir + "/a/adapter_config.json"));
  EXPECT_EQ(written["target_modules"], json::array());
  EXPECT_EQ(written["target_parameters"], json({"experts.down_proj"}));
  EXPECT_TRUE(HfAdapterReader::open(dir + "/a", **arch).is_ok());
}

TEST(LoraConfig, RsLoraScalesByTheRootOfTheRank) {
  auto plain = lora_config(fixture("llama"), {{"r", 16}, {"lora_alpha", 8}});
  auto rs = lora_config(fixture("llama"), {{"r", 16}, {"lora_alpha", 8}, {"use_rslora", true}});
  ASSERT_TRUE(plain.is_ok() && rs.is_ok());
  auto a = create_architecture(plain->model), b = create_architecture(rs->model);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ((*a)->lora()->scaling, 0.5f);
  EXPECT_EQ((*b)->lora()->scaling, 2.0f);
}

// export --adapter's adapter_config.json carries the section as peft saves it, and reading the
// directory back checks it: use_rslora in the scaling, a pattern as given, all-linear as the
// layers' names; what strata cannot load is refused by name.
TEST(LoraConfig, AdapterConfigCarriesPeftsFieldsBothWays) {
  const std::string dir = test::temp_dir("strata_lora", "adapter_fields");
  const std::string pattern = "model\\.layers\\.\\d+\\.self_attn\\.(q|v)_proj";
  auto cfg = lora_config(fixture("llama"), {{"r", 4},
                                            {"lora_alpha", 8},
                                            {"use_rslora", true},
                                            {"lora_dropout", 0.1},
                                            {"target_modules", pattern}});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  auto fill = [](int m, float* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = float(m) + float(i) * 1e-3f;
  };
  const ModelLayout& lay = (*arch)->layout();
  ASSERT_TRUE(write_hf_adapter(dir + "/a", **arch, "base", [&](int m, float* out) {
                fill(m, out, lay.modules[size_t(m)].numel);
                return Status::ok();
              }).is_ok());
  const std::string cfg_path = dir + "/a/adapter_config.json";
  auto write = [](const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::trunc) << text;
  };
  const json written = json::parse(test::read_file(cfg_path));
  EXPECT_EQ(written["lora_alpha"], 8.0);
  EXPECT_EQ(written["lora_dropout"], 0.1);
  EXPECT_EQ(written["use_rslora"], true);
  EXPECT_EQ(written["target_modules"], pattern);
  EXPECT_EQ(written["bias"], "none");
  {
    auto ad = HfAdapterReader::open(dir + "/a", **arch);
    ASSERT_TRUE(ad.is_ok()) << ad.status().to_string();
    const int m = int(lay.modules.size()) - 1;
    std::vector<float> got(lay.modules[size_t(m)].numel), want(got.size());
    ASSERT_TRUE((*ad)->read_module(m, got.data()).is_ok());
    fill(m, want.data(), want.size());
    EXPECT_EQ(got, want);
  }
  // Each edit of the written config refused, naming the field.
  const std::vector<std::pair<json, const char*>> edits = {
      {{{"use_rslora", false}}, "use_rslora"},
      {{{"bias", "all"}}, "bias"},
      {{{"modules_to_save", {"lm_head"}}}, "modules_to_save"},
      {{{"rank_pattern", {{"q_proj", 8}}}}, "rank_pattern"},
      {{{"lora_bias", true}}, "lora_bias"},
      {{{"use_dora", true}}, "use_dora"},
      {{{"lora_dropout", 1.5}}, "lora_dropout"},
      {{{"target_modules", ".*q_proj"}}, "target_modules"},
  };
  for (const auto& [edit, name] : edits) {
    json c = written;
    c.update(edit);
    write(cfg_path, c.dump());
    auto ad = HfAdapterReader::open(dir + "/a", **arch);
    ASSERT_FALSE(ad.is_ok()) << edit.dump();
    EXPECT_NE(ad.status().message().find(name), std::string::npos) << ad.status().message();
  }
  // "all-linear": written as the layers' names (what peft saves), read back either way.
  cfg = lora_config(fixture("llama"), {{"r", 4}, {"target_modules", "all-linear"}});
  ASSERT_TRUE(cfg.is_ok());
  arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok());
  ASSERT_TRUE(write_hf_adapter(dir + "/b", **arch, "base", [&](int m, float* out) {
                fill(m, out, (*arch)->layout().modules[size_t(m)].numel);
                return Status::ok();
              }).is_ok());
  json b = json::parse(test::read_file(dir + "/b/adapter_config.json"));
  EXPECT_EQ(b["target_modules"].size(), 7u) << b["target_modules"].dump();
  EXPECT_TRUE(HfAdapterReader::open(dir + "/b", **arch).is_ok());
  b["target_modules"] = "all-linear";
  write(dir + "/b/adapter_config.json", b.dump());
  auto ad = HfAdapterReader::open(dir + "/b", **arch);
  EXPECT_TRUE(ad.is_ok()) << ad.status().to_string();
}

// ---- lora_dropout: the op against a scalar reference -----------------------------------------

// configs/tiny-cpu.json with a 2-layer Llama of width 64 (MLP 96, 4 heads / 2 key-value).
json small_llama_doc(int vocab) {
  json doc =
      json::parse(test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"));
  doc["model"] = {{"type", "llama"},
                  {"n_layer", 2},
                  {"n_head", 4},
                  {"n_embd", 64},
                  {"vocab_size", vocab},
                  {"context", 16},
                  {"intermediate_size", 96},
                  {"num_key_value_heads", 2}};
  return doc;
}

TEST(LoraConfig, AnAdapterOfAnotherBaseIsRefusedByName) {
  // The llama fixture's adapter on a wider Llama with the same lora section.
  json doc = small_llama_doc(100);
  doc["lora"] = fixture_lora("llama");
  auto cfg = parse_config(doc.dump(), "<lora test>", {"bf16.enabled=false"});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  auto ad = HfAdapterReader::open(fixture("lora-llama"), **arch);
  ASSERT_FALSE(ad.is_ok());
  EXPECT_NE(ad.status().message().find("another base model"), std::string::npos)
      << ad.status().message();
  EXPECT_NE(ad.status().message().find("lora_A.weight has shape"), std::string::npos)
      << ad.status().message();
  // Another rank: the config's lora.r named.
  doc["lora"]["r"] = 8;
  cfg = parse_config(doc.dump(), "<lora test>", {"bf16.enabled=false"});
  arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok());
  ad = HfAdapterReader::open(fixture("lora-llama"), **arch);
  ASSERT_FALSE(ad.is_ok());
  EXPECT_NE(ad.status().message().find("lora.r"), std::string::npos) << ad.status().message();
}

// The planner's FLOPs of a LoRA run: the frozen base's GEMMs lose their weight gradients (one
// product per weight per token, 2 FLOPs, in backward) and the adapters' products are trained.
// adapter_config.json of any shape is a Status naming the file, never a crash: the values
// fuzz_adapter_config's seeds start from (an alpha whose alpha / r is past a float was an
// unchecked float conversion, undefined behaviour).
TEST(LoraConfig, AdapterConfigOfAnyShapeIsAnErrorNamingTheFile) {
  const AdapterExpectation want{4, 2.0f, {"q_proj", "v_proj"}, false, "", {}};
  const std::string ok =
      R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
          "use_dora": false, "use_rslora": null})";
  EXPECT_TRUE(check_adapter_config(ok, "a/adapter_config.json", want).is_ok());
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"peft_type": "LORA", "r": 4, "lora_alpha": 1e300, "target_modules": ["q_proj", "v_proj"]})",
       "differ from the config's lora.r 4"},
      {R"({"peft_type": "LORA", "r": 1e31, "lora_alpha": 8})", "r must be a positive integer"},
      {R"({"peft_type": "LORA", "r": 4, "lora_alpha": "8"})", "lora_alpha a number"},
      {R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": "yes"})",
       "use_dora is \"yes\""},
      {R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", 7]})",
       "target_modules holds 7"},
      {R"({"peft_type": 3})", "not a LoRA adapter"},
      {R"([1, 2])", "not a LoRA adapter"},
      {std::string(100000, '['), "nested deeper than 64 levels"},
      {R"({"peft_type": "LORA", "r": 4,)", "invalid JSON"},
      {"{\"peft_type\": \"LO\xff\"}", "invalid JSON"},
  };
  for (const auto& [text, what] : bad) {
    const Status st = check_adapter_config(text, "a/adapter_config.json", want);
    EXPECT_FALSE(st.is_ok()) << text.substr(0, 80);
    EXPECT_NE(st.message().find("a/adapter_config.json"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
  }
}

TEST(LoraConfig, TrainFlopsLeaveOutTheFrozenBasesWeightGradients) {
  json doc = small_llama_doc(128);
  auto full_cfg = parse_config(doc.dump(), "<full>", {});
  doc["lora"] = {{"r", 4}, {"target_modules", {"q_proj", "v_proj"}}};
  auto lora_cfg = parse_config(doc.dump(), "<lora>", {});
  ASSERT_TRUE(full_cfg.is_ok() && lora_cfg.is_ok());
  auto full = create_architecture(full_cfg->model);
  auto lora = create_architecture(lora_cfg->model);
  ASSERT_TRUE(full.is_ok() && lora.is_ok());
  const int T = 16;
  const FlopsPerToken f = (*full)->flops_per_token(T, ActivationMode::kKeep);
  const FlopsPerToken l = (*lora)->flops_per_token(T, ActivationMode::kKeep);
  // Weights: per layer q 64x64, k and v 64x32 each, o 64x64, gate/up/down 3 x 64x96; the head
  // 128x64. Adapters per layer: q (64 in, 64 out) and v (64 in, 32 out) at r = 4.
  const double weights = 2 * (64.0 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96) + 128.0 * 64;
  const double adapters = 2 * 4.0 * ((64 + 64) + (64 + 32));
  EXPECT_DOUBLE_EQ(l.frozen, 2 * weights);
  EXPECT_DOUBLE_EQ(l.forward, f.forward + 2 * adapters);
  EXPECT_DOUBLE_EQ(l.train(), f.train() - 2 * weights + 3 * 2 * adapters);
  EXPECT_DOUBLE_EQ(f.frozen, 0.0);
}

}  // namespace
}  // namespace strata
