// The CUDA fused attention (kernels/cuda/flash_attention.cu) on a GPU, against the CPU backend:
// its fused attention (kernels/cpu/flash_attention.cc), its plain attention, and the
// double-precision reference (tests/attention_reference.h); and against the plain CUDA kernels
// at a long sequence. Fresh random inputs, several shapes: T not a multiple of the tile, head
// sizes 64 and 128, grouped-query heads; forward (out, lse) and backward (dqkv, accumulated onto
// a random gradient), bf16 and fp16. These run the own kernels (under the device's cuDNN layer,
// KernelsWrapper::wrapped()); the Cudnn* tests run the device's kernels as a model does, where
// cuDNN's fused attention takes the shapes it supports (kernels/cuda/cudnn_attention.cc), and
// compare it the same way.
//
// Without a visible GPU every test reports SKIPPED with the reason; without cuDNN (not built
// with it, not loadable, STRATA_CUDNN=0) the Cudnn* tests report SKIPPED with supports()' reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"
#include "strata/kernels_wrapper.h"
#include "tests/attention_reference.h"

namespace strata {
namespace {

using test::AttnShape;
using test::Buffer;
using test::compare_close;

constexpr size_t kMiB = size_t{1} << 20;

// |cuda - cpu| <= rtol (|cpu| + rms(cpu)): the CUDA kernels round the probabilities and dS to
// the input type for the tensor cores, and sum in another order.
double rtol(DType dt) { return dt == DType::kBF16 ? 2e-2 : 4e-3; }

// cuDNN's gradient against a reference. cuDNN rounds the probabilities and their gradient to the
// inputs' type before the backward products (as FlashAttention does), where the CPU backend and
// the own kernels keep them in fp32: on an H200 a few elements in 10^5 of a gradient written
// alone (not added to a larger one) were off by up to 1.9x rtol(dt). Each element gets 3x, and
// the error's rms must stay under rtol(dt) of the gradient's rms, which a systematic error (a
// wrong scale, a head or a position mixed up) would not.
std::string compare_cudnn_gradient(const std::vector<double>& got, const std::vector<double>& want,
                                   DType dt) {
  std::string bad = compare_close(got, want, 3 * rtol(dt));
  if (!bad.empty() || got.size() != want.size() || want.empty()) return bad;
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (got[i] - want[i]) * (got[i] - want[i]);
    ref += want[i] * want[i];
  }
  if (err <= rtol(dt) * rtol(dt) * ref) return "";
  return "rms error " + std::to_string(std::sqrt(err / ref)) + " of the rms, over rtol " +
         std::to_string(rtol(dt));
}

std::string skip_reason() {
  std::string why;
  return cuda_device_available(&why) ? std::string() : why;
}

class CudaFlashAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = skip_reason();
    if (!why.empty()) GTEST_SKIP() << why;
    auto cpu = create_cpu_device({.capacity = 256 * kMiB, .threads = 0});
    ASSERT_TRUE(cpu.is_ok()) << cpu.status().to_string();
    auto gpu =
        create_cuda_device({.ordinal = 0, .reserve = size_t{1} << 30, .capacity = 4096 * kMiB});
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    cpu_ = std::move(cpu).value();
    gpu_ = std::move(gpu).value();
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }
  void TearDown() override {
    for (void* p : gpu_bufs_) gpu_->release(p);
  }

  void* upload(const void* host, size_t bytes) {
    auto p = gpu_->allocate(bytes, "test");
    EXPECT_TRUE(p.is_ok()) << p.status().to_string();
    if (!p.is_ok()) return nullptr;
    gpu_bufs_.push_back(*p);
    gpu_->copy_h2d(gpu_->h2d_stream(), *p, host, bytes);
    EXPECT_TRUE(gpu_->synchronize(gpu_->h2d_stream()).is_ok());
    return *p;
  }
  void download(void* host, const void* dev, size_t bytes) {
    gpu_->copy_d2h(gpu_->d2h_stream(), host, dev, bytes);
    EXPECT_TRUE(gpu_->synchronize(gpu_->d2h_stream()).is_ok());
  }

  struct Result {
    Buffer out, dqkv;
    std::vector<float> lse;
  };
  // The CUDA backend's own fused attention kernels (below its library layer).
  Kernels& own() {
    auto* w = dynamic_cast<KernelsWrapper*>(&gpu_->kernels());
    return w != nullptr ? *w->wrapped() : gpu_->kernels();
  }
  // The path the device's kernels take for this call ("cudnn ..." or "cuda wmma; ...").
  std::string path(DType dt, const AttnShape& s) {
    return gpu_->kernels()
        .supports(KernelOp::kFusedAttention, {dt, s.hs, s.B, s.T, s.NH, s.NKV})
        .path;
  }

  // Forward then backward of the fused op. `on_gpu`: buffers are uploaded and `gpu_k` runs
  // (default: the own kernels); else the CPU backend. `positions` (host [B*T]): masked per
  // sequence. `accumulate` false: the gradient is written over dqkv0 (the models' call).
  Result run_fused(bool on_gpu, const AttnShape& s, const Buffer& qkv, const Buffer& dout,
                   const Buffer& dqkv0, Kernels* gpu_k = nullptr,
                   const std::vector<int32_t>* positions = nullptr, bool accumulate = true) {
    const int32_t* host_pos = positions != nullptr ? positions->data() : nullptr;
    Result r{Buffer(qkv.dt, s.out_elems()), dqkv0, std::vector<float>(s.rows())};
    std::vector<float> scratch(s.rows());
    const DType dt = qkv.dt;
    if (!on_gpu) {
      Kernels& k = cpu_->kernels();
      Stream& st = cpu_->compute_stream();
      k.fused_attention_forward(st, dt, r.out.data(), r.lse.data(), qkv.bytes.data(), host_pos, s.B,
                                s.T, s.NH, s.NKV, s.hs);
      k.fused_attention_backward(st, dt, r.dqkv.data(), scratch.data(), dout.bytes.data(),
                                 qkv.bytes.data(), r.out.data(), r.lse.data(), host_pos, s.B, s.T,
                                 s.NH, s.NKV, s.hs, accumulate);
      EXPECT_TRUE(cpu_->synchronize(st).is_ok());
      return r;
    }
    void* x = upload(qkv.bytes.data(), qkv.bytes.size());
    void* g = upload(dout.bytes.data(), dout.bytes.size());
    void* dx = upload(dqkv0.bytes.data(), dqkv0.bytes.size());
    void* y = upload(r.out.data(), r.out.bytes.size());
    auto* lse = static_cast<float*>(upload(r.lse.data(), s.rows() * 4));
    auto* sc = static_cast<float*>(upload(scratch.data(), s.rows() * 4));
    const auto* pos = host_pos != nullptr
                          ? static_cast<const int32_t*>(upload(host_pos, positions->size() * 4))
                          : nullptr;
    Kernels& k = gpu_k != nullptr ? *gpu_k : own();
    Stream& st = gpu_->compute_stream();
    k.fused_attention_forward(st, dt, y, lse, x, pos, s.B, s.T, s.NH, s.NKV, s.hs);
    k.fused_attention_backward(st, dt, dx, sc, g, x, y, lse, pos, s.B, s.T, s.NH, s.NKV, s.hs,
                               accumulate);
    Status done = gpu_->synchronize(st);
    EXPECT_TRUE(done.is_ok()) << done.to_string();
    download(r.out.data(), y, r.out.bytes.size());
    download(r.lse.data(), lse, s.rows() * 4);
    download(r.dqkv.data(), dx, r.dqkv.bytes.size());
    return r;
  }

  std::string seed_text() const { return " (seed " + std::to_string(seed_) + ")"; }

  // A call's random inputs: qkv in [-2, 2]; dout, and the dqkv the gradient is accumulated onto,
  // in [-1, 1].
  struct Inputs {
    Buffer qkv, dout, dqkv0;
  };
  Inputs random_inputs(DType dt, const AttnShape& s) {
    Buffer qkv = test::random_buffer(dt, s.qkv_elems(), rng_, -2.0f, 2.0f);
    Buffer dout = test::random_buffer(dt, s.out_elems(), rng_, -1.0f, 1.0f);
    return {std::move(qkv), std::move(dout),
            test::random_buffer(dt, s.qkv_elems(), rng_, -1.0f, 1.0f)};
  }

  // Replaces the fixture's GPU with one made with `o` (the old one and its buffers go first).
  void reopen(const CudaDeviceOptions& o) {
    for (void* p : gpu_bufs_) gpu_->release(p);
    gpu_bufs_.clear();
    gpu_.reset();
    auto gpu = create_cuda_device(o);
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    gpu_ = std::move(gpu).value();
  }

  std::unique_ptr<Device> cpu_, gpu_;
  std::vector<void*> gpu_bufs_;
  uint32_t seed_ = 0;
  std::mt19937_64 rng_;
};

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

