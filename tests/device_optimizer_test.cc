// The optimizer on the device (src/tiers/device_optimizer.h): device-resident master weights and
// moments are stepped by the device's Kernels::optimizer_step. On the CPU backend that kernel is
// the fused CPU optimizer, so every placement trains bit for bit like the host optimizer path;
// a device that claims the host cannot address its memory (tests/wrapped_device.h) runs the
// paths a GPU takes (gradients accumulated and reduced on the device, checkpoints and the
// weights' checksum through copies, no undo copies of device state) on the CPU backend.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"
#include "tests/wrapped_device.h"

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must point at the repository"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;

// configs/tiny-cpu.json, 12 steps, everything but the optimizer's placement on the device.
Config tiny(const std::string& dir, const std::vector<std::string>& extra) {
  return test::tiny_cpu(
      dir,
      {"train.steps=12", "scheduler.params.warmup_num_steps=4", "device.memory_limit=\"256MiB\"",
       "zero_optimization.offload_param.device=\"none\""},
      extra);
}

struct Outcome {
  TrainResult result;
  long steps = 0, elements = 0;  // optimizer_step kernel calls, and their elements
};

// Trains `cfg`; the device wrapped, claiming host_addressable or not.
Outcome train_wrapped(const Config& cfg, bool host_addressable, TrainOptions o = {}) {
  o.progress = false;
  auto counts = std::make_shared<test::KernelCounts>();
  o.wrap_device = [&](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
    return std::make_unique<test::WrappedDevice>(std::move(d), host_addressable, counts);
  };
  Outcome r;
  auto res = train(cfg, o);
  EXPECT_TRUE(res.is_ok()) << res.status().to_string();
  if (!res.is_ok()) return r;
  r.result = *res;
  r.steps = counts->optimizer_steps.load();
  r.elements = counts->optimizer_elements.load();
  return r;
}

class DeviceOptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override { set_log_level(LogLevel::kWarn); }
};

TEST_F(DeviceOptimizerTest, CpuBackendTrainsBitIdenticallyToTheHostOptimizer) {
  const std::string dir = test::temp_dir("strata_devopt", "bitexact");
  struct Case {
    const char* name;
    std::vector<std::string> ov;
    bool all_on_device, some_on_device;
  };
  const std::vector<Case> cases = {
      {"optimizer in host RAM",
       {"zero_optimization.offload_optimizer.device=\"cpu\""},
       false,
       false},
      {"optimizer on the device",
       {"zero_optimization.offload_optimizer.device=\"none\""},
       true,
       true},
      {"ratio 0.5",
       {"zero_optimization.offload_optimizer.device=\"cpu\"",
        "zero_optimization.offload_optimizer.ratio=0.5"},
       false,
       true},
      {"on the device, no overlap",
       {"zero_optimization.offload_optimizer.device=\"none\"", "strata.optimizer.overlap=false"},
       true,
       true},
  };
  Outcome ref;
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    Outcome r = train_wrapped(tiny(dir + "/" + std::to_string(i), cases[i].ov), true);
    ASSERT_EQ(r.result.losses.size(), 12u);
    // Each module stepped once per step on the device (again when a step is redone), or never.
    if (!cases[i].some_on_device) {
      EXPECT_EQ(r.steps, 0);
    } else {
      EXPECT_GT(r.steps, 0);
    }
    if (cases[i].all_on_device) {
      EXPECT_GE(r.steps, 12 * 6) << "6 modules, 12 steps";
    }
    if (i == 0) {
      ref = r;
      for (double l : ref.result.losses) ASSERT_TRUE(std::isfinite(l));
      continue;
    }
    for (size_t s = 0; s < ref.result.losses.size(); ++s) {
      ASSERT_EQ(r.result.losses[s], ref.result.losses[s]) << "loss differs at step " << s + 1;
    }
    EXPECT_EQ(r.result.weights_crc, ref.result.weights_crc) << "final weights differ";
  }
  fs::remove_all(dir);
}

TEST_F(DeviceOptimizerTest, RatioSplitsTheModulesBetweenDeviceAndHost) {
  const std::string dir = test::temp_dir("strata_devopt", "ratio");
  Outcome all = train_wrapped(
      tiny(dir + "/all", {"zero_optimization.offload_optimizer.device=\"none\""}), true);
  Outcome half =
      train_wrapped(tiny(dir + "/half", {"zero_optimization.offload_optimizer.device=\"cpu\"",
                                         "zero_optimization.offload_optimizer.ratio=0.5"}),
                    true);
  ASSERT_GT(all.elements, 0);
  // The first (1 - ratio) of the optimizer bytes, in module order, whole modules: about half.
  const double share = double(half.elements) / double(all.elements);
  EXPECT_GT(share, 0.3) << half.elements << " of " << all.elements;
  EXPECT_LT(share, 0.8) << half.elements << " of " << all.elements;
  fs::remove_all(dir);
}

