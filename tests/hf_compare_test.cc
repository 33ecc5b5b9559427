// Hugging Face checkpoints against transformers itself: the fixtures under tests/fixtures/hf/
// (written by tools/make_hf_fixtures.py and, the mixtures of experts, make_moe_fixtures.py with
// transformers; see their headers) are loaded through model.from_pretrained, and strata's
// forward and backward on the fixture's tokens must give transformers' logits (1e-4), per-token
// losses (1e-5 relative), mean loss, and every parameter's gradient (1e-4: norm of the
// difference over the norm) in fp32; in bf16 the logits and the loss within bf16's tolerance.
// DPO's loss (each row's logits' gradient weighted, MicroBatch::row_weights) and every gradient
// against torch's on the llama fixture (tools/make_dpo_fixture.py). Then every way an import can
// go wrong is an error naming the tensor, file and offset; a DeepSpeed config without a model is
// refused; and a from_pretrained model trains bit-identically whether its weights stream into
// the device, host memory or NVMe.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/checkpoint/checkpoint.h"
#include "src/hf/hf_checkpoint.h"
#include "src/hf/hf_export.h"
#include "src/hf/safetensors.h"
#include "src/model/architecture.h"
#include "src/train/data.h"
#include "src/train/preference.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/log.h"
#include "tests/hf_test_util.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using test::config_for;
using test::fixture;

// The fixture's reference tensors (tools/make_hf_fixtures.py), as fp32.
std::map<std::string, std::vector<float>> read_reference(const std::string& dir) {
  return test::read_safetensors_f32(dir + "/reference.safetensors");
}

// What one forward + backward of the model gives on the CPU backend.
struct Pass1 {
  std::vector<float> logits;              // [B*T, V], fp32
  std::vector<float> losses;              // [B*T]
  std::vector<std::vector<float>> grads;  // per module, fp32
  float aux_loss = -1;                    // a mixture's load-balancing loss (-1: none)
};

// Loads `dir` through from_pretrained and runs one training micro-batch's program on `tokens`
// and `targets` ([B*T]) with every module bound, the loss gradient scaled to the mean, or with
// `row_weights` each row's gradient weighted by them (MicroBatch::row_weights).
Pass1 run_one(const std::string& dir, const Architecture& arch, DType dt, int B, int T,
              const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
              const RowWeights* row_weights = nullptr) {
  Pass1 r;
  auto hf = HfCheckpointReader::open(dir, arch);
  EXPECT_TRUE(hf.is_ok()) << hf.status().to_string();
  if (!hf.is_ok()) return r;
  CpuDeviceOptions o;
  o.capacity = size_t{256} << 20;
  auto dev = create_cpu_device(o);
  EXPECT_TRUE(dev.is_ok());
  Device& d = **dev;
  Stream& s = d.compute_stream();
  const ModelLayout& lay = arch.layout();
  std::vector<const void*> params;
  std::vector<float*> grads;
  for (size_t i = 0; i < lay.modules.size(); ++i) {
    const size_t n = lay.modules[i].numel;
    std::vector<float> master(n);
    EXPECT_TRUE((*hf)->read_module(int(i), master.data()).is_ok());
    std::vector<char> lp(n * dtype_size(dt));
    convert(master.data(), DType::kF32, lp.data(), dt, n);
    void* p = *d.allocate(lp.size(), "test.params");
    void* g = *d.allocate(n * 4, "test.grads");
    d.copy_h2d(s, p, lp.data(), lp.size());
    d.memset_zero(s, g, n * 4);
    EXPECT_TRUE(d.synchronize(s).is_ok());  // lp is read by the copy
    params.push_back(p);
    grads.push_back(static_cast<float*>(g));
  }
  auto runner = arch.create_runner(d, B, T, dt, ActivationMode::kKeep, nullptr);
  EXPECT_TRUE(runner.is_ok()) << runner.status().to_string();
  r.losses.resize(size_t(B) * T);
  // The head's logits, [B*T, Vp] in the model dtype (MicroBatch::logits_out).
  // Vp from the token embedding: [V, C] in the checkpoint, [Vp, C] in strata.
  const HfTensor emb = arch.hf_tensors(0).at(0);
  const size_t V = size_t(arch.vocab_size()), C = size_t(emb.shape.at(1));
  const size_t Vp = lay.modules[0].tensors[size_t(emb.tensor)].numel / C;
  void* logits = *d.allocate_host(size_t(B) * T * Vp * dtype_size(dt));
  const ModuleBindings bound{params, grads};
  MicroBatch mb{1.0f / float(B * T), r.losses.data(), logits, &r.aux_loss};
  mb.row_weights = row_weights;
  (*runner)->begin_batch(tokens.data(), targets.data());
  for (const ProgramOp& op : arch.program(Pass::kTrain).ops) {
    if (op.kind == ProgramOp::kCompute) (*runner)->compute(op, bound, mb);
  }
  EXPECT_TRUE(d.synchronize(s).is_ok());
  r.logits.resize(size_t(B) * T * V);
  for (size_t i = 0; i < size_t(B) * T; ++i) {
    convert(static_cast<const char*>(logits) + i * Vp * dtype_size(dt), dt, &r.logits[i * V],
            DType::kF32, V);
  }
  d.release_host(logits);
  for (size_t i = 0; i < lay.modules.size(); ++i) {
    std::vector<float> g(lay.modules[i].numel);
    d.copy_d2h(s, g.data(), grads[i], g.size() * 4);
    r.grads.push_back(std::move(g));
  }
  EXPECT_TRUE(d.synchronize(s).is_ok());
  runner->reset();
  for (size_t i = 0; i < params.size(); ++i) {
    d.release(const_cast<void*>(params[i]));
    d.release(grads[i]);
  }
  return r;
}

