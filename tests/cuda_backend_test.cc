// The CUDA backend against the CPU backend, in the style of ggml's test-backend-ops: every op of
// the Kernels table, for fp32, bf16 and fp16, runs on fresh random inputs on both devices and the
// outputs are compared with a per-op tolerance. The device features (arena, streams, events,
// pinned memory, deferred errors) are tested on their own, and the device optimizer step against
// optimizer_step_reference.
//
// Without a visible GPU every test that needs one reports SKIPPED with the reason; the test of
// the no-GPU path itself (CudaUnavailable.*) runs instead.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_optimizer.h"
#include "strata/cpu_optim.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"
#include "strata/optimizer.h"
#include "tests/cuda_twin.h"
#include "tests/timed_events.h"

namespace strata {
namespace {

// --- the no-GPU path --------------------------------------------------------------------------

TEST(CudaUnavailable, FactoryExplainsWhyWithoutAGpu) {
  std::string why;
  if (cuda_device_available(&why)) {
    GTEST_SKIP() << "a GPU is visible, so the no-GPU path cannot be exercised on this machine";
  }
  EXPECT_FALSE(why.empty());
  auto dev = create_cuda_device({});
  ASSERT_FALSE(dev.is_ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kUnavailable) << dev.status().to_string();
  // The reason reaches the user, with what to do instead.
  EXPECT_NE(dev.status().message().find(why), std::string::npos) << dev.status().to_string();
  EXPECT_NE(dev.status().message().find("device.backend=cpu"), std::string::npos);
}

// --- helpers: tests/cuda_twin.h ----------------------------------------------------------

using namespace cuda_test;

// --- device features --------------------------------------------------------------------------

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = skip_reason();
    if (!why.empty()) GTEST_SKIP() << why;
  }
  std::unique_ptr<Device> make(size_t capacity) {
    auto d = create_cuda_device({.ordinal = 0, .reserve = size_t{1} << 30, .capacity = capacity});
    EXPECT_TRUE(d.is_ok()) << d.status().to_string();
    return d.is_ok() ? std::move(d).value() : nullptr;
  }
};

TEST_F(CudaDeviceTest, ArenaIsBoundedByCapacityAndMergesFreedBlocks) {
  auto dev = make(kMiB);
  ASSERT_TRUE(dev);
  EXPECT_EQ(dev->kind(), DeviceKind::kCuda);
  EXPECT_EQ(dev->memory_stats().capacity, kMiB);
  auto a = dev->allocate(600 << 10, "a");
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*a) % 256, 0u);
  auto b = dev->allocate(600 << 10, "b");
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("'b'"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("device.memory_limit"), std::string::npos);
  dev->release(*a);
  EXPECT_EQ(dev->memory_stats().used, 0u);
  EXPECT_EQ(dev->memory_stats().peak, size_t(600 << 10));

  // Four quarters fill the arena; freeing two neighbours makes room for one half.
  void* q[4];
  for (void*& p : q) {
    auto r = dev->allocate(kMiB / 4, "quarter");
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    p = *r;
  }
  EXPECT_FALSE(dev->allocate(1, "full").is_ok());
  dev->release(q[1]);
  dev->release(q[2]);
  auto half = dev->allocate(kMiB / 2, "half");
  ASSERT_TRUE(half.is_ok()) << half.status().to_string();
  dev->release(*half);
  dev->release(q[0]);
  dev->release(q[3]);
  EXPECT_EQ(dev->memory_stats().used, 0u);
  EXPECT_TRUE(dev->allocate(kMiB, "all").is_ok());
}

TEST_F(CudaDeviceTest, CopiesAndKernelsAreOrderedByEventsAcrossStreams) {
  auto dev = make(64 * kMiB);
  ASSERT_TRUE(dev);
  const size_t n = size_t{1} << 22;
  std::mt19937 rng(fresh_seed());
  std::vector<float> src = random_floats(rng, n, -1, 1), dst(n, 0.0f);
  float* d = static_cast<float*>(*dev->allocate(n * 4, "buf"));
  auto copied = dev->create_event(), scaled = dev->create_event();
  dev->copy_h2d(dev->h2d_stream(), d, src.data(), n * 4);
  dev->record(*copied, dev->h2d_stream());
  dev->wait(dev->compute_stream(), *copied);
  dev->kernels().scale(dev->compute_stream(), d, -2.0f, n);
  dev->record(*scaled, dev->compute_stream());
  dev->wait(dev->d2h_stream(), *scaled);
  dev->copy_d2h(dev->d2h_stream(), dst.data(), d, n * 4);
  ASSERT_TRUE(dev->synchronize(dev->d2h_stream()).is_ok());
  ASSERT_TRUE(dev->synchronize(*scaled).is_ok());
  EXPECT_TRUE(dev->query(*scaled));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(dst[i], src[i] * -2.0f) << i;
  dev->release(d);
}

