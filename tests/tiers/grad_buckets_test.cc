// The gradient buffers (src/tiers/grad_buckets.h) alone, one rank, over Homes and a device
// cache on the CPU device (and the same device claiming the host cannot address it, as a GPU):
// each micro-batch's gradients reach the module's fp32 accumulator (copied for the first, added
// for the later ones) with the same bits on every path, the first written in place where the
// device's kernels reach the accumulator; on_final once per module after the last; the step's
// norm² and inf/nan flag; a backward group's parts added; the room prefetches leave.
#include "src/tiers/grad_buckets.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/log.h"
#include "tests/tiers/tier_rig.h"
#include "tests/wrapped_device.h"

namespace strata {
namespace {

struct Rig : test::TierParts {
  std::unique_ptr<DeviceCache> cache;
  std::vector<int> finals;
  std::unique_ptr<GradBuckets> grads;

  Rig(std::vector<size_t> numel, Tier grads_tier, bool addressable, size_t capacity = 4 << 20) {
    set_log_level(LogLevel::kError);
    dev = std::make_unique<test::WrappedDevice>(test::cpu_device(capacity), addressable);
    const ModelLayout l = test::plain_modules(numel);
    const Tier opt = grads_tier == Tier::kDevice ? Tier::kDevice : Tier::kHost;
    options.placement = {Tier::kHost, opt, opt, grads_tier, 1.0};
    auto plan = module_homes(l, options.placement, 1, DType::kBF16, DType::kF32, false, 0);
    EXPECT_TRUE(plan.is_ok());
    auto h = Homes::create(*dev, *plan, 0, 1, 4 << 20, options, nullptr);
    EXPECT_TRUE(h.is_ok()) << h.status().to_string();
    homes = std::move(*h);
    cache = std::make_unique<DeviceCache>(*homes, options, DType::kBF16, false, counters, errors);
    grads = std::make_unique<GradBuckets>(*homes, *cache, options, false, counters, errors,
                                          [this](int m) { finals.push_back(m); });
  }
  ~Rig() {
    sync();
    grads->release_all();
    cache->release_all();
  }
  void sync() {
    for (Stream* s : {&dev->compute_stream(), &dev->h2d_stream(), &dev->d2h_stream()})
      EXPECT_TRUE(dev->synchronize(*s).is_ok());
  }
  // Writes `g` into module m's gradient buffer `buf` as backward would (on the compute stream).
  void backward(float* buf, const std::vector<float>& g) {
    std::vector<float>* copy = new std::vector<float>(g);
    dev->host_fn(dev->compute_stream(), [buf, copy] {
      std::memcpy(buf, copy->data(), copy->size() * 4);
      delete copy;
    });
  }
  std::vector<float> gacc(int m) {
    sync();
    const Module& mod = homes->module(m);
    std::vector<float> out(mod.sn);
    std::memcpy(out.data(), mod.gacc.ptr(), mod.sn * 4);
    return out;
  }
};

// Three micro-batches of two modules: GACC holds g0 + g1 + g2 summed in that order in fp32,
// bit for bit, whichever path the accumulator takes (in place, added on the host from the
// device buffer, or through a landing buffer; host- or device-homed); on_final once per
// module, after the last micro-batch; the stats are the accumulator's.
TEST(GradBuckets, MicroBatchesSumIntoTheAccumulatorOnEveryPath) {
  const std::vector<size_t> numel = {1000, 5000};
  struct Path {
    const char* name;
    Tier tier;
    bool addressable;
  };
  std::vector<std::vector<float>> want(2);
  for (int m = 0; m < 2; ++m) {
    want[size_t(m)].assign(numel[size_t(m)], 0.0f);
    for (int micro = 0; micro < 3; ++micro) {
      auto g = test::random_grad(numel[size_t(m)], 10 * m + micro);
      for (size_t i = 0; i < g.size(); ++i) {
        want[size_t(m)][i] = micro == 0 ? g[i] : want[size_t(m)][i] + g[i];
      }
    }
  }
  for (Path p : {Path{"host, addressable", Tier::kHost, true},
                 Path{"host, not addressable", Tier::kHost, false},
                 Path{"device, addressable", Tier::kDevice, true},
                 Path{"device, not addressable", Tier::kDevice, false}}) {
    SCOPED_TRACE(p.name);
    Rig r(numel, p.tier, p.addressable);
    for (int micro = 0; micro < 3; ++micro) {
      for (int m = 1; m >= 0; --m) {  // backward: the last module first
        auto buf = r.grads->acquire(m, micro);
        ASSERT_TRUE(buf.is_ok()) << buf.status().to_string();
        const bool in_place = buf.value() == r.homes->module(m).gacc.ptr();
        // The first micro-batch writes GACC where the device's kernels reach it: any GACC on a
        // host-addressable device, a device-homed one on any device.
        EXPECT_EQ(in_place, micro == 0 && (p.addressable || p.tier == Tier::kDevice))
            << "micro " << micro;
        auto again = r.grads->acquire(m, micro);  // acquiring a held buffer returns it
        ASSERT_TRUE(again.is_ok());
        EXPECT_EQ(*again, *buf);
        r.backward(*buf, test::random_grad(numel[size_t(m)], 10 * m + micro));
        r.grads->drain(m, micro, micro == 2);
      }
      r.sync();
      EXPECT_EQ(r.finals.size(), micro == 2 ? 2u : 0u);
    }
    EXPECT_EQ(r.finals, (std::vector<int>{1, 0}));
    EXPECT_TRUE(r.errors.take().is_ok());
    double norm_sq = 0;
    for (int m = 0; m < 2; ++m) {
      const std::vector<float> got = r.gacc(m);
      EXPECT_EQ(0, std::memcmp(got.data(), want[size_t(m)].data(), got.size() * 4)) << m;
      for (float x : want[size_t(m)]) norm_sq += double(x) * double(x);
    }
    const GradStats s = r.grads->stats();
    EXPECT_FALSE(s.nonfinite);
    EXPECT_NEAR(s.norm_sq, norm_sq, 1e-5 * norm_sq);
  }
}

// An inf or a nan anywhere in the final gradients sets the flag.
TEST(GradBuckets, NonFiniteGradientsAreFlagged) {
  for (bool addressable : {true, false}) {
    SCOPED_TRACE(addressable);
    Rig r({1000}, Tier::kHost, addressable);
    auto buf = r.grads->acquire(0, 0);
    ASSERT_TRUE(buf.is_ok());
    auto g = test::random_grad(1000, 3);
    g[777] = std::numeric_limits<float>::quiet_NaN();
    r.backward(*buf, g);
    r.grads->drain(0, 0, true);
    r.sync();
    EXPECT_TRUE(r.grads->stats().nonfinite);
  }
}

// A backward group's further micro-batch writes a part, added to the module's buffer on the
// compute stream: the accumulator holds the fp32 sum.
TEST(GradBuckets, PartsAreAddedToTheAcquiredBuffer) {
  Rig r({3000}, Tier::kHost, true);
  auto g0 = test::random_grad(3000, 1), g1 = test::random_grad(3000, 2);
  auto buf = r.grads->acquire(0, 0);
  ASSERT_TRUE(buf.is_ok());
  r.backward(*buf, g0);
  auto part = r.grads->acquire_part(0);
  ASSERT_TRUE(part.is_ok()) << part.status().to_string();
  EXPECT_NE(*part, *buf);
  r.backward(*part, g1);
  r.grads->add_part(0, *part);
  r.grads->drain(0, 0, true);
  const std::vector<float> got = r.gacc(0);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], g0[i] + g1[i]) << i;
}

