// The emulation's own checks (tests/cuda_emu/), each shown to fire on a kernel or a call that
// breaks the rule it guards: without these, a passing cuda_emu_kernels_test or cuda_*_emu_test
// would prove less than it claims. Test-local kernels, launched the way translated .cu files
// launch theirs.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "tests/cuda_emu/launch.h"

namespace strata {
namespace {

using emu::Launch;
using emu::Order;

// out[i] = the value thread i+1 stored in shared memory: needs the barrier.
__global__ void rotate_kernel(float* out, bool barrier) {
  auto& s = emu::block_shared<float[64]>(1);
  const unsigned t = threadIdx.x;
  s[t] = float(t);
  if (barrier) __syncthreads();
  out[t] = s[(t + 1) % 64];
}
__global__ void copy_kernel(float* out, const float* in, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = in[i];
}
__global__ void write_at_kernel(float* p, int i) { p[i] = 1.0f; }
// A 16-byte pack read at p, checked as kernels/cuda/cuda_common.cuh's load_elems checks it.
__global__ void pack_kernel(float* out, const float* p) {
  STRATA_PACK_CHECK(p);
  out[threadIdx.x] = p[0];
}
// Half the warp waits at the block barrier, the other half at a shuffle that needs the whole
// warp: neither can complete. (Threads that have exited do not hold a barrier up, as on a GPU.)
__global__ void divergent_kernel(float* p) {
  float v = float(threadIdx.x);
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  }
  p[threadIdx.x] = v;
}

class EmulationChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    emu::set_order(Order::kForward);
    emu::clear_failure();
    for (void* p : bufs_) cudaFree(p);
    emu::clear_failure();
    cudaStreamDestroy(s_);
  }
  float* alloc(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * 4), cudaSuccess);
    bufs_.push_back(p);
    return static_cast<float*>(p);
  }
  std::vector<float> get(const float* d, size_t n) {
    std::vector<float> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  cudaStream_t s_ = nullptr;
  std::vector<void*> bufs_;
};

TEST_F(EmulationChecks, AMissingBarrierChangesTheResultInOneOfTheOrders) {
  for (bool barrier : {true, false}) {
    std::vector<float> got[2];
    for (int o = 0; o < 2; ++o) {
      emu::set_order(o ? Order::kReverse : Order::kForward);
      float* out = alloc(64);
      rotate_kernel | Launch(1, 64, 0, s_)(out, barrier);
      ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess) << emu::failure();
      got[o] = get(out, 64);
    }
    bool right = true;
    for (int o = 0; o < 2; ++o) {
      for (unsigned t = 0; t < 64; ++t) right &= got[o][t] == float((t + 1) % 64);
    }
    EXPECT_EQ(right, barrier) << (barrier ? "with" : "without") << " the barrier";
  }
}

TEST_F(EmulationChecks, FreshDeviceMemoryReadsAsNaN) {
  float* in = alloc(1000);
  float* out = alloc(1000);
  copy_kernel | Launch(4, 256, 0, s_)(out, in, 1000);
  ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
  for (float v : get(out, 1000)) ASSERT_TRUE(std::isnan(v));
}

TEST_F(EmulationChecks, AWriteJustPastTheEndFailsTheContext) {
  float* p = alloc(250);  // 1000 bytes: 24 bytes of alignment slack before the guard page
  write_at_kernel | Launch(1, 1, 0, s_)(p, 250);
  const cudaError_t err = cudaStreamSynchronize(s_);
  EXPECT_EQ(err, cudaErrorLaunchFailure);
  EXPECT_NE(std::string(cudaGetErrorString(err)).find("guard zone"), std::string::npos)
      << cudaGetErrorString(err);
}

TEST_F(EmulationChecks, AnAccessIntoAGuardPageStopsTheProcess) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_DEATH(
      {
        float* p = alloc(250);
        write_at_kernel | Launch(1, 1, 0, s_)(p, 250 + 1024);
        cudaStreamSynchronize(s_);
      },
      "out-of-bounds access to device memory");
}

TEST_F(EmulationChecks, ThreadsWaitingAtDifferentBarriersAreADeadlock) {
  float* p = alloc(32);
  divergent_kernel | Launch(1, 32, 0, s_)(p);
  const cudaError_t err = cudaStreamSynchronize(s_);
  EXPECT_EQ(err, cudaErrorLaunchFailure);
  EXPECT_NE(emu::failure().find("deadlock"), std::string::npos) << emu::failure();
}

TEST_F(EmulationChecks, AMisalignedPackFailsTheLaunch) {
  float* p = alloc(64);
  pack_kernel | Launch(1, 1, 0, s_)(p, p + 4);  // 16 bytes in: aligned
  EXPECT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
  pack_kernel | Launch(1, 1, 0, s_)(p, p + 1);
  EXPECT_EQ(cudaStreamSynchronize(s_), cudaErrorLaunchFailure);
  EXPECT_NE(emu::failure().find("not 16-byte aligned"), std::string::npos) << emu::failure();
}