TEST_F(CudaDeviceTest, HostFunctionsRunInStreamOrderAndJoinThroughEvents) {
  auto dev = make(kMiB);
  ASSERT_TRUE(dev);
  std::vector<int> order;
  std::mutex mu;
  auto push = [&](int v) {
    std::lock_guard<std::mutex> l(mu);
    order.push_back(v);
  };
  auto ev = dev->create_event();
  EXPECT_TRUE(dev->query(*ev));  // never recorded: complete
  dev->host_fn(dev->compute_stream(), [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    push(1);
  });
  dev->record(*ev, dev->compute_stream());
  dev->wait(dev->h2d_stream(), *ev);
  dev->host_fn(dev->h2d_stream(), [&] { push(2); });
  ASSERT_TRUE(dev->synchronize(dev->h2d_stream()).is_ok());
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

// Timed events (the op profile's clock): cudaEvents with timing, measured by
// cudaEventElapsedTime; an ordinary event (cudaEventDisableTiming) is refused.
TEST_F(CudaDeviceTest, TimedEventsMeasureTheStream) {
  auto dev = make(kMiB);
  ASSERT_TRUE(dev);
  test::expect_timed_events_measure_the_stream(*dev);
  auto a = dev->create_event();
  auto b = dev->create_timed_event();
  dev->record(*a, dev->compute_stream());
  dev->record(*b, dev->compute_stream());
  ASSERT_TRUE(dev->synchronize(dev->compute_stream()).is_ok());
  EXPECT_FALSE(dev->elapsed_ms(*a, *b).is_ok());
  auto same = dev->elapsed_ms(*b, *b);  // one event as both ends: 0 ms
  ASSERT_TRUE(same.is_ok()) << same.status().to_string();
  EXPECT_EQ(*same, 0.0);
}

// A CUDA call that fails is reported where it is made, and leaves no error behind for the next
// launch's check (the runtime keeps a failed call's error as the thread's last error). Outside
// the CudaDeviceTest suite: the deliberate failure is an API error to compute-sanitizer.
class CudaErrorTest : public CudaDeviceTest {};
TEST_F(CudaErrorTest, AFailedCallLeavesNothingForTheNextLaunch) {
  auto dev = make(kMiB);
  ASSERT_TRUE(dev);
  float ms = 0;
  const Status failed =
      STRATA_CUDA_STATUS(cudaEventElapsedTime(&ms, nullptr, nullptr), "timing no events");
  EXPECT_FALSE(failed.is_ok());
  float* x = static_cast<float*>(*dev->allocate(256 * 4, "x"));
  dev->memset_zero(dev->compute_stream(), x, 256 * 4);
  dev->kernels().gelu_forward(dev->compute_stream(), DType::kF32, x, x, 256);  // a launch check
  const Status st = dev->synchronize(dev->compute_stream());
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  dev->release(x);
}

TEST_F(CudaDeviceTest, PinnedAndRegisteredHostMemoryRoundTrip) {
  auto dev = make(16 * kMiB);
  ASSERT_TRUE(dev);
  const size_t bytes = 8 * kMiB;
  auto pinned = dev->allocate_host(bytes);
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  std::vector<uint8_t> caller(bytes);
  ASSERT_TRUE(dev->register_host(caller.data(), bytes).is_ok());
  auto* p = static_cast<uint8_t*>(*pinned);
  for (size_t i = 0; i < bytes; ++i) p[i] = uint8_t(i * 131 + 7);
  void* d = *dev->allocate(bytes, "roundtrip");
  dev->copy_h2d(dev->h2d_stream(), d, p, bytes);
  auto ev = dev->create_event();
  dev->record(*ev, dev->h2d_stream());
  dev->wait(dev->d2h_stream(), *ev);
  dev->copy_d2h(dev->d2h_stream(), caller.data(), d, bytes);
  ASSERT_TRUE(dev->synchronize(dev->d2h_stream()).is_ok());
  EXPECT_EQ(std::memcmp(caller.data(), p, bytes), 0);
  dev->unregister_host(caller.data());
  dev->release_host(p);
  dev->release(d);
}

// STRATA_FUSED_OPS=0 (read when the device is created) turns the fused elementwise ops off, so
// the models take the unfused calls; unset, they are offered.
TEST_F(CudaDeviceTest, FusedOpsEnvironmentSwitch) {
  const OpShape mm{.dt = DType::kBF16, .N = 64, .C = 256, .OC = 64};
  const OpShape norm{.dt = DType::kBF16, .N = 64, .C = 256};
  ASSERT_EQ(setenv("STRATA_FUSED_OPS", "0", 1), 0);
  auto off = make(kMiB);
  unsetenv("STRATA_FUSED_OPS");
  ASSERT_TRUE(off);
  for (KernelOp op : {KernelOp::kMatmulGelu, KernelOp::kMatmulBackwardGelu}) {
    const KernelSupport s = off->kernels().supports(op, mm);
    EXPECT_FALSE(s.supported);
    EXPECT_NE(s.path.find("STRATA_FUSED_OPS=0"), std::string::npos) << s.path;
  }
  EXPECT_FALSE(off->kernels().supports(KernelOp::kResidualNorm, norm).supported);
  EXPECT_TRUE(off->kernels().supports(KernelOp::kDropout, {}).supported);  // not a fused op
  auto on = make(kMiB);
  ASSERT_TRUE(on);
  EXPECT_TRUE(on->kernels().supports(KernelOp::kMatmulGelu, mm).supported);
  EXPECT_TRUE(on->kernels().supports(KernelOp::kMatmulBackwardGelu, mm).supported);
  EXPECT_TRUE(on->kernels().supports(KernelOp::kResidualNorm, norm).supported);
}

// STRATA_CUDA_PACKED=0, read when the kernel table is created, keeps the one-element kernels: a
// LayerNorm of rows that fill whole 16-byte packs then sums each row as the default table does
// for an output one element off alignment (which it cannot write in packs), and in another
// order than the default table's packs.
TEST_F(CudaDeviceTest, PackedAccessEnvironmentSwitch) {
  const int N = 64, C = 256;
  const size_t n = size_t(N) * C;
  ASSERT_EQ(setenv("STRATA_CUDA_PACKED", "0", 1), 0);
  auto off = make(kMiB);
  unsetenv("STRATA_CUDA_PACKED");
  auto on = make(kMiB);
  ASSERT_TRUE(off && on);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 3.0f);
  std::vector<float> x(n), wb(2 * size_t(C));
  for (float& v : x) v = u(rng);
  for (float& v : wb) v = u(rng);
  // out, then the rows' means and rstds, the output `offset` elements into its buffer.
  auto layernorm = [&](Device& d, size_t offset) {
    Stream& s = d.compute_stream();
    float* inp = static_cast<float*>(*d.allocate(n * 4, "inp"));
    float* w = static_cast<float*>(*d.allocate(wb.size() * 4, "weight and bias"));
    float* out = static_cast<float*>(*d.allocate((n + 1) * 4, "out"));
    float* stats = static_cast<float*>(*d.allocate(2 * size_t(N) * 4, "stats"));
    d.copy_h2d(s, inp, x.data(), n * 4);
    d.copy_h2d(s, w, wb.data(), wb.size() * 4);
    d.kernels().layernorm_forward(s, DType::kF32, out + offset, stats, stats + N, inp, w, w + C, N,
                                  C);
    std::vector<float> got(n + 2 * size_t(N));
    d.copy_d2h(s, got.data(), out + offset, n * 4);
    d.copy_d2h(s, got.data() + n, stats, 2 * size_t(N) * 4);
    EXPECT_TRUE(d.synchronize(s).is_ok());
    for (void* p : {static_cast<void*>(inp), static_cast<void*>(w), static_cast<void*>(out),
                    static_cast<void*>(stats)}) {
      d.release(p);
    }
    return got;
  };
  const std::vector<float> one_element = layernorm(*off, 0);
  EXPECT_EQ(one_element, layernorm(*on, 1));
  EXPECT_NE(one_element, layernorm(*on, 0)) << "packs and one element summed alike";
}