using test::rel_norm_diff;

// strata's gradient of Hugging Face tensor `h` of module m, in Hugging Face's layout.
std::vector<float> hf_view(const Architecture& arch, int m, const HfTensor& h,
                           const std::vector<float>& module_grad) {
  const TensorSpec& t = arch.layout().modules[size_t(m)].tensors[size_t(h.tensor)];
  size_t n = 1;
  for (int64_t d : h.shape) n *= size_t(d);
  std::vector<float> v(n);
  const float* src = module_grad.data() + t.offset;
  if (!h.transposed) {
    std::copy(src, src + n, v.begin());
  } else {
    const size_t in = size_t(h.shape[0]), out = size_t(h.shape[1]);
    for (size_t i = 0; i < in; ++i) {
      for (size_t o = 0; o < out; ++o) v[i * out + o] = src[o * in + i];
    }
  }
  return v;
}

// Every parameter's gradient within 1e-4 (the norm of the difference over the norm) of the
// reference's `prefix`<Hugging Face name>, each transformers parameter exactly once.
void expect_gradients(const Architecture& arch, const std::vector<std::vector<float>>& grads,
                      std::map<std::string, std::vector<float>>& ref, const std::string& prefix,
                      const std::string& what) {
  size_t compared = 0;
  for (size_t m = 0; m < arch.layout().modules.size(); ++m) {
    for (const HfTensor& h : arch.hf_tensors(int(m))) {
      std::string key = prefix + h.name;
      if (!ref.count(key) && !h.alt_name.empty()) key = prefix + h.alt_name;
      ASSERT_TRUE(ref.count(key)) << what << ": no reference gradient for " << h.name;
      const std::vector<float> g = hf_view(arch, int(m), h, grads[m]);
      std::vector<float>& want = ref[key];
      if (h.more_rows_ok && want.size() > g.size()) {
        // GPT-2's positions past model.context: no gradient in transformers either.
        for (size_t i = g.size(); i < want.size(); ++i) ASSERT_EQ(want[i], 0.0f) << key;
        want.resize(g.size());
      }
      ASSERT_EQ(g.size(), want.size()) << key;
      EXPECT_LT(rel_norm_diff(g, want), 1e-4) << what << " " << key;
      ++compared;
    }
  }
  size_t ref_grads = 0;
  for (const auto& [k, v] : ref) ref_grads += k.rfind(prefix, 0) == 0;
  EXPECT_EQ(compared, ref_grads) << what << ": strata and transformers have different parameters";
}

struct Case {
  const char* name;
  DType dt;
};

class HfCompare : public ::testing::TestWithParam<Case> {};

