// The CUDA backend's choice between a vendor library's fused attention (cuDNN) and its own
// kernels (kernels/cuda/attention_library.h), on the emulated GPU (tests/cuda_emu.cmake): what
// supports() says with the library absent or turned off, and, with a test double standing in
// for the library, that the shapes it takes run on it, the others on the own kernels, that its
// written gradient is ACCUMULATED into dqkv as the contract asks, and that its errors come back
// at the next synchronize, while a library whose memory runs out leaves that call and every later
// call of the shape to the own kernels, without an error. The numbers are compared with the CPU
// backend's fused attention.
//
// cuDNN itself needs a GPU: tests/cuda_flash_attention_test.cc's CudnnAttention tests.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/attention_library.h"
#include "strata/device.h"
#include "strata/kernels.h"
#include "strata/kernels_wrapper.h"
#include "tests/attention_reference.h"

namespace strata {
namespace {

using test::AttnShape;
using test::Buffer;
using test::compare_close;

constexpr size_t kMiB = size_t{1} << 20;

// A library that runs the own kernels' launchers, but with a library's conventions: the
// backward writes the gradient (zeroes dqkv first), and it rejects one sequence length. Its
// forward or backward can fail (fail_forward), find no memory (oom_forward, oom_backward:
// kOutOfMemory with nothing enqueued, as cuDNN's workspace allocation does) or refuse the call
// (refuse_forward, refuse_backward: kUnavailable, as cuDNN's execute failing without a CUDA
// error).
class FakeLibrary final : public AttentionLibrary {
 public:
  int forwards = 0, backwards = 0;
  int rejected_T = -1;
  bool fail_forward = false;
  bool oom_forward = false, oom_backward = false;
  bool refuse_forward = false, refuse_backward = false;
  size_t workspace = 0;

  ~FakeLibrary() override {
    if (scratch_ != nullptr) cudaFree(scratch_);
  }
  std::string name() const override { return "fake library"; }
  bool supports(const OpShape& s, std::string* why) override {
    if (s.T == rejected_T) {
      *why = "fake rejects T=" + std::to_string(s.T);
      return false;
    }
    return true;
  }
  size_t workspace_bytes(const OpShape& /*shape*/) override { return workspace; }
  Status forward(cudaStream_t s, const OpShape& sh, void* out, float* lse,
                 const void* qkv) override {
    ++forwards;
    if (fail_forward) return internal_error("boom");
    if (oom_forward) return out_of_memory("fake forward workspace");
    if (refuse_forward) return unavailable("fake forward refused");
    return cuda_fused_attention_forward(s, sh.dt, out, lse, qkv, nullptr, sh.B, sh.T, sh.NH, sh.KVH,
                                        sh.hs);
  }
  Status backward(cudaStream_t s, const OpShape& sh, void* dqkv, const void* dout, const void* qkv,
                  const void* out, const float* lse) override {
    ++backwards;
    if (oom_backward) return out_of_memory("fake backward workspace");
    if (refuse_backward) return unavailable("fake backward refused");
    const size_t n = size_t(sh.B) * sh.T * (sh.NH + 2 * sh.KVH) * sh.hs;
    if (cudaMemsetAsync(dqkv, 0, n * dtype_size(sh.dt), s) != cudaSuccess) {
      return internal_error("memset");
    }
    const size_t rows = size_t(sh.B) * sh.NH * sh.T;
    if (scratch_ == nullptr && cudaMalloc(&scratch_, rows * 4 * 64) != cudaSuccess) {
      return internal_error("malloc");
    }
    return cuda_fused_attention_backward(s, sh.dt, dqkv, static_cast<float*>(scratch_), dout, qkv,
                                         out, lse, nullptr, sh.B, sh.T, sh.NH, sh.KVH, sh.hs);
  }

