// LoRA over a frozen base (src/model/lora.h) against peft itself: the fixtures under
// tests/fixtures/hf/lora-<base>/ (tools/make_lora_fixtures.py: peft's adapter directory with
// random A and B, and what peft computes on the base fixture's tokens) are loaded into a model
// with the same lora section; strata's per-token losses must be peft's within 1e-5 (relative)
// and every adapter tensor's gradient within 1e-4 (norm of the difference over the norm), fp32.
// Then: lora_dropout's op against a scalar reference and a training pass against peft's with
// the same masks, and training through the tier manager: only the adapters change, on every
// placement, and a resumed run equals the uninterrupted one bit for bit (with dropout too). The
// lora section's own rules are lora_config_test.cc's.
#include "src/model/lora.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "src/checkpoint/checkpoint.h"
#include "src/hf/adapter_config.h"
#include "src/hf/hf_adapter.h"
#include "src/hf/hf_checkpoint.h"
#include "src/hf/safetensors.h"
#include "src/model/architecture.h"
#include "src/model/decoder.h"
#include "src/tiers/memory_model.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/log.h"
#include "tests/hf_test_util.h"
#include "tests/lora_util.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using test::fixture;
using test::fixture_lora;
using test::lora_config;
using test::rel_norm_diff;
const auto& read_all = test::read_safetensors_f32;

// One training micro-batch of `arch` (fp32) on the CPU backend: the base modules from
// `base_dir`, the adapters from `adapter_dir`, only the adapters bound with gradient buffers;
// `dropout_key` its MicroBatch's (0: no dropout, as in eval).
struct Pass1 {
  std::vector<float> losses;
  std::vector<std::vector<float>> grads;  // per module (empty for a frozen one)
};
Pass1 run_one(const Architecture& arch, const std::string& base_dir, const std::string& adapter_dir,
              int B, int T, const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
              uint64_t dropout_key = 0) {
  Pass1 r;
  auto hf = HfCheckpointReader::open(base_dir, arch);
  EXPECT_TRUE(hf.is_ok()) << hf.status().to_string();
  auto ad = HfAdapterReader::open(adapter_dir, arch);
  EXPECT_TRUE(ad.is_ok()) << ad.status().to_string();
  if (!hf.is_ok() || !ad.is_ok()) return r;
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
    std::vector<float> w(n);
    const bool adapter = lay.modules[i].trainable;
    EXPECT_TRUE(
        (adapter ? (*ad)->read_module(int(i), w.data()) : (*hf)->read_module(int(i), w.data()))
            .is_ok());
    void* p = *d.allocate(n * 4, "test.params");
    d.copy_h2d(s, p, w.data(), n * 4);
    float* g = nullptr;
    if (adapter) {
      g = static_cast<float*>(*d.allocate(n * 4, "test.grads"));
      d.memset_zero(s, g, n * 4);
    }
    EXPECT_TRUE(d.synchronize(s).is_ok());
    params.push_back(p);
    grads.push_back(g);
  }
  auto runner = arch.create_runner(d, B, T, DType::kF32, ActivationMode::kKeep, nullptr);
  EXPECT_TRUE(runner.is_ok()) << runner.status().to_string();
  if (!runner.is_ok()) return r;
  r.losses.resize(size_t(B) * T);
  const ModuleBindings bound{params, grads};
  const MicroBatch mb{1.0f / float(B * T), r.losses.data(), nullptr, nullptr, dropout_key};
  (*runner)->begin_batch(tokens.data(), targets.data());
  for (const ProgramOp& op : arch.program(Pass::kTrain).ops) {
    // The program never asks for a frozen module's gradients.
    if (op.kind == ProgramOp::kAcquireGrads) {
      EXPECT_TRUE(lay.modules[size_t(op.module)].trainable);
    }
    if (op.kind == ProgramOp::kCompute) (*runner)->compute(op, bound, mb);
  }
  EXPECT_TRUE(d.synchronize(s).is_ok());
  for (size_t i = 0; i < lay.modules.size(); ++i) {
    std::vector<float> g;
    if (grads[i]) {
      g.resize(lay.modules[i].numel);
      d.copy_d2h(s, g.data(), grads[i], g.size() * 4);
    }
    r.grads.push_back(std::move(g));
  }
  EXPECT_TRUE(d.synchronize(s).is_ok());
  runner->reset();
  for (size_t i = 0; i < params.size(); ++i) {
    d.release(const_cast<void*>(params[i]));
    if (grads[i]) d.release(grads[i]);
  }
  return r;
}