TEST_F(CudaDeviceTest, EnqueueErrorsSurfaceAtTheNextSynchronize) {
  auto dev = make(kMiB);
  ASSERT_TRUE(dev);
  float* d = static_cast<float*>(*dev->allocate(4096, "logits"));
  // V > Vp is rejected when enqueued; the error must come back from synchronize, once.
  dev->kernels().crossentropy_forward_backward(dev->compute_stream(), DType::kF32, d, d,
                                               reinterpret_cast<int32_t*>(d), 1.0f, 1, 10, 4);
  Status st = dev->synchronize(dev->compute_stream());
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("crossentropy"), std::string::npos) << st.to_string();
  EXPECT_TRUE(dev->synchronize(dev->compute_stream()).is_ok());
  dev->release(d);
}

// --- every op, every dtype, against the CPU backend -------------------------------------------

class CudaOpTest : public CudaBackendTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaOpTest, Encoder) {
  const DType dt = GetParam();
  const int B = 3, T = 37, C = 72, V = 29;  // few tokens: repeats exercise dwte's accumulation
  Twin tok = tokens(size_t(B) * T, V), wte = random(size_t(V) * C, dt), wpe = random(T * C, dt);
  Twin out = random(size_t(B) * T * C, dt);
  run([&](Kernels& k, Stream& s, int i) {
    k.encoder_forward(s, dt, out.p[i], tok.at<int32_t>(i), nullptr, wte.p[i], wpe.p[i], B, T, C);
  });
  compare("encoder_forward out", out, dt, tol(dt, kElementwise));
  Twin dwte = random(size_t(V) * C, DType::kF32), dwpe = random(T * C, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.encoder_backward(s, dt, dwte.at<float>(i), dwpe.at<float>(i), out.p[i], tok.at<int32_t>(i),
                       nullptr, B, T, C);
  });
  compare("encoder_backward dwte", dwte, DType::kF32, kReduction);
  compare("encoder_backward dwpe", dwpe, DType::kF32, kReduction);
}