TEST_P(HfCompare, LossAndGradientsMatchTransformers) {
  const Case c = GetParam();
  const std::string dir = fixture(c.name);
  auto ref = read_reference(dir);
  ASSERT_TRUE(ref.count("tokens") && ref.count("losses") && ref.count("loss"));
  const int T = 16, B = int(ref["tokens"].size()) / T;
  auto cfg = config_for({{"from_pretrained", dir}, {"context", T}},
                        {c.dt == DType::kF32 ? "bf16.enabled=false" : "bf16.enabled=true"});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  ASSERT_EQ(cfg->model.dtype, c.dt);
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  std::vector<int32_t> tok(size_t(B) * T), tgt(size_t(B) * T);
  for (size_t i = 0; i < tok.size(); ++i) {
    tok[i] = int32_t(ref["tokens"][i]);
    tgt[i] = int32_t(ref["targets"][i]);
  }
  Pass1 r = run_one(dir, **arch, c.dt, B, T, tok, tgt);
  // Logits: within 1e-4 of transformers' in fp32 (the fixtures' logits reach ~5; measured
  // max |diff| ~5e-6); in bf16 within 3% of the largest logit.
  ASSERT_EQ(r.logits.size(), ref["logits"].size());
  double scale = 0, worst = 0;
  for (float v : ref["logits"]) scale = std::max(scale, double(std::fabs(v)));
  for (size_t i = 0; i < r.logits.size(); ++i) {
    worst = std::max(worst, std::fabs(double(r.logits[i]) - ref["logits"][i]));
  }
  EXPECT_LT(worst, c.dt == DType::kF32 ? 1e-4 : 3e-2 * scale)
      << c.name << ": logits differ from transformers' by up to " << worst << " (max |logit| "
      << scale << ")";
  ASSERT_EQ(r.losses.size(), ref["losses"].size());
  // Per-token losses: logsumexp(logits) - logits[target], for every position.
  const double tol = c.dt == DType::kF32 ? 1e-5 : 3e-2;
  double mean = 0;
  for (size_t i = 0; i < r.losses.size(); ++i) {
    EXPECT_NEAR(r.losses[i], ref["losses"][i], tol * std::fabs(ref["losses"][i]) + tol * 0.01)
        << c.name << " token " << i;
    mean += r.losses[i];
  }
  mean /= double(r.losses.size());
  EXPECT_NEAR(mean, ref["loss"][0], tol * ref["loss"][0]) << c.name;
  // A mixture's load-balancing loss, reported apart from the loss (its gradient, weighted by
  // router_aux_loss_coef, is in the reference gradients below).
  if (ref.count("aux_loss")) {
    EXPECT_NEAR(r.aux_loss, ref["aux_loss"][0], tol * ref["aux_loss"][0]) << c.name;
  } else {
    EXPECT_EQ(r.aux_loss, -1.0f) << c.name << ": a dense model reports no auxiliary loss";
  }
  if (c.dt != DType::kF32) return;
  expect_gradients(**arch, r.grads, ref, "grad.", c.name);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfCompare,
                         ::testing::Values(Case{"llama", DType::kF32}, Case{"llama3", DType::kF32},
                                           Case{"qwen2", DType::kF32}, Case{"qwen3", DType::kF32},
                                           Case{"phi3", DType::kF32}, Case{"gpt2", DType::kF32},
                                           Case{"mixtral", DType::kF32},
                                           Case{"qwen2-moe", DType::kF32},
                                           Case{"qwen3-moe", DType::kF32},
                                           Case{"llama-bf16", DType::kBF16},
                                           Case{"llama", DType::kBF16}),
                         [](const auto& info) {
                           std::string n = info.param.name;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n + (info.param.dt == DType::kF32 ? "_fp32" : "_bf16");
                         });

// DPO's sigmoid loss with label smoothing (cDPO) against torch (tools/make_dpo_fixture.py): two
// pairs of prompt + completion + padding rows, the reference log-probabilities a few nats off
// the policy's (z of both signs). The rows' per-token losses give each row's log-probability
// (the completion's only: the prompt's and padding's targets are ignored) and, through DpoSums,
// the loss; DpoRowWeights (scale 1 / pairs: the mean over pairs) weighs each row's logits'
// gradient, and every parameter's gradient must be torch's. With eps 0 too (plain DPO).
TEST(HfCompareDpo, SigmoidLossAndGradientsMatchTorch) {
  const std::string dir = fixture("llama");
  auto ref = test::read_safetensors_f32(dir + "/dpo.safetensors");
  ASSERT_TRUE(ref.count("tokens") && ref.count("ref") && ref.count("loss"));
  const int T = 16, B = int(ref["tokens"].size()) / T, pairs = B / 2;
  ASSERT_EQ(B, 4);
  auto cfg = config_for({{"from_pretrained", dir}, {"context", T}}, {"bf16.enabled=false"});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  std::vector<int32_t> tok(size_t(B) * T), tgt(size_t(B) * T);
  for (size_t i = 0; i < tok.size(); ++i) {
    tok[i] = int32_t(ref["tokens"][i]);
    tgt[i] = int32_t(ref["targets"][i]);
  }
  std::vector<float> count(size_t(B), 0.0f);
  for (size_t i = 0; i < tgt.size(); ++i) count[i / T] += tgt[i] >= 0 ? 1.0f : 0.0f;
  DpoConfig dpo;
  dpo.beta = ref["beta"][0];
  for (const double eps : {double(ref["eps"][0]), 0.0}) {
    SCOPED_TRACE("label_smoothing " + std::to_string(eps));
    const std::string prefix = eps == 0.0 ? "eps0." : "";
    dpo.label_smoothing = eps;
    const DpoLoss loss = dpo_loss_of(dpo);
    const DpoRowWeights weights(&loss, 1.0 / pairs, ref["ref"].data(), count.data());
    Pass1 r = run_one(dir, **arch, DType::kF32, B, T, tok, tgt, &weights);
    ASSERT_EQ(r.losses.size(), size_t(B) * T);
    for (int b = 0; b < B; ++b) {
      const double logp = -row_loss_sum(&r.losses[size_t(b) * T], T);
      EXPECT_NEAR(logp, ref["logps"][size_t(b)], 1e-5 * std::fabs(ref["logps"][size_t(b)]))
          << "row " << b;
    }
    DpoSums sums;
    sums.add(loss, r.losses.data(), ref["ref"].data(), count.data(), B, T);
    const DpoMetrics m = dpo_metrics(sums);
    EXPECT_EQ(sums.pairs, double(pairs));
    EXPECT_NEAR(m.loss, ref[prefix + "loss"][0], 1e-5 * ref[prefix + "loss"][0]);
    EXPECT_EQ(m.accuracy, 0.5) << "one pair won, one lost";
    expect_gradients(**arch, r.grads, ref, prefix + "grad.", "dpo");
  }
}

