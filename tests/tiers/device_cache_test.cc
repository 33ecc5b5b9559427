// The device cache (src/tiers/device_cache.h) alone, over Homes on the CPU device, one rank:
// device-homed parameters are used in place; host- and NVMe-homed ones are fetched into a copy
// holding the home's bytes, counted once while resident; the first step of a phase records the
// trace and a changed order re-records it; a device without room evicts what is not pinned and
// fails, naming the object and the keys, when everything is; write_through updates a copy.
#include "src/tiers/device_cache.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "strata/device.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/tiers/tier_rig.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

// Homes for modules of `numel` bf16 parameters each, placed by `params` (the optimizer state on
// the host), on a CPU device of `capacity` bytes, and a cache over them.
struct Rig : test::TierParts {
  std::unique_ptr<DeviceCache> cache;
  std::vector<int> fetched;

  Rig(std::vector<size_t> numel, Tier params, size_t capacity, const std::string& swap_dir = "") {
    set_log_level(LogLevel::kError);
    dev = test::cpu_device(capacity);
    const ModelLayout l = test::plain_modules(numel);
    options.placement = {params, Tier::kHost, Tier::kHost, Tier::kHost, 1.0};
    options.storage.backend = "posix";
    auto plan = module_homes(l, options.placement, 1, DType::kBF16, DType::kF32, false, 2048);
    EXPECT_TRUE(plan.is_ok());
    SwapOptions so;
    so.paths = {swap_dir};
    so.bytes_per_path = 4 << 20;
    auto h = Homes::create(*dev, *plan, 0, 1, 4 << 20, options, swap_dir.empty() ? nullptr : &so);
    EXPECT_TRUE(h.is_ok()) << h.status().to_string();
    homes = std::move(*h);
    cache = std::make_unique<DeviceCache>(*homes, options, DType::kBF16, false, counters, errors);
    // Every fetch (demand or prefetch) runs the hook first: the fetches, counted by module.
    cache->set_before_fetch([this](int m) {
      fetched.push_back(m);
      return Status::ok();
    });
  }
  ~Rig() {
    dev->synchronize(dev->compute_stream()).ignore();
    dev->synchronize(dev->h2d_stream()).ignore();
    dev->synchronize(dev->d2h_stream()).ignore();
    cache->release_all();
  }
  // Fills module m's host home with a pattern of its own.
  void fill(int m) {
    Module& mod = homes->module(m);
    auto* p = static_cast<uint16_t*>(mod.p.ptr());
    for (size_t i = 0; i < mod.sn; ++i) p[i] = uint16_t(1000 * m + i);
  }
  bool holds_home(int m, const void* copy) {
    dev->synchronize(dev->compute_stream()).ignore();
    dev->synchronize(dev->h2d_stream()).ignore();
    Module& mod = homes->module(m);
    std::vector<uint16_t> want(mod.sn);
    for (size_t i = 0; i < mod.sn; ++i) want[i] = uint16_t(1000 * m + i);
    return std::memcmp(copy, want.data(), mod.p.bytes) == 0;
  }
  // One step of the phase: acquire and release each module of `order`.
  void step(const std::string& phase, const std::vector<int>& order) {
    cache->begin_phase(phase);
    for (int m : order) {
      auto p = cache->acquire(m);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      cache->release(m);
    }
    cache->end_phase();
  }
};

TEST(DeviceCache, DeviceHomedParametersAreUsedInPlace) {
  Rig r({1000, 2000}, Tier::kDevice, 1 << 20);
  r.cache->begin_phase("train");
  for (int m : {0, 1}) {
    auto p = r.cache->acquire(m);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    EXPECT_EQ(*p, r.homes->module(m).p.dev);
    EXPECT_FALSE(r.cache->fetchable(m));
    r.cache->release(m);
  }
  r.cache->end_phase();
  EXPECT_TRUE(r.fetched.empty());
  ASSERT_NE(r.cache->trace("train"), nullptr);
  EXPECT_EQ(r.cache->trace("train")->size(), 2u);
}

