// The op profile (flops_profiler): timed events on every backend, the profile of one step
// against the ops the kernels were actually called with, the same training bits with the
// profile on, the simulated device's time beside each op, and the table's file. No timing is
// asserted beyond the lower bound of a sleep.
#include "src/train/op_profile.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "src/train/trainer.h"
#include "strata/device.h"
#include "strata/device_wrapper.h"
#include "strata/kernels_wrapper.h"
#include "strata/log.h"
#include "strata/simulated_device.h"
#include "tests/test_util.h"
#include "tests/timed_events.h"
#include "tests/train_util.h"

namespace strata {
namespace {

TEST(TimedEvents, CpuAndSimulatedDevicesTimeTheirStreams) {
  auto cpu = create_cpu_device({.capacity = 1 << 20, .threads = 1});
  ASSERT_TRUE(cpu.is_ok());
  test::expect_timed_events_measure_the_stream(**cpu);
  // An ordinary event keeps no time.
  auto a = (*cpu)->create_event();
  auto b = (*cpu)->create_event();
  (*cpu)->record(*a, (*cpu)->compute_stream());
  (*cpu)->record(*b, (*cpu)->compute_stream());
  ASSERT_TRUE((*cpu)->synchronize(*b).is_ok());
  EXPECT_FALSE((*cpu)->elapsed_ms(*a, *b).is_ok());

  auto sim = create_simulated_device({.capacity = 1 << 20, .threads = 1},
                                     simulated_device_preset("h200").value());
  ASSERT_TRUE(sim.is_ok());
  test::expect_timed_events_measure_the_stream(**sim);
}

// Counts the kernel ops forwarded while `on` (a test double over the run's device, inside the
// profile's).
class CountingDevice final : public DeviceWrapper {
 public:
  explicit CountingDevice(std::unique_ptr<Device> d)
      : DeviceWrapper(std::move(d)), counter_(this, &wrapped().kernels()) {}
  Kernels& kernels() override { return counter_; }
  Status synchronize(Event& e) override {
    if (on) ++waits;
    return DeviceWrapper::synchronize(e);
  }
  Status synchronize(Stream& s) override {
    if (on) ++waits;
    return DeviceWrapper::synchronize(s);
  }
  std::atomic<bool> on{false};
  std::atomic<int64_t> waits{0};
  std::map<std::string, int64_t> counts() {
    std::lock_guard<std::mutex> l(mu_);
    return counts_;
  }

 private:
  class Counter final : public KernelsWrapper {
   public:
    Counter(CountingDevice* d, Kernels* k) : KernelsWrapper(k), d_(d) {}

   protected:
    void run_op(Stream& s, const char* op, const KernelCall& call) override {
      if (d_->on) {
        std::lock_guard<std::mutex> l(d_->mu_);
        ++d_->counts_[op];
      }
      KernelsWrapper::run_op(s, op, call);
    }

