// Gradient accumulators on NVMe (src/tiers/grad_spill.h) alone, over Homes with a swap file on
// the CPU device (and the same device claiming the host cannot address it): each micro-batch's
// gradients reach the module's swap extents, one per sub-group (copied for the first, added for
// the later ones), holding the fp32 sums bit for bit; the last micro-batch's norm² equals
// grad_stats() over the whole accumulator exactly; a failed write is reported, naming the module
// and sub-group, before the statistics.
#include "src/tiers/grad_spill.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "strata/cpu_optim.h"
#include "strata/device.h"
#include "strata/log.h"
#include "strata/storage_faults.h"
#include "tests/test_util.h"
#include "tests/tiers/tier_rig.h"
#include "tests/wrapped_device.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

struct Rig : test::TierParts {
  std::string dir;
  std::unique_ptr<GradSpill> spill;

  Rig(std::vector<size_t> numel, bool addressable, std::shared_ptr<FaultPlan> faults = nullptr)
      : dir(test::temp_dir("strata_grad_spill", addressable ? "a" : "n")) {
    set_log_level(LogLevel::kError);
    dev = std::make_unique<test::WrappedDevice>(test::cpu_device(4 << 20), addressable);
    const ModelLayout l = test::plain_modules(numel);
    options.placement = {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kNvme, 1.0};
    options.storage.backend = "posix";
    options.storage.faults = std::move(faults);
    auto plan =
        module_homes(l, options.placement, 1, DType::kBF16, DType::kF32, false, kStatsTileElems);
    EXPECT_TRUE(plan.is_ok());
    SwapOptions so;
    so.paths = {dir};
    so.bytes_per_path = 32 << 20;
    auto h = Homes::create(*dev, *plan, 0, 1, 8 << 20, options, &so);
    EXPECT_TRUE(h.is_ok()) << h.status().to_string();
    homes = std::move(*h);
    spill = std::make_unique<GradSpill>(*homes, counters, errors, /*threads=*/2);
  }
  ~Rig() {
    sync();
    spill.reset();
    homes.reset();
    fs::remove_all(dir);
  }
  void sync() {
    for (Stream* s : {&dev->compute_stream(), &dev->h2d_stream(), &dev->d2h_stream()})
      EXPECT_TRUE(dev->synchronize(*s).is_ok());
  }
  // Module m's accumulator, read back from its extents.
  std::vector<float> gacc(int m) {
    sync();
    const Module& mod = homes->module(m);
    std::vector<float> out(mod.sn);
    for (size_t j = 0; j < mod.sub_groups(); ++j) {
      auto buf = homes->host_buf(mod.gacc.subs[j].bytes, "test read");
      EXPECT_TRUE(buf.is_ok());
      EXPECT_TRUE(homes->io()->wait(homes->io()->read(mod.gacc.subs[j], buf->data())).is_ok());
      std::memcpy(out.data() + mod.sub_start(j), buf->data(), mod.sub_len(j) * 4);
    }
    return out;
  }
};

// Modules of 4 and 2 sub-groups (the last one short), three micro-batches each.
TEST(GradSpill, MicroBatchesSumIntoTheExtentsAndTheStatsAreExact) {
  const std::vector<size_t> numel = {4 * kStatsTileElems - 1000, kStatsTileElems + 4464};
  for (bool addressable : {true, false}) {
    SCOPED_TRACE(addressable ? "host-addressable" : "not host-addressable");
    Rig r(numel, addressable);
    ASSERT_EQ(r.homes->module(0).sub_groups(), 4u);
    ASSERT_EQ(r.homes->module(1).sub_groups(), 2u);
    std::vector<std::vector<float>> want(2);
    std::vector<GradStats> stats(2);
    for (int micro = 0; micro < 3; ++micro) {
      std::vector<std::vector<float>> g(2);  // the device buffers, alive until the drains ran
      for (int m = 1; m >= 0; --m) {
        g[size_t(m)] = test::random_grad(numel[size_t(m)], 10 * m + micro);
        if (micro == 0)
          want[size_t(m)] = g[size_t(m)];
        else
          for (size_t i = 0; i < numel[size_t(m)]; ++i) want[size_t(m)][i] += g[size_t(m)][i];
        r.spill->accumulate(m, g[size_t(m)].data(), micro, micro == 2, &stats[size_t(m)]);
      }
      r.sync();
    }
    EXPECT_TRUE(r.errors.take().is_ok());
    for (int m = 0; m < 2; ++m) {
      SCOPED_TRACE(m);
      const std::vector<float> got = r.gacc(m);
      EXPECT_EQ(0, std::memcmp(got.data(), want[size_t(m)].data(), got.size() * 4));
      const GradStats ref = grad_stats(want[size_t(m)].data(), DType::kF32, numel[size_t(m)]);
      EXPECT_EQ(stats[size_t(m)].norm_sq, ref.norm_sq);
      EXPECT_FALSE(stats[size_t(m)].nonfinite);
    }
  }
}

TEST(GradSpill, NonFiniteGradientsAreFlagged) {
  Rig r({2 * kStatsTileElems}, true);
  auto g = test::random_grad(2 * kStatsTileElems, 5);
  g[kStatsTileElems + 3] = std::numeric_limits<float>::infinity();
  GradStats s;
  r.spill->accumulate(0, g.data(), 0, true, &s);
  r.sync();
  EXPECT_TRUE(s.nonfinite);
}

// A write that fails (EIO on the first write) is reported with the module and sub-group, by
// the time the statistics are out.
TEST(GradSpill, AFailedWriteIsReportedWithItsSubGroup) {
  auto faults = std::make_shared<FaultPlan>();
  faults->fail_nth = 1;
  faults->fail_nth_kind = 2;  // writes
  Rig r({2 * kStatsTileElems}, true, faults);
  auto g = test::random_grad(2 * kStatsTileElems, 6);
  GradStats s;
  r.spill->accumulate(0, g.data(), 0, true, &s);
  r.sync();
  Status e = r.errors.take();
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.to_string().find("writing m0 gradients (sub-group 0)"), std::string::npos)
      << e.to_string();
  EXPECT_GE(faults->injected_errors.load(), 1u);
}

}  // namespace
}  // namespace strata
