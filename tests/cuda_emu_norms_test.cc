// The norms (kernels/cuda/layernorm.cu, rmsnorm.cu with the query/key norms, and their backward
// in one pass,
// norm_backward.cu) and the linear layer's backward with its bias gradient's column sums
// (matmul.cu), on the CPU emulation of CUDA, as cuda_emu_kernels_test.cc runs every kernel file:
// both thread orders, against the CPU backend's kernels, on the same fixture
// (tests/cuda_emu_kernels_fixture.h).
#include "tests/cuda_emu_kernels_fixture.h"

namespace strata {
namespace {

// Rows of C = 83 take the one-element kernels; C = 96 the 16-byte packs (every dtype), and
// `packed` false (STRATA_CUDA_PACKED=0) the one-element kernels again.
const int kRowWidths[] = {83, 96};

TEST_F(EmulatedKernels, LayerNorm) {
  const int N = 37;
  for (DType dt : kDtypes)
    for (int C : kRowWidths)
      for (bool packed : {true, false}) {
        SCOPED_TRACE("C " + std::to_string(C) + (packed ? ", packed" : ", one element"));
        check_op(
            name("layernorm_forward", dt),
            {floats(size_t(N) * C, dt), floats(N, DType::kF32), floats(N, DType::kF32),
             floats(size_t(N) * C, dt, -2, 2), floats(C, dt), floats(C, dt)},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.layernorm_forward(s, dt, p[0], static_cast<float*>(p[1]), static_cast<float*>(p[2]),
                                  p[3], p[4], p[5], N, C);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_layernorm_forward(s, dt, p[0], static_cast<float*>(p[1]),
                                            static_cast<float*>(p[2]), p[3], p[4], p[5], N, C,
                                            packed);
            },
            {{0, "out", tol(dt, 1e-5)}, {1, "mean", 1e-5}, {2, "rstd", 1e-5}});
        // Rows past one 256-row chunk of the parameter gradient's grid.
        const int N2 = 300;
        std::vector<float> mean(N2), rstd(N2);
        for (int i = 0; i < N2; ++i) {
          mean[i] = 0.1f * float(i % 7) - 0.3f;
          rstd[i] = 0.5f + 0.01f * float(i % 13);
        }
        check_op(
            name("layernorm_backward", dt),
            {floats(size_t(N2) * C, dt),
             floats(C, DType::kF32),
             floats(C, DType::kF32),
             floats(size_t(N2) * C, dt),
             floats(size_t(N2) * C, dt, -2, 2),
             floats(C, dt),
             {to_bytes(mean, DType::kF32), DType::kF32},
             {to_bytes(rstd, DType::kF32), DType::kF32}},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.layernorm_backward(s, dt, p[0], p[0], static_cast<float*>(p[1]),
                                   static_cast<float*>(p[2]), p[3], p[4], p[5],
                                   static_cast<float*>(p[6]), static_cast<float*>(p[7]), N2, C);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_layernorm_backward(s, dt, p[0], p[0], static_cast<float*>(p[1]),
                                             static_cast<float*>(p[2]), p[3], p[4], p[5],
                                             static_cast<float*>(p[6]), static_cast<float*>(p[7]),
                                             N2, C, reduce_, packed);
            },
            {{0, "dinp", tol(dt, 5e-5)}, {1, "dweight", 5e-5}, {2, "dbias", 5e-5}});
      }
}

