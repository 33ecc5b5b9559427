// The Llama-family ops of the CUDA backend (kernels/cuda/{rmsnorm,swiglu,rope,attention,
// attention_decode}.cu; Qwen3's query/key norms in rmsnorm.cu)
// against the CPU backend, as tests/cuda_backend_test.cc does for the GPT ops: fp32, bf16 and
// fp16, fresh random inputs on both devices, outputs compared with a per-op tolerance. Without
// a visible GPU every test reports SKIPPED with the reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"
#include "tests/cuda_twin.h"

namespace strata {
namespace {

using namespace cuda_test;

class LlamaCudaOpTest : public CudaBackendTest, public ::testing::WithParamInterface<DType> {};

TEST_P(LlamaCudaOpTest, RmsNorm) {
  const DType dt = GetParam();
  const int N = 67, C = 200;
  Twin inp = random(size_t(N) * C, dt, -3, 5), w = random(C, dt, 0.5, 1.5);
  Twin out = random(size_t(N) * C, dt), rstd = random(N, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.rmsnorm_forward(s, dt, out.p[i], rstd.at<float>(i), inp.p[i], w.p[i], 1e-6f, N, C);
  });
  compare("rmsnorm_forward out", out, dt, tol(dt, kReduction));
  compare("rmsnorm_forward rstd", rstd, DType::kF32, kReduction);
  Twin dout = random(size_t(N) * C, dt), dinp = random(size_t(N) * C, dt);
  Twin dw = random(C, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.rmsnorm_backward(s, dt, dinp.p[i], dinp.p[i], dw.at<float>(i), dout.p[i], inp.p[i], w.p[i],
                       rstd.at<float>(i), N, C);
  });
  compare("rmsnorm_backward dinp", dinp, dt, tol(dt, kReduction));
  compare("rmsnorm_backward dweight", dw, DType::kF32, kReduction);
}

TEST_P(LlamaCudaOpTest, QkNorm) {
  const DType dt = GetParam();
  const int N = 300, NH = 8, NKV = 2, hs = 128, H = NH + NKV;
  const size_t W = size_t(NH + 2 * NKV) * hs;
  Twin qkv = random(size_t(N) * W, dt, -3, 5), qw = random(hs, dt, 0.5, 1.5),
       kw = random(hs, dt, 0.5, 1.5);
  Twin saved = random(size_t(N) * H * hs, dt), rstd = random(size_t(N) * H, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.qk_norm_forward(s, dt, qkv.p[i], saved.p[i], rstd.at<float>(i), qw.p[i], kw.p[i], 1e-6f, N,
                      NH, NKV, hs);
  });
  compare("qk_norm_forward qkv", qkv, dt, tol(dt, kReduction));
  compare("qk_norm_forward saved", saved, dt, 0.0);
  compare("qk_norm_forward rstd", rstd, DType::kF32, kReduction);
  Twin dqkv = random(size_t(N) * W, dt), dqw = random(hs, DType::kF32),
       dkw = random(hs, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.qk_norm_backward(s, dt, dqkv.p[i], dqw.at<float>(i), dkw.at<float>(i), saved.p[i], qw.p[i],
                       kw.p[i], rstd.at<float>(i), N, NH, NKV, hs);
  });
  compare("qk_norm_backward dqkv", dqkv, dt, tol(dt, kReduction));
  compare("qk_norm_backward dqw", dqw, DType::kF32, kReduction);
  compare("qk_norm_backward dkw", dkw, DType::kF32, kReduction);
}

TEST_P(LlamaCudaOpTest, Swiglu) {
  const DType dt = GetParam();
  const int N = 97, H = 301;
  Twin inp = random(size_t(N) * 2 * H, dt, -5, 5), out = random(size_t(N) * H, dt);
  run([&](Kernels& k, Stream& s, int i) { k.swiglu_forward(s, dt, out.p[i], inp.p[i], N, H); });
  compare("swiglu_forward", out, dt, tol(dt, kElementwise));
  Twin dout = random(size_t(N) * H, dt), dinp = random(size_t(N) * 2 * H, dt);
  run([&](Kernels& k, Stream& s, int i) {
    k.swiglu_backward(s, dt, dinp.p[i], inp.p[i], dout.p[i], N, H);
  });
  compare("swiglu_backward", dinp, dt, tol(dt, kElementwise));
}