TEST_F(CudaFlashAttentionTest, SupportsBf16AndFp16WithHeadSizes64And128) {
  Kernels& k = own();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    EXPECT_TRUE(k.supports(KernelOp::kFusedAttention, {dt, 64}).supported);
    EXPECT_TRUE(k.supports(KernelOp::kFusedAttention, {dt, 128}).supported);
    EXPECT_FALSE(k.supports(KernelOp::kFusedAttention, {dt, 96}).supported);
  }
  EXPECT_FALSE(k.supports(KernelOp::kFusedAttention, {DType::kF32, 64}).supported);
}

TEST_F(CudaFlashAttentionTest, MatchesTheCpuBackendAndTheReference) {
  const AttnShape shapes[] = {
      {2, 64, 2, 2, 64},    // one tile
      {2, 100, 3, 3, 64},   // T not a multiple of the tile
      {1, 257, 8, 2, 64},   // grouped-query heads, 5 tiles
      {2, 130, 4, 4, 128},  // head size 128
      {1, 200, 4, 1, 128},  // multi-query
      {3, 17, 2, 1, 64},    // shorter than one tile
  };
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (const AttnShape& s : shapes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + s.name() + seed_text());
      const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
      Result cpu = run_fused(false, s, qkv, dout, dqkv0);
      Result gpu = run_fused(true, s, qkv, dout, dqkv0);
      EXPECT_EQ(compare_close(gpu.out.values(), cpu.out.values(), rtol(dt)), "") << "out";
      EXPECT_EQ(compare_close(as_double(gpu.lse), as_double(cpu.lse), 1e-4), "") << "lse";
      EXPECT_EQ(compare_close(gpu.dqkv.values(), cpu.dqkv.values(), rtol(dt)), "") << "dqkv";
      if (s.T <= 130) {  // the O(T^2 hs) double reference, on the smaller shapes
        std::vector<double> out_ref, lse_ref;
        test::reference_attention_forward(s, qkv.values(), &out_ref, &lse_ref);
        std::vector<double> d_ref =
            test::reference_attention_backward(s, qkv.values(), dout.values());
        const std::vector<double> before = dqkv0.values();
        for (size_t i = 0; i < d_ref.size(); ++i) d_ref[i] += before[i];
        EXPECT_EQ(compare_close(gpu.out.values(), out_ref, rtol(dt)), "") << "out vs reference";
        EXPECT_EQ(compare_close(gpu.dqkv.values(), d_ref, rtol(dt)), "") << "dqkv vs reference";
      }
    }
  }
}

