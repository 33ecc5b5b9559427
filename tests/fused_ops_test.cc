// The fused elementwise ops (KernelOp::kResidualNorm, kMatmulBackwardGelu) on the CPU backend:
// each is the unfused calls it replaces, bit for bit (what keeps the golden curves where they
// are), through the kernel table and through a KernelsWrapper; the simulated device's answers;
// and GPT-2 and Llama training steps with the fused ops against the same steps with the
// fallbacks, loss for loss.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/device_wrapper.h"
#include "strata/kernels.h"
#include "strata/kernels_wrapper.h"
#include "strata/log.h"
#include "tests/kernel_test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

using namespace kernel_test;

// Fills a buffer with bytes no op writes by accident (a NaN pattern in every dtype), so that an
// output the fused op leaves unwritten shows up.
void poison(Typed& t) { std::memset(t.data(), 0xff, t.n * dtype_size(t.dt)); }

std::vector<float> floats_of(const Typed& t) {
  std::vector<float> v(t.n);
  for (size_t i = 0; i < t.n; ++i) v[i] = t.get(i);
  return v;
}

// residual_layernorm_forward == residual_forward, then layernorm_forward on its output; also
// with res in place of a (decode's x = x + mlp_out), and through a KernelsWrapper.
TEST(FusedOps, ResidualLayerNormIsTheTwoCallsBitForBit) {
  const int N = 37, C = 200;
  for (DType dt : kAllTypes) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(fmt::format("{} in_place={}", dtype_name(dt), in_place));
      std::mt19937_64 rng(test_seed(31));
      const size_t n = size_t(N) * C;
      Typed a = random_typed(dt, n, rng, -2, 2), b = random_typed(dt, n, rng, -2, 2);
      Typed w = random_typed(dt, C, rng), bias = random_typed(dt, C, rng);
      Typed res(dt, n), out(dt, n), res2(dt, n), out2(dt, n), a2 = a;
      std::vector<float> mean(N, -1), rstd(N, -1), mean2(N, -2), rstd2(N, -2);
      poison(res);
      poison(out);
      Fixture f;
      KernelsWrapper wrapper(&f.k());
      ASSERT_TRUE(wrapper.supports(KernelOp::kResidualNorm, {.dt = dt, .N = N, .C = C}));
      void* r = in_place ? a2.data() : res.data();
      wrapper.residual_layernorm_forward(f.s(), dt, r, out.data(), mean.data(), rstd.data(),
                                         in_place ? a2.data() : a.data(), b.data(), w.data(),
                                         bias.data(), N, C);
      f.k().residual_forward(f.s(), dt, res2.data(), a.data(), b.data(), n);
      f.k().layernorm_forward(f.s(), dt, out2.data(), mean2.data(), rstd2.data(), res2.data(),
                              w.data(), bias.data(), N, C);
      f.sync();
      EXPECT_EQ(in_place ? a2.bytes : res.bytes, res2.bytes);
      EXPECT_EQ(out.bytes, out2.bytes);
      EXPECT_EQ(mean, mean2);
      EXPECT_EQ(rstd, rstd2);
    }
  }
}

TEST(FusedOps, ResidualRmsNormIsTheTwoCallsBitForBit) {
  const int N = 41, C = 96;
  const float eps = 1e-6f;
  for (DType dt : kAllTypes) {
    SCOPED_TRACE(dtype_name(dt));
    std::mt19937_64 rng(test_seed(32));
    const size_t n = size_t(N) * C;
    Typed a = random_typed(dt, n, rng, -2, 2), b = random_typed(dt, n, rng, -2, 2);
    Typed w = random_typed(dt, C, rng);
    Typed res(dt, n), out(dt, n), res2(dt, n), out2(dt, n);
    std::vector<float> rstd(N, -1), rstd2(N, -2);
    poison(res);
    poison(out);
    Fixture f;
    ASSERT_TRUE(f.k().supports(KernelOp::kResidualNorm, {.dt = dt, .N = N, .C = C}));
    KernelsWrapper wrapper(&f.k());
    wrapper.residual_rmsnorm_forward(f.s(), dt, res.data(), out.data(), rstd.data(), a.data(),
                                     b.data(), w.data(), eps, N, C);
    f.k().residual_forward(f.s(), dt, res2.data(), a.data(), b.data(), n);
    f.k().rmsnorm_forward(f.s(), dt, out2.data(), rstd2.data(), res2.data(), w.data(), eps, N, C);
    f.sync();
    EXPECT_EQ(res.bytes, res2.bytes);
    EXPECT_EQ(out.bytes, out2.bytes);
    EXPECT_EQ(rstd, rstd2);
  }
}