TEST_P(LlamaCudaOpTest, Rope) {
  const DType dt = GetParam();
  const int B = 2, T = 45, NH = 6, KVH = 2, hs = 64;
  const size_t n = size_t(B) * T * (NH + 2 * KVH) * hs;
  for (RopeParams p :
       {RopeParams{.theta = 1e6},
        RopeParams{.theta = 500000.0, .llama3 = true, .original_max_position = 32}}) {
    Twin x = random(n, dt, -2, 2);
    run([&](Kernels& k, Stream& s, int i) {
      k.rope_forward(s, dt, x.p[i], p, nullptr, B, T, NH, KVH, hs);
    });
    compare("rope_forward", x, dt, tol(dt, kElementwise));
    run([&](Kernels& k, Stream& s, int i) {
      k.rope_backward(s, dt, x.p[i], p, nullptr, B, T, NH, KVH, hs);
    });
    compare("rope_backward", x, dt, tol(dt, kElementwise));
  }
}

TEST_P(LlamaCudaOpTest, GroupedQueryAttention) {
  const DType dt = GetParam();
  const int B = 2, T = 45, NH = 6, KVH = 2, hs = 16;  // T not a multiple of the warp width
  const size_t W = size_t(NH + 2 * KVH) * hs;
  Twin qkv = random(size_t(B) * T * W, dt, -2, 2), out = random(size_t(B) * T * NH * hs, dt);
  Twin att = random(size_t(B) * NH * T * T, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.attention_gqa_forward(s, dt, out.p[i], att.at<float>(i), qkv.p[i], nullptr, B, T, NH, KVH,
                            hs);
  });
  compare("attention_gqa_forward out", out, dt, tol(dt, kReduction));
  compare("attention_gqa_forward att", att, DType::kF32, kReduction);
  Twin dout = random(size_t(B) * T * NH * hs, dt), dqkv = random(size_t(B) * T * W, dt);
  Twin scratch = random(size_t(B) * NH * T * T, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.attention_gqa_backward(s, dt, dqkv.p[i], scratch.at<float>(i), dout.p[i], qkv.p[i],
                             att.at<float>(i), nullptr, B, T, NH, KVH, hs);
  });
  compare("attention_gqa_backward dqkv", dqkv, dt, tol(dt, kReduction));
}

// Generation's cached attention (kernels/cuda/attention_decode.cu): a prompt filling the cache
// from position 0, then a few tokens at once and one token's step further on, at a Llama's head
// size (128) with grouped key/value heads and at GPT-2's (64) with one key/value head a query
// head. The caches start with the same random rows (the positions before pos0); the new rows
// must land bit for bit, the output within the reduction tolerance.
TEST_P(LlamaCudaOpTest, AttentionDecode) {
  const DType dt = GetParam();
  struct Heads {
    int NH, KVH, hs;
  };
  struct Step {
    int pos0, T;
  };
  const int B = 2, maxT = 160;
  for (const Heads h : {Heads{8, 2, 128}, Heads{4, 4, 64}}) {
    const size_t W = size_t(h.NH + 2 * h.KVH) * h.hs, cache = size_t(B) * maxT * h.KVH * h.hs;
    Twin kc = random(cache, dt, -2, 2), vc = random(cache, dt);
    for (const Step st : {Step{0, 45}, Step{45, 3}, Step{159, 1}}) {
      SCOPED_TRACE("NH " + std::to_string(h.NH) + " KVH " + std::to_string(h.KVH) + " hs " +
                   std::to_string(h.hs) + " at " + std::to_string(st.pos0));
      Twin qkv = random(size_t(B) * st.T * W, dt, -2, 2);
      Twin out = random(size_t(B) * st.T * h.NH * h.hs, dt);
      run([&](Kernels& k, Stream& s, int i) {
        k.attention_decode(s, dt, out.p[i], kc.p[i], vc.p[i], qkv.p[i], B, st.T, st.pos0, maxT,
                           h.NH, h.KVH, h.hs);
      });
      compare("attention_decode out", out, dt, tol(dt, kReduction));
      compare("attention_decode kcache", kc, dt, 0.0);
      compare("attention_decode vcache", vc, dt, 0.0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, LlamaCudaOpTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& p) {
                           return std::string(dtype_name(p.param));
                         });

}  // namespace
}  // namespace strata