// ---- what can go wrong -------------------------------------------------------------------

// A copy of fixture `name` in a fresh directory, with config.json edited by `edit`.
std::string copy_fixture(const std::string& name, const std::string& tag,
                         const std::function<void(json&)>& edit = nullptr) {
  const std::string dir = test::temp_dir("strata_hf", tag);
  for (const auto& e : fs::directory_iterator(fixture(name))) {
    fs::copy_file(e.path(), dir + "/" + e.path().filename().string());
  }
  if (edit) {
    json c = json::parse(test::read_file(dir + "/config.json"));
    edit(c);
    std::ofstream(dir + "/config.json") << c.dump(2);
  }
  return dir;
}

std::string open_error(const std::string& dir) {
  auto cfg = config_for({{"from_pretrained", dir}, {"context", 16}});
  if (!cfg.is_ok()) return cfg.status().message();
  auto arch = create_architecture(cfg->model);
  if (!arch.is_ok()) return arch.status().message();
  auto r = HfCheckpointReader::open(dir, **arch);
  return r.is_ok() ? "" : r.status().message();
}

TEST(HfImport, MismatchesNameTheTensorFileAndOffset) {
  // A layer the files do not have: the missing tensor, where it was looked for.
  std::string e = open_error(copy_fixture("gpt2", "missing", [](json& c) { c["n_layer"] = 3; }));
  EXPECT_NE(e.find("\"transformer.h.2.ln_1.weight\""), std::string::npos) << e;
  EXPECT_NE(e.find("is missing from"), std::string::npos) << e;
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  // A layer the config does not have: the extra tensor, its file and offset.
  e = open_error(copy_fixture("llama3", "extra", [](json& c) { c["num_hidden_layers"] = 1; }));
  EXPECT_NE(e.find("\"model.layers.1."), std::string::npos) << e;
  EXPECT_NE(e.find("model.safetensors: tensor"), std::string::npos) << e;
  EXPECT_NE(e.find("offset"), std::string::npos) << e;
  EXPECT_NE(e.find("is not a parameter"), std::string::npos) << e;
  // A shape config.json does not imply.
  e = open_error(copy_fixture("qwen2", "shape", [](json& c) { c["intermediate_size"] = 40; }));
  EXPECT_NE(e.find("has shape [48, 32], but config.json (and model.context) make it [40, 32]"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("offset"), std::string::npos) << e;
  // The sharded index: a shard that is gone, and a tensor the index puts in the wrong file.
  std::string dir = copy_fixture("llama", "shard_gone");
  json index = json::parse(test::read_file(dir + "/model.safetensors.index.json"));
  const std::string first = index["weight_map"]["model.norm.weight"];
  fs::remove(dir + "/" + first);
  e = open_error(dir);
  EXPECT_NE(e.find(first), std::string::npos) << e;
  dir = copy_fixture("llama", "wrong_shard");
  index = json::parse(test::read_file(dir + "/model.safetensors.index.json"));
  std::string other;
  for (const auto& [k, v] : index["weight_map"].items()) {
    if (v != index["weight_map"]["lm_head.weight"]) other = v;
  }
  ASSERT_FALSE(other.empty()) << "the llama fixture is sharded";
  index["weight_map"]["lm_head.weight"] = other;
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  e = open_error(dir);
  EXPECT_NE(e.find("names tensor \"lm_head.weight\" in"), std::string::npos) << e;
  EXPECT_NE(e.find(other), std::string::npos) << e;
  // A truncated file: the safetensors reader names the file and the offset.
  dir = copy_fixture("qwen2", "truncated");
  fs::resize_file(dir + "/model.safetensors", fs::file_size(dir + "/model.safetensors") - 100);
  e = open_error(dir);
  EXPECT_NE(e.find("model.safetensors: tensor"), std::string::npos) << e;
  EXPECT_NE(e.find("data_offsets [88064, 88192] lie past its end"), std::string::npos) << e;
  EXPECT_NE(e.find("the data region from offset 2688"), std::string::npos) << e;
  // No weights at all.
  dir = copy_fixture("qwen2", "no_weights");
  fs::remove(dir + "/model.safetensors");
  e = open_error(dir);
  EXPECT_NE(e.find("has neither model.safetensors nor model.safetensors.index.json"),
            std::string::npos)
      << e;
}

TEST(HfImport, FromPretrainedTakesOnlyContextBesideIt) {
  auto cfg = config_for({{"from_pretrained", fixture("llama")}, {"n_layer", 4}});
  ASSERT_FALSE(cfg.is_ok());
  EXPECT_NE(cfg.status().message().find("model.n_layer: the model's shape comes from "
                                        "model.from_pretrained"),
            std::string::npos)
      << cfg.status().message();
  auto ok = config_for({{"from_pretrained", fixture("llama")}});
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->model.type, "llama");
  EXPECT_EQ(ok->model.context, 32);  // max_position_embeddings
  EXPECT_EQ(ok->model.num_key_value_heads, 2);
  EXPECT_FALSE(ok->model.tied_embeddings);
  auto missing = config_for({{"from_pretrained", "/nonexistent/strata/model"}});
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/strata/model/config.json"),
            std::string::npos)
      << missing.status().message();
}