// matmul_backward_gelu == matmul_backward into a zeroed buffer, then gelu_backward into a zeroed
// dpre (GPT-2's MLP backward before the fusion). dpre starts as garbage: it is written, not
// accumulated; the weight and bias gradients accumulate onto what they hold.
TEST(FusedOps, MatmulBackwardGeluIsTheTwoCallsBitForBit) {
  const int N = 37, C = 160, OC = 48;  // C: the GELU's width (4x the MLP's OC in GPT-2)
  for (DType dt : kAllTypes) {
    for (int grads = 0; grads < 3; ++grads) {  // weight and bias; weight only; frozen (neither)
      SCOPED_TRACE(fmt::format("{} grads={}", dtype_name(dt), grads));
      std::mt19937_64 rng(test_seed(33));
      Typed dout = random_typed(dt, size_t(N) * OC, rng),
            inp = random_typed(dt, size_t(N) * C, rng);
      Typed w = random_typed(dt, size_t(OC) * C, rng);
      Typed pre = random_typed(dt, size_t(N) * C, rng, -4, 4);
      const std::vector<float> dw0 = random_f32(size_t(OC) * C, rng), db0 = random_f32(OC, rng);
      std::vector<float> dw = dw0, db = db0, dw2 = dw0, db2 = db0;
      float* pdw = grads < 2 ? dw.data() : nullptr;
      float* pdb = grads == 0 ? db.data() : nullptr;
      float* pdw2 = grads < 2 ? dw2.data() : nullptr;
      float* pdb2 = grads == 0 ? db2.data() : nullptr;
      Typed dpre = random_typed(dt, size_t(N) * C, rng), t(dt, dpre.n), dpre2(dt, dpre.n);
      Fixture f;
      ASSERT_TRUE(
          f.k().supports(KernelOp::kMatmulBackwardGelu, {.dt = dt, .N = N, .C = C, .OC = OC}));
      KernelsWrapper wrapper(&f.k());
      wrapper.matmul_backward_gelu(f.s(), dt, dpre.data(), pdw, pdb, dout.data(), inp.data(),
                                   w.data(), pre.data(), N, C, OC);
      f.k().matmul_backward(f.s(), dt, t.data(), pdw2, pdb2, dout.data(), inp.data(), w.data(), N,
                            C, OC, /*accumulate=*/true);
      f.k().gelu_backward(f.s(), dt, dpre2.data(), pre.data(), t.data(), t.n);
      f.sync();
      EXPECT_EQ(dpre.bytes, dpre2.bytes);
      EXPECT_EQ(dw, dw2);
      EXPECT_EQ(db, db2);
      if (grads < 2) {
        EXPECT_NE(dw, dw0);  // the weight gradient did move
      }
      // gelu' applied: dpre differs from the plain input gradient wherever gelu'(pre) != 1.
      EXPECT_NE(floats_of(dpre), floats_of(t));
    }
  }
}

// The simulated device answers as the CUDA backend: the residual norm everywhere, the DGELU
// epilogue where the GELU's width is a multiple of 8 (its aux matrix's leading dimension).
TEST(FusedOps, SimulatedDeviceAnswersAsTheCudaBackend) {
  auto preset = simulated_device_preset("h200");
  ASSERT_TRUE(preset.is_ok()) << preset.status().to_string();
  auto sim = create_simulated_device({.capacity = size_t{1} << 20, .threads = 1}, *preset);
  ASSERT_TRUE(sim.is_ok()) << sim.status().to_string();
  Kernels& k = (*sim)->kernels();
  EXPECT_TRUE(k.supports(KernelOp::kResidualNorm, {.dt = DType::kBF16, .N = 8, .C = 77}));
  EXPECT_TRUE(k.supports(KernelOp::kMatmulBackwardGelu,
                         {.dt = DType::kBF16, .N = 8, .C = 3072, .OC = 768}));
  const KernelSupport no =
      k.supports(KernelOp::kMatmulBackwardGelu, {.dt = DType::kBF16, .N = 8, .C = 100, .OC = 25});
  EXPECT_FALSE(no.supported);
  EXPECT_NE(no.path.find("multiple of 8"), std::string::npos) << no.path;
}

// --- whole training steps ----------------------------------------------------------------------

// Counts the fused calls, or (fused false) answers no for every fused elementwise op so that the
// models take their fallbacks.
class FusionSwitch final : public KernelsWrapper {
 public:
  FusionSwitch(Kernels& inner, bool fused, std::shared_ptr<std::atomic<long>> calls)
      : KernelsWrapper(&inner), fused_(fused), calls_(std::move(calls)) {}