 private:
  void* scratch_ = nullptr;
};

class LibraryAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = create_cpu_device({.capacity = 64 * kMiB, .threads = 0});
    ASSERT_TRUE(cpu.is_ok()) << cpu.status().to_string();
    cpu_ = std::move(cpu).value();
    gpu_ = make_gpu();
    ASSERT_NE(gpu_, nullptr);
    rng_.seed(std::random_device{}());
  }
  void TearDown() override {
    if (gpu_ == nullptr) return;
    for (void* p : bufs_) gpu_->release(p);
  }
  static std::unique_ptr<Device> make_gpu() {
    auto gpu = create_cuda_device({.ordinal = 0, .reserve = 64 * kMiB, .capacity = 64 * kMiB});
    EXPECT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    return gpu.is_ok() ? std::move(gpu).value() : nullptr;
  }
  // The device's kernels under a LibraryAttentionKernels with `lib` (not owned by the caller).
  std::unique_ptr<LibraryAttentionKernels> with_library(std::unique_ptr<AttentionLibrary> lib) {
    return std::make_unique<LibraryAttentionKernels>(
        std::make_unique<KernelsWrapper>(&gpu_->kernels()), std::move(lib), "no library", 0,
        &sink_);
  }

  void* upload(const void* host, size_t bytes) {
    auto p = gpu_->allocate(bytes, "test");
    EXPECT_TRUE(p.is_ok()) << p.status().to_string();
    bufs_.push_back(*p);
    gpu_->copy_h2d(gpu_->h2d_stream(), *p, host, bytes);
    EXPECT_TRUE(gpu_->synchronize(gpu_->h2d_stream()).is_ok());
    return *p;
  }
  void download(void* host, const void* dev, size_t bytes) {
    gpu_->copy_d2h(gpu_->d2h_stream(), host, dev, bytes);
    EXPECT_TRUE(gpu_->synchronize(gpu_->d2h_stream()).is_ok());
  }

  // Forward then backward through `k` (the emulated GPU's kernels, or a wrapper of them),
  // dqkv starting from dqkv0 (accumulated onto, or written over); compared with the CPU
  // backend's fused attention. `packed`: rows of several sequences (positions), attention
  // masked per sequence.
  void expect_matches_cpu(Kernels& k, const AttnShape& s, DType dt, bool packed = false,
                          bool accumulate = true) {
    const std::vector<int32_t> host_pos =
        packed ? test::packed_positions(s.B, s.T, {11, 3, 20}) : std::vector<int32_t>();
    const int32_t* cpu_pos = packed ? host_pos.data() : nullptr;
    const Buffer qkv = test::random_buffer(dt, s.qkv_elems(), rng_, -2.0f, 2.0f);
    const Buffer dout = test::random_buffer(dt, s.out_elems(), rng_, -1.0f, 1.0f);
    const Buffer dqkv0 = test::random_buffer(dt, s.qkv_elems(), rng_, -1.0f, 1.0f);
    Buffer out_cpu(dt, s.out_elems()), dqkv_cpu = dqkv0;
    std::vector<float> lse_cpu(s.rows()), scratch(s.rows());
    Kernels& ck = cpu_->kernels();
    Stream& cs = cpu_->compute_stream();
    ck.fused_attention_forward(cs, dt, out_cpu.data(), lse_cpu.data(), qkv.bytes.data(), cpu_pos,
                               s.B, s.T, s.NH, s.NKV, s.hs);
    ck.fused_attention_backward(cs, dt, dqkv_cpu.data(), scratch.data(), dout.bytes.data(),
                                qkv.bytes.data(), out_cpu.data(), lse_cpu.data(), cpu_pos, s.B, s.T,
                                s.NH, s.NKV, s.hs, accumulate);
    ASSERT_TRUE(cpu_->synchronize(cs).is_ok());

    void* x = upload(qkv.bytes.data(), qkv.bytes.size());
    void* g = upload(dout.bytes.data(), dout.bytes.size());
    void* dx = upload(dqkv0.bytes.data(), dqkv0.bytes.size());
    void* y = upload(out_cpu.data(), out_cpu.bytes.size());  // overwritten
    auto* lse = static_cast<float*>(upload(lse_cpu.data(), s.rows() * 4));
    auto* sc = static_cast<float*>(upload(scratch.data(), s.rows() * 4));
    const auto* pos =
        packed ? static_cast<const int32_t*>(upload(host_pos.data(), host_pos.size() * 4))
               : nullptr;
    Stream& st = gpu_->compute_stream();
    k.fused_attention_forward(st, dt, y, lse, x, pos, s.B, s.T, s.NH, s.NKV, s.hs);
    k.fused_attention_backward(st, dt, dx, sc, g, x, y, lse, pos, s.B, s.T, s.NH, s.NKV, s.hs,
                               accumulate);
    Status done = gpu_->synchronize(st);
    ASSERT_TRUE(done.is_ok()) << done.to_string();
    ASSERT_TRUE(sink_.take().is_ok());
    Buffer out(dt, s.out_elems()), dqkv(dt, s.qkv_elems());
    std::vector<float> lse_got(s.rows());
    download(out.data(), y, out.bytes.size());
    download(dqkv.data(), dx, dqkv.bytes.size());
    download(lse_got.data(), lse, s.rows() * 4);
    const double rtol = dt == DType::kBF16 ? 2e-2 : 4e-3;
    EXPECT_EQ(compare_close(out.values(), out_cpu.values(), rtol), "") << "out";
    EXPECT_EQ(compare_close(std::vector<double>(lse_got.begin(), lse_got.end()),
                            std::vector<double>(lse_cpu.begin(), lse_cpu.end()), 1e-4),
              "")
        << "lse";
    // Accumulated onto dqkv0 (a written gradient would miss dqkv0 by far more than rtol), or
    // written over it (one that kept dqkv0 would miss by as much). A written gradient is
    // compared with dqkv0 added to both sides in double, so its tolerance is the accumulated
    // one's: the kernels' error is the gradient's (bf16 P and dS), and measured against the
    // bare gradient's rms alone one element in thousands of runs' worth fell outside.
    std::vector<double> got = dqkv.values(), want = dqkv_cpu.values();
    if (!accumulate) {
      const std::vector<double> base = dqkv0.values();
      for (size_t i = 0; i < got.size(); ++i) {
        got[i] += base[i];
        want[i] += base[i];
      }
    }
    EXPECT_EQ(compare_close(got, want, rtol), "")
        << (accumulate ? "dqkv accumulated" : "dqkv written");
  }