   private:
    CountingDevice* d_;
  };
  Counter counter_;
  std::mutex mu_;
  std::map<std::string, int64_t> counts_;
};

// configs/tiny-cpu.json for 3 steps, its swap files in `dir` (not the working directory's
// runs/swap, which other tests use at the same time).
Config tiny(const std::string& dir, const std::vector<std::string>& more = {}) {
  return test::tiny_cpu(dir,
                        {"train.steps=3", "scheduler.params.warmup_num_steps=1",
                         "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\""},
                        more);
}

Config profiled(const std::string& dir, std::vector<std::string> more = {}) {
  more.insert(more.begin(), "flops_profiler.enabled=true");
  return tiny(dir, more);
}

TEST(OpProfile, CountsEveryOpOfTheProfiledStepAndChangesNoBits) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_op_profile", "counts");
  Config c = profiled(dir + "/p");
  CountingDevice* counting = nullptr;
  TrainOptions o;
  o.wrap_device = [&](std::unique_ptr<Device> d) {
    auto w = std::make_unique<CountingDevice>(std::move(d));
    counting = w.get();
    return std::unique_ptr<Device>(std::move(w));
  };
  // The profiled step is the second (profile_step 1): count from the first's end to its own
  // (the device is gone when train() returns).
  std::map<std::string, int64_t> counted;
  int64_t waits = 0;
  o.on_step_end = [&](int64_t step) {
    counting->on = step == 1;
    if (step == 2) {
      counted = counting->counts();
      waits = counting->waits;
    }
  };
  TrainResult r = test::must_train(c, o);
  ASSERT_TRUE(r.op_profile.has_value());
  const OpProfile& p = *r.op_profile;
  EXPECT_EQ(p.step, 2);
  EXPECT_GT(p.busy_ms[0], 0);
  EXPECT_GE(p.span_ms[0], p.busy_ms[0] * 0.999);
  std::map<std::string, int64_t> profiled_calls;
  for (const OpProfileRow& row : p.rows) {
    EXPECT_GE(row.ms, 0) << row.op;
    EXPECT_GT(row.calls, 0) << row.op;
    EXPECT_LT(row.model_ms, 0) << row.op << ": the CPU backend has no model";
    if (row.op.rfind("copy_", 0) == 0 || row.op == "memset_zero" || row.op == "host_fn") {
      continue;
    }
    profiled_calls[row.op] += row.calls;
    EXPECT_GT(row.bytes, 0) << row.op;
    if (row.op.find("matmul") != std::string::npos ||
        row.op.find("attention") != std::string::npos) {
      EXPECT_GT(row.flops, 0) << row.op;
    } else {
      EXPECT_EQ(row.flops, 0) << row.op;
    }
  }
  EXPECT_EQ(profiled_calls, counted);
  // The host's waits during the step, and the profile's own three for the streams at its end.
  EXPECT_EQ(p.host_waits + 3, waits);
  EXPECT_GT(p.host_waits, 0) << "the step's loss is read back";
  EXPECT_GT(profiled_calls["matmul_forward"], 0);
  // The table names every op.
  const std::string table = format_op_profile(p);
  EXPECT_EQ(table.rfind(kOpProfileTitle, 0), 0u);
  for (const auto& [op, n] : profiled_calls) EXPECT_NE(table.find(op), std::string::npos) << op;

  // The same run without the profile: the same losses and weights, bit for bit.
  Config plain = tiny(dir + "/plain");
  TrainResult q = test::must_train(plain);
  EXPECT_FALSE(q.op_profile.has_value());
  EXPECT_EQ(q.losses, r.losses);
  EXPECT_EQ(q.weights_crc, r.weights_crc);
}

TEST(OpProfile, OnTheSimulatedDeviceEachOpHasTheModelsTime) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_op_profile", "sim");
  TrainResult r = test::must_train(profiled(dir, {"device.simulate=\"h200\""}));
  ASSERT_TRUE(r.op_profile.has_value());
  EXPECT_EQ(r.op_profile->model, "h200");
  ASSERT_FALSE(r.op_profile->rows.empty());
  // Every kernel and copy; a host function takes the host's time, which no model has.
  for (const OpProfileRow& row : r.op_profile->rows) {
    EXPECT_EQ(row.model_ms >= 0, row.op != "host_fn") << row.op;
  }
  EXPECT_NE(format_op_profile(*r.op_profile).find("h200 ms"), std::string::npos);
}

// Everything on the (simulated) GPU: the step's timing marks are timed events, the losses and
// the gradient statistics are copied into the host's memory and read after its wait for the
// streams, so no stream waits for a host function (on a GPU each holds its stream, and on
// some every stream, until the driver's thread has run it).
TEST(OpProfile, AllOnTheDeviceNoStreamWaitsForTheHost) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_op_profile", "no_host_fn");
  for (const char* defer : {"\"never\"", "\"always\""}) {
    SCOPED_TRACE(defer);
    const std::string run = dir + "/" + (defer[1] == 'n' ? "never" : "always");
    TrainResult r =
        test::must_train(profiled(run, {"device.simulate=\"h200\"", "device.memory_limit=\"64MiB\"",
                                        "zero_optimization.offload_param.device=\"none\"",
                                        "zero_optimization.offload_optimizer.device=\"none\"",
                                        std::string("strata.optimizer.defer=") + defer}));
    ASSERT_TRUE(r.op_profile.has_value());
    bool gemm = false;
    for (const OpProfileRow& row : r.op_profile->rows) {
      gemm = gemm || row.op == "matmul_forward";
      EXPECT_NE(row.op, "host_fn") << row.stream << "\n" << format_op_profile(*r.op_profile);
    }
    EXPECT_TRUE(gemm) << format_op_profile(*r.op_profile);
  }
  std::filesystem::remove_all(dir);
}

