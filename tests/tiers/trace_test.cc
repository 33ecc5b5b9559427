// The access trace (src/tiers/trace.h) alone: next uses and reuse distances over a cyclic
// step, its JSON lines and what they refuse, and the replayer's promises (bytes moved, the
// copy engine's stall, an access larger than the capacity).
#include "src/tiers/trace.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace strata {
namespace {

TEST(Trace, ReuseDistancesAndNextUse) {
  // A B C B A, cyclic.
  Trace t({{0, 10, 0}, {1, 20, 0}, {2, 30, 0}, {1, 20, 0}, {0, 10, 0}});
  EXPECT_EQ(t.next_use(0), 4u);
  EXPECT_EQ(t.next_use(1), 3u);
  EXPECT_EQ(t.next_use(2), 7u);  // next step's position 2
  EXPECT_EQ(t.reuse_distance(0), 20u + 30 + 20);
  EXPECT_EQ(t.reuse_distance(1), 30u);
  EXPECT_EQ(t.reuse_distance(4), 0u);  // used again at once (next step starts with it)
  EXPECT_EQ(t.next_use_of(2, 3), 7u);
  auto round = Trace::from_jsonl(t.to_jsonl({"a", "b", "c"}));
  ASSERT_TRUE(round.is_ok());
  EXPECT_EQ(round->size(), 5u);
  EXPECT_FALSE(Trace::from_jsonl("{\"object\": 1}\n").is_ok());
  // An object id the replay would size a list for (INT_MAX: a length_error, abort).
  auto huge = Trace::from_jsonl(t.to_jsonl({"a"}) + "{\"object\": 2147483647, \"bytes\": 8}\n");
  ASSERT_FALSE(huge.is_ok());
  EXPECT_NE(huge.status().message().find("from 0 to 1048575"), std::string::npos)
      << huge.status().message();
}

// An object touched once a step is next used one step later, after every other object's bytes.
TEST(Trace, AnObjectUsedOnceIsNextUsedAStepLater) {
  Trace t({{0, 4, 0}, {1, 8, 0}, {2, 16, 0}});
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t.next_use(i), i + 3) << i;
    EXPECT_EQ(t.reuse_distance(i), 28u - t.accesses()[i].bytes) << i;
  }
  // A trace of one object: reused at once, nothing between.
  Trace one({{5, 100, 0}});
  EXPECT_EQ(one.next_use(0), 1u);
  EXPECT_EQ(one.reuse_distance(0), 0u);
}

// next_use_of counts absolute positions over repeated steps: at or after p, in this step or the
// next; an object the trace never touches (or a negative id) is never used.
TEST(Trace, NextUseOfIsCyclicAndNeverForUnknownObjects) {
  Trace t({{0, 1, 0}, {1, 1, 0}, {0, 1, 0}, {2, 1, 0}});
  EXPECT_EQ(t.next_use_of(0, 0), 0u);  // at p itself
  EXPECT_EQ(t.next_use_of(0, 1), 2u);
  EXPECT_EQ(t.next_use_of(0, 3), 4u);    // the next step's first access
  EXPECT_EQ(t.next_use_of(1, 10), 13u);  // step 2 (positions 8..11), then step 3's position 1
  EXPECT_EQ(t.next_use_of(2, 7), 7u);
  EXPECT_EQ(t.next_use_of(7, 0), UINT64_MAX);
  EXPECT_EQ(t.next_use_of(-1, 0), UINT64_MAX);
  // Object 3 lies below the largest id but is never touched.
  Trace gap({{0, 1, 0}, {4, 1, 0}});
  EXPECT_EQ(gap.next_use_of(3, 0), UINT64_MAX);
}

TEST(Trace, JsonLinesRoundTripEveryField) {
  Trace t({{3, 4096, 0.25}, {0, 1, 0}, {3, 4096, 1e-3}});
  const std::string text = t.to_jsonl({"a", "b", "c", "d"});
  EXPECT_EQ(text.find("{\"accesses\":3"), 0u) << text;  // a header line first
  auto back = Trace::from_jsonl(text);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  ASSERT_EQ(back->size(), t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(back->accesses()[i].object, t.accesses()[i].object) << i;
    EXPECT_EQ(back->accesses()[i].bytes, t.accesses()[i].bytes) << i;
    EXPECT_EQ(back->accesses()[i].compute_s, t.accesses()[i].compute_s) << i;
    EXPECT_EQ(back->next_use(i), t.next_use(i)) << i;
  }
}