// A host-homed module is fetched into a copy of its bytes once; acquiring it again while it is
// resident fetches nothing.
TEST(DeviceCache, HostHomedParametersAreFetchedOnce) {
  Rig r({1000, 3000}, Tier::kHost, 1 << 20);
  r.fill(0);
  r.fill(1);
  r.cache->begin_phase("train");
  auto p0 = r.cache->acquire(0);
  ASSERT_TRUE(p0.is_ok()) << p0.status().to_string();
  EXPECT_NE(*p0, r.homes->module(0).p.ptr());
  EXPECT_TRUE(r.cache->resident(0));
  EXPECT_FALSE(r.cache->evictable(0));  // pinned while acquired
  EXPECT_TRUE(r.holds_home(0, *p0));
  auto again = r.cache->acquire(0);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*again, *p0);
  r.cache->release(0);
  r.cache->release(0);
  EXPECT_TRUE(r.cache->evictable(0));
  auto p1 = r.cache->acquire(1);
  ASSERT_TRUE(p1.is_ok());
  EXPECT_TRUE(r.holds_home(1, *p1));
  r.cache->release(1);
  r.cache->end_phase();
  EXPECT_EQ(r.fetched, (std::vector<int>{0, 1}));
  ASSERT_NE(r.cache->trace("train"), nullptr);
  EXPECT_EQ(r.cache->trace("train")->size(), 3u);
  EXPECT_EQ(r.cache->trace("eval"), nullptr);
}

// The first step of a phase records its order; the same order keeps it; a changed order is
// served on demand and re-recorded; each phase has its own.
TEST(DeviceCache, ChangedOrderIsReRecorded) {
  Rig r({1000, 1000, 1000}, Tier::kHost, 1 << 20);
  r.step("train", {0, 1, 2});
  const Trace* t = r.cache->trace("train");
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->size(), 3u);
  r.step("train", {0, 1, 2});
  EXPECT_EQ(r.cache->trace("train"), t);
  EXPECT_EQ(t->size(), 3u);
  r.step("train", {0, 2, 1, 0});
  ASSERT_EQ(r.cache->trace("train")->size(), 4u);
  EXPECT_EQ(r.cache->trace("train")->accesses()[1].object, 2);
  r.step("eval", {2});
  ASSERT_NE(r.cache->trace("eval"), nullptr);
  EXPECT_EQ(r.cache->trace("eval")->size(), 1u);
  EXPECT_EQ(r.cache->trace("train")->size(), 4u);
  // A step that stops short of its trace re-records too.
  r.step("train", {0, 2});
  EXPECT_EQ(r.cache->trace("train")->size(), 2u);
}

// Room for two copies of three: each fetch past the second evicts one that is not pinned, and
// the copies still hold their homes' bytes.
TEST(DeviceCache, ATightDeviceEvictsWhatIsNotPinned) {
  const size_t numel = 64 << 10;  // 128 KiB of bf16 a module
  Rig r({numel, numel, numel}, Tier::kHost, 2 * 2 * numel + 4096);
  for (int m = 0; m < 3; ++m) r.fill(m);
  for (int s = 0; s < 3; ++s) {
    r.cache->begin_phase("train");
    for (int m = 0; m < 3; ++m) {
      auto p = r.cache->acquire(m);
      ASSERT_TRUE(p.is_ok()) << "step " << s << " module " << m << ": " << p.status().to_string();
      EXPECT_TRUE(r.holds_home(m, *p)) << "step " << s << " module " << m;
      r.cache->release(m);
    }
    r.cache->end_phase();
  }
  EXPECT_TRUE(r.errors.take().is_ok());
  EXPECT_GT(r.fetched.size(), 3u);  // the first step alone fetched every module
  EXPECT_LE(r.dev->memory_stats().peak, r.dev->memory_stats().capacity);
}