TEST_P(CudaOpTest, Layernorm) {
  const DType dt = GetParam();
  const int N = 67, C = 200;
  Twin inp = random(size_t(N) * C, dt, -3, 5), w = random(C, dt, 0.5, 1.5), b = random(C, dt);
  Twin out = random(size_t(N) * C, dt), mean = random(N, DType::kF32),
       rstd = random(N, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.layernorm_forward(s, dt, out.p[i], mean.at<float>(i), rstd.at<float>(i), inp.p[i], w.p[i],
                        b.p[i], N, C);
  });
  compare("layernorm_forward out", out, dt, tol(dt, kReduction));
  compare("layernorm_forward mean", mean, DType::kF32, kReduction);
  compare("layernorm_forward rstd", rstd, DType::kF32, kReduction);
  Twin dout = random(size_t(N) * C, dt), dinp = random(size_t(N) * C, dt);
  Twin dw = random(C, DType::kF32), db = random(C, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.layernorm_backward(s, dt, dinp.p[i], dinp.p[i], dw.at<float>(i), db.at<float>(i), dout.p[i],
                         inp.p[i], w.p[i], mean.at<float>(i), rstd.at<float>(i), N, C);
  });
  compare("layernorm_backward dinp", dinp, dt, tol(dt, kReduction));
  compare("layernorm_backward dweight", dw, DType::kF32, kReduction);
  compare("layernorm_backward dbias", db, DType::kF32, kReduction);
}

TEST_P(CudaOpTest, Matmul) {
  const DType dt = GetParam();
  const int N = 96, C = 136, OC = 200;
  Twin inp = random(size_t(N) * C, dt), w = random(size_t(OC) * C, dt), b = random(OC, dt);
  for (bool with_bias : {true, false}) {
    Twin out = random(size_t(N) * OC, dt);
    run([&](Kernels& k, Stream& s, int i) {
      k.matmul_forward(s, dt, out.p[i], inp.p[i], w.p[i], with_bias ? b.p[i] : nullptr, N, C, OC);
    });
    compare(with_bias ? "matmul_forward (bias)" : "matmul_forward (no bias)", out, dt,
            tol(dt, kReduction));
  }
  // dinp accumulated (cuBLASLt's beta 1) and written (beta 0: the random old values unread).
  for (bool accumulate : {true, false}) {
    SCOPED_TRACE(accumulate ? "dinp accumulated" : "dinp written");
    Twin dout = random(size_t(N) * OC, dt), dinp = random(size_t(N) * C, dt);
    Twin dw = random(size_t(OC) * C, DType::kF32), db = random(OC, DType::kF32);
    run([&](Kernels& k, Stream& s, int i) {
      k.matmul_backward(s, dt, dinp.p[i], dw.at<float>(i), db.at<float>(i), dout.p[i], inp.p[i],
                        w.p[i], N, C, OC, accumulate);
    });
    compare("matmul_backward dinp", dinp, dt, tol(dt, kReduction));
    compare("matmul_backward dweight", dw, DType::kF32, kReduction);
    compare("matmul_backward dbias", db, DType::kF32, kReduction);
  }
}

// The fused up-projection + GELU (cuBLASLt's GELU_AUX_BIAS epilogue) against the CPU backend's
// matmul_forward + gelu_forward: pre as a matmul, out within one more rounding of dt.
TEST_P(CudaOpTest, MatmulGelu) {
  const DType dt = GetParam();
  const int N = 96, C = 136, OC = 200;  // OC a multiple of 8: the epilogue's aux matrix
  KernelSupport sup =
      dev_[1]->kernels().supports(KernelOp::kMatmulGelu, {.dt = dt, .N = N, .C = C, .OC = OC});
  if (!sup.supported) GTEST_SKIP() << "matmul_gelu_forward: " << sup.path;
  EXPECT_FALSE(dev_[1]->kernels().supports(KernelOp::kMatmulGelu, {.dt = dt, .OC = 100}).supported);
  Twin inp = random(size_t(N) * C, dt), w = random(size_t(OC) * C, dt), b = random(OC, dt);
  for (bool with_bias : {true, false}) {
    Twin out = random(size_t(N) * OC, dt), pre = random(size_t(N) * OC, dt);
    run([&](Kernels& k, Stream& s, int i) {
      k.matmul_gelu_forward(s, dt, out.p[i], pre.p[i], inp.p[i], w.p[i],
                            with_bias ? b.p[i] : nullptr, N, C, OC);
    });
    const std::string what = with_bias ? " (bias)" : " (no bias)";
    compare("matmul_gelu_forward pre" + what, pre, dt, tol(dt, kReduction));
    compare("matmul_gelu_forward out" + what, out, dt, 2 * tol(dt, kReduction));
  }
}

