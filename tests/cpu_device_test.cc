// The CPU device backend: capacity-accounted arena, in-order streams, events across streams.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "strata/device.h"

namespace strata {
namespace {

std::unique_ptr<Device> make(size_t cap) {
  auto d = create_cpu_device({.capacity = cap, .threads = 2});
  EXPECT_TRUE(d.is_ok()) << d.status().to_string();
  return std::move(d).value();
}

TEST(CpuDevice, AllocationIsBoundedByCapacity) {
  auto dev = make(1 << 20);
  auto a = dev->allocate(600 << 10, "a");
  ASSERT_TRUE(a.is_ok());
  auto b = dev->allocate(600 << 10, "b");
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("'b'"), std::string::npos);
  EXPECT_NE(b.status().message().find("device.memory_limit"), std::string::npos);
  dev->release(*a);
  auto c = dev->allocate(600 << 10, "c");
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(dev->memory_stats().peak, size_t(600 << 10));
  dev->release(*c);
  EXPECT_EQ(dev->memory_stats().used, 0u);
}

// A released block is kept for the next allocation of its size (no unmap and refault per
// step); kept blocks never make the device hold more than its capacity: an allocation that
// would exceed it with them returns them first.
TEST(CpuDevice, ReleasedBlocksAreReusedWithinTheCapacity) {
  auto dev = make(1 << 20);
  auto a = dev->allocate(300 << 10, "a");
  ASSERT_TRUE(a.is_ok());
  void* first = *a;
  dev->release(*a);
  auto b = dev->allocate(300 << 10, "b");
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(*b, first) << "a block of the same size is reused";
  dev->release(*b);
  // 300 KiB kept + 800 KiB new > 1 MiB: the kept block is returned and the new one fits.
  // (With the old code's unmapping this test passes too, except for the reuse above.)
  auto c = dev->allocate(800 << 10, "c");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(dev->memory_stats().used, size_t(800 << 10));
  auto d = dev->allocate(300 << 10, "d");
  EXPECT_FALSE(d.is_ok()) << "in use 800 KiB + 300 KiB is over the capacity";
  dev->release(*c);
  EXPECT_EQ(dev->memory_stats().used, 0u);
  EXPECT_EQ(dev->memory_stats().peak, size_t(800 << 10));
}

TEST(CpuDevice, StreamsRunInOrderAndEventsJoinThem) {
  auto dev = make(1 << 20);
  std::vector<int> order;
  std::mutex mu;
  auto push = [&](int v) {
    std::lock_guard<std::mutex> l(mu);
    order.push_back(v);
  };
  auto ev = dev->create_event();
  // compute: slow task then 2; h2d must wait for compute's first task via the event.
  dev->host_fn(dev->compute_stream(), [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    push(1);
  });
  dev->record(*ev, dev->compute_stream());
  dev->wait(dev->h2d_stream(), *ev);
  dev->host_fn(dev->h2d_stream(), [&] { push(2); });
  ASSERT_TRUE(dev->synchronize(dev->h2d_stream()).is_ok());
  ASSERT_TRUE(dev->synchronize(*ev).is_ok());
  EXPECT_TRUE(dev->query(*ev));
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

TEST(CpuDevice, CopiesAreOrderedOnTheirStream) {
  auto dev = make(1 << 20);
  void* d = *dev->allocate(4096, "buf");
  std::vector<uint8_t> src(4096), dst(4096, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i * 7 + 3);
  dev->copy_h2d(dev->h2d_stream(), d, src.data(), src.size());
  auto ev = dev->create_event();
  dev->record(*ev, dev->h2d_stream());
  dev->wait(dev->d2h_stream(), *ev);
  dev->copy_d2h(dev->d2h_stream(), dst.data(), d, dst.size());
  ASSERT_TRUE(dev->synchronize(dev->d2h_stream()).is_ok());
  EXPECT_EQ(src, dst);
  dev->release(d);
}

}  // namespace
}  // namespace strata