// With every copy pinned an allocation fails: at once without may_block, else once nothing is
// on its way, naming the object and the keys to change.
TEST(DeviceCache, NoRoomWithEverythingPinnedNamesTheObjectAndKeys) {
  const size_t numel = 64 << 10;
  Rig r({numel, numel}, Tier::kHost, 2 * 2 * numel + 4096);
  r.cache->begin_phase("train");
  ASSERT_TRUE(r.cache->acquire(0).is_ok());
  ASSERT_TRUE(r.cache->acquire(1).is_ok());
  auto quick = r.cache->allocate(2 * numel, "grad.m0", -1, UINT64_MAX, false);
  EXPECT_FALSE(quick.is_ok());
  auto full = r.cache->allocate(2 * numel, "grad.m0", -1, UINT64_MAX, true);
  ASSERT_FALSE(full.is_ok());
  EXPECT_EQ(full.status().code(), StatusCode::kOutOfMemory);
  const std::string msg = full.status().message();
  EXPECT_NE(msg.find("device tier full"), std::string::npos) << msg;
  EXPECT_NE(msg.find("grad.m0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("device.memory_limit"), std::string::npos) << msg;
  // Released, module 1's copy is evicted for the allocation (never `keep`).
  r.cache->release(1);
  EXPECT_FALSE(r.cache->allocate(2 * numel, "grad.m0", 1, UINT64_MAX, false).is_ok());
  auto ok = r.cache->allocate(2 * numel, "grad.m0", -1, UINT64_MAX, true);
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_FALSE(r.cache->resident(1));
  r.cache->release(0);
  r.cache->end_phase();
  r.cache->release_after(*ok, 2 * numel, nullptr);
}

// write_through copies new parameters into a resident copy at an offset; drop forgets the copy
// and the next acquire fetches the home again.
TEST(DeviceCache, WriteThroughAndDrop) {
  Rig r({1000}, Tier::kHost, 1 << 20);
  r.fill(0);
  r.cache->begin_phase("train");
  auto p = r.cache->acquire(0);
  ASSERT_TRUE(p.is_ok());
  ASSERT_TRUE(r.cache->wait_fetch(0).is_ok());
  std::vector<uint16_t> fresh(10, 0xBEEF);
  r.cache->write_through(0, 100 * 2, fresh.data(), fresh.size() * 2);
  ASSERT_TRUE(r.dev->synchronize(r.dev->h2d_stream()).is_ok());
  const auto* copy = static_cast<const uint16_t*>(*p);
  EXPECT_EQ(copy[99], uint16_t(99));
  EXPECT_EQ(copy[100], 0xBEEF);
  EXPECT_EQ(copy[109], 0xBEEF);
  EXPECT_EQ(copy[110], uint16_t(110));
  r.cache->release(0);
  r.cache->drop(0);
  EXPECT_FALSE(r.cache->resident(0));
  auto back = r.cache->acquire(0);
  ASSERT_TRUE(back.is_ok());
  EXPECT_TRUE(r.holds_home(0, *back));
  r.cache->release(0);
  r.cache->end_phase();
  EXPECT_EQ(r.fetched, (std::vector<int>{0, 0}));
}

// The device's optimizer steps a host-homed module's parameters in its resident copy
// (step_in_place) and copies them down into the home on the d2h stream without waiting
// (copied_down): dropping the copy waits for that copy down, and the fetch after it reads the
// new parameters. The d2h stream is held until another thread opens a gate, so a drop that did
// not wait would see the old home.
TEST(DeviceCache, StepInPlaceAndTheCopyDownBeforeADrop) {
  Rig r({1000}, Tier::kHost, 1 << 20);
  r.fill(0);
  r.cache->begin_phase("train");
  auto p = r.cache->acquire(0);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  r.cache->release(0);
  void* copy = r.cache->step_in_place(0);
  ASSERT_EQ(copy, *p);
  ASSERT_TRUE(r.dev->synchronize(r.dev->compute_stream()).is_ok());
  Module& mod = r.homes->module(0);
  std::vector<uint16_t> fresh(mod.sn);
  std::iota(fresh.begin(), fresh.end(), uint16_t(7000));
  std::memcpy(copy, fresh.data(), mod.p.bytes);  // the step, on a host-addressable device
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  r.dev->host_fn(r.dev->d2h_stream(), [open] { open.wait(); });
  r.dev->copy_d2h(r.dev->d2h_stream(), mod.p.ptr(), copy, mod.p.bytes);
  auto down = std::shared_ptr<Event>(r.dev->create_event());
  r.dev->record(*down, r.dev->d2h_stream());
  r.cache->copied_down(0, down);
  std::thread opener([&gate] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate.set_value();
  });
  r.cache->drop(0);
  EXPECT_EQ(std::memcmp(mod.p.ptr(), fresh.data(), mod.p.bytes), 0)
      << "the copy was dropped before its copy down into the home ran";
  opener.join();
  auto back = r.cache->acquire(0);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  ASSERT_TRUE(r.dev->synchronize(r.dev->h2d_stream()).is_ok());
  EXPECT_EQ(std::memcmp(*back, fresh.data(), mod.p.bytes), 0);
  r.cache->release(0);
  r.cache->end_phase();
  EXPECT_EQ(r.fetched, (std::vector<int>{0, 0}));
}

// A fetch's before-fetch hook runs first; its failure fails the demand fetch with the module
// named.
TEST(DeviceCache, BeforeFetchFailureFailsTheDemandFetch) {
  Rig r({1000, 1000}, Tier::kHost, 1 << 20);
  std::vector<int> asked;
  r.cache->set_before_fetch([&](int m) {
    asked.push_back(m);
    return m == 1 ? io_error("publishing the deferred step") : Status::ok();
  });
  r.cache->begin_phase("train");
  ASSERT_TRUE(r.cache->acquire(0).is_ok());
  r.cache->release(0);
  auto bad = r.cache->acquire(1);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().to_string().find("fetching m1 parameters"), std::string::npos)
      << bad.status().to_string();
  EXPECT_NE(bad.status().to_string().find("publishing the deferred step"), std::string::npos);
  EXPECT_EQ(asked, (std::vector<int>{0, 1}));
}

