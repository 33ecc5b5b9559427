// The simulated fast device (device.simulate): the CPU backend's memory and streams, kernels
// that write nothing, copies that are real, zeroing that clears what copies wrote, and the
// trainer running on it with the configured gradient norm. No timing is asserted.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <future>
#include <vector>

#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/kernels.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

std::unique_ptr<Device> make() {
  auto p = simulated_device_preset("h200");
  EXPECT_TRUE(p.is_ok()) << p.status().to_string();
  auto d = create_simulated_device({.capacity = 64 << 20, .threads = 1}, *p);
  EXPECT_TRUE(d.is_ok()) << d.status().to_string();
  return std::move(d).value();
}

TEST(SimDevice, PresetsAndBadRates) {
  for (const char* name : {"h200", "h100", "a100"}) {
    auto p = simulated_device_preset(name);
    ASSERT_TRUE(p.is_ok()) << name;
    EXPECT_GT(p->gemm_tflops, 0);
    EXPECT_GT(p->memory, size_t{1} << 30);
  }
  auto bad = simulated_device_preset("h900");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("h200, h100 or a100"), std::string::npos);
  auto p = *simulated_device_preset("h200");
  p.hbm_gbps = 0;
  auto d = create_simulated_device({.capacity = 1 << 20}, p);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("simulate_hbm_gbps"), std::string::npos);
}

// Like a GPU's, its memory is reached through copies; they move the bytes; kernels write
// nothing but the cross-entropy's losses; zeroing clears what copies wrote; a copy within the
// device gives the destination the source's bytes.
TEST(SimDevice, CopiesAreRealKernelsWriteNothingZeroingClearsCopies) {
  auto dev = make();
  EXPECT_FALSE(dev->host_addressable());
  EXPECT_NE(dev->name().find("simulated h200"), std::string::npos) << dev->name();
  const int N = 64, C = 32, OC = 48;
  std::vector<float> host(size_t(N) * OC), back(host.size());
  for (size_t i = 0; i < host.size(); ++i) host[i] = 1.0f + float(i);
  auto out = dev->allocate(host.size() * 4, "out");
  auto inp = dev->allocate(size_t(N) * C * 4, "inp");
  auto w = dev->allocate(size_t(OC) * C * 4, "w");
  ASSERT_TRUE(out.is_ok() && inp.is_ok() && w.is_ok());
  Stream& s = dev->compute_stream();
  dev->copy_h2d(dev->h2d_stream(), *out, host.data(), host.size() * 4);
  ASSERT_TRUE(dev->synchronize(dev->h2d_stream()).is_ok());
  dev->kernels().matmul_forward(s, DType::kF32, *out, *inp, *w, nullptr, N, C, OC);
  dev->kernels().gelu_forward(s, DType::kF32, *out, *out, host.size());
  dev->kernels().scale_rows(s, DType::kF32, *out, static_cast<const float*>(*inp), N, OC);
  dev->copy_d2h(s, back.data(), *out, back.size() * 4);
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), host.data(), host.size() * 4), 0)
      << "a simulated kernel wrote device memory";
  // Zeroing a range that partly holds a copy's bytes: all of it reads back as zeros.
  dev->memset_zero(s, static_cast<char*>(*out) + 40, host.size() * 4 - 80);
  dev->copy_d2h(s, back.data(), *out, back.size() * 4);
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  EXPECT_EQ(back[0], host[0]);
  EXPECT_EQ(back[9], host[9]);
  for (size_t i = 10; i + 10 < back.size(); ++i) ASSERT_EQ(back[i], 0.0f) << "element " << i;
  EXPECT_EQ(back[back.size() - 10], host[host.size() - 10]);
  // The rest of what the copy wrote is still cleared by a later zeroing of everything.
  dev->memset_zero(s, *out, host.size() * 4);
  dev->copy_d2h(s, back.data(), *out, back.size() * 4);
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], 0.0f) << "element " << i;
  // A copy within the device moves what copies wrote and zeroes what they did not: the
  // destination reads back as the source would, whatever it held before.
  auto other = dev->allocate(host.size() * 4, "other");
  ASSERT_TRUE(other.is_ok());
  std::vector<float> ones(host.size(), 7.0f);
  dev->copy_h2d(s, *other, ones.data(), ones.size() * 4);  // other: written everywhere
  dev->copy_h2d(s, *out, host.data(), 16 * 4);             // out: its first 16 written
  dev->copy_d2d(s, static_cast<char*>(*other) + 8 * 4, static_cast<char*>(*out) + 4 * 4,
                (host.size() - 16) * 4);
  dev->copy_d2h(s, back.data(), *other, back.size() * 4);
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  for (size_t i = 0; i < back.size(); ++i) {
    const float want = i < 8 || i >= back.size() - 8 ? 7.0f : i < 20 ? host[i - 4] : 0.0f;
    ASSERT_EQ(back[i], want) << "element " << i;
  }
  // What the copy wrote counts as written: zeroing the destination clears it.
  dev->memset_zero(s, *other, host.size() * 4);
  dev->copy_d2h(s, back.data(), *other, back.size() * 4);
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], 0.0f) << "element " << i;
  dev->release(*other);
  // Cross-entropy's losses: ln(V), finite.
  auto losses = dev->allocate(N * 4, "losses");
  auto logits = dev->allocate(size_t(N) * 64 * 2, "logits");
  auto targets = dev->allocate(N * 4, "targets");
  ASSERT_TRUE(losses.is_ok() && logits.is_ok() && targets.is_ok());
  dev->kernels().crossentropy_forward_backward(s, DType::kBF16, static_cast<float*>(*losses),
                                               *logits, static_cast<const int32_t*>(*targets),
                                               1.0f / N, N, 50, 64);
  std::vector<float> l(N);
  dev->copy_d2h(s, l.data(), *losses, N * 4);
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  for (float x : l) EXPECT_FLOAT_EQ(x, std::log(50.0f));
  for (void* p : {*out, *inp, *w, *losses, *logits, *targets}) dev->release(p);
}