// The Hugging Face Trainer's ZeRO-3 config (its documented shape: "auto" everywhere, no model).
TEST(HfImport, DeepSpeedConfigWithoutAModelIsRefused) {
  const char* hf_trainer_zero3 = R"({
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                  "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "offload_param": {"device": "cpu", "pin_memory": true},
                          "overlap_comm": true, "contiguous_gradients": true,
                          "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": true},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false})";
  auto cfg = parse_config(hf_trainer_zero3, "ds_config_zero3.json");
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  EXPECT_FALSE(cfg->model.given);
  auto r = train(*cfg, TrainOptions{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("the config has no model"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("from_pretrained"), std::string::npos);
  // The same config with a model given on the command line is one.
  auto with = parse_config(hf_trainer_zero3, "ds_config_zero3.json",
                           {"model.from_pretrained=\"" + fixture("llama") + "\""});
  ASSERT_TRUE(with.is_ok()) << with.status().to_string();
  EXPECT_TRUE(with->model.given);
}

// A mixture's checkpoint: more experts than the files hold is named at the router's tensor; what
// strata's mixtures do not do (OLMoE's q/k norms over all heads, a sparse step, router jitter) is
// refused naming the key.
TEST(HfImport, MixtureMismatchesNameTheExpertOrTheKey) {
  std::string e =
      open_error(copy_fixture("mixtral", "experts", [](json& c) { c["num_local_experts"] = 5; }));
  EXPECT_NE(e.find("tensor \"model.layers.0.block_sparse_moe.gate.weight\" at offset"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("has shape [4, 32], but config.json (and model.context) make it [5, 32]"),
            std::string::npos)
      << e;
  e = open_error(copy_fixture("qwen2-moe", "olmoe",
                              [](json& c) { c["architectures"] = {"OlmoeForCausalLM"}; }));
  EXPECT_NE(e.find("q_norm"), std::string::npos) << e;
  // Qwen2-MoE's weights under a Qwen3-MoE config.json: the first query norm is missing.
  e = open_error(copy_fixture("qwen2-moe", "qwen3",
                              [](json& c) { c["architectures"] = {"Qwen3MoeForCausalLM"}; }));
  EXPECT_NE(e.find("model.layers.0.self_attn.q_norm.weight"), std::string::npos) << e;
  e = open_error(
      copy_fixture("qwen2-moe", "sparse_step", [](json& c) { c["decoder_sparse_step"] = 2; }));
  EXPECT_NE(e.find("decoder_sparse_step"), std::string::npos) << e;
  e = open_error(
      copy_fixture("mixtral", "jitter", [](json& c) { c["router_jitter_noise"] = 0.1; }));
  EXPECT_NE(e.find("router_jitter_noise"), std::string::npos) << e;
  e = open_error(copy_fixture("mixtral", "top_k", [](json& c) { c["num_experts_per_tok"] = 9; }));
  EXPECT_NE(e.find("model.num_experts_per_tok: 9 must be in [1, model.num_experts = 4]"),
            std::string::npos)
      << e;
}

// Any range of a module reads as the same range of the whole module, bit for bit: GPT-2's
// transposed Conv1D weights (a range gathers columns of the stored rows), bf16 converted per
// range, Qwen2's biases; pieces of odd sizes that cut rows and tensors anywhere.
TEST(HfImport, RangesReadAsTheWholeModule) {
  for (const char* name : {"gpt2", "llama-bf16", "qwen2"}) {
    SCOPED_TRACE(name);
    auto cfg = config_for({{"from_pretrained", fixture(name)}, {"context", 16}});
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    auto arch = create_architecture(cfg->model);
    ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
    auto hf = HfCheckpointReader::open(fixture(name), **arch);
    ASSERT_TRUE(hf.is_ok()) << hf.status().to_string();
    const ModelLayout& lay = (*arch)->layout();
    for (size_t i = 0; i < lay.modules.size(); ++i) {
      const size_t n = lay.modules[i].numel;
      SCOPED_TRACE(lay.modules[i].name);
      std::vector<float> whole(n, -1.0f);
      ASSERT_TRUE((*hf)->read_module(int(i), whole.data()).is_ok());
      size_t nonzero = 0;
      for (float x : whole) nonzero += x != 0.0f;
      EXPECT_GT(nonzero, n / 2) << "the fixture's weights were not read";
      for (size_t piece : {size_t(1), size_t(7), size_t(100), size_t(1000), n - 1}) {
        std::vector<float> got(n, -2.0f);
        for (size_t a = 0; a < n; a += piece) {
          ASSERT_TRUE((*hf)->read_range(int(i), a, std::min(piece, n - a), got.data() + a).is_ok());
        }
        ASSERT_EQ(std::memcmp(whole.data(), got.data(), n * 4), 0) << "pieces of " << piece;
      }
    }
  }
}

// Weights stream into their homes: the same losses bit for bit with every state on the device,
// in host memory, or on NVMe (params and optimizer; the master weights written whole or a
// 2048-element sub-group at a time), 1 step of 4 micro-batches on the bf16 fixture.
TEST(HfImport, TrainsBitIdenticallyWhereverTheWeightsLive) {
  std::vector<std::vector<double>> runs;
  Config last;
  for (std::string where : {"none", "cpu", "nvme", "nvme-pieces"}) {
    const std::string dir = test::temp_dir("strata_hf_train", where);
    fs::create_directories(dir + "/swap");
    const std::string sub_group = where == "nvme-pieces" ? "2048" : "1000000000";
    if (where == "nvme-pieces") where = "nvme";
    auto cfg = config_for(
        {{"from_pretrained", fixture("llama-bf16")}, {"context", 16}},
        {"train.checkpoint_dir=\"" + dir + "/ckpt\"", "train.steps=3", "train.eval_interval=0",
         "steps_per_print=1000", "device.memory_limit=\"64MiB\"",
         "zero_optimization.offload_param.device=\"" + where + "\"",
         "zero_optimization.offload_optimizer.device=\"" + where + "\"",
         "zero_optimization.offload_param.nvme_path=\"" + dir + "/swap\"",
         "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"",
         "zero_optimization.sub_group_size=" + sub_group});
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    TrainResult r = test::must_train(*cfg);
    ASSERT_EQ(r.losses.size(), 3u) << where;
    runs.push_back(r.losses);
    last = *cfg;
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    for (size_t s = 0; s < runs[0].size(); ++s) EXPECT_EQ(runs[i][s], runs[0][s]) << i << " " << s;
  }
  // Loaded, not random: the same shape from a random initialization starts elsewhere.
  last.model.from_pretrained.clear();
  last.train.checkpoint_dir = test::temp_dir("strata_hf_train", "random") + "/ckpt";
  TrainResult fresh = test::must_train(last);
  ASSERT_EQ(fresh.losses.size(), 3u);
  EXPECT_GT(std::fabs(fresh.losses[0] - runs[0][0]), 1e-3) << fresh.losses[0];
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// The tensors (name -> raw bytes, dtype, shape) of a checkpoint directory, whatever its layout.
std::map<std::string, std::string> tensor_bytes(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.size() < 12 || n.substr(n.size() - 12) != ".safetensors" || n == "reference.safetensors")
      continue;
    auto f = SafetensorsFile::open(e.path().string());
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    if (!f.is_ok()) continue;
    for (const SafetensorsTensor& t : (*f)->tensors()) {
      std::string b(t.bytes, '\0');
      EXPECT_TRUE((*f)->read(t, b.data()).is_ok());
      std::string shape;
      for (int64_t d : t.shape) shape += std::to_string(d) + ",";
      out[t.name] = std::string(dtype_name(t.dtype)) + "[" + shape + "]" + b;
    }
  }
  return out;
}

// Import then export without training: the same tensor bytes (bf16 -> fp32 -> bf16 is exact),
// in one file or in shards with an index, and a config.json that imports to the same model.
TEST(HfExport, ImportThenExportGivesTheSameTensorBytes) {
  for (uint64_t shard : {kHfShardBytes, uint64_t{40000}}) {
    const std::string src = fixture("llama-bf16");
    auto cfg = config_for({{"from_pretrained", src}});
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    ASSERT_EQ(cfg->model.dtype, DType::kBF16);
    auto arch = create_architecture(cfg->model);
    ASSERT_TRUE(arch.is_ok());
    auto reader = HfCheckpointReader::open(src, **arch);
    ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
    const std::string out = test::temp_dir("strata_hf_export", std::to_string(shard));
    HfExportOptions options;
    options.shard_bytes = shard;
    auto w = HfCheckpointWriter::create(out, cfg->model, **arch, options);
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    for (size_t m = 0; m < (*arch)->layout().modules.size(); ++m) {
      std::vector<float> master((*arch)->layout().modules[m].numel);
      ASSERT_TRUE((*reader)->read_module(int(m), master.data()).is_ok());
      ASSERT_TRUE((*w)->write_module(int(m), master.data()).is_ok());
    }
    ASSERT_TRUE((*w)->finish().is_ok());
    EXPECT_EQ(tensor_bytes(out), tensor_bytes(src));
    EXPECT_EQ(fs::exists(out + "/model.safetensors.index.json"), shard != kHfShardBytes);
    EXPECT_EQ(fs::exists(out + "/model.safetensors"), shard == kHfShardBytes);
    for (const auto& e : fs::directory_iterator(out)) {
      EXPECT_NE(e.path().extension(), ".tmp") << "a temporary was left: " << e.path();
    }
    // The exported config.json describes the same model.
    auto again = config_for({{"from_pretrained", out}});
    ASSERT_TRUE(again.is_ok()) << again.status().to_string();
    auto arch2 = create_architecture(again->model);
    ASSERT_TRUE(arch2.is_ok());
    EXPECT_EQ((*arch2)->shape_string(), (*arch)->shape_string());
  }
}

// Import -> train 3 steps -> train.export_dir: the exported tensors are the final checkpoint's
// master weights in the model dtype, for a Llama (from a sharded index) and a GPT-2 (Conv1D
// weights transposed back); `strata export` of the checkpoint writes the same bytes.
TEST(HfExport, TrainedWeightsExportAsTheCheckpointHoldsThem) {
  for (const char* name : {"llama", "gpt2"}) {
    const std::string dir = test::temp_dir("strata_hf_trained", name);
    fs::create_directories(dir + "/swap");
    auto cfg = config_for({{"from_pretrained", fixture(name)}, {"context", 16}},
                          {"train.checkpoint_dir=\"" + dir + "/ckpt\"", "train.steps=3",
                           "train.eval_interval=0", "steps_per_print=1000",
                           "device.memory_limit=\"64MiB\"", "train.export_dir=\"" + dir + "/hf\"",
                           "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\""});
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    TrainResult r = test::must_train(*cfg);
    ASSERT_FALSE(r.last_checkpoint.empty());
    auto arch = create_architecture(cfg->model);
    ASSERT_TRUE(arch.is_ok());
    const ModelLayout& lay = (*arch)->layout();
    std::vector<std::vector<float>> master(lay.modules.size());
    std::vector<CheckpointBuffers> bufs;
    for (size_t m = 0; m < lay.modules.size(); ++m) {
      master[m].resize(lay.modules[m].numel);
      bufs.push_back({master[m].data(), nullptr, nullptr, 4});
    }
    ASSERT_TRUE(read_checkpoint(r.last_checkpoint, bufs).is_ok());
    auto exported = tensor_bytes(dir + "/hf");
    size_t n = 0;
    for (size_t m = 0; m < lay.modules.size(); ++m) {
      for (const HfTensor& h : (*arch)->hf_tensors(int(m))) {
        const std::vector<float> v = hf_view(**arch, int(m), h, master[m]);
        std::string b(v.size() * 2, '\0');
        convert(v.data(), DType::kF32, b.data(), DType::kBF16, v.size());
        ASSERT_TRUE(exported.count(h.name)) << h.name;
        const std::string& e = exported[h.name];
        const std::string data = e.substr(e.find(']') + 1);
        EXPECT_EQ(data.substr(0, b.size()), b) << name << " " << h.name;
        EXPECT_EQ(e.rfind("bf16[", 0), 0u) << h.name;
        if (h.more_rows_ok) {
          // GPT-2's position table: the fixture's 32 rows, not model.context's 16; the rows past
          // the context are the fixture's, unchanged (in the model dtype).
          auto src = SafetensorsFile::open(fixture(name) + "/model.safetensors");
          ASSERT_TRUE(src.is_ok());
          const SafetensorsTensor* t = (*src)->find(h.name);
          ASSERT_NE(t, nullptr);
          ASSERT_EQ(t->shape[0], 32);
          EXPECT_EQ(e.substr(0, e.find(']') + 1), "bf16[32,32,]");
          std::vector<float> stored(t->numel());
          ASSERT_TRUE((*src)->read_as(*t, DType::kF32, stored.data()).is_ok());
          std::string tail((stored.size() - v.size()) * 2, '\0');
          convert(stored.data() + v.size(), DType::kF32, tail.data(), DType::kBF16,
                  stored.size() - v.size());
          EXPECT_EQ(data.substr(b.size()), tail);
        } else {
          EXPECT_EQ(data.size(), b.size()) << h.name;
        }
        ++n;
      }
    }
    EXPECT_EQ(n, exported.size());
    if (std::string(name) == "gpt2") {
      auto again = config_for({{"from_pretrained", dir + "/hf"}});
      ASSERT_TRUE(again.is_ok()) << again.status().to_string();
      EXPECT_EQ(again->model.context, 32) << "n_positions is the stored table's";
    }
    // The tokenizer and generation files of the fixture, byte for byte.
    int copied = 0;
    for (const char* f : kHfTokenizerFiles) {
      const std::string from = fixture(name) + "/" + f;
      if (!fs::exists(from)) continue;
      EXPECT_EQ(test::read_file(dir + "/hf/" + f), test::read_file(from)) << f;
      ++copied;
    }
    EXPECT_GE(copied, 3) << "the fixture's tokenizer.json, tokenizer_config.json and "
                            "generation_config.json (tools/make_hf_fixtures.py)";
    // The same through `strata export`'s function, from the run directory's checkpoint.
    ASSERT_TRUE(export_checkpoint(r.last_checkpoint, cfg->model, dir + "/hf2").is_ok());
    EXPECT_EQ(tensor_bytes(dir + "/hf2"), exported);
    EXPECT_EQ(test::read_file(dir + "/hf2/config.json"), test::read_file(dir + "/hf/config.json"));
  }
}

// --tokenizer naming a directory with no tokenizer is refused before anything is written.
TEST(HfExport, TokenizerDirectoryWithoutATokenizerIsRefused) {
  const std::string dir = test::temp_dir("strata_hf_export", "tokenizer");
  auto cfg = config_for({{"from_pretrained", fixture("llama")}});
  ASSERT_TRUE(cfg.is_ok());
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok());
  HfExportOptions options;
  options.tokenizer_dir = dir;
  auto w = HfCheckpointWriter::create(dir + "/hf", cfg->model, **arch, options);
  ASSERT_FALSE(w.is_ok());
  EXPECT_NE(w.status().message().find("no tokenizer.json, tokenizer.model or vocab.json"),
            std::string::npos)
      << w.status().message();
  EXPECT_FALSE(fs::exists(dir + "/hf"));
}