// Every refusal is kInvalidArgument naming the line (and, for a missing header, how to record
// a trace).
TEST(Trace, FromJsonlRefusesWhatIsNotATrace) {
  const std::string header = "{\"strata_trace\": 1}\n";
  struct Case {
    std::string text, want;
  } cases[] = {
      {"{\"object\": 1, \"bytes\": 2}\n", "line 1: not a strata trace"},
      {"{\"strata_trace\": 2}\n{\"object\": 1, \"bytes\": 2}\n", "strata.trace_file"},
      {header, "trace has no accesses"},
      {"", "trace has no accesses"},
      {header + "{\"object\": -1, \"bytes\": 2}\n", "line 2: object -1 is not a whole number"},
      // Numbers a field cannot hold (a float beyond uint64 was undefined behaviour: fuzz_trace).
      {header + "{\"object\": 0, \"bytes\": 18446744075903175615}\n", "line 2: bytes"},
      {header + "{\"object\": 0, \"bytes\": -8}\n", "line 2: bytes -8 is not"},
      {header + "{\"object\": 0, \"bytes\": 4.5}\n", "line 2: bytes 4.5 is not"},
      {header + "{\"object\": 1e10, \"bytes\": 2}\n", "line 2: object 10000000000.0 is not"},
      {header + "{\"object\": 0, \"bytes\": 2, \"compute_s\": -1}\n", "line 2: compute_s -1"},
      {header + "{\"object\": 0, \"bytes\": 2, \"compute_s\": \"x\"}\n", "compute_s \"x\""},
      {header + std::string(100, '[') + std::string(100, ']') + "\n",
       "line 2: JSON nested deeper than 64"},
      {header + "{\"object\": 1}\n", "line 2:"},
      {header + "\n{\"object\": 0, \"bytes\": 1}\nnot json\n", "line 4:"},
  };
  for (const Case& c : cases) {
    auto t = Trace::from_jsonl(c.text);
    ASSERT_FALSE(t.is_ok()) << c.text;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(t.status().message().find(c.want), std::string::npos)
        << c.text << " -> " << t.status().message();
  }
  // Blank lines are skipped; compute_s is optional.
  auto ok = Trace::from_jsonl("\n" + header + "\n{\"object\": 2, \"bytes\": 7}\n");
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->size(), 1u);
  EXPECT_EQ(ok->accesses()[0].compute_s, 0.0);
}

TEST(Trace, PolicyNames) {
  EXPECT_STREQ(cache_policy_name(CachePolicy::kLru), "lru");
  EXPECT_STREQ(cache_policy_name(CachePolicy::kBelady), "belady");
  EXPECT_STREQ(cache_policy_name(CachePolicy::kStrata), "strata");
}

// With room for every object, each is fetched once whatever the policy; an empty trace moves
// nothing; an access larger than the capacity does not fit.
TEST(TraceReplay, RoomForEverythingFetchesEachObjectOnce) {
  Trace t({{0, 100, 0.5}, {1, 200, 0.5}, {0, 100, 0.5}, {2, 300, 0.5}});
  ReplayOptions o;
  o.capacity = 600;
  o.steps = 4;
  for (CachePolicy p : {CachePolicy::kLru, CachePolicy::kBelady, CachePolicy::kStrata}) {
    SCOPED_TRACE(cache_policy_name(p));
    ReplayResult r = replay(t, p, o);
    EXPECT_TRUE(r.fits);
    EXPECT_EQ(r.fetches, 3u);
    EXPECT_EQ(r.bytes_fetched, 600u);
    EXPECT_DOUBLE_EQ(r.compute_s, 4 * 4 * 0.5);
  }
  ReplayResult none = replay(Trace(), CachePolicy::kStrata, o);
  EXPECT_EQ(none.fetches, 0u);
  EXPECT_EQ(none.bytes_fetched, 0u);
  EXPECT_TRUE(none.fits);
  o.capacity = 299;
  EXPECT_FALSE(replay(t, CachePolicy::kBelady, o).fits);
}

// A B C cyclic with room for two: LRU misses every access (its worst case), Belady keeps one
// object each time, and the tier manager's policy (Belady's victims, prefetch within Belady's
// horizon) never moves more bytes than Belady.
TEST(TraceReplay, BeladyBeatsLruOnACycleAndPrefetchMovesNoMore) {
  Trace t({{0, 10, 1.0}, {1, 10, 1.0}, {2, 10, 1.0}});
  ReplayOptions o;
  o.capacity = 20;
  o.steps = 3;
  o.bandwidth = 10;  // one second per object
  const ReplayResult lru = replay(t, CachePolicy::kLru, o);
  const ReplayResult belady = replay(t, CachePolicy::kBelady, o);
  const ReplayResult strata = replay(t, CachePolicy::kStrata, o);
  EXPECT_EQ(lru.fetches, 9u);
  EXPECT_LT(belady.fetches, lru.fetches);
  EXPECT_LE(strata.bytes_fetched, belady.bytes_fetched);
  // On demand, the compute waits for every copy whole: one second per fetch.
  EXPECT_DOUBLE_EQ(lru.stall_s, 9.0);
  EXPECT_DOUBLE_EQ(belady.stall_s, double(belady.fetches));
  // Prefetching hides some of it behind the compute.
  EXPECT_LT(strata.stall_s, belady.stall_s);
}

}  // namespace
}  // namespace strata