  std::unique_ptr<Device> cpu_, gpu_;
  std::vector<void*> bufs_;
  CudaErrorSink sink_;
  std::mt19937_64 rng_;
};

const OpShape kShape{DType::kBF16, 64, 1, 40, 4, 2};

TEST_F(LibraryAttention, WithoutCudnnTheOwnKernelsRunAndSupportsSaysWhy) {
  KernelSupport any = gpu_->kernels().supports(KernelOp::kFusedAttention, {DType::kBF16, 64});
  EXPECT_TRUE(any.supported);
  EXPECT_EQ(any.path.rfind("cuda wmma", 0), 0u) << any.path;
  KernelSupport full = gpu_->kernels().supports(KernelOp::kFusedAttention, kShape);
  EXPECT_TRUE(full.supported);
  EXPECT_EQ(full.path.rfind("cuda wmma", 0), 0u) << full.path;
  EXPECT_NE(full.path.find("built without cuDNN"), std::string::npos) << full.path;
  KernelSupport f32 = gpu_->kernels().supports(KernelOp::kFusedAttention, {DType::kF32, 64});
  EXPECT_FALSE(f32.supported) << f32.path;
  expect_matches_cpu(gpu_->kernels(), {1, 40, 4, 2, 64}, DType::kBF16);
}

TEST_F(LibraryAttention, EnvironmentSwitchTurnsTheLibraryOff) {
  ASSERT_EQ(setenv(kCudnnEnv, "0", 1), 0);
  std::string why;
  EXPECT_EQ(attention_library_from_env(0, /*deterministic=*/true, &why), nullptr);
  EXPECT_NE(why.find("STRATA_CUDNN=0"), std::string::npos) << why;
  for (void* p : bufs_) gpu_->release(p);
  bufs_.clear();
  gpu_.reset();  // one emulated GPU: the old device goes first
  gpu_ = make_gpu();
  ASSERT_NE(gpu_, nullptr);
  KernelSupport full = gpu_->kernels().supports(KernelOp::kFusedAttention, kShape);
  unsetenv(kCudnnEnv);
  EXPECT_TRUE(full.supported);
  EXPECT_NE(full.path.find("STRATA_CUDNN=0"), std::string::npos) << full.path;
}