TEST_F(EmulatedKernels, RmsNorm) {
  const int N = 300;
  for (DType dt : kDtypes)
    for (int C : {77, 96})
      for (bool packed : {true, false}) {
        SCOPED_TRACE("C " + std::to_string(C) + (packed ? ", packed" : ", one element"));
        check_op(
            name("rmsnorm_forward", dt),
            {floats(size_t(N) * C, dt), floats(N, DType::kF32), floats(size_t(N) * C, dt, -2, 2),
             floats(C, dt)},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.rmsnorm_forward(s, dt, p[0], static_cast<float*>(p[1]), p[2], p[3], 1e-5f, N, C);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_rmsnorm_forward(s, dt, p[0], static_cast<float*>(p[1]), p[2], p[3], 1e-5f,
                                          N, C, packed);
            },
            {{0, "out", tol(dt, 1e-5)}, {1, "rstd", 1e-5}});
        std::vector<float> rstd(N);
        for (int i = 0; i < N; ++i) rstd[i] = 0.5f + 0.01f * float(i % 13);
        check_op(
            name("rmsnorm_backward", dt),
            {floats(size_t(N) * C, dt),
             floats(C, DType::kF32),
             floats(size_t(N) * C, dt),
             floats(size_t(N) * C, dt, -2, 2),
             floats(C, dt),
             {to_bytes(rstd, DType::kF32), DType::kF32}},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.rmsnorm_backward(s, dt, p[0], p[0], static_cast<float*>(p[1]), p[2], p[3], p[4],
                                 static_cast<float*>(p[5]), N, C);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_rmsnorm_backward(s, dt, p[0], p[0], static_cast<float*>(p[1]), p[2], p[3],
                                           p[4], static_cast<float*>(p[5]), N, C, reduce_, packed);
            },
            {{0, "dinp", tol(dt, 5e-5)}, {1, "dweight", 5e-5}});
      }
}

// The query/key norms over the heads of packed q|k|v rows: head widths that take the
// one-element kernels (62) and the 16-byte packs (64), rows past one 256-row chunk of the
// weights' gradient grid.
TEST_F(EmulatedKernels, QkNorm) {
  const int N = 300, NH = 4, NKV = 2, H = NH + NKV;
  for (DType dt : kDtypes)
    for (int hs : {62, 64})
      for (bool packed : {true, false}) {
        SCOPED_TRACE("hs " + std::to_string(hs) + (packed ? ", packed" : ", one element"));
        const size_t rows = size_t(N) * (NH + 2 * NKV) * hs, heads = size_t(N) * H;
        check_op(
            name("qk_norm_forward", dt),
            {floats(rows, dt, -2, 2), floats(heads * hs, dt), floats(heads, DType::kF32),
             floats(hs, dt), floats(hs, dt)},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.qk_norm_forward(s, dt, p[0], p[1], static_cast<float*>(p[2]), p[3], p[4], 1e-6f, N,
                                NH, NKV, hs);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_qk_norm_forward(s, dt, p[0], p[1], static_cast<float*>(p[2]), p[3], p[4],
                                          1e-6f, N, NH, NKV, hs, packed);
            },
            {{0, "qkv", tol(dt, 1e-5)}, {1, "saved", 0.0}, {2, "rstd", 1e-5}});
        std::vector<float> rstd(heads);
        for (size_t i = 0; i < heads; ++i) rstd[i] = 0.5f + 0.01f * float(i % 13);
        check_op(
            name("qk_norm_backward", dt),
            {floats(rows, dt),
             floats(hs, DType::kF32),
             floats(hs, DType::kF32),
             floats(heads * hs, dt, -2, 2),
             floats(hs, dt),
             floats(hs, dt),
             {to_bytes(rstd, DType::kF32), DType::kF32}},
            [&](Kernels& k, Stream& s, void* const* p) {
              k.qk_norm_backward(s, dt, p[0], static_cast<float*>(p[1]), static_cast<float*>(p[2]),
                                 p[3], p[4], p[5], static_cast<float*>(p[6]), N, NH, NKV, hs);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_qk_norm_backward(
                  s, dt, p[0], static_cast<float*>(p[1]), static_cast<float*>(p[2]), p[3], p[4],
                  p[5], static_cast<float*>(p[6]), N, NH, NKV, hs, reduce_, packed);
            },
            {{0, "dqkv", tol(dt, 5e-5)}, {1, "dqw", 5e-5}, {2, "dkw", 5e-5}});
      }
}

