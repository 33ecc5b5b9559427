// IoWorker (io/io_worker.h): read-after-write order per extent, and no lost wake-up; and the
// storage engine's urgent lane (IoRequest::urgent), which parameter fetches take past the
// optimizer's traffic.
//
// A read queued while a write of the same extent is in flight is held back until that write
// completes. The worker used to go back to sleep after reaping that write, leaving the held
// read unsubmitted until some unrelated request arrived: a caller waiting for the read (an
// NVMe parameter fetch with nothing else queued) hung forever. Each round below queues a
// write and, at once, a read of the same extent, with nothing after them; the read must
// complete (bounded wait) and return what the write wrote.
#include "io/io_worker.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <random>
#include <string>
#include <vector>

#include "strata/storage.h"
#include "strata/swap_space.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

TEST(IoWorkerTest, ReadHeldBehindWriteCompletesAndSeesTheWrite) {
  const std::string dir = "/tmp/strata_io_worker_test_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  StorageOptions so;
  auto storage = open_storage(so);
  ASSERT_TRUE(storage.is_ok()) << storage.status().to_string();
  SwapOptions wo;
  wo.paths = {dir};
  wo.bytes_per_path = 8 << 20;
  auto swap = SwapSpace::create(storage->get(), wo);
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
  const size_t bytes = 256 << 10;
  auto ext = (*swap)->allocate(bytes);
  ASSERT_TRUE(ext.is_ok()) << ext.status().to_string();
  auto* a = static_cast<unsigned char*>(std::aligned_alloc(4096, bytes));
  auto* b = static_cast<unsigned char*>(std::aligned_alloc(4096, bytes));
  std::mt19937_64 rng(std::random_device{}());
  {
    IoWorker io(storage->get(), swap->get());
    for (int round = 0; round < 200; ++round) {
      for (size_t i = 0; i < bytes; ++i) a[i] = static_cast<unsigned char>(rng());
      std::memset(b, 0, bytes);
      IoWorker::Ticket w = io.write(*ext, a);
      IoWorker::Ticket r = io.read(*ext, b);
      auto done = std::async(std::launch::async, [&] { return io.wait(r); });
      if (done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
        ADD_FAILURE() << "round " << round
                      << ": a read held behind a write never completed (lost wake-up)";
        std::_Exit(1);  // the worker is stuck; nothing can be torn down cleanly
      }
      ASSERT_TRUE(done.get().is_ok());
      ASSERT_TRUE(io.wait(w).is_ok());
      ASSERT_EQ(std::memcmp(a, b, bytes), 0) << "round " << round << ": read overtook the write";
    }
  }
  std::free(a);
  std::free(b);
  swap->reset();
  fs::remove_all(dir);
}

// With one piece in flight, an urgent read submitted behind eight 1 MiB reads is cut into pieces
// before their remaining ones: it completes first. The same read not urgent completes last.
TEST(StorageEngine, UrgentRequestsGoBeforeTheQueuedOnes) {
  const std::string dir = "/tmp/strata_io_urgent_test_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  StorageOptions so;
  so.queue_depth = 1;
  so.block_size = 64 << 10;
  auto storage = open_storage(so);
  ASSERT_TRUE(storage.is_ok()) << storage.status().to_string();
  SwapOptions wo;
  wo.paths = {dir};
  wo.bytes_per_path = 16 << 20;
  auto swap = SwapSpace::create(storage->get(), wo);
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
  const size_t bytes = 1 << 20;
  std::vector<SwapExtent> ext;
  for (int i = 0; i < 9; ++i) {
    auto e = (*swap)->allocate(bytes);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    ext.push_back(*e);
  }
  auto* buf = static_cast<char*>(std::aligned_alloc(4096, 9 * bytes));
  for (bool urgent : {true, false}) {
    std::vector<IoRequest> reqs;
    for (int i = 0; i < 9; ++i) {
      std::vector<IoRequest> one;
      (*swap)->requests(ext[size_t(i)], IoOp::kRead, buf + size_t(i) * bytes, uint64_t(i), &one);
      for (IoRequest& r : one) r.urgent = i == 8 && urgent;
      // The eight first, then the ninth on its own: it arrives behind them.
      ASSERT_TRUE((*storage)->submit(one).is_ok());
    }
    std::vector<uint64_t> order;
    std::vector<IoCompletion> comps(16);
    while (order.size() < 9) {
      const size_t n = (*storage)->reap(comps, 1);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(comps[i].status.is_ok()) << comps[i].status.to_string();
        order.push_back(comps[i].cookie);
      }
    }
    if (urgent) {
      EXPECT_EQ(order.front(), 8u) << "the urgent read waited behind the queued ones";
    } else {
      EXPECT_EQ(order.back(), 8u) << "without the flag, requests are served in order";
    }
  }
  std::free(buf);
  swap->reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
