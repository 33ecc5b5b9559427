// A device's memory as one block carved up by first fit: the CUDA backend's arena (one
// cudaMalloc) and the CPU backend's (one mapping), so that both hand out blocks the same way.
//
// The ranges are an ExtentAllocator's (strata/extent_allocator.h: first fit by address,
// neighbours merged on release, 256-byte granules), the swap files' and the pinned pool's
// allocator; the arena adds the base address and the peak. What may be in use is the device's
// to decide (the CPU arena spans twice its capacity, so that a block fits wherever malloc's
// would, while first fit keeps a steady state's blocks low in the span, on pages touched once).
// Not thread-safe by itself: each device holds its mutex around every call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>

#include "strata/extent_allocator.h"

namespace strata {

class DeviceArena {
 public:
  static constexpr size_t kGranule = 256;  // every block's size and offset a multiple of it

  void reset(char* base, size_t span) {
    base_ = base;
    ranges_.emplace(span, kGranule, "device arena");
    peak_ = 0;
  }
  char* base() const { return base_; }
  size_t span() const { return ranges_ ? ranges_->capacity() : 0; }
  size_t used() const { return ranges_ ? ranges_->used_bytes() : 0; }
  size_t peak() const { return peak_; }
  void reset_peak() { peak_ = used(); }
  size_t largest_free() const { return ranges_ ? ranges_->largest_free() : 0; }

  // Null if no free block holds n bytes (rounded up to kGranule).
  void* allocate(size_t n) {
    const std::optional<uint64_t> off = ranges_ ? ranges_->try_allocate(n) : std::nullopt;
    if (!off) return nullptr;
    peak_ = std::max(peak_, used());
    return base_ + *off;
  }
  // The released block's size and the free block it is now part of (merged with its free
  // neighbours); nothing if p is not a live block.
  struct Block {
    size_t offset = 0, bytes = 0;
  };
  struct Released {
    size_t bytes = 0;
    Block merged;
  };
  std::optional<Released> release(void* p) {
    if (!ranges_) return std::nullopt;
    const auto f = ranges_->free_at(uint64_t(static_cast<char*>(p) - base_));
    if (!f) return std::nullopt;
    return Released{f->bytes, {f->merged_offset, f->merged_length}};
  }

 private:
  char* base_ = nullptr;
  std::optional<ExtentAllocator> ranges_;
  size_t peak_ = 0;
};

}  // namespace strata
