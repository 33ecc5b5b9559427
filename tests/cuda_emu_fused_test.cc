// The fused elementwise ops of the CUDA backend on the CPU emulation of CUDA (the fixture of
// cuda_emu_kernels_test.cc): the residual + norm kernel (kernels/cuda/residual_norm.cu) against
// the CPU backend's, and bit for bit against the CUDA backend's own unfused kernels (the
// residual add, then the norm) on the same inputs; the matmul backward with cuBLASLt's DGELU
// epilogue, on the emulation's cuBLASLt stand-in, against the CPU backend's matmul_backward_gelu.
// A real GPU's numbers are cuda_backend_test.cc's.
#include "tests/cuda_emu_kernels_fixture.h"

namespace strata {
namespace {

// Device copies of host buffers, freed at the end of the scope.
class DeviceBuffers {
 public:
  explicit DeviceBuffers(const std::vector<Buf>& bufs) {
    for (const Buf& b : bufs) {
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, b.bytes.size()), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(p, b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
      p_.push_back(p);
      sizes_.push_back(b.bytes.size());
    }
  }
  ~DeviceBuffers() {
    for (void* p : p_) cudaFree(p);
  }
  void* const* p() const { return p_.data(); }
  std::vector<uint8_t> get(size_t i) const {
    std::vector<uint8_t> b(sizes_[i]);
    EXPECT_EQ(cudaMemcpy(b.data(), p_[i], b.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return b;
  }

 private:
  std::vector<void*> p_;
  std::vector<size_t> sizes_;
};

// The residual + LayerNorm kernel against the CPU backend, and bit for bit against the unfused
// CUDA kernels on the same inputs; a and b start `ab_offset` elements into their buffers.
class EmulatedResidualNorm : public EmulatedKernels {
 protected:
  void check_residual_layernorm(DType dt, int N, int C, size_t ab_offset) {
    const size_t n = size_t(N) * C, off = ab_offset * dtype_size(dt);
    // res, out, mean, rstd, a, b, weight, bias
    const std::vector<Buf> bufs = {floats(n, dt),
                                   floats(n, dt),
                                   floats(N, DType::kF32),
                                   floats(N, DType::kF32),
                                   floats(n + ab_offset, dt, -2, 2),
                                   floats(n + ab_offset, dt, -2, 2),
                                   floats(C, dt),
                                   floats(C, dt)};
    auto at = [off](void* p) { return static_cast<const char*>(p) + off; };
    auto f = [](void* p) { return static_cast<float*>(p); };
    check_op(
        name("residual_layernorm_forward", dt), bufs,
        [&](Kernels& k, Stream& s, void* const* p) {
          k.residual_layernorm_forward(s, dt, p[0], p[1], f(p[2]), f(p[3]), at(p[4]), at(p[5]),
                                       p[6], p[7], N, C);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_residual_layernorm_forward(s, dt, p[0], p[1], f(p[2]), f(p[3]), at(p[4]),
                                                 at(p[5]), p[6], p[7], N, C);
        },
        {{0, "res"}, {1, "out", tol(dt, 1e-5)}, {2, "mean", 1e-5}, {3, "rstd", 1e-5}});
    // The fused kernel against the two kernels it replaces, on this backend: the same bits.
    SCOPED_TRACE(name("residual_layernorm_forward against the unfused kernels", dt));
    DeviceBuffers fused(bufs), unfused(bufs);
    void* const* d = fused.p();
    ASSERT_TRUE(cuda_residual_layernorm_forward(stream_, dt, d[0], d[1], f(d[2]), f(d[3]), at(d[4]),
                                                at(d[5]), d[6], d[7], N, C)
                    .is_ok());
    void* const* u = unfused.p();
    ASSERT_TRUE(cuda_residual_forward(stream_, dt, u[0], at(u[4]), at(u[5]), n).is_ok());
    ASSERT_TRUE(cuda_layernorm_forward(stream_, dt, u[1], f(u[2]), f(u[3]), u[0], u[6], u[7], N, C)
                    .is_ok());
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (size_t i : {0, 1, 2, 3}) EXPECT_EQ(fused.get(i), unfused.get(i)) << "buffer " << i;
  }
};

// C = 83: one element a lane; C = 96: 16-byte packs (cuda_common.cuh). `ab_offset` 1 puts the
// summands one element off alignment: the fused kernel then reads them one element at a time
// while it still takes the row's columns in packs, as the unfused norm over the aligned res does.
TEST_F(EmulatedResidualNorm, ResidualLayerNorm) {
  const int N = 37;
  for (DType dt : kDtypes) {
    for (int C : {83, 96}) {
      for (size_t ab_offset : {0, 1}) {
        SCOPED_TRACE("C " + std::to_string(C) + ", summands " + std::to_string(ab_offset) +
                     " element(s) off alignment");
        check_residual_layernorm(dt, N, C, ab_offset);
      }
    }
  }
}

TEST_F(EmulatedKernels, ResidualRmsNorm) {
  const int N = 300;
  for (DType dt : kDtypes) {
    for (int C : {77, 96}) {  // one element a lane; 16-byte packs
      SCOPED_TRACE("C " + std::to_string(C));
      const size_t n = size_t(N) * C;
      // res, out, rstd, a, b, weight; then res in place of a
      const std::vector<Buf> bufs = {floats(n, dt),          floats(n, dt),
                                     floats(N, DType::kF32), floats(n, dt, -2, 2),
                                     floats(n, dt, -2, 2),   floats(C, dt)};
      for (bool in_place : {false, true}) {
        const int r = in_place ? 3 : 0;
        check_op(
            name("residual_rmsnorm_forward", dt) + (in_place ? " in place" : ""), bufs,
            [&](Kernels& k, Stream& s, void* const* p) {
              k.residual_rmsnorm_forward(s, dt, p[r], p[1], static_cast<float*>(p[2]), p[3], p[4],
                                         p[5], 1e-5f, N, C);
            },
            [&](cudaStream_t s, void* const* p) {
              return cuda_residual_rmsnorm_forward(s, dt, p[r], p[1], static_cast<float*>(p[2]),
                                                   p[3], p[4], p[5], 1e-5f, N, C);
            },
            {{r, "res"}, {1, "out", tol(dt, 1e-5)}, {2, "rstd", 1e-5}});
      }
      SCOPED_TRACE(name("residual_rmsnorm_forward against the unfused kernels", dt));
      DeviceBuffers fused(bufs), unfused(bufs);
      ASSERT_TRUE(cuda_residual_rmsnorm_forward(stream_, dt, fused.p()[0], fused.p()[1],
                                                static_cast<float*>(fused.p()[2]), fused.p()[3],
                                                fused.p()[4], fused.p()[5], 1e-5f, N, C)
                      .is_ok());
      ASSERT_TRUE(
          cuda_residual_forward(stream_, dt, unfused.p()[0], unfused.p()[3], unfused.p()[4], n)
              .is_ok());
      ASSERT_TRUE(cuda_rmsnorm_forward(stream_, dt, unfused.p()[1],
                                       static_cast<float*>(unfused.p()[2]), unfused.p()[0],
                                       unfused.p()[5], 1e-5f, N, C)
                      .is_ok());
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      for (size_t i : {0, 1, 2}) EXPECT_EQ(fused.get(i), unfused.get(i)) << "buffer " << i;
    }
  }
}

// The DGELU epilogue applies gelu' to the fp32 sum before the one rounding (the CPU backend rounds
// the product first): dpre within two roundings of dt. dpre starts as garbage: it is written.
TEST_F(EmulatedKernels, MatmulBackwardGeluThroughTheDgeluEpilogue) {
  const int N = 37, C = 88, OC = 29;  // C a multiple of 8: the epilogue's aux matrix
  for (DType dt : kDtypes) {
    const double t = tol(dt, 5e-5);
    // dpre, dweight, dbias, dout, inp, weight, pre
    const std::vector<Buf> bufs = {
        floats(size_t(N) * C, dt),       floats(size_t(OC) * C, DType::kF32),
        floats(OC, DType::kF32),         floats(size_t(N) * OC, dt),
        floats(size_t(N) * C, dt),       floats(size_t(OC) * C, dt),
        floats(size_t(N) * C, dt, -3, 3)};
    check_op(
        name("matmul_backward_gelu", dt), bufs,
        [&](Kernels& k, Stream& s, void* const* p) {
          k.matmul_backward_gelu(s, dt, p[0], static_cast<float*>(p[1]), static_cast<float*>(p[2]),
                                 p[3], p[4], p[5], p[6], N, C, OC);
        },
        [&](cudaStream_t s, void* const* p) {
          return cuda_matmul_backward_gelu(s, blas_, reduce_, dt, p[0], static_cast<float*>(p[1]),
                                           static_cast<float*>(p[2]), p[3], p[4], p[5], p[6], N, C,
                                           OC);
        },
        {{0, "dpre", 2 * t}, {1, "dweight", t}, {2, "dbias", 5e-5}});
  }
  // A width the epilogue cannot take is refused with the fallback named, not run.
  Status st = cuda_matmul_backward_gelu(stream_, blas_, reduce_, DType::kBF16, nullptr, nullptr,
                                        nullptr, nullptr, nullptr, nullptr, nullptr, N, 100, OC);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("supports(kMatmulBackwardGelu)"), std::string::npos) << st.message();
  EXPECT_FALSE(cuda_matmul_backward_gelu_supported(100));
  EXPECT_TRUE(cuda_matmul_backward_gelu_supported(3072));
}

}  // namespace
}  // namespace strata
