// Homes (src/tiers/homes.h) alone, on the CPU device: every module's objects get a home in the
// tier its plan names, of the plan's bytes (device memory, the host tier's arena, or one swap
// extent per sub-group); a rank's shard offsets; a tier without room fails naming the tier and
// the object; a full host tier reclaims before it fails; the NVMe tier's use counts its extents;
// the undo room closes with a region being made ready; ~Homes gives everything back.
#include "src/tiers/homes.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "strata/device.h"
#include "tests/test_util.h"
#include "tests/tiers/tier_rig.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

ModelLayout layout_of(std::vector<std::pair<std::string, size_t>> mods) {
  ModelLayout l;
  for (auto& [name, numel] : mods) {
    ModuleSpec s;
    s.name = name;
    s.numel = numel;
    l.modules.push_back(s);
  }
  return l;
}

// Parameters on the device, master weights and moments in the host tier, gradients on the
// device: each home where and as large as the plan says, reachable from the host (the CPU
// backend's device memory is host memory), and given back by ~Homes.
TEST(Homes, EveryObjectInItsTier) {
  auto dev = test::cpu_device(8 << 20);
  ASSERT_NE(dev, nullptr);
  const Placement pl{Tier::kDevice, Tier::kHost, Tier::kHost, Tier::kDevice, 1.0};
  auto plan = module_homes(layout_of({{"a", 1000}, {"b", 3000}}), pl, 1, DType::kBF16, DType::kF32,
                           true, 0);
  ASSERT_TRUE(plan.is_ok());
  TierOptions o;
  o.placement = pl;
  const size_t used_before = dev->memory_stats().used;
  {
    auto h = Homes::create(*dev, *plan, 0, 1, 1 << 20, o, nullptr);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    ASSERT_EQ((*h)->modules().size(), 2u);
    EXPECT_EQ((*h)->io(), nullptr);  // no NVMe tier
    EXPECT_EQ((*h)->swap(), nullptr);
    size_t host_bytes = 0, dev_bytes = 0;
    for (size_t i = 0; i < 2; ++i) {
      const Module& m = (*h)->modules()[i];
      const ModuleHomes& p = (*plan)[i];
      SCOPED_TRACE(m.name);
      EXPECT_EQ(m.name, p.name);
      EXPECT_EQ(m.numel, p.numel);
      EXPECT_EQ(m.sn, p.numel);
      EXPECT_EQ(m.off, 0u);
      EXPECT_EQ(m.valid, p.numel);
      EXPECT_EQ(m.p.tier, Tier::kDevice);
      EXPECT_EQ(m.p.bytes, p.params.bytes);
      EXPECT_NE(m.p.dev, nullptr);
      EXPECT_EQ(m.p.ptr(), m.p.dev);
      EXPECT_EQ(m.master.tier, Tier::kHost);
      EXPECT_EQ(m.master.bytes, 4 * m.sn);
      EXPECT_NE(m.master.ptr(), nullptr);
      EXPECT_EQ(m.master.ptr(), m.master.host.data());
      EXPECT_EQ(m.mom.bytes, 8 * m.sn);
      EXPECT_EQ(m.gacc.tier, Tier::kDevice);
      EXPECT_EQ(m.gacc2.tier, Tier::kDevice);  // the delayed update's second accumulator
      EXPECT_NE(m.gacc2.dev, nullptr);
      EXPECT_EQ(m.master_elem(), 4u);
      EXPECT_EQ(m.mom_elem(), 8u);
      EXPECT_FALSE(m.frozen());
      EXPECT_FALSE((*h)->staged(m.p));  // the CPU device is host-addressable
      host_bytes += m.master.bytes + m.mom.bytes;
      dev_bytes += m.p.bytes + m.gacc.bytes + m.gacc2.bytes;
    }
    EXPECT_GE((*h)->pool().in_use(), host_bytes);
    EXPECT_GE(dev->memory_stats().used - used_before, dev_bytes);
    // The homes do not overlap: writing each whole leaves the others' bytes alone.
    auto& mods = (*h)->modules();
    std::memset(mods[0].master.ptr(), 0x11, mods[0].master.bytes);
    std::memset(mods[1].master.ptr(), 0x22, mods[1].master.bytes);
    std::memset(mods[0].mom.ptr(), 0x33, mods[0].mom.bytes);
    EXPECT_EQ(static_cast<unsigned char*>(mods[0].master.ptr())[mods[0].master.bytes - 1], 0x11);
    EXPECT_EQ(static_cast<unsigned char*>(mods[1].master.ptr())[0], 0x22);
  }
  EXPECT_EQ(dev->memory_stats().used, used_before);
}