// The paths a GPU takes, on the CPU backend: every number is the host optimizer's, bit for bit,
// with clipping too (the device reduces the gradient norm in the host's order, in fp64).
TEST_F(DeviceOptimizerTest, UnaddressableDeviceTrainsLikeTheHostOptimizer) {
  const std::string dir = test::temp_dir("strata_devopt", "unaddressable");
  const std::vector<std::string> no_clip = {"gradient_clipping=0.0"};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), no_clip.begin(), no_clip.end());
    return a;
  };
  Outcome ref = train_wrapped(
      tiny(dir + "/ref", with({"zero_optimization.offload_optimizer.device=\"cpu\""})), true);
  ASSERT_EQ(ref.result.losses.size(), 12u);
  struct Case {
    const char* name;
    std::vector<std::string> ov;
  };
  const std::vector<Case> cases = {
      {"optimizer on the device", with({"zero_optimization.offload_optimizer.device=\"none\""})},
      {"ratio 0.5", with({"zero_optimization.offload_optimizer.device=\"cpu\"",
                          "zero_optimization.offload_optimizer.ratio=0.5"})},
      {"ratio 0.5 over nvme",
       with({"zero_optimization.offload_optimizer.device=\"nvme\"",
             "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"",
             "zero_optimization.offload_optimizer.ratio=0.5"})},
      {"params in host RAM, optimizer on the device",
       with({"zero_optimization.offload_param.device=\"cpu\"",
             "zero_optimization.offload_optimizer.device=\"none\""})},
  };
  fs::create_directories(dir + "/swap");
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    Outcome r = train_wrapped(tiny(dir + "/" + std::to_string(i), cases[i].ov), false);
    ASSERT_EQ(r.result.losses.size(), 12u);
    EXPECT_GT(r.steps, 0);
    for (size_t s = 0; s < ref.result.losses.size(); ++s) {
      ASSERT_EQ(r.result.losses[s], ref.result.losses[s]) << "loss differs at step " << s + 1;
    }
    EXPECT_EQ(r.result.weights_crc, ref.result.weights_crc) << "final weights differ";
  }
  // With clipping (tiny-cpu.json's 1.0) and the optimizer under backward: device modules are
  // stepped after backward (no undo copy of device memory); the norm is the device's.
  Outcome clip_ref = train_wrapped(
      tiny(dir + "/clip_ref", {"zero_optimization.offload_optimizer.device=\"cpu\""}), true);
  Outcome clip = train_wrapped(
      tiny(dir + "/clip", {"zero_optimization.offload_optimizer.device=\"none\""}), false);
  ASSERT_EQ(clip.result.losses.size(), 12u);
  EXPECT_EQ(clip.result.schedule.modules_stepped_under_backward, 0u);
  for (size_t s = 0; s < clip_ref.result.losses.size(); ++s) {
    ASSERT_EQ(clip.result.losses[s], clip_ref.result.losses[s]) << "loss differs at step " << s + 1;
  }
  EXPECT_EQ(clip.result.weights_crc, clip_ref.result.weights_crc) << "final weights differ";
  fs::remove_all(dir);
}

// Checkpoints of device-resident state go through copies on such a device: a run saved at step
// 6 and resumed equals the uninterrupted one bit for bit.
TEST_F(DeviceOptimizerTest, UnaddressableDeviceResumesBitIdentically) {
  const std::string dir = test::temp_dir("strata_devopt", "resume");
  auto cfg = [&](const std::string& sub) {
    return tiny(dir + "/" + sub,
                {"zero_optimization.offload_optimizer.device=\"none\"", "gradient_clipping=0.0"});
  };
  Outcome whole = train_wrapped(cfg("whole"), false);
  ASSERT_EQ(whole.result.losses.size(), 12u);
  TrainOptions stop;
  stop.stop_at_step = 6;
  Outcome first = train_wrapped(cfg("split"), false, stop);
  ASSERT_EQ(first.result.end_step, 6);
  TrainOptions resume;
  resume.resume = "latest";
  Outcome second = train_wrapped(cfg("split"), false, resume);
  ASSERT_EQ(second.result.start_step, 6);
  ASSERT_EQ(second.result.losses.size(), 6u);
  for (size_t s = 0; s < 6; ++s) {
    EXPECT_EQ(second.result.losses[s], whole.result.losses[6 + s]) << "step " << 7 + s;
  }
  EXPECT_EQ(second.result.weights_crc, whole.result.weights_crc);
  fs::remove_all(dir);
}