// With NKV == NH the fused op replaces attention_forward/backward: same input, same numbers.
TEST_F(CudaFlashAttentionTest, MatchesThePlainCudaAttentionAtALongSequence) {
  const DType dt = DType::kBF16;
  const AttnShape s{1, 2048 + 33, 4, 4, 128};
  const int C = s.NH * s.hs;
  SCOPED_TRACE(s.name() + seed_text());
  const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
  Result fused = run_fused(true, s, qkv, dout, dqkv0);

  const size_t tt = size_t(s.B) * s.NH * s.T * s.T;
  void* x = upload(qkv.bytes.data(), qkv.bytes.size());
  void* g = upload(dout.bytes.data(), dout.bytes.size());
  void* dx = upload(dqkv0.bytes.data(), dqkv0.bytes.size());
  auto y = gpu_->allocate(fused.out.bytes.size(), "out");
  auto att = gpu_->allocate(tt * 4, "att");
  auto scratch = gpu_->allocate(tt * 4, "scratch");
  ASSERT_TRUE(y.is_ok() && att.is_ok() && scratch.is_ok());
  for (void* p : {*y, *att, *scratch}) gpu_bufs_.push_back(p);
  Kernels& k = gpu_->kernels();
  Stream& st = gpu_->compute_stream();
  k.attention_gqa_forward(st, dt, *y, static_cast<float*>(*att), x, nullptr, s.B, s.T, s.NH, s.NH,
                          C / s.NH);
  k.attention_gqa_backward(st, dt, dx, static_cast<float*>(*scratch), g, x,
                           static_cast<float*>(*att), nullptr, s.B, s.T, s.NH, s.NH, C / s.NH);
  ASSERT_TRUE(gpu_->synchronize(st).is_ok());
  Buffer out_plain(dt, s.out_elems()), dqkv_plain(dt, s.qkv_elems());
  download(out_plain.data(), *y, out_plain.bytes.size());
  download(dqkv_plain.data(), dx, dqkv_plain.bytes.size());
  EXPECT_EQ(compare_close(fused.out.values(), out_plain.values(), rtol(dt)), "") << "out";
  EXPECT_EQ(compare_close(fused.dqkv.values(), dqkv_plain.values(), rtol(dt)), "") << "dqkv";
}