// A rank's shard: elements [rank * sn, rank * sn + sn) of the padded group, of which `valid`
// are real (none on a rank past the module's end).
TEST(Homes, ShardOffsetsPerRank) {
  auto dev = test::cpu_device(8 << 20);
  ASSERT_NE(dev, nullptr);
  const Placement pl{Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0};
  auto plan = module_homes(layout_of({{"small", 100}, {"big", 5000}}), pl, 4, DType::kBF16,
                           DType::kF32, false, 0);
  ASSERT_TRUE(plan.is_ok());
  TierOptions o;
  o.placement = pl;
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE(rank);
    auto h = Homes::create(*dev, *plan, rank, 4, 1 << 20, o, nullptr);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    const Module& small = (*h)->modules()[0];
    const Module& big = (*h)->modules()[1];
    EXPECT_EQ(small.sn, 2048u);  // 4 KiB of bf16
    EXPECT_EQ(small.padded, 4 * 2048u);
    EXPECT_EQ(small.off, size_t(rank) * 2048);
    EXPECT_EQ(small.valid, rank == 0 ? 100u : 0u);
    EXPECT_EQ(big.off, size_t(rank) * big.sn);
    const size_t want = big.off >= 5000 ? 0 : std::min<size_t>(5000 - big.off, big.sn);
    EXPECT_EQ(big.valid, want);
    EXPECT_EQ(small.p.bytes, 2 * 2048u);
  }
}

// A tier without room: the error names the tier and the object (module and kind).
TEST(Homes, ATierWithoutRoomNamesTheTierAndObject) {
  const Placement pl{Tier::kDevice, Tier::kHost, Tier::kHost, Tier::kHost, 1.0};
  auto plan = module_homes(layout_of({{"emb", 100'000}, {"blk", 100'000}}), pl, 1, DType::kBF16,
                           DType::kF32, false, 0);
  ASSERT_TRUE(plan.is_ok());
  TierOptions o;
  o.placement = pl;
  {
    // Room for the first module's parameters only.
    auto dev = test::cpu_device(300'000);
    ASSERT_NE(dev, nullptr);
    auto h = Homes::create(*dev, *plan, 0, 1, 8 << 20, o, nullptr);
    ASSERT_FALSE(h.is_ok());
    EXPECT_NE(h.status().message().find("device tier: blk.params"), std::string::npos)
        << h.status().message();
    EXPECT_EQ(dev->memory_stats().used, 0u);  // what was allocated is given back
  }
  {
    auto dev = test::cpu_device(8 << 20);
    ASSERT_NE(dev, nullptr);
    // An arena of 1 MiB holds emb's master weights (400 KB), not its moments (800 KB) beside.
    auto h = Homes::create(*dev, *plan, 0, 1, 1 << 20, o, nullptr);
    ASSERT_FALSE(h.is_ok());
    EXPECT_NE(h.status().message().find("host tier: emb.moments"), std::string::npos)
        << h.status().message();
  }
}

// host_buf: a buffer from the host tier while it has room; a full tier fails with `what` in the
// message once the streams are drained and it still has none.
TEST(Homes, HostBufFromTheHostTier) {
  auto dev = test::cpu_device(1 << 20);
  ASSERT_NE(dev, nullptr);
  TierOptions o;
  auto h = Homes::create(*dev, {}, 0, 1, 1 << 20, o, nullptr);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  auto a = (*h)->host_buf(512 << 10, "staging a");
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(a->size(), size_t(512) << 10);
  auto b = (*h)->host_buf(768 << 10, "staging b");
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("staging b"), std::string::npos) << b.status().message();
  a->reset();
  auto c = (*h)->host_buf(768 << 10, "staging c");
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
}

// A full tier runs the reclaim function (what gives back buffers held until copies from them
// ran) before it tries again: a buffer it returns serves the request; none, and it fails.
TEST(Homes, AFullTierReclaimsBeforeItFails) {
  auto dev = test::cpu_device(1 << 20);
  ASSERT_NE(dev, nullptr);
  TierOptions o;
  auto h = Homes::create(*dev, {}, 0, 1, 1 << 20, o, nullptr);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  auto held = (*h)->host_buf(512 << 10, "held");
  ASSERT_TRUE(held.is_ok()) << held.status().to_string();
  int calls = 0;
  (*h)->set_reclaim([&] {
    ++calls;
    held->reset();
  });
  auto b = (*h)->host_buf(768 << 10, "staging b");
  EXPECT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_EQ(calls, 1);
  auto c = (*h)->host_buf(512 << 10, "staging c");  // nothing more to give back
  EXPECT_FALSE(c.is_ok());
  EXPECT_EQ(calls, 3);  // once before each of the two tries again
  (*h)->set_reclaim(nullptr);
}

