// Offloaded activations (src/tiers/activation_stash.h) alone, over Homes and a device cache on
// the CPU device: a stash copies a block's input after the compute stream's work so far into its
// host-tier buffer, a restore brings back exactly the bytes stashed, and a bad layer or size is
// an error naming strata.activations, also kept for end_backward (the AsyncError).
#include "src/tiers/activation_stash.h"

#include <gtest/gtest.h>

#include <future>
#include <string>
#include <vector>

#include "strata/device.h"
#include "tests/tiers/tier_rig.h"

namespace strata {
namespace {

struct Rig : test::TierParts {
  std::unique_ptr<DeviceCache> cache;
  std::unique_ptr<ActivationStash> stash;

  explicit Rig(size_t host_bytes) {
    dev = test::cpu_device(4 << 20);
    auto h = Homes::create(*dev, {}, 0, 1, host_bytes, options, nullptr);
    EXPECT_TRUE(h.is_ok()) << h.status().to_string();
    homes = std::move(*h);
    cache = std::make_unique<DeviceCache>(*homes, options, DType::kBF16, false, counters, errors);
    stash = std::make_unique<ActivationStash>(*homes, *cache, counters, errors);
  }
  ~Rig() {
    sync();
    stash->release_all();
    cache->release_all();
  }
  void sync() {
    for (Stream* s : {&dev->compute_stream(), &dev->h2d_stream(), &dev->d2h_stream()})
      EXPECT_TRUE(dev->synchronize(*s).is_ok());
  }
};

std::vector<float> pattern(size_t n, float base) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = base + float(i);
  return v;
}

// Stashed, overwritten, restored: each block's input comes back whole, a short stash restores
// only its bytes.
TEST(ActivationStash, RestoresWhatWasStashed) {
  Rig r(1 << 20);
  const size_t n = 4096, bytes = n * 4;
  ASSERT_TRUE(r.stash->reserve(3, bytes).is_ok());
  std::vector<std::vector<float>> act;
  for (int l = 0; l < 3; ++l) act.push_back(pattern(n, 1000.0f * float(l)));
  for (int l = 0; l < 3; ++l) {
    ASSERT_TRUE(r.stash->stash(l, act[size_t(l)].data(), l == 2 ? bytes / 2 : bytes).is_ok());
  }
  r.sync();
  for (auto& a : act) std::fill(a.begin(), a.end(), -1.0f);  // the device arena is reused
  for (int l = 2; l >= 0; --l) {
    ASSERT_TRUE(r.stash->restore(l, act[size_t(l)].data()).is_ok());
    r.stash->compute_waits(l);
  }
  r.sync();
  for (int l = 0; l < 3; ++l) {
    SCOPED_TRACE(l);
    const size_t restored = l == 2 ? n / 2 : n;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(act[size_t(l)][i], i < restored ? 1000.0f * float(l) + float(i) : -1.0f) << i;
    }
  }
  EXPECT_TRUE(r.errors.take().is_ok());
}

// A stash copies after the compute stream's work so far: what a kernel still queued writes is
// what lands in the host tier.
TEST(ActivationStash, StashRunsAfterTheComputeStreamsWork) {
  Rig r(1 << 20);
  const size_t n = 1024;
  ASSERT_TRUE(r.stash->reserve(1, n * 4).is_ok());
  std::vector<float> act(n, 1.0f);
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  float* a = act.data();
  r.dev->host_fn(r.dev->compute_stream(), [open, a, n] {
    open.wait();
    for (size_t i = 0; i < n; ++i) a[i] = 7.0f;  // the forward's output, written late
  });
  ASSERT_TRUE(r.stash->stash(0, act.data(), n * 4).is_ok());
  gate.set_value();
  r.sync();
  std::vector<float> back(n, 0.0f);
  ASSERT_TRUE(r.stash->restore(0, back.data()).is_ok());
  r.sync();
  EXPECT_EQ(back, std::vector<float>(n, 7.0f));
}

// A layer outside the reservation, a stash larger than its buffer, a restore of a block never
// stashed: kInvalidArgument naming strata.activations, and the same error kept for end_backward.
TEST(ActivationStash, BadLayerOrSizeNamesTheKey) {
  Rig r(1 << 20);
  ASSERT_TRUE(r.stash->reserve(2, 4096).is_ok());
  std::vector<char> buf(8192);
  struct Case {
    const char* what;
    Status status;
  } cases[] = {
      {"negative layer", r.stash->stash(-1, buf.data(), 100)},
      {"layer past the reservation", r.stash->stash(2, buf.data(), 100)},
      {"larger than its buffer", r.stash->stash(0, buf.data(), 8192)},
      {"never stashed", r.stash->restore(1, buf.data())},
      {"restore past the reservation", r.stash->restore(5, buf.data())},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_FALSE(c.status.is_ok());
    EXPECT_EQ(c.status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status.message().find("strata.activations"), std::string::npos)
        << c.status.message();
  }
  // The first error is the one kept.
  Status kept = r.errors.take();
  ASSERT_FALSE(kept.is_ok());
  EXPECT_EQ(kept.message(), cases[0].status.message());
  EXPECT_TRUE(r.errors.take().is_ok());
  r.stash->compute_waits(7);  // nothing to wait for: no effect
}

// A reservation the host tier cannot hold fails naming the block and the key.
TEST(ActivationStash, ReservationBeyondTheHostTierNamesTheBlock) {
  Rig r(1 << 20);
  Status s = r.stash->reserve(3, 400 << 10);  // the third of 400 KiB does not fit in 1 MiB
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.to_string().find("activations of block 2"), std::string::npos) << s.to_string();
  EXPECT_NE(s.to_string().find("strata.activations = offload"), std::string::npos);
}

}  // namespace
}  // namespace strata