// offload_optimizer.ratio (what `strata plan` chooses): the first modules stepped on the device,
// the rest by the host's pipeline, under every exact schedule, on a GPU's paths and the CPU
// backend's, with clipping that bites on most steps (0.1) and that never does (1000): every loss
// and the final weights equal the same placement's with the overlap off.
TEST_F(DeviceOptimizerTest, RatioKeepsThePlainBitsUnderEveryExactSchedule) {
  const std::string dir = test::temp_dir("strata_devopt", "ratio_schedules");
  const std::vector<std::vector<std::string>> schedules = {
      {"strata.optimizer.speculate=\"always\"", "strata.optimizer.defer=\"always\""},
      {"strata.optimizer.speculate=\"always\"", "strata.optimizer.defer=\"never\""},
      {"strata.optimizer.speculate=\"never\"", "strata.optimizer.defer=\"always\""},
      {"strata.optimizer.speculate=\"never\"", "strata.optimizer.defer=\"never\""},
  };
  int n = 0;
  for (const bool addressable : {false, true}) {
    for (const char* clip : {"gradient_clipping=0.1", "gradient_clipping=1000"}) {
      const std::vector<std::string> placement = {
          "zero_optimization.offload_optimizer.device=\"cpu\"",
          "zero_optimization.offload_optimizer.ratio=0.6", clip};
      auto with = [&](std::vector<std::string> extra) {
        extra.insert(extra.begin(), placement.begin(), placement.end());
        return extra;
      };
      Outcome plain = train_wrapped(
          tiny(dir + "/" + std::to_string(n++), with({"strata.optimizer.overlap=false"})),
          addressable);
      ASSERT_EQ(plain.result.losses.size(), 12u);
      ASSERT_GT(plain.steps, 0) << "some modules stepped on the device";
      for (const auto& sched : schedules) {
        SCOPED_TRACE(::testing::Message() << (addressable ? "CPU paths, " : "GPU paths, ") << clip
                                          << ", " << sched[0] << ", " << sched[1]);
        Outcome r = train_wrapped(tiny(dir + "/" + std::to_string(n++), with(sched)), addressable);
        ASSERT_EQ(r.result.losses.size(), 12u);
        EXPECT_GT(r.steps, 0);
        int clipped = 0;
        for (uint8_t k : r.result.optimizer_schedule) clipped += k == 3 || k == 0;
        // After the first step (which follows no norm), 0.1 clips every step, 1000 none.
        if (std::string(clip).find("1000") == std::string::npos) {
          EXPECT_GE(clipped, 11);
        } else if (sched[0].find("always") != std::string::npos) {
          EXPECT_EQ(clipped, 1);
        }
        for (size_t s = 0; s < 12; ++s) {
          ASSERT_EQ(r.result.losses[s], plain.result.losses[s]) << "loss differs at step " << s + 1;
        }
        EXPECT_EQ(r.result.weights_crc, plain.result.weights_crc) << "final weights differ";
      }
    }
  }
  fs::remove_all(dir);
}

TEST_F(DeviceOptimizerTest, UnaddressableDeviceRefusesWhatItCannotStep) {
  const std::string dir = test::temp_dir("strata_devopt", "refuse");
  TrainOptions o;
  o.progress = false;
  o.wrap_device = [](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
    return std::make_unique<test::WrappedDevice>(std::move(d), false);
  };
  // Master weights on the device, moments in host RAM: split within a module.
  auto split = train(tiny(dir + "/a", {"zero_optimization.offload_optimizer.device=\"none\"",
                                       "strata.placement.moments=\"host\""}),
                     o);
  ASSERT_FALSE(split.is_ok());
  EXPECT_NE(split.status().message().find("strata.placement.master"), std::string::npos)
      << split.status().to_string();
  // The delayed update steps on the host.
  auto delayed = train(tiny(dir + "/b", {"zero_optimization.offload_optimizer.device=\"none\"",
                                         "strata.optimizer.delayed_update=true"}),
                       o);
  ASSERT_FALSE(delayed.is_ok());
  EXPECT_NE(delayed.status().message().find("strata.optimizer.delayed_update"), std::string::npos)
      << delayed.status().to_string();
  // The same placements run on a host-addressable device (the host steps the split one).
  o.wrap_device = nullptr;
  auto ok = train(tiny(dir + "/c", {"zero_optimization.offload_optimizer.device=\"none\"",
                                    "strata.placement.moments=\"host\"", "train.steps=4"}),
                  o);
  EXPECT_TRUE(ok.is_ok()) << ok.status().to_string();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
