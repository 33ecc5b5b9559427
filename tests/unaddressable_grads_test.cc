// Gradients on a device the host cannot address (the CPU backend wrapped as one, as a GPU),
// with the optimizer state and the accumulators in host memory (ZeRO-Offload): a micro-batch
// after the first that drains its own gradients lands them in host buffers, a backward group's
// parts are added on the device and drained once, and a step's whole gradient has its norm
// taken on the device. The host tier holds only the buffers a run takes, and every schedule
// trains as the plain one does, bit for bit.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/train/trainer.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  return test::temp_dir("strata_unaddressable_grads", name);
}

// configs/tiny-cpu.json for `steps` steps, with overrides.
Config tiny(const std::string& dir, int steps, const std::vector<std::string>& extra) {
  return test::tiny_cpu(
      dir, {"train.steps=" + std::to_string(steps), "scheduler.params.warmup_num_steps=2"}, extra);
}

// ZeRO-Offload (parameters on the device, optimizer state and gradients in host memory), one
// sequence a micro-batch, `micro_batches` of them a step, clipping at `clip`.
std::vector<std::string> zero_offload(int micro_batches, const std::string& clip) {
  return {"zero_optimization.offload_param.device=\"none\"",
          "zero_optimization.offload_optimizer.device=\"cpu\"",
          "strata.placement.grads=\"host\"",
          "gradient_accumulation_steps=" + std::to_string(micro_batches),
          "train_batch_size=" + std::to_string(micro_batches),
          "train_micro_batch_size_per_gpu=1",
          "gradient_clipping=" + clip};
}

// On a device the host cannot address, a micro-batch after the first that drains its own
// gradients lands them in host buffers before adding them; where every micro-batch of the step
// runs its backward in one group (strata.grouped_backwards, the default) the parts are added on
// the device and drained once: the host tier is sized without landing buffers, holds none, and
// trains bit-identically to the ungrouped run. Parameters on the device, optimizer state and
// gradients in host memory (ZeRO-Offload), 2 micro-batches, no clipping (no undo room).
TEST(HostMemoryModel, GroupedBackwardsTakeNoLandingBuffers) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("landing");
  auto run = [&](const std::string& name, bool grouped) {
    std::vector<std::string> ov = zero_offload(2, "0");
    ov.push_back(fmt::format("strata.grouped_backwards={}", grouped));
    return test::must_train(tiny(dir + "/" + name, 4, ov), test::on_unaddressable_device());
  };
  const TrainResult grouped = run("grouped", true);
  const TrainResult apart = run("apart", false);
  EXPECT_EQ(grouped.losses, apart.losses);
  EXPECT_EQ(grouped.weights_crc, apart.weights_crc);
  const auto g = test::tier(grouped, "host"), a = test::tier(apart, "host");
  EXPECT_LT(g.capacity, a.capacity) << "the arena sized for landing buffers it never takes";
  EXPECT_LT(g.peak, a.peak) << "the ungrouped run took no landing buffers";
  EXPECT_LE(a.peak, a.capacity);
  fs::remove_all(dir);
}

// On a device the host cannot address, a step whose micro-batches all run their backwards in
// one group drains a whole step's gradient at once, and its norm is taken on the device before
// the copy down; ungrouped, the host takes it from its accumulator. Both are the host's
// grad_stats order in fp64: each step's norm (metrics.jsonl, 17 digits) is the same double, and
// with clipping biting every step the losses and weights are the plain run's bit for bit.
TEST(HostMemoryModel, ANormTakenOnTheDeviceClipsAsTheHostsDoes) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("device_norm");
  auto run = [&](const std::string& name, std::vector<std::string> schedule) {
    std::vector<std::string> ov = zero_offload(3, "0.05");
    ov.insert(ov.end(), schedule.begin(), schedule.end());
    ov.push_back("steps_per_print=1");
    return test::must_train(tiny(dir + "/" + name, 6, ov), test::on_unaddressable_device());
  };
  auto norms = [&](const std::string& name) {
    std::vector<double> out;
    std::ifstream f(dir + "/" + name + "/ckpt/metrics.jsonl");
    for (std::string line; std::getline(f, line);) {
      const auto e = nlohmann::json::parse(line, nullptr, false);
      if (e.is_object() && e.contains("grad_norm")) out.push_back(e["grad_norm"].get<double>());
    }
    return out;
  };
  const TrainResult plain =
      run("plain", {"strata.optimizer.overlap=false", "strata.grouped_forwards=1",
                    "strata.grouped_backwards=false"});
  const TrainResult grouped =
      run("grouped", {"strata.grouped_forwards=3", "strata.grouped_backwards=true"});
  for (size_t s = 0; s < plain.losses.size(); ++s) {
    ASSERT_EQ(grouped.losses[s], plain.losses[s]) << "loss differs at step " << s + 1;
  }
  EXPECT_EQ(grouped.weights_crc, plain.weights_crc);
  const std::vector<double> want = norms("plain"), got = norms("grouped");
  ASSERT_EQ(want.size(), 6u);
  for (size_t s = 0; s < want.size(); ++s) {
    ASSERT_EQ(std::memcmp(&got[s], &want[s], sizeof(double)), 0)
        << "step " << s + 1 << ": norm " << got[s] << " against the host's " << want[s];
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