// Packed rows (positions): each query sees only its own sequence, key tiles before a query
// tile's sequences skipped; through the device's kernels (a library path declines positions).
TEST_F(CudaFlashAttentionTest, PackedRowsMatchTheCpuBackendAndTheReference) {
  const AttnShape s{2, 300, 4, 2, 64};
  const std::vector<int32_t> pos = test::packed_positions(s.B, s.T, {200, 7, 1, 90});
  for (DType dt : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " " + s.name() + seed_text());
    const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
    Result cpu = run_fused(false, s, qkv, dout, dqkv0, nullptr, &pos);
    Result gpu = run_fused(true, s, qkv, dout, dqkv0, &gpu_->kernels(), &pos);
    std::vector<double> out_ref, lse_ref;
    test::reference_attention_forward(s, qkv.values(), &out_ref, &lse_ref, &pos);
    EXPECT_EQ(compare_close(gpu.out.values(), out_ref, rtol(dt)), "") << "out vs reference";
    EXPECT_EQ(compare_close(gpu.out.values(), cpu.out.values(), rtol(dt)), "") << "out";
    EXPECT_EQ(compare_close(as_double(gpu.lse), as_double(cpu.lse), 1e-4), "") << "lse";
    EXPECT_EQ(compare_close(gpu.dqkv.values(), cpu.dqkv.values(), rtol(dt)), "") << "dqkv";
  }
}

// No atomics: the same inputs give the same bits.
TEST_F(CudaFlashAttentionTest, IsDeterministic) {
  const AttnShape s{2, 300, 8, 2, 64};
  const DType dt = DType::kBF16;
  const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
  Result a = run_fused(true, s, qkv, dout, dqkv0);
  Result b = run_fused(true, s, qkv, dout, dqkv0);
  EXPECT_EQ(a.out.bytes, b.out.bytes);
  EXPECT_EQ(a.dqkv.bytes, b.dqkv.bytes);
}

TEST_F(CudaFlashAttentionTest, UnsupportedCallsFailAtTheNextSynchronize) {
  auto buf = gpu_->allocate(kMiB, "buf");
  ASSERT_TRUE(buf.is_ok());
  gpu_bufs_.push_back(*buf);
  Stream& st = gpu_->compute_stream();
  gpu_->kernels().fused_attention_forward(st, DType::kF32, *buf, static_cast<float*>(*buf), *buf,
                                          nullptr, 1, 16, 2, 2, 64);
  Status s = gpu_->synchronize(st);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("fused_attention_forward"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("not supported"), std::string::npos) << s.to_string();
  gpu_->kernels().fused_attention_forward(st, DType::kBF16, *buf, static_cast<float*>(*buf), *buf,
                                          nullptr, 1, 16, 3, 2, 64);  // NH not a multiple of NKV
  s = gpu_->synchronize(st);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("multiple of NKV"), std::string::npos) << s.to_string();
}

