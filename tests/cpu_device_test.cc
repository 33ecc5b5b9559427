// The CPU device backend: capacity-accounted arena, in-order streams, events across streams.
#include <gtest/gtest.h>
#include <sanitizer/common_interface_defs.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
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

// Device memory is one arena (kernels/device_arena.h): a released block's room is reused by
// the next allocation that fits it (no unmap and refault per step); the capacity, not the
// layout, decides what fails (the arena spans twice the capacity, as malloc would place a block
// wherever it fits); free pages beyond the capacity are given back to the kernel.
TEST(CpuDevice, ReleasedRoomIsReusedAndOnlyTheCapacityBoundsAllocation) {
  auto dev = make(1 << 20);
  auto a = dev->allocate(300 << 10, "a");
  ASSERT_TRUE(a.is_ok());
  void* first = *a;
  dev->release(*a);
  auto b = dev->allocate(300 << 10, "b");
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(*b, first) << "the released room is reused";
  dev->release(*b);

  // Four quarters, the first and third released: 512 KiB free in two pieces of 256 KiB.
  std::vector<void*> q;
  for (int i = 0; i < 4; ++i) {
    auto r = dev->allocate(256 << 10, "quarter");
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    q.push_back(*r);
  }
  EXPECT_FALSE(dev->allocate(1, "over").is_ok()) << "the capacity is in use";
  dev->release(q[0]);
  dev->release(q[2]);
  auto half = dev->allocate(512 << 10, "half");
  ASSERT_TRUE(half.is_ok()) << "512 KiB free in pieces still holds 512 KiB: "
                            << half.status().to_string();
  EXPECT_EQ(dev->memory_stats().used, size_t(1) << 20);
  EXPECT_FALSE(dev->allocate(1, "over").is_ok());

  // The half lies beyond the capacity's first pages: once released its pages go back.
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  char* h = static_cast<char*>(*half);
  std::memset(h, 1, 512 << 10);
  char* lo = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(h) + page - 1) / page * page);
  const size_t pages = (h + (512 << 10) - lo) / page;
  auto resident = [&] {
    std::vector<unsigned char> v(pages);
    EXPECT_EQ(::mincore(lo, pages * page, v.data()), 0);
    size_t n = 0;
    for (unsigned char c : v) n += c & 1;
    return n;
  };
  EXPECT_EQ(resident(), pages);
  dev->release(*half);
  EXPECT_EQ(resident(), 0u) << "free pages beyond the capacity are returned";
  dev->release(q[1]);
  dev->release(q[3]);
  EXPECT_EQ(dev->memory_stats().used, 0u);
  EXPECT_EQ(dev->memory_stats().peak, size_t(1) << 20);
}

// Under ASan the arena poisons a gap after every block and every released block, as malloc's
// redzones did: a kernel that writes past its buffer or into a released one is reported.
#if defined(__SANITIZE_ADDRESS__)
// The report to stderr, where the death test reads it (tools/dev.sh sends reports to files).
#define STRATA_ASAN_DIES(statement)                                      \
  EXPECT_DEATH(                                                          \
      {                                                                  \
        __sanitizer_set_report_fd(reinterpret_cast<void*>(intptr_t{2})); \
        statement;                                                       \
      },                                                                 \
      "AddressSanitizer: use-after-poison")
TEST(CpuDevice, AsanSeesWritesPastABlockAndIntoAReleasedOne) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto dev = make(1 << 20);
  auto a = dev->allocate(1000, "a");
  ASSERT_TRUE(a.is_ok());
  char* p = static_cast<char*>(*a);
  p[1023] = 1;  // the block is rounded up to 1024 bytes: still its own
  volatile char* past = p + 1024;
  STRATA_ASAN_DIES(*past = 1);
  dev->release(p);
  volatile char* freed = p;
  STRATA_ASAN_DIES(*freed = 1);
}
#else
TEST(CpuDevice, AsanSeesWritesPastABlockAndIntoAReleasedOne) {
  GTEST_SKIP() << "needs an ASan build (tools/dev.sh sanitize asan)";
}
#endif

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

// memset_zero splits a large range into pieces run on the device's threads (1 MiB each): every
// byte of the range is zeroed, none beside it, on a device limited to 2 threads and on one with
// all, in stream order after a kernel-free write on the same stream.
TEST(CpuDevice, ZeroingALargeRangeZeroesItAllAndNothingBeside) {
  for (int threads : {2, 0}) {
    SCOPED_TRACE(threads);
    auto made = create_cpu_device({.capacity = size_t{16} << 20, .threads = threads});
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    Device& dev = **made;
    const size_t n = (size_t{5} << 20) + 4099, pad = 4096;
    auto* buf = static_cast<uint8_t*>(*dev.allocate(n + 2 * pad, "buf"));
    Stream& s = dev.compute_stream();
    dev.host_fn(s, [buf, n, pad] { std::memset(buf, 0xA5, n + 2 * pad); });
    dev.memset_zero(s, buf + pad + 1, n);
    ASSERT_TRUE(dev.synchronize(s).is_ok());
    size_t nonzero = 0;
    for (size_t i = pad + 1; i < pad + 1 + n; ++i) nonzero += buf[i] != 0;
    EXPECT_EQ(nonzero, 0u);
    for (size_t i = 0; i <= pad; ++i) ASSERT_EQ(buf[i], 0xA5) << "before the range, at " << i;
    for (size_t i = pad + 1 + n; i < n + 2 * pad; ++i) {
      ASSERT_EQ(buf[i], 0xA5) << "after the range, at " << i;
    }
    dev.release(buf);
  }
}

}  // namespace
}  // namespace strata
