// ExtentAllocator: hands out aligned byte ranges of a fixed-size space and takes them back,
// merging neighbours so free space does not splinter.
//
// Used for swap files (one allocator per file, offsets within its data area), for the pinned
// buffer pool (offsets within its arena) and for the devices' memory (kernels/device_arena.h).
// Policy: first fit by address, which keeps allocations packed toward the start of the space;
// freeing coalesces with the free ranges on both sides. Every size is rounded up to `alignment`,
// and every offset handed out is a multiple of it.
//
// Errors: allocate() fails with kNoSpace, naming the request, the free total and the largest
// free range (so fragmentation is visible). free() of a range that was not allocated is a bug
// (STRATA_CHECK), not a Status.
//
// Thread safety: none; callers hold their own lock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "strata/status.h"

namespace strata {

class ExtentAllocator {
 public:
  // Manages [0, capacity). `alignment` must be a power of two; capacity is rounded down to it.
  // `name` appears in error messages (e.g. the swap file's path).
  ExtentAllocator(uint64_t capacity, uint64_t alignment, std::string name = "extent allocator");

  // An offset o with [o, o + round_up(bytes)) free and now allocated. bytes must be > 0.
  Result<uint64_t> allocate(uint64_t bytes);
  // The same, without the error's message (a device's allocation that fails and is retried).
  std::optional<uint64_t> try_allocate(uint64_t bytes);
  // Returns [offset, offset + round_up(bytes)), which must have been allocated exactly so.
  void free(uint64_t offset, uint64_t bytes);
  // Returns the range allocated at offset, whatever its size: its size and the free range it is
  // now part of (merged with its free neighbours); nothing if no range was allocated there.
  struct Freed {
    uint64_t bytes = 0, merged_offset = 0, merged_length = 0;
  };
  std::optional<Freed> free_at(uint64_t offset);

  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t used_bytes() const { return capacity_ - free_bytes_; }
  uint64_t largest_free() const;
  // Number of separate free ranges (1 when nothing is allocated; a fragmentation measure).
  size_t free_ranges() const { return free_.size(); }
  uint64_t round_up(uint64_t bytes) const { return (bytes + alignment_ - 1) & ~(alignment_ - 1); }

 private:
  Freed release(std::map<uint64_t, uint64_t>::iterator allocated);

  uint64_t capacity_;
  uint64_t alignment_;
  uint64_t free_bytes_;
  std::string name_;
  std::map<uint64_t, uint64_t> free_;       // offset -> length of each free range
  std::map<uint64_t, uint64_t> allocated_;  // offset -> length, to catch bad frees
};

}  // namespace strata