// cuDNN's fused attention, through the device's kernels, against the CPU backend and the double
// reference: the shapes above plus a longer Llama-like one. Shapes cuDNN does not take are
// listed, not failed; if it takes none the test is SKIPPED with supports()' reason.
TEST_F(CudaFlashAttentionTest, CudnnMatchesTheCpuBackendAndTheReference) {
  const AttnShape shapes[] = {
      {2, 64, 2, 2, 64},   {2, 100, 3, 3, 64}, {1, 257, 8, 2, 64},   {2, 130, 4, 4, 128},
      {1, 200, 4, 1, 128}, {3, 17, 2, 1, 64},  {1, 1024, 8, 2, 128},  // grouped-query heads as
                                                                      // Llama 3 (4 query heads per
                                                                      // KV head)
  };
  int ran = 0;
  std::string not_run, first_not_run;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (const AttnShape& s : shapes) {
      const std::string p = path(dt, s);
      const std::string what = std::string(dtype_name(dt)) + " " + s.name();
      if (p.rfind("cudnn", 0) != 0) {
        if (not_run.empty()) first_not_run = what + ": " + p;
        not_run += "\n  " + what + ": " + p;
        continue;
      }
      ++ran;
      SCOPED_TRACE(what + " on " + p + seed_text());
      const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
      Result cpu = run_fused(false, s, qkv, dout, dqkv0);
      Result gpu = run_fused(true, s, qkv, dout, dqkv0, &gpu_->kernels());
      EXPECT_EQ(compare_close(gpu.out.values(), cpu.out.values(), rtol(dt)), "") << "out";
      EXPECT_EQ(compare_close(as_double(gpu.lse), as_double(cpu.lse), 1e-4), "") << "lse";
      EXPECT_EQ(compare_cudnn_gradient(gpu.dqkv.values(), cpu.dqkv.values(), dt), "") << "dqkv";
      if (s.T <= 130) {
        std::vector<double> out_ref, lse_ref;
        test::reference_attention_forward(s, qkv.values(), &out_ref, &lse_ref);
        std::vector<double> d_ref =
            test::reference_attention_backward(s, qkv.values(), dout.values());
        const std::vector<double> before = dqkv0.values();
        for (size_t i = 0; i < d_ref.size(); ++i) d_ref[i] += before[i];
        EXPECT_EQ(compare_close(gpu.out.values(), out_ref, rtol(dt)), "") << "out vs reference";
        EXPECT_EQ(compare_cudnn_gradient(gpu.dqkv.values(), d_ref, dt), "") << "dqkv vs reference";
      }
      // The models' call: the gradient written by strides straight into dqkv, whose bytes were
      // NaN (every element is written).
      Buffer nan = dqkv0;
      std::memset(nan.bytes.data(), 0xff, nan.bytes.size());
      Result cpu_w = run_fused(false, s, qkv, dout, nan, nullptr, nullptr, /*accumulate=*/false);
      Result gpu_w = run_fused(true, s, qkv, dout, nan, &gpu_->kernels(), nullptr, false);
      EXPECT_EQ(compare_cudnn_gradient(gpu_w.dqkv.values(), cpu_w.dqkv.values(), dt), "")
          << "dqkv written";
      // Neither call was declined at execution (it would have run on the own kernels).
      EXPECT_EQ(path(dt, s), p) << "cuDNN declined the shape after running it";
    }
  }
  if (ran == 0) GTEST_SKIP() << "cuDNN ran no shape; the first: " << first_not_run;
  if (!not_run.empty()) std::printf("cuDNN did not take:%s\n", not_run.c_str());
}

// cuDNN and the own kernels on one long sequence (bf16, hs 128, grouped-query heads): the same
// numbers within bf16 rounding.
TEST_F(CudaFlashAttentionTest, CudnnAgreesWithTheOwnKernelsAtALongSequence) {
  const DType dt = DType::kBF16;
  const AttnShape s{2, 2048 + 33, 8, 2, 128};
  const std::string p = path(dt, s);
  if (p.rfind("cudnn", 0) != 0) GTEST_SKIP() << "cuDNN does not run " << s.name() << ": " << p;
  SCOPED_TRACE(s.name() + " on " + p + seed_text());
  const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
  Result lib = run_fused(true, s, qkv, dout, dqkv0, &gpu_->kernels());
  Result mine = run_fused(true, s, qkv, dout, dqkv0);
  EXPECT_EQ(compare_close(lib.out.values(), mine.out.values(), rtol(dt)), "") << "out";
  EXPECT_EQ(compare_close(as_double(lib.lse), as_double(mine.lse), 1e-4), "") << "lse";
  EXPECT_EQ(compare_cudnn_gradient(lib.dqkv.values(), mine.dqkv.values(), dt), "") << "dqkv";
}