// NVMe-homed parameters come through the fetch ring a sub-group at a time and land whole.
TEST(DeviceCache, NvmeHomedParametersLandWhole) {
  const std::string dir = test::temp_dir("strata_device_cache", "nvme");
  {
    Rig r({5000, 3000}, Tier::kNvme, 1 << 20, dir);
    // Write each module's pattern to its extents through the I/O worker.
    for (int m = 0; m < 2; ++m) {
      Module& mod = r.homes->module(m);
      ASSERT_EQ(mod.p.subs.size(), mod.sub_groups());
      for (size_t j = 0; j < mod.sub_groups(); ++j) {
        auto buf = r.homes->host_buf(mod.p.subs[j].bytes, "test");
        ASSERT_TRUE(buf.is_ok());
        auto* p = static_cast<uint16_t*>(buf->data());
        for (size_t i = 0; i < mod.sub_len(j); ++i)
          p[i] = uint16_t(1000 * m + mod.sub_start(j) + i);
        ASSERT_TRUE(r.homes->io()->wait(r.homes->io()->write(mod.p.subs[j], buf->data())).is_ok());
      }
    }
    r.cache->begin_phase("train");
    for (int m : {0, 1}) {
      auto p = r.cache->acquire(m);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      EXPECT_TRUE(r.holds_home(m, *p)) << m;
      r.cache->release(m);
    }
    r.cache->end_phase();
    EXPECT_TRUE(r.errors.take().is_ok());
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