TEST_F(LibraryAttention, TheLibraryRunsTheShapesItTakesItsGradientAccumulatedOrWritten) {
  auto owned = std::make_unique<FakeLibrary>();
  FakeLibrary* lib = owned.get();
  auto k = with_library(std::move(owned));
  KernelSupport full = k->supports(KernelOp::kFusedAttention, kShape);
  EXPECT_TRUE(full.supported);
  EXPECT_EQ(full.path, "fake library");
  lib->workspace = 3 * kMiB;
  EXPECT_EQ(k->supports(KernelOp::kFusedAttention, kShape).path,
            "fake library, workspace 3.00 MiB");
  // "Any shape" is the own kernels' answer: the library is never the only path.
  EXPECT_EQ(k->supports(KernelOp::kFusedAttention, {DType::kBF16, 64}).path.rfind("cuda wmma", 0),
            0u);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (bool accumulate : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (accumulate ? " accumulated" : " written"));
      expect_matches_cpu(*k, {2, 40, 4, 2, 64}, dt, /*packed=*/false, accumulate);
    }
  }
  EXPECT_EQ(lib->forwards, 4);
  EXPECT_EQ(lib->backwards, 4);
}

TEST_F(LibraryAttention, ShapesTheLibraryRejectsRunOnTheOwnKernels) {
  auto owned = std::make_unique<FakeLibrary>();
  FakeLibrary* lib = owned.get();
  lib->rejected_T = 40;
  auto k = with_library(std::move(owned));
  KernelSupport full = k->supports(KernelOp::kFusedAttention, kShape);
  EXPECT_TRUE(full.supported);
  EXPECT_EQ(full.path.rfind("cuda wmma", 0), 0u) << full.path;
  EXPECT_NE(full.path.find("fake rejects T=40"), std::string::npos) << full.path;
  expect_matches_cpu(*k, {1, 40, 4, 2, 64}, DType::kBF16);
  expect_matches_cpu(*k, {1, 40, 4, 2, 64}, DType::kBF16, /*packed=*/false, /*accumulate=*/false);
  EXPECT_EQ(lib->forwards, 0);
  EXPECT_EQ(lib->backwards, 0);
}

// A call with positions (attention masked per sequence) runs on the own kernels: the library
// path does not mask per sequence, and says so.
TEST_F(LibraryAttention, CallsWithPositionsRunOnTheOwnKernels) {
  auto owned = std::make_unique<FakeLibrary>();
  FakeLibrary* lib = owned.get();
  auto k = with_library(std::move(owned));
  OpShape packed = kShape;
  packed.positions = true;
  KernelSupport s = k->supports(KernelOp::kFusedAttention, packed);
  EXPECT_TRUE(s.supported);
  EXPECT_EQ(s.path.rfind("cuda wmma", 0), 0u) << s.path;
  EXPECT_NE(s.path.find("per sequence"), std::string::npos) << s.path;
  expect_matches_cpu(*k, {2, 40, 4, 2, 64}, DType::kBF16, /*packed=*/true);
  EXPECT_EQ(lib->forwards, 0);
  EXPECT_EQ(lib->backwards, 0);
  expect_matches_cpu(*k, {2, 40, 4, 2, 64}, DType::kBF16);  // the same shape without positions
  EXPECT_EQ(lib->forwards, 1);
}

