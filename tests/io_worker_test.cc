// IoWorker (io/io_worker.h): read-after-write order per extent, and no lost wake-up.
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

}  // namespace
}  // namespace strata