class PeftCompare : public ::testing::TestWithParam<const char*> {};

TEST_P(PeftCompare, LossAndAdapterGradientsMatchPeft) {
  const std::string name = GetParam(), base = test::fixture_base(name);
  const std::string adir = fixture("lora-" + name);
  auto ref = read_all(adir + "/reference.safetensors");
  auto base_ref = read_all(fixture(base) + "/reference.safetensors");
  ASSERT_TRUE(ref.count("loss") && base_ref.count("tokens"));
  const int T = 16, B = int(base_ref["tokens"].size()) / T;
  auto cfg = lora_config(fixture(base), fixture_lora(name));
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  ASSERT_NE((*arch)->lora(), nullptr);
  std::vector<int32_t> tok(size_t(B) * T), tgt(size_t(B) * T);
  for (size_t i = 0; i < tok.size(); ++i) {
    tok[i] = int32_t(base_ref["tokens"][i]);
    tgt[i] = int32_t(base_ref["targets"][i]);
  }
  Pass1 r = run_one(**arch, fixture(base), adir, B, T, tok, tgt);
  ASSERT_EQ(r.losses.size(), ref["losses"].size());
  double mean = 0;
  for (size_t i = 0; i < r.losses.size(); ++i) {
    EXPECT_NEAR(r.losses[i], ref["losses"][i], 1e-5 * std::fabs(ref["losses"][i]) + 1e-7)
        << name << " token " << i;
    mean += r.losses[i];
  }
  mean /= double(r.losses.size());
  EXPECT_NEAR(mean, ref["loss"][0], 1e-5 * ref["loss"][0]);
  // The adapters move the loss: the base's own differs.
  EXPECT_GT(std::fabs(mean - base_ref["loss"][0]), 1e-3);
  size_t compared = 0;
  const ModelLayout& lay = (*arch)->layout();
  for (size_t m = 0; m < lay.modules.size(); ++m) {
    for (const HfTensor& h : (*arch)->hf_adapter_tensors(int(m))) {
      const std::string key = "grad." + h.name;
      ASSERT_TRUE(ref.count(key)) << "no peft gradient for " << h.name;
      const TensorSpec& t = lay.modules[m].tensors[size_t(h.tensor)];
      std::vector<float> g(r.grads[m].begin() + long(t.offset),
                           r.grads[m].begin() + long(t.offset + t.numel));
      ASSERT_EQ(g.size(), ref[key].size()) << key;
      EXPECT_LT(rel_norm_diff(g, ref[key]), 1e-4) << name << " " << key;
      ++compared;
    }
  }
  size_t want = 0;
  for (const auto& [k, v] : ref) want += k.rfind("grad.", 0) == 0;
  EXPECT_EQ(compared, want) << "strata and peft adapt different layers";
}