// The optimizer in host RAM (ZeRO-Offload's placement): the gradient statistics still come
// from the device (the buffer a micro-batch group drains holds the step's whole gradient), so
// neither the compute nor the d2h stream waits for the host; the published parameters' staging
// buffers go back to their pool once an event recorded after their copies has completed, so no
// stream holds a host function either.
TEST(OpProfile, OptimizerInHostRamLeavesComputeAndDrainsToTheDevice) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("strata_op_profile", "host_ram");
  TrainResult r =
      test::must_train(profiled(dir, {"device.simulate=\"h200\"", "device.memory_limit=\"64MiB\"",
                                      "zero_optimization.offload_param.device=\"none\"",
                                      "zero_optimization.offload_optimizer.device=\"cpu\""}));
  ASSERT_TRUE(r.op_profile.has_value());
  bool stats = false;
  for (const OpProfileRow& row : r.op_profile->rows) {
    stats = stats || (row.op == "norm_sq_and_nonfinite" && row.stream == "d2h");
    EXPECT_NE(row.op, "host_fn") << row.stream << "\n" << format_op_profile(*r.op_profile);
  }
  EXPECT_TRUE(stats) << format_op_profile(*r.op_profile);
  std::filesystem::remove_all(dir);
}

TEST(OpProfile, TheTableGoesToANewFileOrOverAProfileNeverOverAnythingElse) {
  set_log_level(LogLevel::kError);
  const std::string dir = test::temp_dir("strata_op_profile", "file");
  const std::string out = dir + "/profile.txt";
  TrainResult r =
      test::must_train(profiled(dir + "/a", {"flops_profiler.output_file=\"" + out + "\""}));
  ASSERT_TRUE(r.op_profile.has_value());
  EXPECT_EQ(test::read_file(out), format_op_profile(*r.op_profile));
  // Over an earlier profile: written again.
  std::filesystem::remove(out);
  { std::ofstream(out) << kOpProfileTitle << "1 on an earlier run\n"; }
  r = test::must_train(profiled(dir + "/b", {"flops_profiler.output_file=\"" + out + "\""}));
  EXPECT_EQ(test::read_file(out), format_op_profile(*r.op_profile));
  // Over anything else, or through a link: refused before training, the file as it was.
  const std::string input = dir + "/config.json";
  { std::ofstream(input) << "{\"train_batch_size\": 8}\n"; }
  const std::string link = dir + "/link.txt";
  ASSERT_EQ(::symlink(out.c_str(), link.c_str()), 0);
  for (const std::string& target : {input, link}) {
    auto bad = train(profiled(dir + "/c", {"flops_profiler.output_file=\"" + target + "\""}), {});
    ASSERT_FALSE(bad.is_ok()) << target;
    EXPECT_NE(bad.status().message().find("is not an op profile"), std::string::npos)
        << bad.status().to_string();
  }
  EXPECT_EQ(test::read_file(input), "{\"train_batch_size\": 8}\n");
  struct stat st;
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
}

TEST(OpProfile, AStepThisRunDoesNotReachProfilesNothing) {
  set_log_level(LogLevel::kError);
  const std::string dir = test::temp_dir("strata_op_profile", "late");
  TrainResult r = test::must_train(profiled(dir, {"flops_profiler.profile_step=5"}));
  EXPECT_EQ(r.losses.size(), 3u);
  EXPECT_FALSE(r.op_profile.has_value());
}

TEST(OpProfile, TheTableGivesRatesAndTheModelsRatio) {
  OpProfile p;
  p.step = 7;
  p.device = "test device";
  p.model = "h200";
  p.host_ms = 12;
  p.rows.push_back({"matmul_forward", "compute", 4, 2.0, 2e12, 4e9, 1.0});
  p.rows.push_back({"layernorm_forward", "compute", 2, 1.0, 0, 2e9, -1});
  const std::string t = format_op_profile(p);
  EXPECT_EQ(t.rfind("op profile of step 7 on test device", 0), 0u) << t;
  // 2e12 FLOPs in 2 ms: 1000 TFLOP/s; 4e9 bytes: 2000 GB/s; twice the model's 1 ms.
  EXPECT_NE(t.find("1000.00"), std::string::npos) << t;
  EXPECT_NE(t.find("2000.0"), std::string::npos) << t;
  EXPECT_NE(t.find("2.00"), std::string::npos) << t;
  EXPECT_NE(t.find("h200 ms"), std::string::npos) << t;
  EXPECT_NE(t.find("total"), std::string::npos) << t;
}

}  // namespace
}  // namespace strata
