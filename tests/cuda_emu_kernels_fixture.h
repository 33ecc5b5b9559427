// The fixture of the CUDA kernels' emulated tests (cuda_emu_kernels_test.cc,
// cuda_emu_attention_test.cc): each op through its CUDA launcher on the emulation in both
// thread orders against the CPU backend's kernel (check_op), and typed random buffers.
#pragma once

#include <cublasLt.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "strata/device.h"
#include "strata/kernels.h"
#include "strata/optimizer.h"
#include "tests/cuda_emu/control.h"
#include "tests/cuda_twin.h"

namespace strata {
namespace {

using cuda_test::expect_close;
using cuda_test::random_floats;
using cuda_test::to_bytes;

// A buffer of an op: its bytes before the op and, for the comparison, its dtype.
struct Buf {
  std::vector<uint8_t> bytes;
  DType dt = DType::kF32;
};

// How an output is compared: rtol 0 means bit for bit with the CPU backend, else within rtol of
// it. The two thread orders must give the same bits: no kernel's result depends on the order
// the GPU runs its blocks in (none sums floats with atomics).
struct Check {
  int index;
  const char* name;
  double rtol = 0.0;
};

using CpuOp = std::function<void(Kernels&, Stream&, void* const*)>;
using CudaOp = std::function<Status(cudaStream_t, void* const*)>;

class EmulatedKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = create_cpu_device({.capacity = 256 << 20, .threads = 2});
    ASSERT_TRUE(cpu.is_ok()) << cpu.status().to_string();
    cpu_ = std::move(cpu).value();
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cublasLtCreate(&blas_.handle), CUBLAS_STATUS_SUCCESS);
    blas_.workspace_bytes = 1 << 20;
    ASSERT_EQ(cudaMalloc(&blas_.workspace, blas_.workspace_bytes), cudaSuccess);
    const Status st = allocate_reduce_scratch(stream_, &reduce_);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }
  void TearDown() override {
    emu::set_order(emu::Order::kForward);
    free_reduce_scratch(&reduce_);
    cudaFree(blas_.workspace);
    cublasLtDestroy(blas_.handle);
    cudaStreamDestroy(stream_);
    EXPECT_EQ(emu::failure(), "");
    emu::clear_failure();
  }

  Buf floats(size_t n, DType dt, float lo = -1.0f, float hi = 1.0f) {
    return {to_bytes(random_floats(rng_, n, lo, hi), dt), dt};
  }
  static std::vector<int32_t> as_ints(const Buf& b) {
    std::vector<int32_t> v(b.bytes.size() / 4);
    std::memcpy(v.data(), b.bytes.data(), b.bytes.size());
    return v;
  }
  Buf ints(size_t n, int lo, int hi) {
    std::uniform_int_distribution<int32_t> u(lo, hi);
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = u(rng_);
    Buf b{std::vector<uint8_t>(n * 4), DType::kF32};
    std::memcpy(b.bytes.data(), v.data(), b.bytes.size());
    return b;
  }

  // Runs the op on the CPU backend and, in both orders, on the emulation; compares `checks`.
  void check_op(const std::string& what, const std::vector<Buf>& bufs, const CpuOp& cpu,
                const CudaOp& cuda, const std::vector<Check>& checks) {
    SCOPED_TRACE(what + " (seed " + std::to_string(seed_) + ")");
    std::vector<std::vector<uint8_t>> want(bufs.size());
    std::vector<void*> cp(bufs.size());
    for (size_t i = 0; i < bufs.size(); ++i) {
      want[i] = bufs[i].bytes;
      cp[i] = want[i].empty() ? nullptr : want[i].data();
    }
    cpu(cpu_->kernels(), cpu_->compute_stream(), cp.data());
    ASSERT_TRUE(cpu_->synchronize(cpu_->compute_stream()).is_ok());

    std::vector<std::vector<uint8_t>> got[2];
    for (int o = 0; o < 2; ++o) {
      emu::set_order(o == 0 ? emu::Order::kForward : emu::Order::kReverse);
      got[o] = run_emulated(bufs, cuda);
    }
    for (const Check& c : checks) {
      const DType dt = bufs[c.index].dt;
      const std::vector<float> w = values(want[c.index], dt);
      const std::vector<float> g0 = values(got[0][c.index], dt);
      EXPECT_EQ(first_difference(got[0][c.index], got[1][c.index], dt), "")
          << c.name << ": the thread order changed the result";
      if (c.rtol == 0.0) {
        EXPECT_EQ(first_difference(got[0][c.index], want[c.index], dt), "")
            << c.name << ": not bit for bit the CPU backend's";
      } else {
        expect_close(std::string(c.name) + " against the CPU backend", g0, w, c.rtol);
      }
    }
  }

  // Runs `cuda` on device copies of `bufs`, each `offset` elements (of its dtype) past an
  // aligned address, in the current thread order; returns every buffer's bytes after it (an
  // empty buffer: a null pointer, nothing back). Failures are reported, not fatal.
  std::vector<std::vector<uint8_t>> run_emulated(const std::vector<Buf>& bufs, const CudaOp& cuda,
                                                 size_t offset = 0) {
    std::vector<void*> base(bufs.size(), nullptr), dp(bufs.size(), nullptr);
    for (size_t i = 0; i < bufs.size(); ++i) {
      if (bufs[i].bytes.empty()) continue;
      const size_t skip = offset * dtype_size(bufs[i].dt);
      EXPECT_EQ(cudaMalloc(&base[i], bufs[i].bytes.size() + skip), cudaSuccess);
      dp[i] = static_cast<char*>(base[i]) + skip;
      EXPECT_EQ(
          cudaMemcpy(dp[i], bufs[i].bytes.data(), bufs[i].bytes.size(), cudaMemcpyHostToDevice),
          cudaSuccess);
    }
    const Status st = cuda(stream_, dp.data());
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    const cudaError_t err = cudaStreamSynchronize(stream_);
    EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
    std::vector<std::vector<uint8_t>> got(bufs.size());
    for (size_t i = 0; i < bufs.size(); ++i) {
      if (!base[i]) continue;
      got[i].resize(bufs[i].bytes.size());
      EXPECT_EQ(cudaMemcpy(got[i].data(), dp[i], got[i].size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(cudaFree(base[i]), cudaSuccess) << emu::failure();
    }
    return got;
  }

  static std::vector<float> values(const std::vector<uint8_t>& b, DType dt) {
    std::vector<float> v(b.size() / dtype_size(dt));
    convert(b.data(), dt, v.data(), DType::kF32, v.size());
    return v;
  }
  static std::string first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                                      DType dt) {
    if (a == b) return "";
    const size_t es = dtype_size(dt);
    for (size_t i = 0; i < a.size(); i += es) {
      if (std::memcmp(&a[i], &b[i], es) == 0) continue;
      float x, y;
      convert(&a[i], dt, &x, DType::kF32, 1);
      convert(&b[i], dt, &y, DType::kF32, 1);
      return "element " + std::to_string(i / es) + ": " + std::to_string(x) + " vs " +
             std::to_string(y);
    }
    return "sizes differ";
  }

  std::unique_ptr<Device> cpu_;
  cudaStream_t stream_ = nullptr;
  CudaBlas blas_;
  CudaReduceScratch reduce_;  // the stream's, as CudaDevice gives each stream
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

const DType kDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

std::string name(const char* op, DType dt) { return std::string(op) + " " + dtype_name(dt); }
// Tolerance for ops whose CPU twin sums in another order or uses other math functions.
double tol(DType dt, double f32) { return cuda_test::tol(dt, f32); }

}  // namespace
}  // namespace strata