  KernelSupport supports(KernelOp op, const OpShape& shape) const override {
    const bool elementwise = op == KernelOp::kResidualNorm || op == KernelOp::kMatmulBackwardGelu ||
                             op == KernelOp::kMatmulGelu;
    if (elementwise && !fused_) return {false, "fused ops turned off by the test"};
    return KernelsWrapper::supports(op, shape);
  }
  void matmul_backward_gelu(Stream& s, DType dt, void* dpre, float* dweight, float* dbias,
                            const void* dout, const void* inp, const void* weight, const void* pre,
                            int N, int C, int OC) override {
    calls_->fetch_add(1);
    KernelsWrapper::matmul_backward_gelu(s, dt, dpre, dweight, dbias, dout, inp, weight, pre, N, C,
                                         OC);
  }
  void residual_layernorm_forward(Stream& s, DType dt, void* res, void* out, float* mean,
                                  float* rstd, const void* a, const void* b, const void* weight,
                                  const void* bias, int N, int C) override {
    calls_->fetch_add(1);
    KernelsWrapper::residual_layernorm_forward(s, dt, res, out, mean, rstd, a, b, weight, bias, N,
                                               C);
  }
  void residual_rmsnorm_forward(Stream& s, DType dt, void* res, void* out, float* rstd,
                                const void* a, const void* b, const void* weight, float eps, int N,
                                int C) override {
    calls_->fetch_add(1);
    KernelsWrapper::residual_rmsnorm_forward(s, dt, res, out, rstd, a, b, weight, eps, N, C);
  }

 private:
  const bool fused_;
  std::shared_ptr<std::atomic<long>> calls_;
};

class FusionDevice final : public DeviceWrapper {
 public:
  FusionDevice(std::unique_ptr<Device> inner, bool fused, std::shared_ptr<std::atomic<long>> calls)
      : DeviceWrapper(std::move(inner)), kernels_(wrapped().kernels(), fused, std::move(calls)) {}
  Kernels& kernels() override { return kernels_; }

 private:
  FusionSwitch kernels_;
};

// A tiny model trained for a few steps (two micro-batches each, recomputed activations: the
// backward reruns the blocks' forwards), then `extra` overrides.
Config step_config(const std::string& model, std::vector<std::string> extra = {}) {
  const std::string json = fmt::format(R"({{
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2, "steps_per_print": 1000,
    "bf16": {{"enabled": true}},
    "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-3, "weight_decay": 0.1}}}},
    "model": {},
    "data": {{"synthetic_tokens": 65536}},
    "device": {{"backend": "cpu", "memory_limit": "64MiB", "cpu_threads": 2}},
    "strata": {{"host_memory_limit": "256MiB"}},
    "train": {{"steps": 4, "seed": 5, "final_checkpoint": false}}
  }})",
                                       model);
  extra.push_back("strata.activations=recompute");
  auto cfg = parse_config(json, "<test>", extra);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  return cfg.is_ok() ? *cfg : Config{};
}

TrainResult train_with(const Config& cfg, bool fused, long* fused_calls) {
  auto calls = std::make_shared<std::atomic<long>>(0);
  TrainOptions o;
  o.wrap_device = [fused, calls](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
    return std::make_unique<FusionDevice>(std::move(d), fused, calls);
  };
  TrainResult r = test::must_train(cfg, o);
  *fused_calls = calls->load();
  return r;
}

void expect_same_losses(const Config& cfg) {
  long fused_calls = 0, unfused_calls = 0;
  const TrainResult fused = train_with(cfg, true, &fused_calls);
  const TrainResult unfused = train_with(cfg, false, &unfused_calls);
  ASSERT_EQ(fused.losses.size(), 4u);
  EXPECT_EQ(fused.losses, unfused.losses);  // bit for bit
  EXPECT_GT(fused_calls, 0);                // the fused path did run
  EXPECT_EQ(unfused_calls, 0);
}

class FusedSteps : public ::testing::Test {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }
};

TEST_F(FusedSteps, Gpt2TrainsToTheSameLossesFusedOrNot) {
  expect_same_losses(step_config(
      R"({"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256, "context": 32})"));
}

TEST_F(FusedSteps, LlamaTrainsToTheSameLossesFusedOrNot) {
  expect_same_losses(step_config(
      R"({"type": "llama", "n_layer": 2, "n_head": 4, "num_key_value_heads": 2, "n_embd": 64,
          "intermediate_size": 128, "vocab_size": 256, "context": 32})"));
}

}  // namespace
}  // namespace strata
