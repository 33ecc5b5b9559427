// A device's memory as one block carved up by first fit: the CUDA backend's arena (one
// cudaMalloc) and the CPU backend's (one mapping), so that both hand out blocks the same way.
//
// Blocks are taken first fit over an offset-ordered free list and merged with their neighbours
// on release. `limit` bounds the bytes in use: the CUDA arena's limit is its span; the CPU
// arena's span is larger than its limit, so that a block fits wherever malloc's would (the
// capacity, not the layout, decides what fails), while first fit keeps the blocks of a steady
// state low in the span, on pages touched once. Not thread-safe by itself: each device holds
// its mutex around every call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <optional>
#include <unordered_map>

namespace strata {

class DeviceArena {
 public:
  struct Block {
    size_t offset = 0, bytes = 0;
  };

  void reset(char* base, size_t span, size_t limit) {
    base_ = base;
    span_ = span;
    limit_ = std::min(limit, span);
    used_ = peak_ = 0;
    free_.clear();
    live_.clear();
    if (span > 0) free_[0] = span;
  }
  char* base() const { return base_; }
  size_t span() const { return span_; }
  size_t limit() const { return limit_; }
  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  void reset_peak() { peak_ = used_; }

  // Returns null if n bytes more would pass the limit or no free block holds them.
  void* allocate(size_t n) {
    if (used_ + n > limit_) return nullptr;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < n) continue;
      const size_t off = it->first, rest = it->second - n;
      free_.erase(it);
      if (rest > 0) free_[off + n] = rest;
      live_[off] = n;
      used_ += n;
      peak_ = std::max(peak_, used_);
      return base_ + off;
    }
    return nullptr;
  }
  // The released block's size and the free block it is now part of (merged with its free
  // neighbours); nothing if p is not a live block.
  struct Released {
    size_t bytes = 0;
    Block merged;
  };
  std::optional<Released> release(void* p) {
    const size_t off = static_cast<size_t>(static_cast<char*>(p) - base_);
    auto it = live_.find(off);
    if (it == live_.end()) return std::nullopt;
    const size_t bytes = it->second;
    size_t start = off, size = bytes;
    used_ -= size;
    live_.erase(it);
    auto next = free_.lower_bound(off);
    if (next != free_.end() && next->first == off + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        size += prev->second;
        free_.erase(prev);
      }
    }
    free_[start] = size;
    return Released{bytes, {start, size}};
  }
  size_t largest_free() const {
    size_t best = 0;
    for (const auto& [off, size] : free_) best = std::max(best, size);
    return best;
  }

 private:
  char* base_ = nullptr;
  size_t span_ = 0, limit_ = 0, used_ = 0, peak_ = 0;
  std::map<size_t, size_t> free_;            // offset -> bytes, no two adjacent
  std::unordered_map<size_t, size_t> live_;  // offset -> bytes
};

}  // namespace strata