TEST_F(LibraryAttention, ALibraryErrorComesBackWithItsName) {
  auto owned = std::make_unique<FakeLibrary>();
  owned->fail_forward = true;
  auto k = with_library(std::move(owned));
  auto buf = gpu_->allocate(kMiB, "buf");
  ASSERT_TRUE(buf.is_ok());
  bufs_.push_back(*buf);
  k->fused_attention_forward(gpu_->compute_stream(), DType::kBF16, *buf, static_cast<float*>(*buf),
                             *buf, nullptr, 1, 16, 2, 2, 64);
  Status s = sink_.take();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("boom"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("fused_attention_forward (fake library)"), std::string::npos)
      << s.to_string();
}

// A library whose workspace cannot be had (kOutOfMemory), or that refuses to run a call
// (kUnavailable), fails neither the call nor the step: the call runs on the own kernels, with
// the same numbers, no error reaches the sink, and the shape stays on the own kernels,
// supports() saying why. A backward declined after the library's forward takes the library's
// out and lse as the own forward's.
TEST_F(LibraryAttention, ADeclinedCallLeavesTheShapeToTheOwnKernels) {
  for (bool memory : {true, false}) {
    for (bool in_forward : {true, false}) {
      const std::string why = std::string("fake ") + (in_forward ? "forward" : "backward") +
                              (memory ? " workspace" : " refused");
      SCOPED_TRACE(why);
      auto owned = std::make_unique<FakeLibrary>();
      FakeLibrary* lib = owned.get();
      if (memory) {
        (in_forward ? lib->oom_forward : lib->oom_backward) = true;
      } else {
        (in_forward ? lib->refuse_forward : lib->refuse_backward) = true;
      }
      auto k = with_library(std::move(owned));
      expect_matches_cpu(*k, {2, 40, 4, 2, 64}, DType::kBF16);  // the sink is checked empty there
      EXPECT_EQ(lib->forwards, 1);
      EXPECT_EQ(lib->backwards, in_forward ? 0 : 1);
      KernelSupport after = k->supports(KernelOp::kFusedAttention, {DType::kBF16, 64, 2, 40, 4, 2});
      EXPECT_TRUE(after.supported);
      EXPECT_EQ(after.path.rfind("cuda wmma", 0), 0u) << after.path;
      EXPECT_NE(after.path.find(why), std::string::npos) << after.path;
      // Later calls of the shape do not ask the library again; another shape still runs on it.
      expect_matches_cpu(*k, {2, 40, 4, 2, 64}, DType::kBF16);
      EXPECT_EQ(lib->forwards, 1);
      lib->oom_forward = lib->oom_backward = lib->refuse_forward = lib->refuse_backward = false;
      expect_matches_cpu(*k, {1, 40, 4, 2, 64}, DType::kBF16);
      EXPECT_EQ(lib->forwards, 2);
      EXPECT_EQ(lib->backwards, in_forward ? 1 : 2);
    }
  }
}

// The memory rule a library's shape is declined by when its graphs are built: workspace +
// gradient scratch + headroom against the free memory outside the arena plus the workspace a
// grown one replaces; the reason names the bytes device.reserve lacks and, for a deterministic
// backward, the switch that needs no such workspace.
TEST(LibraryMemory, AShapeFitsTheMemoryOutsideTheArenaOrSaysHowMuchMoreItNeeds) {
  const size_t GiB = size_t{1} << 30;
  EXPECT_EQ(library_memory_fits(GiB, 40 * kMiB, 64 * kMiB, 2 * GiB, 0, true), "");
  EXPECT_EQ(library_memory_fits(GiB, 40 * kMiB, 64 * kMiB, GiB, 104 * kMiB, true), "");
  const std::string why = library_memory_fits(GiB, 40 * kMiB, 64 * kMiB, GiB, 0, true);
  EXPECT_NE(why.find("raise device.reserve by 104.00 MiB"), std::string::npos) << why;
  EXPECT_NE(why.find("device.deterministic false"), std::string::npos) << why;
  const std::string nd = library_memory_fits(GiB, 40 * kMiB, 64 * kMiB, GiB, 0, false);
  EXPECT_NE(nd.find("raise device.reserve by 104.00 MiB"), std::string::npos) << nd;
  EXPECT_EQ(nd.find("device.deterministic"), std::string::npos) << nd;
}

}  // namespace
}  // namespace strata