// A checkpoint of another shape is refused, naming both shapes.
TEST(HfExport, RefusesACheckpointOfAnotherModel) {
  const std::string dir = test::temp_dir("strata_hf_export", "shape");
  fs::create_directories(dir + "/swap");
  auto cfg = config_for({{"from_pretrained", fixture("llama3")}, {"context", 16}},
                        {"train.checkpoint_dir=\"" + dir + "/ckpt\"", "train.steps=1",
                         "train.eval_interval=0", "device.memory_limit=\"64MiB\"",
                         "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\""});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  TrainResult r = test::must_train(*cfg);
  auto other = config_for({{"from_pretrained", fixture("qwen2")}, {"context", 16}});
  ASSERT_TRUE(other.is_ok());
  Status st = export_checkpoint(r.last_checkpoint, other->model, dir + "/hf");
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("holds a model of shape"), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(dir + "/hf/config.json"));
}

// Vocabularies past 65,535 (Llama 3: 128,256): llm.c's uint32 token files (magic 20240801,
// version 7), as tools/prepare_data.py writes them; a short file is refused with the counts.
TEST(HfData, LlmcUint32TokenFiles) {
  const std::string dir = test::temp_dir("strata_hf_data", "u32");
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 5000; ++i) toks.push_back((i * 2654435761u) % 128256u);
  int32_t header[256] = {20240801, 7, int32_t(toks.size())};
  {
    std::ofstream f(dir + "/train.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(header), sizeof(header));
    f.write(reinterpret_cast<const char*>(toks.data()), std::streamsize(toks.size() * 4));
  }
  DataConfig dc;
  dc.source = dir + "/train.bin";
  auto d = Dataset::load(dc, 128256, 1);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_NE(d->description().find("llmc, 5000 tokens"), std::string::npos) << d->description();
  // A vocabulary that is too small names the token.
  auto small = Dataset::load(dc, 65536, 1);
  ASSERT_FALSE(small.is_ok());
  EXPECT_NE(small.status().message().find("outside model.vocab_size 65536"), std::string::npos);
  fs::resize_file(dc.source, 1024 + 4 * 4999 + 2);
  auto cut = Dataset::load(dc, 128256, 1);
  ASSERT_FALSE(cut.is_ok());
  EXPECT_NE(cut.status().message().find("the llm.c header says 5000 tokens"), std::string::npos)
      << cut.status().message();
  EXPECT_NE(cut.status().message().find("truncated"), std::string::npos);
}

}  // namespace
}  // namespace strata
