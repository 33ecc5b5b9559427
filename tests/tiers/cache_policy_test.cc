// The device cache policy (src/tiers/cache_policy.h) alone, over a cache written here: which
// object it evicts (Belady with a trace, LRU without; never `keep`, never what is not evictable,
// nothing a prefetch needs before its horizon), what it prefetches (trace order, within
// prefetch_bytes, stopping at the first object without room), and what it drops after use.
#include "src/tiers/cache_policy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace strata {
namespace {

// A cache of `n` objects: resident ones are evictable, the others fetchable; each prefetch is
// recorded with its horizon and succeeds while `room` allows.
struct Cache final : CacheState {
  explicit Cache(std::vector<bool> resident) : res(std::move(resident)), last(res.size(), 0) {}
  std::vector<bool> res;
  std::vector<uint64_t> last;
  std::vector<bool> pinned = std::vector<bool>(res.size(), false);
  std::vector<int> fetched;
  std::vector<uint64_t> horizons;
  int room = 1 << 30;  // prefetches that succeed
  int object_count() const override { return int(res.size()); }
  bool evictable(int o) const override { return res[size_t(o)] && !pinned[size_t(o)]; }
  uint64_t last_access(int o) const override { return last[size_t(o)]; }
  bool fetchable(int o) const override { return !res[size_t(o)]; }
  bool prefetch(int o, uint64_t, uint64_t horizon) override {
    if (room == 0) return false;
    --room;
    fetched.push_back(o);
    horizons.push_back(horizon);
    res[size_t(o)] = true;
    return true;
  }
};

// The replayer and the tier manager run one DeviceCachePolicy: on a cyclic trace A B C with room
// for two objects, Belady keeps the object used soonest and the prefetch never evicts it.
TEST(CachePolicy, BeladyVictimAndPrefetchHorizon) {
  Trace t({{0, 10, 0}, {1, 10, 0}, {2, 10, 0}});
  struct Cache final : CacheState {
    std::vector<bool> res = {true, true, false};
    std::vector<int> fetched;
    int object_count() const override { return 3; }
    bool evictable(int o) const override { return res[size_t(o)]; }
    uint64_t last_access(int o) const override { return uint64_t(o); }
    bool fetchable(int o) const override { return !res[size_t(o)]; }
    bool prefetch(int o, uint64_t, uint64_t) override {
      fetched.push_back(o);
      res[size_t(o)] = true;
      return true;
    }
  } cache;
  CachePolicyOptions po;
  po.prefetch_bytes = 10;
  DeviceCachePolicy belady(po);
  belady.set_trace(&t);
  // At position 2 (C), A is next used at 3 and B at 4: Belady evicts B, LRU evicts A.
  EXPECT_EQ(belady.victim(cache, 3, 2, UINT64_MAX), 1);
  DeviceCachePolicy lru(po);
  EXPECT_EQ(lru.victim(cache, 3, 2, UINT64_MAX), 0);
  // A prefetch for C at position 1 (after B) may only evict what is used after C's horizon.
  EXPECT_EQ(prefetch_horizon(t, 1, 2), 4u);
  EXPECT_EQ(belady.victim(cache, 2, 1, prefetch_horizon(t, 1, 2)), -1);
  belady.prefetch(cache, 1, 0);
  EXPECT_EQ(cache.fetched, std::vector<int>({2}));
  po.max_reuse_distance = 15;
  DeviceCachePolicy drop(po);
  drop.set_trace(&t);
  EXPECT_TRUE(drop.drop_after_use(0));  // 20 bytes of others before A comes back
}

// Never `keep`, never an object that is not evictable; -1 when nothing qualifies.
TEST(CachePolicy, VictimSkipsKeepAndWhatIsNotEvictable) {
  Trace t({{0, 1, 0}, {1, 1, 0}, {2, 1, 0}, {3, 1, 0}});
  Cache cache({true, true, true, false});
  DeviceCachePolicy p(CachePolicyOptions{});
  p.set_trace(&t);
  // From position 4 (the next step): 0 at 4, 1 at 5, 2 at 6. Belady picks 2.
  EXPECT_EQ(p.victim(cache, 4, -1, UINT64_MAX), 2);
  EXPECT_EQ(p.victim(cache, 4, 2, UINT64_MAX), 1);
  cache.pinned[1] = true;
  EXPECT_EQ(p.victim(cache, 4, 2, UINT64_MAX), 0);
  cache.pinned[0] = true;
  EXPECT_EQ(p.victim(cache, 4, 2, UINT64_MAX), -1);
  // Object 3 is not resident: never a victim, even with nothing else left.
  cache.pinned = {true, true, true, false};
  EXPECT_EQ(p.victim(cache, 4, -1, UINT64_MAX), -1);
}

// Without a trace (or with belady off): the least recently used, ties to the lowest id; and no
// victim at all for a prefetch (nothing is prefetched without a trace).
TEST(CachePolicy, WithoutATraceLeastRecentlyUsedAndNoPrefetchVictims) {
  Cache cache({true, true, true});
  cache.last = {7, 3, 9};
  DeviceCachePolicy none(CachePolicyOptions{});
  EXPECT_EQ(none.trace(), nullptr);
  EXPECT_EQ(none.victim(cache, 10, -1, UINT64_MAX), 1);
  EXPECT_EQ(none.victim(cache, 10, 1, UINT64_MAX), 0);
  EXPECT_EQ(none.victim(cache, 10, -1, 12), -1);
  cache.last = {5, 5, 5};
  EXPECT_EQ(none.victim(cache, 10, -1, UINT64_MAX), 0);

  Trace t({{0, 1, 0}, {1, 1, 0}, {2, 1, 0}});
  CachePolicyOptions lru_opts;
  lru_opts.belady = false;
  DeviceCachePolicy lru(lru_opts);
  lru.set_trace(&t);
  cache.last = {7, 3, 9};
  EXPECT_EQ(lru.victim(cache, 3, -1, UINT64_MAX), 1);  // Belady would pick 2 (next used at 5)
}

// Ties between objects next used at the same position (never, for ones the trace lacks) go to
// the lowest id.
TEST(CachePolicy, BeladyTiesGoToTheLowestId) {
  Trace t({{0, 1, 0}, {1, 1, 0}});
  Cache cache({true, true, true, true});  // objects 2 and 3 are not in the trace
  DeviceCachePolicy p(CachePolicyOptions{});
  p.set_trace(&t);
  EXPECT_EQ(p.victim(cache, 0, -1, UINT64_MAX), 2);
  EXPECT_EQ(p.victim(cache, 0, 2, UINT64_MAX), 3);
}

// A prefetch evicts only objects next used after its horizon.
TEST(CachePolicy, PrefetchVictimsLieBeyondTheHorizon) {
  Trace t({{0, 1, 0}, {1, 1, 0}, {2, 1, 0}, {3, 1, 0}});
  Cache cache({true, true, true, false});
  DeviceCachePolicy p(CachePolicyOptions{});
  p.set_trace(&t);
  // From position 4: 0 at 4, 1 at 5, 2 at 6.
  EXPECT_EQ(p.victim(cache, 4, -1, 5), 2);
  EXPECT_EQ(p.victim(cache, 4, -1, 6), -1);
  EXPECT_EQ(p.victim(cache, 4, -1, 3), 2);
}

// The horizon for prefetching j from pos: the latest first use after j of anything touched in
// [pos, j), and at least j.
TEST(CachePolicy, PrefetchHorizon) {
  Trace t({{0, 1, 0}, {1, 1, 0}, {2, 1, 0}, {0, 1, 0}, {3, 1, 0}});
  EXPECT_EQ(prefetch_horizon(t, 2, 2), 2u);  // nothing in between
  EXPECT_EQ(prefetch_horizon(t, 0, 2), 6u);  // 0 next at 3, 1 next at 6
  EXPECT_EQ(prefetch_horizon(t, 2, 4), 7u);  // 2 next at 7, 0 next at 5
  EXPECT_EQ(prefetch_horizon(t, 3, 4), 5u);  // 0 next at 5
}

// Prefetch walks the trace after `pos` in order, skipping what is not fetchable, while the
// bytes in flight stay within prefetch_bytes, and stops at the first object without room.
TEST(CachePolicy, PrefetchFollowsTheTraceWithinItsBudget) {
  Trace t({{0, 10, 0}, {1, 10, 0}, {2, 10, 0}, {3, 10, 0}, {4, 10, 0}});
  CachePolicyOptions o;
  o.prefetch_bytes = 25;
  DeviceCachePolicy p(o);
  p.set_trace(&t);
  {
    Cache cache({true, false, true, false, false});
    p.prefetch(cache, 0, 0);
    EXPECT_EQ(cache.fetched, std::vector<int>({1, 3}));  // 2 is resident; 4 would pass 25
    ASSERT_EQ(cache.horizons.size(), 2u);
    EXPECT_EQ(cache.horizons[0], prefetch_horizon(t, 0, 1));
    EXPECT_EQ(cache.horizons[1], prefetch_horizon(t, 0, 3));
  }
  {
    Cache cache({true, false, false, false, false});
    p.prefetch(cache, 0, 10);  // 10 bytes already in flight: room for one more
    EXPECT_EQ(cache.fetched, std::vector<int>({1}));
  }
  {
    Cache cache({true, false, false, false, false});
    cache.room = 1;  // the second finds no room: the walk stops
    o.prefetch_bytes = 1000;
    DeviceCachePolicy wide(o);
    wide.set_trace(&t);
    wide.prefetch(cache, 0, 0);
    EXPECT_EQ(cache.fetched, std::vector<int>({1}));
  }
  {
    // The walk wraps into the next step, up to (not including) pos itself.
    Cache cache({false, false, false, true, false});
    o.prefetch_bytes = 1000;
    DeviceCachePolicy wide(o);
    wide.set_trace(&t);
    wide.prefetch(cache, 3, 0);
    EXPECT_EQ(cache.fetched, std::vector<int>({4, 0, 1, 2}));
  }
}

// No trace, or prefetch off: nothing is prefetched and nothing dropped.
TEST(CachePolicy, NoPrefetchOrDropWithoutTraceOrOption) {
  Trace t({{0, 10, 0}, {1, 10, 0}});
  CachePolicyOptions o;
  o.max_reuse_distance = 0;
  {
    DeviceCachePolicy p(o);
    Cache cache({false, false});
    p.prefetch(cache, 0, 0);
    EXPECT_TRUE(cache.fetched.empty());
    EXPECT_FALSE(p.drop_after_use(0));
  }
  {
    o.prefetch = false;
    DeviceCachePolicy p(o);
    p.set_trace(&t);
    Cache cache({false, false});
    p.prefetch(cache, 0, 0);
    EXPECT_TRUE(cache.fetched.empty());
    EXPECT_FALSE(p.drop_after_use(0));
  }
}

// Dropped after use: exactly the positions whose reuse distance exceeds max_reuse_distance;
// positions past the step are never dropped.
TEST(CachePolicy, DropAfterUseByReuseDistance) {
  // Reuse distances: A 30 (B and C), B 20 (C, then the next step's A), C 30 (A and B).
  Trace t({{0, 10, 0}, {1, 20, 0}, {2, 10, 0}});
  CachePolicyOptions o;
  o.max_reuse_distance = 20;
  DeviceCachePolicy p(o);
  p.set_trace(&t);
  EXPECT_EQ(t.reuse_distance(0), 30u);
  EXPECT_EQ(t.reuse_distance(1), 20u);
  EXPECT_EQ(t.reuse_distance(2), 30u);
  EXPECT_TRUE(p.drop_after_use(0));
  EXPECT_FALSE(p.drop_after_use(1));
  EXPECT_TRUE(p.drop_after_use(2));
  EXPECT_FALSE(p.drop_after_use(3));
  CachePolicyOptions keep_all;  // UINT64_MAX by default
  DeviceCachePolicy q(keep_all);
  q.set_trace(&t);
  EXPECT_FALSE(q.drop_after_use(0));
}

}  // namespace
}  // namespace strata