// The norms' backwards in one pass (kernels/cuda/norm_backward.cu), where the rows go in packs
// and a lane's columns fit its registers: against the CPU backend, and against their two kernels
// (`fused` false): the input gradient bit for bit (the same row terms; the emulation contracts
// nothing), the parameter gradients summed in another fixed order. Widths that take 1-8 packs a
// lane, and ones that do not fit (1032 for LayerNorm, fp32's 2048 for RMSNorm: the two kernels
// either way, the same bits); 300 rows: 19 chunks.
TEST_F(EmulatedKernels, NormBackwardsInOnePass) {
  const int N = 300;
  std::vector<float> mean(N), rstd(N);
  for (int i = 0; i < N; ++i) {
    mean[i] = 0.1f * float(i % 7) - 0.3f;
    rstd[i] = 0.5f + 0.01f * float(i % 13);
  }
  const Buf mean_buf{to_bytes(mean, DType::kF32), DType::kF32};
  const Buf rstd_buf{to_bytes(rstd, DType::kF32), DType::kF32};
  for (DType dt : kDtypes)
    for (bool layer : {true, false})
      for (int C : layer ? std::vector<int>{96, 768, 1032} : std::vector<int>{96, 2048}) {
        SCOPED_TRACE(std::string(layer ? "layernorm" : "rmsnorm") + " C " + std::to_string(C));
        // dinp (with dres in it), dweight, dbias (LayerNorm), dout, inp, weight, mean, rstd.
        const std::vector<Buf> bufs = {floats(size_t(N) * C, dt),
                                       floats(C, DType::kF32),
                                       floats(C, DType::kF32),
                                       floats(size_t(N) * C, dt),
                                       floats(size_t(N) * C, dt, -2, 2),
                                       floats(C, dt),
                                       mean_buf,
                                       rstd_buf};
        auto cuda = [&](bool fused) {
          return [&, fused](cudaStream_t s, void* const* p) {
            auto* dw = static_cast<float*>(p[1]);
            const auto* m = static_cast<const float*>(p[6]);
            const auto* r = static_cast<const float*>(p[7]);
            return layer ? cuda_layernorm_backward(s, dt, p[0], p[0], dw, static_cast<float*>(p[2]),
                                                   p[3], p[4], p[5], m, r, N, C, reduce_,
                                                   /*packed=*/true, fused)
                         : cuda_rmsnorm_backward(s, dt, p[0], p[0], dw, p[3], p[4], p[5], r, N, C,
                                                 reduce_, /*packed=*/true, fused);
          };
        };
        check_op(
            name(layer ? "layernorm_backward" : "rmsnorm_backward", dt), bufs,
            [&](Kernels& k, Stream& s, void* const* p) {
              auto* dw = static_cast<float*>(p[1]);
              if (layer) {
                k.layernorm_backward(s, dt, p[0], p[0], dw, static_cast<float*>(p[2]), p[3], p[4],
                                     p[5], static_cast<float*>(p[6]), static_cast<float*>(p[7]), N,
                                     C);
              } else {
                k.rmsnorm_backward(s, dt, p[0], p[0], dw, p[3], p[4], p[5],
                                   static_cast<float*>(p[7]), N, C);
              }
            },
            cuda(true),
            layer ? std::vector<Check>{{0, "dinp", tol(dt, 5e-5)},
                                       {1, "dweight", 5e-5},
                                       {2, "dbias", 5e-5}}
                  : std::vector<Check>{{0, "dinp", tol(dt, 5e-5)}, {1, "dweight", 5e-5}});
        const std::vector<std::vector<uint8_t>> one = run_emulated(bufs, cuda(true)),
                                                two = run_emulated(bufs, cuda(false));
        EXPECT_EQ(first_difference(one[0], two[0], dt), "") << "dinp: one pass against two kernels";
        const bool fits = C != 1032 && !(dt == DType::kF32 && C == 2048);
        for (int i : layer ? std::vector<int>{1, 2} : std::vector<int>{1}) {
          if (fits) {
            expect_close(
                std::string(i == 1 ? "dweight" : "dbias") + ": one pass against two kernels",
                values(one[size_t(i)], DType::kF32), values(two[size_t(i)], DType::kF32), 1e-5);
          } else {
            EXPECT_EQ(one[size_t(i)], two[size_t(i)])
                << "a width that does not fit runs the two kernels";
          }
        }
      }
}