// The backward is built with cuDNN's deterministic algorithm: the same inputs give the same bits.
TEST_F(CudaFlashAttentionTest, CudnnIsDeterministic) {
  const AttnShape s{2, 300, 8, 2, 64};
  const DType dt = DType::kBF16;
  const std::string p = path(dt, s);
  if (p.rfind("cudnn", 0) != 0) GTEST_SKIP() << "cuDNN does not run " << s.name() << ": " << p;
  const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
  Result a = run_fused(true, s, qkv, dout, dqkv0, &gpu_->kernels());
  Result b = run_fused(true, s, qkv, dout, dqkv0, &gpu_->kernels());
  EXPECT_EQ(a.out.bytes, b.out.bytes);
  EXPECT_EQ(a.dqkv.bytes, b.dqkv.bytes);
}

// device.deterministic false: cuDNN's non-deterministic backward, the same numbers within the
// tolerances (its bits may vary run to run).
TEST_F(CudaFlashAttentionTest, CudnnNonDeterministicBackwardMatchesTheCpuBackend) {
  ASSERT_NO_FATAL_FAILURE(reopen(
      {.ordinal = 0, .reserve = size_t{1} << 30, .capacity = 4096 * kMiB, .deterministic = false}));
  const DType dt = DType::kBF16;
  const AttnShape s{2, 1024 + 7, 8, 2, 128};
  const std::string p = path(dt, s);
  if (p.rfind("cudnn", 0) != 0) GTEST_SKIP() << "cuDNN does not run " << s.name() << ": " << p;
  EXPECT_NE(p.find("non-deterministic backward"), std::string::npos) << p;
  SCOPED_TRACE(s.name() + " on " + p + seed_text());
  const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
  Result lib = run_fused(true, s, qkv, dout, dqkv0, &gpu_->kernels());
  Result cpu = run_fused(false, s, qkv, dout, dqkv0);
  EXPECT_EQ(compare_close(lib.out.values(), cpu.out.values(), rtol(dt)), "") << "out";
  EXPECT_EQ(compare_cudnn_gradient(lib.dqkv.values(), cpu.dqkv.values(), dt), "") << "dqkv";
}

// A training-sized shape on a GPU whose arena takes all but 256 MiB: cuDNN's deterministic
// backward would need a workspace of B*NH*T^2 bf16 (1 GiB here) on Hopper. Either the shape
// runs on cuDNN with a workspace that fits, or supports() declines it naming device.reserve; the
// call succeeds on whichever path (a step never fails for the library's memory).
TEST_F(CudaFlashAttentionTest, CudnnDeclinesAWorkspaceTheReserveCannotHold) {
  const DType dt = DType::kBF16;
  const AttnShape small{1, 256, 4, 2, 64};
  if (const std::string p = path(dt, small); p.rfind("cudnn", 0) != 0) {
    GTEST_SKIP() << "cuDNN does not run " << small.name() << ": " << p;
  }
  ASSERT_NO_FATAL_FAILURE(reopen({.ordinal = 0, .reserve = 256 * kMiB}));
  const AttnShape s{4, 2048, 32, 8, 64};
  const std::string p = path(dt, s);
  SCOPED_TRACE(s.name() + " on " + p + seed_text());
  if (p.rfind("cudnn", 0) == 0) {
    EXPECT_NE(p.find("workspace"), std::string::npos) << p;
  } else {
    EXPECT_NE(p.find("device.reserve"), std::string::npos) << p;
  }
  const auto [qkv, dout, dqkv0] = random_inputs(dt, s);
  Result got = run_fused(true, s, qkv, dout, dqkv0, &gpu_->kernels());  // asserts no error
  Result own_result = run_fused(true, s, qkv, dout, dqkv0);
  EXPECT_EQ(compare_close(got.out.values(), own_result.out.values(), rtol(dt)), "") << "out";
  EXPECT_EQ(compare_cudnn_gradient(got.dqkv.values(), own_result.dqkv.values(), dt), "") << "dqkv";
}

}  // namespace
}  // namespace strata