// The down-projection's backward with cuBLASLt's DGELU epilogue against the CPU backend's
// matmul_backward + gelu_backward bits: dpre within one more rounding of dt (the epilogue
// rounds once, after gelu'), written over what it held; the weight and bias gradients as
// matmul_backward's.
TEST_P(CudaOpTest, MatmulBackwardGelu) {
  const DType dt = GetParam();
  const int N = 96, C = 200, OC = 136;  // C a multiple of 8: the epilogue's aux matrix
  KernelSupport sup = dev_[1]->kernels().supports(KernelOp::kMatmulBackwardGelu,
                                                  {.dt = dt, .N = N, .C = C, .OC = OC});
  if (!sup.supported) GTEST_SKIP() << "matmul_backward_gelu: " << sup.path;
  EXPECT_FALSE(
      dev_[1]->kernels().supports(KernelOp::kMatmulBackwardGelu, {.dt = dt, .C = 100}).supported);
  Twin dout = random(size_t(N) * OC, dt), inp = random(size_t(N) * C, dt);
  Twin w = random(size_t(OC) * C, dt), pre = random(size_t(N) * C, dt, -3, 3);
  Twin dpre = random(size_t(N) * C, dt);
  Twin dw = random(size_t(OC) * C, DType::kF32), db = random(OC, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.matmul_backward_gelu(s, dt, dpre.p[i], dw.at<float>(i), db.at<float>(i), dout.p[i], inp.p[i],
                           w.p[i], pre.p[i], N, C, OC);
  });
  compare("matmul_backward_gelu dpre", dpre, dt, 2 * tol(dt, kReduction));
  compare("matmul_backward_gelu dweight", dw, DType::kF32, kReduction);
  compare("matmul_backward_gelu dbias", db, DType::kF32, kReduction);
}

// The residual add and the norm after it in one kernel, against the CPU backend's two calls:
// res as residual_forward's (exact), out and the statistics as the norm's.
TEST_P(CudaOpTest, ResidualNorm) {
  const DType dt = GetParam();
  const int N = 67, C = 200;
  ASSERT_TRUE(dev_[1]->kernels().supports(KernelOp::kResidualNorm, {.dt = dt, .N = N, .C = C}));
  const size_t n = size_t(N) * C;
  Twin a = random(n, dt, -3, 3), b = random(n, dt, -3, 3), w = random(C, dt, 0.5, 1.5);
  Twin bias = random(C, dt), res = random(n, dt), out = random(n, dt);
  Twin mean = random(N, DType::kF32), rstd = random(N, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.residual_layernorm_forward(s, dt, res.p[i], out.p[i], mean.at<float>(i), rstd.at<float>(i),
                                 a.p[i], b.p[i], w.p[i], bias.p[i], N, C);
  });
  compare("residual_layernorm_forward res", res, dt, 0.0);
  compare("residual_layernorm_forward out", out, dt, tol(dt, kReduction));
  compare("residual_layernorm_forward mean", mean, DType::kF32, kReduction);
  compare("residual_layernorm_forward rstd", rstd, DType::kF32, kReduction);
  run([&](Kernels& k, Stream& s, int i) {
    k.residual_rmsnorm_forward(s, dt, a.p[i], out.p[i], rstd.at<float>(i), a.p[i], b.p[i], w.p[i],
                               1e-5f, N, C);
  });
  compare("residual_rmsnorm_forward res (in place)", a, dt, 0.0);
  compare("residual_rmsnorm_forward out", out, dt, tol(dt, kReduction));
  compare("residual_rmsnorm_forward rstd", rstd, DType::kF32, kReduction);
}

TEST_P(CudaOpTest, Attention) {
  const DType dt = GetParam();
  const int B = 2, T = 45, NH = 3, C = 48;  // T not a multiple of the warp width
  Twin qkv = random(size_t(B) * T * 3 * C, dt, -2, 2), out = random(size_t(B) * T * C, dt);
  Twin att = random(size_t(B) * NH * T * T, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.attention_gqa_forward(s, dt, out.p[i], att.at<float>(i), qkv.p[i], nullptr, B, T, NH, NH,
                            C / NH);
  });
  compare("attention_forward out", out, dt, tol(dt, kReduction));
  compare("attention_forward att", att, DType::kF32, kReduction);
  Twin dout = random(size_t(B) * T * C, dt), dqkv = random(size_t(B) * T * 3 * C, dt);
  Twin scratch = random(size_t(B) * NH * T * T, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.attention_gqa_backward(s, dt, dqkv.p[i], scratch.at<float>(i), dout.p[i], qkv.p[i],
                             att.at<float>(i), nullptr, B, T, NH, NH, C / NH);
  });
  compare("attention_backward dqkv", dqkv, dt, tol(dt, kReduction));
}

TEST_P(CudaOpTest, Gelu) {
  const DType dt = GetParam();
  const size_t n = 100003;
  Twin inp = random(n, dt, -5, 5), out = random(n, dt), dout = random(n, dt), dinp = random(n, dt);
  run([&](Kernels& k, Stream& s, int i) { k.gelu_forward(s, dt, out.p[i], inp.p[i], n); });
  compare("gelu_forward", out, dt, tol(dt, kElementwise));
  run([&](Kernels& k, Stream& s, int i) {
    k.gelu_backward(s, dt, dinp.p[i], inp.p[i], dout.p[i], n);
  });
  compare("gelu_backward", dinp, dt, tol(dt, kElementwise));
}