// The mixtures: the attention's adapters (and Qwen2-MoE's shared expert's), the router and the
// experts frozen, gradients of the loss plus the router's auxiliary loss; then (-experts) with
// adapters on the routed experts' fused parameters too (peft's target_parameters), the router
// frozen.
INSTANTIATE_TEST_SUITE_P(Fixtures, PeftCompare,
                         ::testing::Values("llama", "qwen2", "qwen3", "phi3", "gpt2", "mixtral",
                                           "qwen2-moe", "qwen3-moe", "mixtral-experts",
                                           "qwen2-moe-experts"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           std::string n = i.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

// Training with lora_dropout against peft: tests/fixtures/hf/lora-llama/reference_dropout
// .safetensors is peft's loss and adapter gradients with each adapter's dropout drawing strata's
// mask (tools/make_lora_fixtures.py: dropout_uniform of lora_dropout_key(0x5EED1234, block,
// site)), so this checks everything around the draw — which input is dropped, the 1 / (1 - p)
// scaling, the backward through the mask — against peft's own arithmetic.
TEST(LoraDropout, TrainingPassMatchesPeftWithTheSameMasks) {
  const std::string adir = fixture("lora-llama");
  auto ref = read_all(adir + "/reference_dropout.safetensors");
  auto plain = read_all(adir + "/reference.safetensors");
  auto base_ref = read_all(fixture("llama") + "/reference.safetensors");
  ASSERT_TRUE(ref.count("loss") && base_ref.count("tokens"));
  const int T = 16, B = int(base_ref["tokens"].size()) / T;
  json lora = fixture_lora("llama");
  lora["lora_dropout"] = 0.1;
  auto cfg = lora_config(fixture("llama"), lora);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  std::vector<int32_t> tok(size_t(B) * T), tgt(size_t(B) * T);
  for (size_t i = 0; i < tok.size(); ++i) {
    tok[i] = int32_t(base_ref["tokens"][i]);
    tgt[i] = int32_t(base_ref["targets"][i]);
  }
  Pass1 r = run_one(**arch, fixture("llama"), adir, B, T, tok, tgt, 0x5EED1234);
  ASSERT_EQ(r.losses.size(), ref["losses"].size());
  for (size_t i = 0; i < r.losses.size(); ++i) {
    EXPECT_NEAR(r.losses[i], ref["losses"][i], 1e-5 * std::fabs(ref["losses"][i]) + 1e-7)
        << "token " << i;
  }
  EXPECT_GT(std::fabs(ref["loss"][0] - plain["loss"][0]), 1e-3);  // the masks move the loss
  size_t compared = 0;
  const ModelLayout& lay = (*arch)->layout();
  for (size_t m = 0; m < lay.modules.size(); ++m) {
    for (const HfTensor& h : (*arch)->hf_adapter_tensors(int(m))) {
      const std::string key = "grad." + h.name;
      ASSERT_TRUE(ref.count(key)) << "no peft gradient for " << h.name;
      const TensorSpec& t = lay.modules[m].tensors[size_t(h.tensor)];
      std::vector<float> g(r.grads[m].begin() + long(t.offset),
                           r.grads[m].begin() + long(t.offset + t.numel));
      EXPECT_LT(rel_norm_diff(g, ref[key]), 1e-4) << key;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 28u);
}

// A section with lora_dropout computes peft's numbers (dropout off, as peft's eval()) when the
// micro-batch has no dropout key (eval, generate), and other ones in training.
TEST(LoraDropout, OnlyTrainingDropsTheAdaptersInput) {
  auto ref = read_all(fixture("lora-llama") + "/reference.safetensors");
  auto base_ref = read_all(fixture("llama") + "/reference.safetensors");
  const int T = 16, B = int(base_ref["tokens"].size()) / T;
  json lora = fixture_lora("llama");
  lora["lora_dropout"] = 0.1;
  auto cfg = lora_config(fixture("llama"), lora);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto arch = create_architecture(cfg->model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  std::vector<int32_t> tok(size_t(B) * T), tgt(size_t(B) * T);
  for (size_t i = 0; i < tok.size(); ++i) {
    tok[i] = int32_t(base_ref["tokens"][i]);
    tgt[i] = int32_t(base_ref["targets"][i]);
  }
  const Pass1 eval = run_one(**arch, fixture("llama"), fixture("lora-llama"), B, T, tok, tgt);
  ASSERT_EQ(eval.losses.size(), ref["losses"].size());
  for (size_t i = 0; i < eval.losses.size(); ++i) {
    EXPECT_NEAR(eval.losses[i], ref["losses"][i], 1e-5 * std::fabs(ref["losses"][i]) + 1e-7);
  }
  const uint64_t key = training_dropout_key(1234, 0, 0, 0);
  const Pass1 a = run_one(**arch, fixture("llama"), fixture("lora-llama"), B, T, tok, tgt, key);
  const Pass1 b = run_one(**arch, fixture("llama"), fixture("lora-llama"), B, T, tok, tgt, key);
  EXPECT_NE(a.losses, eval.losses);
  EXPECT_EQ(a.losses, b.losses);  // the key decides the masks
  EXPECT_EQ(a.grads, b.grads);
}

// Two sites on one packed matmul of width 10 (columns [2, 6) and [6, 9)), N = 6 rows of 8
// inputs, r = 2, fp32: lora_forward and lora_backward against double loops that draw the same
// masks (dropout_uniform of lora_dropout_key); then the same with key 0 (eval): no dropout.
TEST(LoraDropout, ForwardAndBackwardMatchAScalarReference) {
  const int N = 6, C = 8, W = 10, r = 2;
  LoraLayout L;
  L.r = r;
  L.scaling = 1.5f;
  L.dropout = 0.3f;
  L.max_width = W;
  L.max_in = C;
  for (auto [name, out, col0] : {std::tuple{"x.q", 4, 2}, std::tuple{"x.v", 3, 6}}) {
    LoraLayout::Target t;
    t.site = {name, 0, C, out, col0, W, "w"};
    t.a = L.numel;
    L.numel += size_t(r * C);
    t.b = L.numel;
    L.numel += size_t(out * r);
    L.targets.push_back(t);
  }
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> U(-1, 1);
  auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = U(gen);
    return v;
  };
  const std::vector<float> x = random(N * C), y0 = random(N * W), dy = random(N * W),
                           params = random(L.numel);
  CpuDeviceOptions o;
  o.capacity = size_t{16} << 20;
  auto dev = create_cpu_device(o);
  ASSERT_TRUE(dev.is_ok());
  Device& d = **dev;
  Stream& s = d.compute_stream();
  auto put = [&](const std::vector<float>& v) {
    void* p = *d.allocate(v.size() * 4, "test");
    d.copy_h2d(s, p, v.data(), v.size() * 4);
    EXPECT_TRUE(d.synchronize(s).is_ok());  // the copy reads `v`, which may be a temporary
    return p;
  };
  for (const uint64_t key : {uint64_t{0x1234567}, uint64_t{0}}) {
    SCOPED_TRACE(key);
    void* dx_ = put(std::vector<float>(N * C, 0.0f));
    void* y_ = put(y0);
    void* x_ = put(x);
    void* dy_ = put(dy);
    void* p_ = put(params);
    float* g_ = static_cast<float*>(put(std::vector<float>(L.numel, 0.0f)));
    LoraRun run;
    run.layout = &L;
    Carver measure(nullptr);
    run.carve(measure, N, 4);
    char* arena = static_cast<char*>(*d.allocate(measure.used(), "test.arena"));
    Carver carver(arena);
    run.carve(carver, N, 4);
    run.p = p_;
    run.g = g_;
    DecoderStep st;
    st.B = 2;
    st.T = 3;
    st.dt = DType::kF32;
    st.dev = &d;
    st.k = &d.kernels();
    st.s = &s;
    st.layer = 3;
    st.dropout_key = key;
    st.lora = &run;
    lora_forward(st, run, 0, x_, y_);
    lora_backward(st, run, 0, x_, dy_, dx_);
    std::vector<float> y(N * W), dx(N * C), g(L.numel);
    d.copy_d2h(s, y.data(), y_, y.size() * 4);
    d.copy_d2h(s, dx.data(), dx_, dx.size() * 4);
    d.copy_d2h(s, g.data(), g_, g.size() * 4);
    ASSERT_TRUE(d.synchronize(s).is_ok());
    // The reference.
    std::vector<double> yr(y0.begin(), y0.end()), dxr(N * C, 0.0), gr(L.numel, 0.0);
    size_t dropped = 0;
    for (size_t i = 0; i < L.targets.size(); ++i) {
      const LoraLayout::Target& t = L.targets[i];
      const float* A = params.data() + t.a;
      const float* B = params.data() + t.b;
      std::vector<double> m(N * C, 1.0);
      if (key != 0) {
        const uint64_t k = lora_dropout_key(key, 3, int(i));
        for (int e = 0; e < N * C; ++e) {
          m[e] = dropout_uniform(k, size_t(e)) >= L.dropout ? 1.0 / (1.0 - L.dropout) : 0.0;
          dropped += m[e] == 0;
        }
      }
      for (int n = 0; n < N; ++n) {
        std::vector<double> u(r, 0.0), du(r, 0.0);
        for (int k = 0; k < r; ++k)
          for (int c = 0; c < C; ++c) u[k] += double(A[k * C + c]) * m[n * C + c] * x[n * C + c];
        for (int o2 = 0; o2 < t.site.out; ++o2) {
          const size_t col = size_t(n * W + t.site.col0 + o2);
          for (int k = 0; k < r; ++k) {
            yr[col] += L.scaling * double(B[o2 * r + k]) * u[k];
            gr[t.b + size_t(o2 * r + k)] += L.scaling * double(dy[col]) * u[k];
            du[k] += L.scaling * double(dy[col]) * double(B[o2 * r + k]);
          }
        }
        for (int k = 0; k < r; ++k) {
          for (int c = 0; c < C; ++c) {
            gr[t.a + size_t(k * C + c)] += du[k] * m[n * C + c] * x[n * C + c];
            dxr[size_t(n * C + c)] += m[n * C + c] * du[k] * double(A[k * C + c]);
          }
        }
      }
    }
    if (key != 0) {
      // p = 0.3 of 96 elements per site: some dropped, most kept.
      EXPECT_GT(dropped, 20u);
      EXPECT_LT(dropped, 100u);
    }
    auto near = [](const std::vector<float>& got, const std::vector<double>& want,
                   const char* what) {
      for (size_t e = 0; e < got.size(); ++e) {
        EXPECT_NEAR(got[e], want[e], 1e-5 * (1 + std::fabs(want[e]))) << what << "[" << e << "]";
      }
    };
    near(y, yr, "y");
    near(dx, dxr, "dx");
    near(g, gr, "grad");
    for (void* q : {dx_, y_, x_, dy_, p_, static_cast<void*>(g_), static_cast<void*>(arena)}) {
      d.release(q);
    }
  }
}

// ---- training: only the adapters move ------------------------------------------------------

// The llama fixture with every block linear layer adapted (or LoRA fixture `name`'s base with
// its lora section), trained `steps` steps from the fixture's weights with checkpoints in `dir`,
// then `extra`.
Config lora_run(const std::string& dir, int steps, std::vector<std::string> extra = {},
                const std::string& name = "llama") {
  fs::create_directories(dir + "/swap");
  std::vector<std::string> ov = {
      "train.checkpoint_dir=\"" + dir + "/ckpt\"",
      "train.steps=" + std::to_string(steps),
      "train.eval_interval=0",
      "steps_per_print=1000",
      "train_batch_size=4",
      "train_micro_batch_size_per_gpu=2",
      "gradient_accumulation_steps=2",
      "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"",
      "zero_optimization.offload_param.nvme_path=\"" + dir + "/swap\"",
      "optimizer.params.lr=1e-2",
      "data.synthetic_tokens=20000"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  auto cfg = lora_config(fixture(test::fixture_base(name)), fixture_lora(name), ov);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  return cfg.is_ok() ? *cfg : Config{};
}

TEST(LoraTrain, TheBaseHasNoOptimizerStateAndEveryPlacementTrainsAlike) {
  const std::string dir = test::temp_dir("strata_lora", "placements");
  // The memory model: a frozen module has parameters only.
  const Config c0 = lora_run(dir + "/a", 8);
  auto arch = create_architecture(c0.model);
  ASSERT_TRUE(arch.is_ok()) << arch.status().to_string();
  auto homes = module_homes((*arch)->layout(), Placement{}, 1, DType::kF32, DType::kF32, false, 0);
  ASSERT_TRUE(homes.is_ok());
  size_t adapters = 0;
  for (size_t m = 0; m < homes->size(); ++m) {
    const ModuleHomes& h = (*homes)[m];
    const bool trainable = (*arch)->layout().modules[m].trainable;
    EXPECT_EQ(trainable, h.name.rfind("lora.", 0) == 0) << h.name;
    EXPECT_EQ(h.params.bytes, h.numel * 4) << h.name;
    EXPECT_EQ(h.master.bytes, trainable ? h.numel * 4 : 0) << h.name;
    EXPECT_EQ(h.moments.bytes, trainable ? h.numel * 8 : 0) << h.name;
    EXPECT_EQ(h.grads.bytes, trainable ? h.numel * 4 : 0) << h.name;
    adapters += trainable;
  }
  EXPECT_EQ(adapters, 2u);  // one per block
  // The same losses whether the base and the adapters' state live on the device, in host
  // memory or on NVMe; the loss falls; the checkpoint holds the adapters only.
  const std::vector<std::vector<std::string>> placements = {
      {"zero_optimization.offload_param.device=\"none\"",
       "zero_optimization.offload_optimizer.device=\"none\"", "device.memory_limit=\"64MiB\""},
      {"zero_optimization.offload_param.device=\"cpu\"",
       "zero_optimization.offload_optimizer.device=\"cpu\""},
      {"zero_optimization.offload_param.device=\"nvme\"",
       "zero_optimization.offload_optimizer.device=\"nvme\"", "aio.backend=\"posix\""},
  };
  std::vector<double> first;
  for (size_t i = 0; i < placements.size(); ++i) {
    std::vector<std::string> ov = placements[i];
    ov.insert(ov.end(), {"train.eval_interval=16", "data.eval_batches=4"});
    const TrainResult r = test::must_train(lora_run(dir + "/p" + std::to_string(i), 16, ov));
    ASSERT_EQ(r.losses.size(), 16u);
    ASSERT_EQ(r.eval_losses.size(), 2u);  // at steps 0 and 16
    EXPECT_LT(r.eval_losses[1].second, r.eval_losses[0].second - 0.05)
        << "placement " << i << " " << ::testing::PrintToString(r.eval_losses);
    if (i == 0) {
      first = r.losses;
    } else {
      EXPECT_EQ(r.losses, first) << "placement " << i;
    }
    auto meta = read_checkpoint_meta(r.last_checkpoint);
    ASSERT_TRUE(meta.is_ok()) << meta.status().to_string();
    for (const CheckpointModule& m : meta->modules) {
      EXPECT_EQ(m.numel == 0, m.name.rfind("lora.", 0) != 0) << m.name;
    }
  }
}

// With `extra` (lora_dropout's too): 12 steps whole, and 6 + 6 resumed from the checkpoint.
std::vector<double> resumed_equals_whole(const std::string& dir,
                                         const std::vector<std::string>& extra,
                                         const std::string& name = "llama") {
  const TrainResult whole = test::must_train(lora_run(dir + "/whole", 12, extra, name));
  TrainOptions stop;
  stop.stop_at_step = 6;
  const TrainResult a = test::must_train(lora_run(dir + "/half", 12, extra, name), stop);
  EXPECT_EQ(a.losses.size(), 6u);
  TrainOptions o;
  o.resume = "latest";
  const TrainResult b = test::must_train(lora_run(dir + "/half", 12, extra, name), o);
  std::vector<double> joined = a.losses;
  joined.insert(joined.end(), b.losses.begin(), b.losses.end());
  EXPECT_EQ(joined, whole.losses);
  EXPECT_EQ(b.weights_crc, whole.weights_crc);
  return whole.losses;
}

TEST(LoraTrain, AResumedRunEqualsTheUninterruptedOne) {
  resumed_equals_whole(test::temp_dir("strata_lora", "resume"), {});
}

// lora_dropout's masks are a function of the seed, the step, the micro-batch and the site: a
// resumed run draws the uninterrupted run's, bit for bit; recomputing the blocks in backward
// draws the forward's again; and the dropout is in effect (other losses than without it).
TEST(LoraTrain, WithDropoutAResumedRunEqualsTheUninterruptedOne) {
  const std::string dir = test::temp_dir("strata_lora", "resume_dropout");
  const std::vector<double> plain = resumed_equals_whole(dir + "/plain", {});
  const std::vector<double> dropped =
      resumed_equals_whole(dir + "/dropout", {"lora.lora_dropout=0.1"});
  ASSERT_EQ(plain.size(), dropped.size());
  // Step 0's loss is the base's (B starts at zero); the later ones move with the masks.
  EXPECT_EQ(plain[0], dropped[0]);
  EXPECT_NE(plain.back(), dropped.back()) << ::testing::PrintToString(plain) << "\n"
                                          << ::testing::PrintToString(dropped);
  const TrainResult recompute = test::must_train(lora_run(
      dir + "/recompute", 12, {"lora.lora_dropout=0.1", "strata.activations=\"recompute\""}));
  EXPECT_EQ(recompute.losses, dropped);
}

// The routed experts' adapters (lora-mixtral-experts' section) train: other losses than the
// attention's adapters alone, the same whether the blocks are kept, recomputed in backward or
// streamed from NVMe, and a resumed run equals the uninterrupted one bit for bit.
TEST(LoraTrain, MixtureExpertsTrainAlikeOnEveryPlacementAndResumeExactly) {
  const std::string dir = test::temp_dir("strata_lora", "experts");
  const std::string name = "mixtral-experts";
  const std::vector<double> whole = resumed_equals_whole(dir + "/resume", {}, name);
  const TrainResult attention =
      test::must_train(lora_run(dir + "/attention", 12, {"lora.target_parameters=[]"}, name));
  ASSERT_EQ(attention.losses.size(), whole.size());
  EXPECT_EQ(attention.losses[0], whole[0]);  // both Bs start at zero
  EXPECT_NE(attention.losses.back(), whole.back()) << ::testing::PrintToString(whole);
  const std::vector<std::vector<std::string>> placements = {
      {"strata.activations=\"recompute\""},
      {"zero_optimization.offload_param.device=\"nvme\"",
       "zero_optimization.offload_optimizer.device=\"nvme\"", "aio.backend=\"posix\""},
  };
  for (size_t i = 0; i < placements.size(); ++i) {
    const TrainResult r =
        test::must_train(lora_run(dir + "/p" + std::to_string(i), 12, placements[i], name));
    EXPECT_EQ(r.losses, whole) << "placement " << i;
  }
}

// Every budget the preflight accepts trains: the tiny Qwen2-MoE with adapters at the least
// device.memory_limit and strata.host_memory_limit its preflight accepts (and 64 KiB above),
// in the placements whose needs had missed a piece. Every module of the fixture is under
// stage3_param_persistence_threshold, so its copy stays cached on the device once fetched; the
// frozen base is initialized through a piece of fp32 values even with its parameters in host
// memory; and with gradients on NVMe only the adapters have accumulators there, whose
// sub-groups (not the frozen base's modules) size the gradients' staging.
TEST(LoraTrain, EveryBudgetThePreflightAcceptsTrains) {
  set_log_level(LogLevel::kError);
  const std::string dir = test::temp_dir("strata_lora", "least_budget");
  const std::vector<std::string> host = {"zero_optimization.offload_param.device=\"cpu\"",
                                         "zero_optimization.offload_optimizer.device=\"cpu\""};
  std::vector<std::string> grads_nvme = {"zero_optimization.offload_param.device=\"cpu\"",
                                         "zero_optimization.offload_optimizer.device=\"nvme\"",
                                         "strata.placement.grads=\"nvme\"",
                                         "aio.backend=\"posix\""};
  struct Case {
    const char* name;
    const char* key;
    size_t unit;
    std::vector<std::string> ov;
  };
  const std::vector<Case> cases = {
      {"device", "device.memory_limit", 256, host},
      {"host", "strata.host_memory_limit", 4096, host},
      {"grads_nvme", "strata.host_memory_limit", 4096, grads_nvme},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto make = [&](size_t budget, int steps) {
      std::vector<std::string> ov = c.ov;
      ov.push_back(fmt::format("{}={}", c.key, budget));
      return lora_run(fmt::format("{}/{}/{}-{}", dir, c.name, budget, steps), steps, ov,
                      "qwen2-moe");
    };
    const size_t least = test::least_accepted_budget([&](size_t budget) { return make(budget, 1); },
                                                     4096, size_t{256} << 20, c.unit);
    for (size_t budget : {least, least + (64 << 10)}) {
      SCOPED_TRACE(fmt::format("{} {}", c.key, budget));
      const TrainResult r = test::must_train(make(budget, 3));
      EXPECT_EQ(r.losses.size(), 3u);
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
