// StreamStamps (src/tiers/stream_stamps.h): a stamp is dated with the host time its stream
// reached it, between what the host did before and after, in stream order; by a timed event
// where the device times its streams (no host function enqueued), by a host function where it
// does not; hold() keeps an object until its stream has been waited for. No timing is asserted
// beyond what the stream's own order and a sleep guarantee.
#include "src/tiers/stream_stamps.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "strata/device_wrapper.h"
#include "strata/simulated_device.h"
#include "tests/tiers/tier_rig.h"

namespace strata {
namespace {

int64_t now_ticks() { return TierClock::now().time_since_epoch().count(); }

// Stamps a then b dated in that order between host times t0 and t1, at least apart_ms apart.
void expect_dated_between(int64_t t0, const std::atomic<int64_t>& a, const std::atomic<int64_t>& b,
                          int64_t t1, int apart_ms) {
  EXPECT_LE(t0, a.load());
  EXPECT_LE(a.load(), b.load());
  EXPECT_LE(b.load(), t1);
  EXPECT_GE(
      b.load() - a.load(),
      std::chrono::duration_cast<TierClock::duration>(std::chrono::milliseconds(apart_ms)).count());
}

// Counts the host functions enqueued; optionally hides the device's stream timing.
class Watched final : public DeviceWrapper {
 public:
  Watched(std::unique_ptr<Device> d, bool timed) : DeviceWrapper(std::move(d)), timed_(timed) {}
  Result<double> elapsed_ms(Event& from, Event& to) override {
    if (!timed_) return unavailable("not timed (test)");
    return DeviceWrapper::elapsed_ms(from, to);
  }
  void host_fn(Stream& s, std::function<void()> fn) override {
    ++host_fns;
    DeviceWrapper::host_fn(s, std::move(fn));
  }
  std::atomic<int> host_fns{0};

 private:
  bool timed_;
};

TEST(StreamStamps, ADeviceThatTimesItsStreamsIsStampedByEventsDatedAtTheWait) {
  auto dev = std::make_unique<Watched>(test::cpu_device(1 << 20), /*timed=*/true);
  StreamStamps stamps(*dev);
  ASSERT_TRUE(stamps.timed());
  Stream& s = dev->compute_stream();
  std::atomic<bool> go{false};
  dev->host_fn(s, [&go] {
    while (!go.load()) std::this_thread::yield();
  });
  const int before = dev->host_fns;
  const int64_t t0 = now_ticks();
  StreamStamps::Stamp a = stamps.stamp(s);
  dev->host_fn(s, [] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
  StreamStamps::Stamp b = stamps.stamp(s);
  // The stamps enqueued no host function (the sleep is the test's own), and stay undated until
  // the host waits for the stream.
  EXPECT_EQ(dev->host_fns, before + 1);
  go = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(a->load(), 0);
  EXPECT_EQ(b->load(), 0);
  ASSERT_TRUE(stamps.synchronize(s).is_ok());
  expect_dated_between(t0, *a, *b, now_ticks(), /*apart_ms=*/20);
  // A wait for another stream dates nothing of this one.
  StreamStamps::Stamp c = stamps.stamp(s);
  ASSERT_TRUE(stamps.synchronize(dev->d2h_stream()).is_ok());
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  EXPECT_EQ(c->load(), 0);
  ASSERT_TRUE(stamps.synchronize(s).is_ok());
  EXPECT_GE(c->load(), b->load());
}

TEST(StreamStamps, ADeviceThatDoesNotTimeItsStreamsIsStampedByHostFunctions) {
  auto dev = std::make_unique<Watched>(test::cpu_device(1 << 20), /*timed=*/false);
  StreamStamps stamps(*dev);
  EXPECT_FALSE(stamps.timed());
  Stream& s = dev->compute_stream();
  const int64_t t0 = now_ticks();
  StreamStamps::Stamp a = stamps.stamp(s);
  dev->host_fn(s, [] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
  StreamStamps::Stamp b = stamps.stamp(s);
  EXPECT_EQ(dev->host_fns, 3);
  // Dated as the stream reaches them: a plain wait is enough.
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  expect_dated_between(t0, *a, *b, now_ticks(), /*apart_ms=*/20);
  ASSERT_TRUE(stamps.synchronize(s).is_ok());
}

TEST(StreamStamps, OnTheSimulatedDeviceStampsFollowTheModeledStream) {
  auto sim = create_simulated_device({.capacity = size_t(64) << 20, .threads = 1},
                                     simulated_device_preset("h200").value());
  ASSERT_TRUE(sim.is_ok()) << sim.status().to_string();
  auto dev = std::make_unique<Watched>(std::move(*sim), /*timed=*/true);
  StreamStamps stamps(*dev);
  ASSERT_TRUE(stamps.timed());
  Stream& s = dev->compute_stream();
  // 32 MiB copied across the modeled link (55 GB/s): ~0.6 ms of the compute stream.
  const size_t bytes = size_t(32) << 20;
  auto host = dev->allocate_host(bytes);
  auto buf = dev->allocate(bytes, "test");
  ASSERT_TRUE(host.is_ok() && buf.is_ok());
  const int before = dev->host_fns;
  const int64_t t0 = now_ticks();
  StreamStamps::Stamp a = stamps.stamp(s);
  dev->copy_h2d(s, *buf, *host, bytes);
  StreamStamps::Stamp b = stamps.stamp(s);
  EXPECT_EQ(dev->host_fns, before);
  ASSERT_TRUE(stamps.synchronize(s).is_ok());
  expect_dated_between(t0, *a, *b, now_ticks(), /*apart_ms=*/0);
  EXPECT_LT(a->load(), b->load());  // the modeled copy lies between them
  dev->release(*buf);
  dev->release_host(*host);
}

TEST(StreamStamps, WhatAStreamHoldsIsLetGoWhenTheHostHasWaitedForIt) {
  for (bool timed : {true, false}) {
    SCOPED_TRACE(timed ? "timed" : "host functions");
    auto dev = std::make_unique<Watched>(test::cpu_device(1 << 20), timed);
    StreamStamps stamps(*dev);
    auto on_compute = std::make_shared<int>(1), on_h2d = std::make_shared<int>(2);
    std::weak_ptr<int> wc = on_compute, wh = on_h2d;
    stamps.hold(dev->compute_stream(), std::move(on_compute));
    stamps.hold(dev->h2d_stream(), std::move(on_h2d));
    EXPECT_FALSE(wc.expired());
    ASSERT_TRUE(stamps.synchronize(dev->h2d_stream()).is_ok());
    EXPECT_TRUE(wh.expired());
    EXPECT_FALSE(wc.expired());
    ASSERT_TRUE(stamps.synchronize(dev->compute_stream()).is_ok());
    EXPECT_TRUE(wc.expired());
  }
}

}  // namespace
}  // namespace strata