// The undo room closed (a run that no longer steps under backward) while a large region is still
// being made ready on the room's thread: the thread is stopped, what nothing holds is freed, a
// region still holding a buffer stays until a later close, and no buffer is handed out again.
// The room taken (the most held at once) and what was given back are both kept.
TEST(Homes, TheUndoRoomClosesWhileARegionIsBeingMadeReady) {
  auto dev = test::cpu_device(1 << 20);
  ASSERT_NE(dev, nullptr);
  TierOptions o;
  auto h = Homes::create(*dev, {}, 0, 1, 1 << 20, o, nullptr, size_t{64} << 20);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  Homes& homes = **h;
  auto held = homes.undo_buf(1 << 20);  // a small region, taken on the spot
  ASSERT_TRUE(held.is_ok()) << held.status().to_string();
  EXPECT_TRUE(homes.in_undo_room(held->data()));
  EXPECT_FALSE(homes.undo_ready({size_t{16} << 20}));  // being made ready on the room's thread
  const size_t freed = homes.close_undo_room();
  EXPECT_EQ(homes.undo_in_use(), size_t{1} << 20);
  EXPECT_TRUE(homes.in_undo_room(held->data())) << "a region that holds a buffer was freed";
  EXPECT_EQ(homes.undo_given_back(), freed);
  EXPECT_TRUE(homes.undo_ready({size_t{16} << 20})) << "a closed room makes nothing ready";
  EXPECT_FALSE(homes.undo_buf(4096).is_ok()) << "a closed room handed out a buffer";
  const size_t taken = homes.undo_capacity();
  EXPECT_GE(taken, (size_t{1} << 20) + freed);
  held->reset();
  EXPECT_EQ(homes.close_undo_room(), size_t{1} << 20);
  EXPECT_EQ(homes.undo_given_back(), freed + (size_t{1} << 20));
  EXPECT_EQ(homes.undo_in_use(), 0u);
  EXPECT_EQ(homes.undo_capacity(), taken);
  EXPECT_EQ(homes.host_capacity(), homes.pool().capacity() + taken);
}

// The NVMe tier: one swap extent per sub-group of each NVMe-homed object, counted in its use;
// further extents (the optimizer's shadows) count too, and their peak stays; ~Homes removes the
// swap files.
TEST(Homes, NvmeHomesAreOneExtentPerSubGroup) {
  const std::string dir = test::temp_dir("strata_homes", "nvme");
  auto dev = test::cpu_device(8 << 20);
  ASSERT_NE(dev, nullptr);
  const Placement pl{Tier::kDevice, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0};
  auto plan = module_homes(layout_of({{"a", 5000}, {"b", 1000}}), pl, 1, DType::kBF16, DType::kF32,
                           false, 2048);
  ASSERT_TRUE(plan.is_ok());
  TierOptions o;
  o.placement = pl;
  o.storage.backend = "posix";
  SwapOptions so;
  so.paths = {dir};
  so.bytes_per_path = 8 << 20;
  {
    auto h = Homes::create(*dev, *plan, 0, 1, 1 << 20, o, &so);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    ASSERT_NE((*h)->io(), nullptr);
    ASSERT_NE((*h)->swap(), nullptr);
    EXPECT_GE((*h)->nvme_capacity(), size_t(8) << 20);
    EXPECT_FALSE(fs::is_empty(dir));
    size_t extents = 0;
    for (const Module& m : (*h)->modules()) {
      SCOPED_TRACE(m.name);
      EXPECT_EQ(m.master.tier, Tier::kNvme);
      EXPECT_EQ(m.master.ptr(), nullptr);
      EXPECT_TRUE((*h)->staged(m.master));
      ASSERT_EQ(m.master.subs.size(), m.sub_groups());
      ASSERT_EQ(m.mom.subs.size(), m.sub_groups());
      for (size_t j = 0; j < m.sub_groups(); ++j) {
        EXPECT_GE(m.master.subs[j].bytes, m.sub_len(j) * 4);
        EXPECT_GE(m.mom.subs[j].bytes, m.sub_len(j) * 8);
        extents += m.master.subs[j].bytes + m.mom.subs[j].bytes;
      }
    }
    EXPECT_EQ((*h)->modules()[0].sub_groups(), 3u);
    EXPECT_EQ((*h)->nvme_used(), extents);
    EXPECT_EQ((*h)->nvme_peak(), extents);
    auto x = (*h)->allocate_extent(100'000);
    ASSERT_TRUE(x.is_ok()) << x.status().to_string();
    EXPECT_EQ((*h)->nvme_used(), extents + x->bytes);
    (*h)->free_extent(*x);
    EXPECT_EQ((*h)->nvme_used(), extents);
    EXPECT_EQ((*h)->nvme_peak(), extents + x->bytes);
    // More than the swap file holds: an error, the use unchanged.
    auto big = (*h)->allocate_extent(size_t(64) << 20);
    EXPECT_FALSE(big.is_ok());
    EXPECT_NE(big.status().message().find("nvme tier"), std::string::npos)
        << big.status().message();
    EXPECT_EQ((*h)->nvme_used(), extents);
  }
  EXPECT_TRUE(fs::is_empty(dir));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