TEST_F(EmulatedKernels, MatmulThroughCublasLtAndTheBiasColumnSum) {
  const int N = 37, C = 45, OC = 29;
  for (DType dt : kDtypes) {
    const double t = tol(dt, 5e-5);
    check_op(
        name("matmul_forward", dt),
        {floats(size_t(N) * OC, dt), floats(size_t(N) * C, dt), floats(size_t(OC) * C, dt),
         floats(OC, dt)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.matmul_forward(s, dt, p[0], p[1], p[2], p[3], N, C, OC);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_matmul_forward(s, blas_, dt, p[0], p[1], p[2], p[3], N, C, OC);
        },
        {{0, "out", t}});
    check_op(
        name("matmul_backward", dt),
        {floats(size_t(N) * C, dt), floats(size_t(OC) * C, DType::kF32), floats(OC, DType::kF32),
         floats(size_t(N) * OC, dt), floats(size_t(N) * C, dt), floats(size_t(OC) * C, dt)},
        [&](Kernels& k, Stream& s, void* const* p) {
          k.matmul_backward(s, dt, p[0], static_cast<float*>(p[1]), static_cast<float*>(p[2]), p[3],
                            p[4], p[5], N, C, OC, /*accumulate=*/true);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_matmul_backward(s, blas_, reduce_, dt, p[0], static_cast<float*>(p[1]),
                                      static_cast<float*>(p[2]), p[3], p[4], p[5], N, C, OC,
                                      /*accumulate=*/true);
        },
        {{0, "dinp", t}, {1, "dweight", t}, {2, "dbias", 5e-5}});
  }
}

// The bias gradient's column sums with a 16-byte pack of columns a thread (where dout's rows go
// in packs): the one-column kernel's bits, column by column, over several 256-row chunks (the
// tiles' last blocks adding them) and one; against the CPU backend too.
TEST_F(EmulatedKernels, BiasColumnSumsInPacksKeepTheBits) {
  const int C = 8;
  for (DType dt : kDtypes)
    for (int OC : {96, 2304, 29})
      for (int N : {600, 37}) {
        SCOPED_TRACE(name("dbias", dt) + " OC " + std::to_string(OC) + " N " + std::to_string(N));
        // dinp, dweight, dbias, dout, inp, weight
        const std::vector<Buf> bufs = {
            floats(size_t(N) * C, dt), floats(size_t(OC) * C, DType::kF32),
            floats(OC, DType::kF32),   floats(size_t(N) * OC, dt),
            floats(size_t(N) * C, dt), floats(size_t(OC) * C, dt)};
        auto cuda = [&](bool packed) {
          return [&, packed](cudaStream_t s, void* const* p) {
            return cuda_matmul_backward(s, blas_, reduce_, dt, p[0], static_cast<float*>(p[1]),
                                        static_cast<float*>(p[2]), p[3], p[4], p[5], N, C, OC,
                                        /*accumulate=*/true, packed);
          };
        };
        check_op(name("matmul_backward", dt), bufs,
                 [&](Kernels& k, Stream& s, void* const* p) {
                   k.matmul_backward(s, dt, p[0], static_cast<float*>(p[1]),
                                     static_cast<float*>(p[2]), p[3], p[4], p[5], N, C, OC,
                                     /*accumulate=*/true);
                 },
                 cuda(true), {{2, "dbias", 5e-5}});
        EXPECT_EQ(first_difference(run_emulated(bufs, cuda(true))[2],
                                   run_emulated(bufs, cuda(false))[2], DType::kF32),
                  "")
            << "dbias: packs against one column a thread";
      }
}

}  // namespace
}  // namespace strata