// Its events order work across streams as the wrapped device's do (they carry the recording
// stream's clock beside them): a copy on the d2h stream after a wait for an event recorded
// behind an h2d copy reads that copy's bytes, even when the h2d stream is held back; a
// never-recorded event is complete; synchronize and query see the recorded work.
TEST(SimDevice, EventsOrderStreamsAsTheWrappedDevicesDo) {
  auto dev = make();
  std::vector<float> host(4096), back(host.size());
  for (size_t i = 0; i < host.size(); ++i) host[i] = 3.0f + float(i);
  auto buf = dev->allocate(host.size() * 4, "buf");
  ASSERT_TRUE(buf.is_ok());
  auto fresh = dev->create_event();
  EXPECT_TRUE(dev->query(*fresh));
  EXPECT_TRUE(dev->synchronize(*fresh).is_ok());
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  dev->host_fn(dev->h2d_stream(), [open] { open.wait(); });
  dev->copy_h2d(dev->h2d_stream(), *buf, host.data(), host.size() * 4);
  auto landed = dev->create_event();
  dev->record(*landed, dev->h2d_stream());
  EXPECT_FALSE(dev->query(*landed)) << "the event completed before the gated copy ran";
  dev->wait(dev->d2h_stream(), *landed);
  dev->copy_d2h(dev->d2h_stream(), back.data(), *buf, back.size() * 4);
  gate.set_value();
  ASSERT_TRUE(dev->synchronize(dev->d2h_stream()).is_ok());
  EXPECT_TRUE(dev->query(*landed));
  EXPECT_TRUE(dev->synchronize(*landed).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), host.data(), host.size() * 4), 0)
      << "the d2h copy ran before the h2d copy it waited for";
  dev->release(*buf);
}

// The trainer on the simulated device: the configured norm decides the clipping, a stop on
// the CUDA backend is refused, and the run ends with finite losses.
TEST(SimDevice, TrainsWithTheConfiguredGradientNorm) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_sim_device", "train");
  for (double norm : {0.5, 3.0}) {
    Config c = test::tiny_cpu(
        dir + "/n" + std::to_string(int(norm * 10)),
        {"train.steps=6", "scheduler.params.warmup_num_steps=2"},
        // speculate "always": "auto" would time both schedules, which a loaded machine can
        // tip either way; this test is about which steps each regime speculates.
        {"device.simulate=\"h200\"", "device.simulate_grad_norm=" + std::to_string(norm),
         "gradient_clipping=1.0", "zero_optimization.offload_optimizer.device=\"cpu\"",
         "strata.optimizer.speculate=\"always\""});
    TrainResult r = test::must_train(c);
    ASSERT_EQ(r.losses.size(), 6u);
    for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
    // The first step, with no norm before it, is deferred to the next forward (3). Then under
    // the threshold every step is speculated under backward and kept (1); over it every step
    // is deferred (README: the optimizer under backward).
    ASSERT_EQ(r.optimizer_schedule.size(), 6u);
    EXPECT_EQ(r.optimizer_schedule[0], 3);
    for (size_t i = 1; i < 6; ++i) {
      EXPECT_EQ(r.optimizer_schedule[i], norm < 1.0 ? 1 : 3) << "step " << i + 1;
    }
    EXPECT_EQ(r.schedule.rollbacks, 0u);
    EXPECT_EQ(r.schedule.undo_copy_bytes, 0u);
  }
  Config cuda =
      test::tiny_cpu(dir + "/cuda", {"train.steps=2", "scheduler.params.warmup_num_steps=1"},
                     {"device.simulate=\"h200\"", "device.backend=\"cuda\""});
  auto bad = train(cuda, TrainOptions{});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("device.simulate runs on the CPU backend"),
            std::string::npos)
      << bad.status().to_string();
}

}  // namespace
}  // namespace strata
