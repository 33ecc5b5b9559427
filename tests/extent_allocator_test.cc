// ExtentAllocator (strata/extent_allocator.h): the swap files', the pinned pool's and the
// devices' first-fit ranges. Part of the storage_test binary.
#include "strata/extent_allocator.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <utility>
#include <vector>

namespace strata {
namespace {

uint64_t fresh_seed() { return std::random_device{}(); }

// ExtentAllocator against a byte-map model: random allocs and frees never overlap, stay
// aligned, account exactly, and coalesce back to one free range.
TEST(ExtentAllocatorTest, RandomAgainstModel) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  constexpr uint64_t kAlign = 4096, kCap = 1024 * kAlign;
  ExtentAllocator a(kCap, kAlign, "test");
  std::vector<uint8_t> used(kCap / kAlign, 0);
  std::vector<std::pair<uint64_t, uint64_t>> live;
  for (int step = 0; step < 5000; ++step) {
    if (live.empty() || rng() % 2) {
      const uint64_t bytes = 1 + rng() % (40 * kAlign);
      auto r = a.allocate(bytes);
      if (!r.is_ok()) {
        EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
        EXPECT_LT(a.largest_free(), a.round_up(bytes)) << "refused though a range fits";
        continue;
      }
      ASSERT_EQ(*r % kAlign, 0u);
      ASSERT_LE(*r + a.round_up(bytes), kCap);
      for (uint64_t u = *r / kAlign; u < (*r + a.round_up(bytes)) / kAlign; ++u) {
        ASSERT_EQ(used[u], 0) << "overlap at unit " << u << " seed " << seed;
        used[u] = 1;
      }
      live.push_back({*r, bytes});
    } else {
      const size_t i = rng() % live.size();
      auto [o, b] = live[i];
      live.erase(live.begin() + i);
      a.free(o, b);
      for (uint64_t u = o / kAlign; u < (o + a.round_up(b)) / kAlign; ++u) used[u] = 0;
    }
    uint64_t model_used = 0;
    for (uint8_t u : used) model_used += u;
    ASSERT_EQ(a.used_bytes(), model_used * kAlign) << "seed " << seed;
  }
  for (auto [o, b] : live) a.free(o, b);
  EXPECT_EQ(a.free_bytes(), kCap);
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.largest_free(), kCap);
}

TEST(ExtentAllocatorTest, ExhaustionNamesSizes) {
  ExtentAllocator a(16 * 4096, 4096, "swapfile-X");
  auto x = a.allocate(8 * 4096);
  auto y = a.allocate(4 * 4096);
  ASSERT_TRUE(x.is_ok() && y.is_ok());
  a.free(*x, 8 * 4096);  // free: 8 units at 0 and 4 at the end, largest 8
  auto z = a.allocate(9 * 4096);
  ASSERT_FALSE(z.is_ok());
  EXPECT_EQ(z.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(z.status().message().find("swapfile-X"), std::string::npos);
  EXPECT_NE(z.status().message().find("largest free range 32.00 KiB"), std::string::npos)
      << z.status().message();
  EXPECT_TRUE(a.allocate(8 * 4096).is_ok());
}

// free_at (the devices' arenas: they know a block's offset, not its size) frees whatever was
// allocated there and says which free range it joined.
TEST(ExtentAllocatorTest, FreeAtReturnsTheSizeAndTheMergedRange) {
  ExtentAllocator a(8 * 4096, 4096, "arena");
  auto x = a.allocate(4096), y = a.allocate(3 * 4096), z = a.allocate(4096);
  ASSERT_TRUE(x.is_ok() && y.is_ok() && z.is_ok());
  EXPECT_FALSE(a.free_at(*x + 4096 * 2).has_value()) << "no range starts there";
  auto fy = a.free_at(*y);  // between two live ranges: merges with nothing
  ASSERT_TRUE(fy.has_value());
  EXPECT_EQ(fy->bytes, 3u * 4096);
  EXPECT_EQ(fy->merged_offset, *y);
  EXPECT_EQ(fy->merged_length, 3u * 4096);
  auto fz = a.free_at(*z);  // joins y's range before it and the free tail after it
  ASSERT_TRUE(fz.has_value());
  EXPECT_EQ(fz->bytes, 4096u);
  EXPECT_EQ(fz->merged_offset, *y);
  EXPECT_EQ(fz->merged_length, 7u * 4096);
  EXPECT_FALSE(a.free_at(*z).has_value()) << "freed twice";
  a.free(*x, 4096);
  EXPECT_EQ(a.free_ranges(), 1u);
}

}  // namespace
}  // namespace strata
