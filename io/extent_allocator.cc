// First-fit, coalescing extent allocator (see strata/extent_allocator.h).
#include "strata/extent_allocator.h"

#include <fmt/format.h>

#include "strata/log.h"

namespace strata {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t alignment, std::string name)
    : capacity_(capacity & ~(alignment - 1)),
      alignment_(alignment),
      free_bytes_(capacity_),
      name_(std::move(name)) {
  STRATA_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, "alignment: power of two");
  if (capacity_ > 0) free_[0] = capacity_;
}

std::optional<uint64_t> ExtentAllocator::try_allocate(uint64_t bytes) {
  STRATA_CHECK(bytes > 0);
  const uint64_t size = round_up(bytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - size;
    free_.erase(it);
    if (rest > 0) free_[offset + size] = rest;
    free_bytes_ -= size;
    allocated_[offset] = size;
    return offset;
  }
  return std::nullopt;
}

Result<uint64_t> ExtentAllocator::allocate(uint64_t bytes) {
  if (const std::optional<uint64_t> offset = try_allocate(bytes)) return *offset;
  const uint64_t size = round_up(bytes);
  return no_space(fmt::format(
      "{}: cannot allocate {} ({} bytes): {} free of {}, largest free range {}; give it more "
      "space or free extents first",
      name_, format_bytes(static_cast<double>(size)), size,
      format_bytes(static_cast<double>(free_bytes_)), format_bytes(static_cast<double>(capacity_)),
      format_bytes(static_cast<double>(largest_free()))));
}

void ExtentAllocator::free(uint64_t offset, uint64_t bytes) {
  const uint64_t size = round_up(bytes);
  auto a = allocated_.find(offset);
  STRATA_CHECK(a != allocated_.end() && a->second == size,
               fmt::format("{}: free of [{}, +{}) that was not allocated so", name_, offset, size));
  release(a);
}

std::optional<ExtentAllocator::Freed> ExtentAllocator::free_at(uint64_t offset) {
  auto a = allocated_.find(offset);
  if (a == allocated_.end()) return std::nullopt;
  return release(a);
}

ExtentAllocator::Freed ExtentAllocator::release(std::map<uint64_t, uint64_t>::iterator a) {
  const uint64_t offset = a->first, size = a->second;
  allocated_.erase(a);
  free_bytes_ += size;
  uint64_t start = offset, length = size;
  auto next = free_.lower_bound(offset);
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == offset + size) {
    length += next->second;
    free_.erase(next);
  }
  free_[start] = length;
  return {size, start, length};
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& [o, l] : free_) best = std::max(best, l);
  return best;
}

}  // namespace strata