TEST_F(EmulationChecks, AHostPointerAsAKernelArgumentFails) {
  std::vector<float> host(64);
  float* dev = alloc(64);
  copy_kernel | Launch(1, 64, 0, s_)(host.data(), dev, 64);
  EXPECT_EQ(cudaStreamSynchronize(s_), cudaErrorLaunchFailure);
  EXPECT_NE(emu::failure().find("not device memory"), std::string::npos) << emu::failure();
}

TEST_F(EmulationChecks, BadLaunchConfigurationsAreRefusedAtTheLaunch) {
  float* p = alloc(64);
  copy_kernel | Launch(1, 1025, 0, s_)(p, p, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  copy_kernel | Launch(1, 32, 64 << 10, s_)(p, p, 1);  // over 48 KiB without the attribute
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(
      cudaFuncSetAttribute(copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10),
      cudaSuccess);
  copy_kernel | Launch(1, 32, 64 << 10, s_)(p, p, 1);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
}

// A second stream, an event for it to wait for, and a pinned host buffer of n floats.
struct SecondStream {
  cudaStream_t other = nullptr;
  cudaEvent_t ready = nullptr;
  float* host = nullptr;
  explicit SecondStream(int n) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
    void* h = nullptr;
    EXPECT_EQ(cudaHostAlloc(&h, size_t(n) * 4, cudaHostAllocPortable), cudaSuccess);
    host = static_cast<float*>(h);
  }
  ~SecondStream() {
    cudaFreeHost(host);
    cudaEventDestroy(ready);
    cudaStreamDestroy(other);
  }
};

// Concurrent streams (not lazy): a stream waits for an event recorded on another: without the
// wait, the copy on the second stream reads the buffer before the first stream's kernel has
// written it. The first stream is held back by a host function until the copy is done, so the
// outcome does not depend on timing. (Lazy streams run one operation at a time: the spinning
// host function would hold up the copy it waits for.)
TEST_F(EmulationChecks, AMissingEventWaitReadsTooEarly) {
  emu::set_lazy(false);
  struct Restore {
    ~Restore() { emu::set_lazy(true); }
  } restore;
  const int n = 4096;
  SecondStream two(n);
  cudaStream_t other = two.other;
  cudaEvent_t ready = two.ready;
  float* host = two.host;
  float* src = alloc(n);
  float* dst = alloc(n);
  std::vector<float> ones(n, 1.0f);
  ASSERT_EQ(cudaMemcpy(src, ones.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  for (bool wait : {true, false}) {
    ASSERT_EQ(cudaMemsetAsync(dst, 0, n * 4, other), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
    std::atomic<bool> go{wait};
    ASSERT_EQ(cudaLaunchHostFunc(
                  s_,
                  [](void* flag) {
                    while (!static_cast<std::atomic<bool>*>(flag)->load())
                      std::this_thread::yield();
                  },
                  &go),
              cudaSuccess);
    copy_kernel | Launch(n / 256, 256, 0, s_)(dst, src, n);
    ASSERT_EQ(cudaEventRecord(ready, s_), cudaSuccess);
    if (wait) {
      ASSERT_EQ(cudaStreamWaitEvent(other, ready, 0), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(host, dst, n * 4, cudaMemcpyDeviceToHost, other), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
    EXPECT_EQ(host[n - 1], wait ? 1.0f : 0.0f) << (wait ? "with" : "without") << " the wait";
    go = true;
    ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
  }
}

// Lazy streams (the default): nothing runs before the host synchronizes, then released work
// runs in a drawn order. With the event wait, the copy always reads the kernel's output; without
// it, the copy runs before the kernel in some of the draws and reads the buffer as it was, and
// which draws is fixed by the seed: the same every run. Nothing here depends on timing.
TEST_F(EmulationChecks, LazyStreamsMakeAMissingEventWaitReadStaleData) {
  ASSERT_TRUE(emu::lazy());
  const int n = 1000;
  SecondStream two(n);
  cudaStream_t other = two.other;
  cudaEvent_t ready = two.ready;
  float* host = two.host;
  float* src = alloc(n);
  float* dst = alloc(n);
  auto run = [&](bool wait, float value) {
    std::vector<float> v(n, value);
    EXPECT_EQ(cudaMemcpy(src, v.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(dst, 0, n * 4, other), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(other), cudaSuccess);
    copy_kernel | Launch((n + 255) / 256, 256, 0, s_)(dst, src, n);
    EXPECT_EQ(cudaEventRecord(ready, s_), cudaSuccess);
    if (wait) {
      EXPECT_EQ(cudaStreamWaitEvent(other, ready, 0), cudaSuccess);
    }
    EXPECT_EQ(cudaMemcpyAsync(host, dst, n * 4, cudaMemcpyDeviceToHost, other), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return host[n - 1];
  };
  int stale = 0;
  for (int i = 1; i <= 32; ++i) {
    EXPECT_EQ(run(true, float(i)), float(i)) << "with the wait, round " << i;
    const float got = run(false, float(i));
    EXPECT_TRUE(got == float(i) || got == 0.0f) << got;
    stale += got == 0.0f;
  }
  EXPECT_GT(stale, 0) << "without the wait, the copy never ran before the kernel";
  EXPECT_LT(stale, 32) << "without the wait, the copy always ran before the kernel";
}

}  // namespace
}  // namespace strata
