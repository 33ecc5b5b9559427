// BufferPool: pinned, 4096-aligned host buffers for storage I/O, carved from one arena whose
// size is a byte budget from the config.
//
// The arena is allocated once (4096-aligned; 2 MiB-aligned and advised MADV_HUGEPAGE when it is
// at least 2 MiB, so an I/O piece of up to 1 MiB is one physically contiguous segment and a
// virtio/NVMe queue's segment limit does not split it; huge_pages() tells whether the kernel
// accepted the advice) and locked in memory with mlock so the kernel can DMA into it and never
// pages it out. If locking fails (RLIMIT_MEMLOCK, see `ulimit -l`) the
// pool still works with unlocked memory and logs one warning saying how to raise the limit;
// locked() tells which happened. (On CUDA builds the device layer may additionally register the
// arena with cudaHostRegister through base()/capacity().) Because the arena is one region,
// Storage::register_buffer(pool.base(), pool.capacity()) lets io_uring use fixed buffers.
//
// acquire() never waits and never exceeds the budget: a request that does not fit in the free
// space returns kOutOfMemory naming the pool, the request, what is in use and the budget.
// Buffers are returned when their PinnedBuffer handle is destroyed.
//
// Thread safety: acquire() and buffer release may be called from any thread (internal mutex).
// The pool must outlive every buffer it handed out (checked when it is destroyed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "strata/extent_allocator.h"
#include "strata/status.h"

namespace strata {

class BufferPool;

// A buffer from a pool: move-only; destroying it gives the bytes back.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer() { reset(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }  // bytes asked for
  bool empty() const { return data_ == nullptr; }
  void reset();  // gives the buffer back now

 private:
  friend class BufferPool;
  BufferPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
  uint64_t offset_ = 0;
};

struct BufferPoolOptions {
  std::string name = "pinned buffer pool";  // used in messages
  // What sets the budget, named when an acquire does not fit ("" : the pinned-memory budget).
  std::string budget_key;
  bool lock = true;  // try mlock
  // Ask for transparent huge pages (arenas of 2 MiB or more). Faulting huge pages in may stall
  // on the kernel's compaction; a pool that does no I/O can do without.
  bool huge_pages = true;
};

class BufferPool {
 public:
  // An arena of `budget` bytes (rounded up to 4096). Fails only if the memory itself cannot be
  // allocated (kOutOfMemory naming the budget).
  static Result<std::unique_ptr<BufferPool>> create(size_t budget,
                                                    const BufferPoolOptions& options = {});
  ~BufferPool();

  // A 4096-aligned buffer of at least `bytes` bytes (rounded up to 4096), or kOutOfMemory.
  Result<PinnedBuffer> acquire(size_t bytes);

  void* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  size_t in_use() const;
  size_t peak_in_use() const;
  bool locked() const { return locked_; }
  // Whether the arena was advised to use transparent huge pages (2 MiB) and the kernel accepted
  // (false for arenas under 2 MiB, THP "never" in /sys/kernel/mm/transparent_hugepage/enabled,
  // or THP compiled out). The kernel may still fall back to 4 KiB pages when it has no free
  // huge pages.
  bool huge_pages() const { return huge_pages_; }
  static constexpr size_t kHugePage = size_t{2} << 20;

 private:
  BufferPool() = default;
  friend class PinnedBuffer;
  void release(uint64_t offset, size_t size);

  std::string name_;
  std::string budget_key_;  // BufferPoolOptions::budget_key
  void* base_ = nullptr;
  size_t capacity_ = 0;
  bool locked_ = false;
  bool huge_pages_ = false;
  mutable std::mutex mu_;
  std::unique_ptr<ExtentAllocator> alloc_;
  size_t peak_ = 0;
  size_t live_ = 0;  // buffers handed out and not returned
};

}  // namespace strata
