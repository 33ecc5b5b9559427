// Backward ops whose input gradient is written, not accumulated (Kernels::matmul_backward and
// fused_attention_backward with `accumulate` false; the norm backwards without dres), on the CPU
// backend: whatever the output held is never read, and it gets the bits of the same gradient
// accumulated into zeros; the norm backwards with dres give the bits of dres copied and then
// accumulated into.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "strata/dtype.h"
#include "strata/kernels.h"
#include "tests/kernel_test_util.h"

namespace strata {
namespace {

using namespace kernel_test;

// matmul_backward with dinp written: whatever dinp held (NaN here) is never read, and it gets
// the bits of the product accumulated into zeros (no zero product in random inputs, so no -0);
// dweight and dbias accumulate as ever.
TEST(CpuKernels, MatmulBackwardWrittenIsAccumulatedIntoZerosBitForBit) {
  for (DType dt : kAllTypes) {
    SCOPED_TRACE(dtype_name(dt));
    const int N = 37, C = 48, OC = 72;
    std::mt19937_64 rng(test_seed(12));
    Typed x = random_typed(dt, size_t(N) * C, rng), w = random_typed(dt, size_t(OC) * C, rng);
    Typed dout = random_typed(dt, size_t(N) * OC, rng);
    Typed written(dt, x.n), summed(dt, x.n);
    for (size_t i = 0; i < x.n; ++i) written.set(i, std::nanf(""));
    for (size_t i = 0; i < x.n; ++i) summed.set(i, 0.0f);
    std::vector<float> dw(size_t(OC) * C, 0.5f), db(OC, 0.25f), dw2(dw), db2(db);
    Fixture f;
    f.k().matmul_backward(f.s(), dt, written.data(), dw.data(), db.data(), dout.data(), x.data(),
                          w.data(), N, C, OC, /*accumulate=*/false);
    f.k().matmul_backward(f.s(), dt, summed.data(), dw2.data(), db2.data(), dout.data(), x.data(),
                          w.data(), N, C, OC, /*accumulate=*/true);
    f.sync();
    EXPECT_EQ(written.bytes, summed.bytes);
    EXPECT_EQ(dw, dw2);
    EXPECT_EQ(db, db2);
  }
}

// The fused attention's backward with dqkv written: whatever dqkv held (NaN here) is never
// read, and it gets the bits of the gradient accumulated into zeros.
TEST(CpuKernels, FusedAttentionBackwardWrittenIsAccumulatedIntoZerosBitForBit) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int B = 2, T = 24, NH = 4, NKV = 2, hs = 64, W = (NH + 2 * NKV) * hs;
    std::mt19937_64 rng(test_seed(13));
    Typed qkv = random_typed(dt, size_t(B) * T * W, rng);
    Typed dout = random_typed(dt, size_t(B) * T * NH * hs, rng);
    Typed out(dt, dout.n), written(dt, qkv.n), summed(dt, qkv.n);
    for (size_t i = 0; i < qkv.n; ++i) written.set(i, std::nanf(""));
    for (size_t i = 0; i < qkv.n; ++i) summed.set(i, 0.0f);
    std::vector<float> lse(size_t(B) * NH * T), scratch(lse.size());
    Fixture f;
    f.k().fused_attention_forward(f.s(), dt, out.data(), lse.data(), qkv.data(), nullptr, B, T, NH,
                                  NKV, hs);
    f.k().fused_attention_backward(f.s(), dt, written.data(), scratch.data(), dout.data(),
                                   qkv.data(), out.data(), lse.data(), nullptr, B, T, NH, NKV, hs,
                                   /*accumulate=*/false);
    f.k().fused_attention_backward(f.s(), dt, summed.data(), scratch.data(), dout.data(),
                                   qkv.data(), out.data(), lse.data(), nullptr, B, T, NH, NKV, hs,
                                   /*accumulate=*/true);
    f.sync();
    EXPECT_EQ(written.bytes, summed.bytes);
  }
}

// The norm backwards hand on the residual gradient: dinp = dres + the norm's gradient gives the
// bits of dres copied into dinp and accumulated into (the block backward's old copy and +=);
// without dres, the bits of accumulating into zeros, whatever dinp held (NaN here). The
// parameter gradients accumulate as ever.
TEST(CpuKernels, NormBackwardsAddTheResidualGradientBitForBit) {
  for (DType dt : kAllTypes) {
    for (bool rms : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (rms ? " rmsnorm" : " layernorm"));
      const int N = 37, C = 96;
      std::mt19937_64 rng(test_seed(14));
      Typed x = random_typed(dt, size_t(N) * C, rng), w = random_typed(dt, C, rng);
      Typed b = random_typed(dt, C, rng), dout = random_typed(dt, size_t(N) * C, rng);
      Typed dres = random_typed(dt, size_t(N) * C, rng);
      Typed y(dt, x.n), added(dt, x.n), copied(dt, x.n), written(dt, x.n), zeros(dt, x.n);
      for (size_t i = 0; i < x.n; ++i) {
        added.set(i, std::nanf(""));
        written.set(i, std::nanf(""));
        zeros.set(i, 0.0f);
      }
      copied.bytes = dres.bytes;
      std::vector<float> mean(N), rstd(N);
      std::vector<std::vector<float>> dw(4, std::vector<float>(C, 0.5f));
      std::vector<std::vector<float>> db(4, std::vector<float>(C, 0.25f));
      Fixture f;
      if (rms) {
        f.k().rmsnorm_forward(f.s(), dt, y.data(), rstd.data(), x.data(), w.data(), 1e-5f, N, C);
      } else {
        f.k().layernorm_forward(f.s(), dt, y.data(), mean.data(), rstd.data(), x.data(), w.data(),
                                b.data(), N, C);
      }
      Typed* out[4] = {&added, &copied, &written, &zeros};
      const void* res[4] = {dres.data(), copied.data(), nullptr, zeros.data()};
      for (int i = 0; i < 4; ++i) {
        if (rms) {
          f.k().rmsnorm_backward(f.s(), dt, out[i]->data(), res[i], dw[i].data(), dout.data(),
                                 x.data(), w.data(), rstd.data(), N, C);
        } else {
          f.k().layernorm_backward(f.s(), dt, out[i]->data(), res[i], dw[i].data(), db[i].data(),
                                   dout.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
        }
      }
      f.sync();
      EXPECT_EQ(added.bytes, copied.bytes);
      EXPECT_EQ(written.bytes, zeros.bytes);
      EXPECT_NE(added.bytes, written.bytes);  // dres was added
      for (int i = 1; i < 4; ++i) {
        EXPECT_EQ(dw[i], dw[0]);
        EXPECT_EQ(db[i], db[0]);
      }
    }
  }
}

}  // namespace
}  // namespace strata