// The rotary embedding in place on the query and key heads, forward then backward: head size 64
// (the halves in 16-byte packs) and 18 (a pair a thread), grouped heads, with positions (packed
// sequences; any value, past T too) and without; the rows do not fill whole blocks of 4.
TEST_P(CudaOpTest, Rope) {
  const DType dt = GetParam();
  const int B = 3, T = 41, NH = 8, KVH = 2;
  RopeParams rope;
  rope.llama3 = true;
  rope.original_max_position = 32;
  for (int hs : {64, 18}) {
    for (bool with_pos : {false, true}) {
      SCOPED_TRACE("hs " + std::to_string(hs) + (with_pos ? ", positions" : ""));
      Twin qkv = random(size_t(B) * T * (NH + 2 * KVH) * hs, dt, -2, 2);
      Twin pos = tokens(size_t(B) * T, 3 * T);
      auto at = [&](int i) { return with_pos ? pos.at<int32_t>(i) : nullptr; };
      run([&](Kernels& k, Stream& s, int i) {
        k.rope_forward(s, dt, qkv.p[i], rope, at(i), B, T, NH, KVH, hs);
      });
      compare("rope_forward", qkv, dt, tol(dt, kElementwise));
      run([&](Kernels& k, Stream& s, int i) {
        k.rope_backward(s, dt, qkv.p[i], rope, at(i), B, T, NH, KVH, hs);
      });
      compare("rope_backward", qkv, dt, tol(dt, kElementwise));
    }
  }
}

TEST_P(CudaOpTest, ResidualAndAddInplace) {
  const DType dt = GetParam();
  const size_t n = 70001;
  Twin a = random(n, dt), b = random(n, dt), out = random(n, dt);
  run([&](Kernels& k, Stream& s, int i) {
    k.residual_forward(s, dt, out.p[i], a.p[i], b.p[i], n);
  });
  compare("residual_forward", out, dt, tol(dt, kElementwise));
  run([&](Kernels& k, Stream& s, int i) { k.add_inplace(s, dt, a.p[i], b.p[i], n); });
  compare("add_inplace", a, dt, tol(dt, kElementwise));
}

// The same mask from the same key, one rounded multiply: bit-identical.
TEST_P(CudaOpTest, Dropout) {
  const DType dt = GetParam();
  const size_t n = 70001;
  Twin x = random(n, dt), out = random(n, dt);
  run([&](Kernels& k, Stream& s, int i) {
    EXPECT_TRUE(k.supports(KernelOp::kDropout, {}).supported);
    k.dropout(s, dt, out.p[i], x.p[i], n, 0.1f, 0x5eed5eedull);
  });
  compare("dropout", out, dt, 0.0);
  run([&](Kernels& k, Stream& s, int i) { k.dropout(s, dt, x.p[i], x.p[i], n, 0.35f, 42); });
  compare("dropout in place", x, dt, 0.0);
}

TEST_P(CudaOpTest, CrossEntropy) {
  const DType dt = GetParam();
  const int N = 33, V = 1000, Vp = 1024;
  Twin logits = random(size_t(N) * Vp, dt, -4, 4), tgt = tokens(N, V);
  Twin losses = random(N, DType::kF32);
  run([&](Kernels& k, Stream& s, int i) {
    k.crossentropy_forward_backward(s, dt, losses.at<float>(i), logits.p[i], tgt.at<int32_t>(i),
                                    1.0f / N, N, V, Vp);
  });
  compare("crossentropy losses", losses, DType::kF32, tol(dt, kReduction));
  compare("crossentropy dlogits", logits, dt, tol(dt, kReduction));
}

// The two fp32-only ops: plain tests, not dtype instances that would skip on a GPU.
// The squared norm on the GPU is the host's bit for bit (strata::grad_stats' order), past the
// stream scratch's 1024 tiles too; an inf anywhere makes it non-finite on both.
TEST_F(CudaBackendTest, NormSquaredIsTheHostsBitForBit) {
  for (size_t n : {size_t{0}, size_t{17}, (size_t{1} << 20) + 7, size_t{1025} * 65536 + 3}) {
    SCOPED_TRACE(n);
    Twin x = random(n, DType::kF32, -2, 2),
         sq = upload(std::vector<float>{1.5f, 2.5f}, DType::kF32);
    run([&](Kernels& k, Stream& s, int i) {
      k.norm_sq_and_nonfinite(s, reinterpret_cast<double*>(sq.at<float>(i)), x.at<float>(i), n);
    });
    std::vector<float> host_x = download(x, 0, DType::kF32);
    const double want = grad_stats(host_x.data(), DType::kF32, n).norm_sq;
    for (int i = 0; i < 2; ++i) {
      std::vector<float> f = download(sq, i, DType::kF32);
      double got = 0;
      std::memcpy(&got, f.data(), sizeof(got));
      EXPECT_EQ(std::memcmp(&got, &want, sizeof(got)), 0)
          << (i ? "cuda " : "cpu ") << got << " vs " << want << " (seed " << seed_ << ")";
    }
    if (n == 0) continue;
    const float inf = INFINITY;
    for (int i = 0; i < 2; ++i) {
      dev_[i]->copy_h2d(dev_[i]->h2d_stream(), x.at<float>(i) + n / 3, &inf, 4);
      ASSERT_TRUE(dev_[i]->synchronize(dev_[i]->h2d_stream()).is_ok());
    }
    run([&](Kernels& k, Stream& s, int i) {
      k.norm_sq_and_nonfinite(s, reinterpret_cast<double*>(sq.at<float>(i)), x.at<float>(i), n);
    });
    for (int i = 0; i < 2; ++i) {
      std::vector<float> f = download(sq, i, DType::kF32);
      double got = 0;
      std::memcpy(&got, f.data(), sizeof(got));
      EXPECT_FALSE(std::isfinite(got)) << (i ? "cuda" : "cpu");
    }
  }
}