// The room a prefetch leaves for the next gradient buffer: none in the first micro-batch where
// every buffer is the accumulator itself, else the largest module's (256-byte units), plus a
// part's with backward groups.
TEST(GradBuckets, DeviceReserve) {
  Rig r({1000, 5000}, Tier::kHost, true);
  EXPECT_EQ(r.grads->device_reserve(0), 0u);
  EXPECT_EQ(r.grads->device_reserve(1), round_up(5000 * 4, 256));
  r.grads->set_parts(true);
  EXPECT_EQ(r.grads->device_reserve(0), round_up(5000 * 4, 256));
  EXPECT_EQ(r.grads->device_reserve(1), 2 * round_up(5000 * 4, 256));
  Rig n({1000, 5000}, Tier::kHost, false);  // no accumulator in place
  EXPECT_EQ(n.grads->device_reserve(0), round_up(5000 * 4, 256));
}

// No device room for a gradient buffer: the error names the module.
TEST(GradBuckets, NoRoomNamesTheModule) {
  Rig r({1000, 200'000}, Tier::kHost, false, 512 << 10);
  ASSERT_TRUE(r.grads->acquire(0, 1).is_ok());
  auto big = r.grads->acquire(1, 1);
  ASSERT_FALSE(big.is_ok());
  EXPECT_NE(big.status().to_string().find("gradients of m1"), std::string::npos)
      << big.status().to_string();
  r.grads->drain(0, 1, true);
}

}  // namespace
}  // namespace strata
