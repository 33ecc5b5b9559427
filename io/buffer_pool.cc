// Pinned buffer pool (see strata/buffer_pool.h).
#include "strata/buffer_pool.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "strata/log.h"
#include "strata/storage.h"

namespace strata {

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = other.pool_;
    data_ = other.data_;
    size_ = other.size_;
    offset_ = other.offset_;
    other.pool_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void PinnedBuffer::reset() {
  if (pool_ != nullptr && data_ != nullptr) pool_->release(offset_, size_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

Result<std::unique_ptr<BufferPool>> BufferPool::create(size_t budget,
                                                       const BufferPoolOptions& options) {
  if (budget == 0) return invalid_argument(fmt::format("{}: budget must be > 0", options.name));
  const size_t cap = (budget + kStorageAlignment - 1) & ~(kStorageAlignment - 1);
  // Arenas of at least one huge page start on a huge-page boundary and ask for transparent huge
  // pages before any page is touched (mlock below faults them in). With 4 KiB pages a 1 MiB
  // O_DIRECT transfer is 256 scattered pages; a virtio disk takes at most 254 segments per
  // request (/sys/block/*/queue/max_segments), so the block layer split every 1 MiB read into
  // 1016 KiB + 8 KiB and the disk saw twice the requests (measured: docs/BENCHMARKS.md, storage).
  // Inside a 2 MiB page a piece is one physically contiguous segment.
  const size_t align = cap >= kHugePage ? kHugePage : kStorageAlignment;
  void* p = nullptr;
  if (::posix_memalign(&p, align, cap) != 0) p = nullptr;
  if (p == nullptr)
    return out_of_memory(fmt::format("{}: cannot allocate its {} budget; lower the budget",
                                     options.name, format_bytes(static_cast<double>(cap))));
  std::unique_ptr<BufferPool> pool(new BufferPool());
  pool->name_ = options.name;
  pool->budget_key_ = options.budget_key;
  pool->base_ = p;
  pool->capacity_ = cap;
  // madvise fails (EINVAL) when THP is compiled out; it succeeds but has no effect when THP is
  // "never", so that setting is read too. Either way the pool then works with 4 KiB pages.
  if (align == kHugePage && options.huge_pages) {
    std::string thp;
    std::getline(std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"), thp);
    const bool never = thp.empty() || thp.find("[never]") != std::string::npos;
    pool->huge_pages_ = !never && ::madvise(p, cap, MADV_HUGEPAGE) == 0;
    if (!pool->huge_pages_)
      log_debug(
          "{}: no transparent huge pages (THP setting \"{}\"); 1 MiB I/O pieces may be "
          "split by the disk's segment limit (see docs/STORAGE.md, Huge pages)",
          options.name, thp);
  }
  pool->alloc_ = std::make_unique<ExtentAllocator>(cap, kStorageAlignment, options.name);
  if (options.lock) {
    if (::mlock(p, cap) == 0) {
      pool->locked_ = true;
    } else {
      const int err = errno;
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true)) {
        rlimit rl{};
        getrlimit(RLIMIT_MEMLOCK, &rl);
        log_warn(
            "{}: could not lock {} in memory ({}; the locked-memory limit is {}); using "
            "unlocked memory, which is slower for I/O and may be paged out. Raise the limit: "
            "`ulimit -l unlimited` in the launching shell, or `* - memlock unlimited` in "
            "/etc/security/limits.conf, or --ulimit memlock=-1 for docker",
            options.name, format_bytes(static_cast<double>(cap)), std::strerror(err),
            rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                         : format_bytes(static_cast<double>(rl.rlim_cur)));
      }
    }
  }
  return pool;
}

BufferPool::~BufferPool() {
  STRATA_CHECK(live_ == 0, fmt::format("{}: destroyed with {} buffers still out", name_, live_));
  if (locked_) ::munlock(base_, capacity_);
  std::free(base_);
}

Result<PinnedBuffer> BufferPool::acquire(size_t bytes) {
  if (bytes == 0) return invalid_argument(fmt::format("{}: acquire(0)", name_));
  std::lock_guard lock(mu_);
  auto off = alloc_->allocate(bytes);
  if (!off.is_ok())
    return out_of_memory(fmt::format(
        "{}: asking for {} but {} of its {} budget is in use (largest free block {}); raise "
        "{} or release buffers first",
        name_, format_bytes(static_cast<double>(bytes)),
        format_bytes(static_cast<double>(alloc_->used_bytes())),
        format_bytes(static_cast<double>(capacity_)),
        format_bytes(static_cast<double>(alloc_->largest_free())),
        budget_key_.empty() ? std::string("the pinned-memory budget") : budget_key_));
  PinnedBuffer b;
  b.pool_ = this;
  b.offset_ = *off;
  b.data_ = static_cast<char*>(base_) + *off;
  b.size_ = bytes;
  ++live_;
  peak_ = std::max<size_t>(peak_, alloc_->used_bytes());
  return b;
}

void BufferPool::release(uint64_t offset, size_t size) {
  std::lock_guard lock(mu_);
  alloc_->free(offset, size);
  --live_;
}

size_t BufferPool::in_use() const {
  std::lock_guard lock(mu_);
  return alloc_->used_bytes();
}

size_t BufferPool::peak_in_use() const {
  std::lock_guard lock(mu_);
  return peak_;
}

}  // namespace strata