TEST_F(CudaBackendTest, Scale) {
  const size_t n = 123457;
  Twin x = random(n, DType::kF32, -3, 3);
  run([&](Kernels& k, Stream& s, int i) { k.scale(s, x.at<float>(i), 0.37f, n); });
  compare("scale", x, DType::kF32, 0.0);  // one rounded multiply: bit-identical
}

// Block-wise quantization: one IEEE division and one rounding per element, so the CUDA kernels
// give the CPU reference's bits: q, the scales, and the dequantized (and accumulated) values.
TEST_P(CudaOpTest, QuantizeDequantizeMatchCpuBitForBit) {
  const DType dt = GetParam();
  for (int bits : {8, 4}) {
    for (auto [n, block] : std::vector<std::pair<size_t, int>>{{999, 256}, {300001, 128}}) {
      SCOPED_TRACE(fmt::format("bits {} n {} block {}", bits, n, block));
      Twin x = random(n, dt, -3, 3), back = random(n, dt), acc = random(n, dt);
      Twin q = upload(std::vector<uint8_t>(quantized_bytes(bits, n), 0));
      Twin sc = upload(std::vector<float>(quantize_blocks(n, block), 0.0f), DType::kF32);
      run([&, n = n, block = block](Kernels& k, Stream& s, int i) {
        k.quantize(s, bits, dt, q.p[i], sc.at<float>(i), x.p[i], n, block);
        k.dequantize(s, bits, dt, back.p[i], q.p[i], sc.at<float>(i), n, block, false);
        k.dequantize(s, bits, dt, acc.p[i], q.p[i], sc.at<float>(i), n, block, true);
      });
      compare("quantize scales", sc, DType::kF32, 0.0);
      compare("dequantize", back, dt, 0.0);
      compare("dequantize accumulate", acc, dt, 0.0);
      std::vector<uint8_t> qb[2];
      for (int i = 0; i < 2; ++i) {
        qb[i].resize(q.bytes);
        dev_[i]->copy_d2h(dev_[i]->d2h_stream(), qb[i].data(), q.p[i], q.bytes);
        ASSERT_TRUE(dev_[i]->synchronize(dev_[i]->d2h_stream()).is_ok());
      }
      EXPECT_EQ(qb[0], qb[1]) << "quantized bytes differ (seed " << seed_ << ")";
    }
  }
}

// Casts are one rounding of an exact value: both backends must give the same bits, including
// fp16 subnormals and overflow to inf.
TEST_P(CudaOpTest, CastToEveryDtypeIsBitExact) {
  const DType src_t = GetParam();
  std::vector<float> v = random_floats(rng_, 50021, -3, 3);
  for (size_t i = 0; i < v.size(); i += 7) v[i] *= 1e-6f;   // fp16 subnormal range
  for (size_t i = 3; i < v.size(); i += 101) v[i] *= 4e4f;  // beyond fp16's range
  Twin src = upload(v, src_t);
  for (DType dst_t : {DType::kF32, DType::kBF16, DType::kF16}) {
    Twin dst = random(v.size(), dst_t);
    run([&](Kernels& k, Stream& s, int i) {
      k.cast(s, dst.p[i], dst_t, src.p[i], src_t, v.size());
    });
    std::vector<uint8_t> got(dst.bytes), want(dst.bytes);
    dev_[1]->copy_d2h(dev_[1]->d2h_stream(), got.data(), dst.p[1], dst.bytes);
    dev_[0]->copy_d2h(dev_[0]->d2h_stream(), want.data(), dst.p[0], dst.bytes);
    ASSERT_TRUE(dev_[1]->synchronize(dev_[1]->d2h_stream()).is_ok());
    ASSERT_TRUE(dev_[0]->synchronize(dev_[0]->d2h_stream()).is_ok());
    EXPECT_EQ(got, want) << "cast " << dtype_name(src_t) << " -> " << dtype_name(dst_t) << " (seed "
                         << seed_ << ")";
  }
}

// The device optimizer step against the scalar reference (the grad dtype is the parameter).
TEST_P(CudaOpTest, OptimizerStepMatchesReference) {
  const DType grad_t = GetParam();
  const size_t n = 40009;
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kAdagrad,
                             OptimizerKind::kLion}) {
    for (DType moment_t : {DType::kF32, DType::kBF16}) {
      OptimizerHyper h;
      h.kind = kind;
      h.lr = 3e-3f;
      h.weight_decay = 0.1f;
      h.step = 7;
      std::vector<uint8_t> grad = to_bytes(random_floats(rng_, n, -1, 1), grad_t);
      std::vector<float> master = random_floats(rng_, n, -1, 1);
      std::vector<uint8_t> m = to_bytes(random_floats(rng_, n, -0.1f, 0.1f), moment_t);
      std::vector<uint8_t> v = to_bytes(random_floats(rng_, n, 0.0f, 0.01f), moment_t);
      std::vector<uint8_t> lp(n * 2);
      // On the GPU: upload, step, download.
      Device& gpu = *dev_[1];
      auto put = [&](const void* src, size_t bytes) {
        void* d = *gpu.allocate(bytes, "optimizer test");
        gpu.copy_h2d(gpu.compute_stream(), d, src, bytes);
        return d;
      };
      void* dg = put(grad.data(), grad.size());
      void* dmaster = put(master.data(), n * 4);
      void* dm = put(m.data(), m.size());
      void* dv = put(v.data(), v.size());
      void* dlp = put(lp.data(), lp.size());
      ShardState dev_shard{.n = n,
                           .grad = dg,
                           .grad_dtype = grad_t,
                           .grad_mult = 0.5f,
                           .master = static_cast<float*>(dmaster),
                           .m = dm,
                           .v = dv,
                           .moment_dtype = moment_t,
                           .lp_out = dlp,
                           .lp_dtype = DType::kBF16};
      ASSERT_TRUE(cuda_device_optimizer_step(gpu, gpu.compute_stream(), h, dev_shard).is_ok());
      std::vector<float> g_master(n);
      std::vector<uint8_t> g_m(m.size()), g_v(v.size()), g_lp(lp.size());
      gpu.copy_d2h(gpu.compute_stream(), g_master.data(), dmaster, n * 4);
      gpu.copy_d2h(gpu.compute_stream(), g_m.data(), dm, m.size());
      gpu.copy_d2h(gpu.compute_stream(), g_v.data(), dv, v.size());
      gpu.copy_d2h(gpu.compute_stream(), g_lp.data(), dlp, lp.size());
      ASSERT_TRUE(gpu.synchronize(gpu.compute_stream()).is_ok());
      for (void* p : {dg, dmaster, dm, dv, dlp}) gpu.release(p);
      // On the host: the reference.
      ShardState ref{.n = n,
                     .grad = grad.data(),
                     .grad_dtype = grad_t,
                     .grad_mult = 0.5f,
                     .master = master.data(),
                     .m = m.data(),
                     .v = v.data(),
                     .moment_dtype = moment_t,
                     .lp_out = lp.data(),
                     .lp_dtype = DType::kBF16};
      optimizer_step_reference(h, ref);
      const std::string what = std::string(optimizer_kind_name(kind)) + ", moments " +
                               dtype_name(moment_t) + ", seed " + std::to_string(seed_);
      expect_close("master: " + what, g_master, master, 1e-6);
      auto f32 = [](const std::vector<uint8_t>& b, DType t) {
        std::vector<float> out(b.size() / dtype_size(t));
        convert(b.data(), t, out.data(), DType::kF32, out.size());
        return out;
      };
      expect_close("m: " + what, f32(g_m, moment_t), f32(m, moment_t), tol(moment_t, 1e-6));
      expect_close("v: " + what, f32(g_v, moment_t), f32(v, moment_t), tol(moment_t, 1e-6));
      expect_close("lp: " + what, f32(g_lp, DType::kBF16), f32(lp, DType::kBF16), 1e-2);
    }
  }
}

// Kernels::optimizer_step, the entry the tier manager steps device-resident state with: the
// CUDA kernel against the CPU backend's (the fused CPU optimizer), AdamW with fp32 and bf16
// moments, the gradient in the parameterized dtype, a bf16 copy-out.
TEST_P(CudaOpTest, OptimizerStepThroughTheKernelTable) {
  const DType grad_t = GetParam();
  const size_t n = 30011;
  for (DType moment_t : {DType::kF32, DType::kBF16}) {
    OptimizerHyper h;
    h.kind = OptimizerKind::kAdamW;
    h.lr = 1e-3f;
    h.weight_decay = 0.1f;
    h.step = 3;
    Twin grad = random(n, grad_t);
    Twin master = random(n, DType::kF32);
    Twin m = random(n, moment_t, -0.1f, 0.1f);
    Twin v = random(n, moment_t, 0.0f, 0.01f);
    Twin lp = random(n, DType::kBF16);
    run([&](Kernels& k, Stream& s, int i) {
      ShardState sh{.n = n,
                    .grad = grad.p[i],
                    .grad_dtype = grad_t,
                    .grad_mult = 0.25f,
                    .master = static_cast<float*>(master.p[i]),
                    .m = m.p[i],
                    .v = v.p[i],
                    .moment_dtype = moment_t,
                    .lp_out = lp.p[i],
                    .lp_dtype = DType::kBF16};
      k.optimizer_step(s, h, sh);
    });
    const std::string what = std::string("moments ") + dtype_name(moment_t);
    compare("optimizer_step master, " + what, master, DType::kF32, 1e-6);
    compare("optimizer_step m, " + what, m, moment_t, tol(moment_t, 1e-6));
    compare("optimizer_step v, " + what, v, moment_t, tol(moment_t, 1e-6));
    compare("optimizer_step lp, " + what, lp, DType::kBF16, 1e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CudaOpTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& p) {
                           return std::string(dtype_name(p.param));
                         });

}  // namespace
}  // namespace strata
