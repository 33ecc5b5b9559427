// The memory model (src/tiers/memory_model.h) alone, a pure function of sizes: each module's
// homes under a placement (its bytes, the optimizer ratio, frozen modules, shards, sub-groups),
// the device working set of a program, each tier's need and its parts, which tiers fall short,
// the staging sizes the optimizer pipeline and the fetch ring hold, and the forward group auto
// picks. The preflight against a real device is TierTest's (tier_test.cc).
#include "src/tiers/memory_model.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "src/model/gpt2.h"
#include "strata/cpu_optim.h"

namespace strata {
namespace {

// A layout of hand-made modules: (name, numel, trainable).
ModelLayout layout_of(std::vector<std::tuple<std::string, size_t, bool>> mods) {
  ModelLayout l;
  for (auto& [name, numel, trainable] : mods) {
    ModuleSpec s;
    s.name = name;
    s.numel = numel;
    s.trainable = trainable;
    l.modules.push_back(s);
  }
  return l;
}

TEST(MemoryModel, WorkingSetIsTheProgramsPeak) {
  const std::vector<size_t> params = {100, 10, 0}, grads = {1000, 20, 30};
  using Op = ProgramOp;
  EXPECT_EQ(working_set_bytes(params, grads, Program{}), 0u);
  // Module 1 alone (30), then 2 with 1's gradient (50).
  Program p{{{Op::kAcquireParams, 1},
             {Op::kAcquireGrads, 1},
             {Op::kReleaseParams, 1},
             {Op::kAcquireParams, 2},
             {Op::kAcquireGrads, 2},
             {Op::kDrainGrads, 2},
             {Op::kReleaseParams, 2},
             {Op::kDrainGrads, 1}}};
  EXPECT_EQ(working_set_bytes(params, grads, p), 50u);
  p.ops.push_back({Op::kAcquireGrads, 0});
  EXPECT_EQ(working_set_bytes(params, grads, p), 1000u);
}

// ZeRO++'s device buffers in the memory model, per rank of 4 in 2 nodes of 2, against the sizes
// written out here from the algorithm (not from ZeroPPShape): qwZ's gather buffer is the largest
// group's 4 packed int8 units (the int8 bytes, then one fp32 scale per 256 elements); hpZ with
// h = 2 keeps 2 units (model dtype without qwZ) of every module; qgZ's scratch for a bucket of k
// elements is 2 * 4 packed int4 chunks within the node and 2 * 2 across (the fp32 partial sums
// reuse the bucket). Without ZeRO++ or on one rank they are 0; they are part of the working set.
TEST(MemoryModel, ZeroPlusPlusBuffersAreCountedPerSwitch) {
  ModelConfig mc;
  mc.n_layer = 2;
  mc.n_head = 2;
  mc.n_embd = 64;
  mc.vocab_size = 100;
  mc.context = 16;
  auto arch = create_gpt2(mc);
  ASSERT_TRUE(arch.is_ok());
  TierOptions to;
  to.placement.params = to.placement.master = to.placement.moments = to.placement.grads =
      Tier::kHost;
  to.reduce_bucket_elems = 40'000;  // 10'000 per rank, less than the largest group's shard
  const DType dt = DType::kBF16;
  auto homes = module_homes((*arch)->layout(), to.placement, 4, dt, DType::kF32, false, 0);
  ASSERT_TRUE(homes.is_ok());
  const Program& prog = (*arch)->program(Pass::kTrain);
  const TierNeeds plain = tier_needs(*homes, to, 4, dt, 0, prog, {});
  EXPECT_EQ(plain.device.zeropp(), 0u);

  auto r256 = [](size_t n) { return (n + 255) / 256 * 256; };
  auto int8_unit = [](size_t sn) { return (sn + 3) / 4 * 4 + 4 * ((sn + 255) / 256); };
  size_t max_qwz = 0, sec8 = 0, sec_bf16 = 0, max_sn = 0;
  for (const auto& m : *homes) {
    max_sn = std::max(max_sn, m.shard_numel);
    max_qwz = std::max(max_qwz, r256(4 * int8_unit(m.shard_numel)));
    sec8 += r256(2 * int8_unit(m.shard_numel));
    sec_bf16 += r256(2 * m.shard_numel * 2);
  }
  ASSERT_GT(max_sn, 10'000u);
  const size_t k = 10'000, pc = (k / 2 + 3) / 4 * 4 + 4 * ((k + 127) / 128);
  const size_t scratch = r256(2 * 4 * pc + 2 * 2 * pc);

  ZeroPPShape z;
  z.world = 4;
  z.nodes = 2;
  z.per_node = 2;
  for (int sw = 0; sw < 4; ++sw) {
    z.quantized_weights = sw == 0 || sw == 3;
    z.hpz = sw == 1 || sw == 3 ? 2 : 1;
    z.quantized_gradients = sw == 2 || sw == 3;
    const TierNeeds n = tier_needs(*homes, to, 4, dt, 0, prog, z);
    SCOPED_TRACE(
        fmt::format("qwZ {} hpZ {} qgZ {}", z.quantized_weights, z.hpz, z.quantized_gradients));
    EXPECT_EQ(n.bucket_shard_elems, k);
    EXPECT_EQ(n.device.qwz_buffer, z.quantized_weights ? max_qwz : 0u);
    EXPECT_EQ(n.device.hpz_secondary, z.hpz == 1 ? 0u : z.quantized_weights ? sec8 : sec_bf16);
    EXPECT_EQ(n.device.qgz_scratch, z.quantized_gradients ? scratch : 0u);
    EXPECT_EQ(n.device.transient(), plain.device.transient() + n.device.zeropp());
    EXPECT_EQ(n.host.total(), plain.host.total());
  }
  // Four nodes of one rank: the 4 partial sums take k floats each of the scratch.
  z.nodes = 4;
  z.per_node = 1;
  EXPECT_EQ(tier_needs(*homes, to, 4, dt, 0, prog, z).device.qgz_scratch,
            r256(2 * 4 * pc + 2 * 4 * pc + 4 * k * 4));
  // One rank: ZeRO++ is off whatever the shape says.
  auto one = module_homes((*arch)->layout(), to.placement, 1, dt, DType::kF32, false, 0);
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(tier_needs(*one, to, 1, dt, 0, prog, z).device.zeropp(), 0u);
}

// Sub-groups: the option rounded down to the alignment (at least one alignment), at most the
// shard; 0 or an option past the shard is the whole shard.
TEST(MemoryModel, SubGroupElems) {
  EXPECT_EQ(sub_group_elems(10'000, 0), 10'000u);
  EXPECT_EQ(sub_group_elems(10'000, 10'000), 10'000u);
  EXPECT_EQ(sub_group_elems(10'000, 50'000), 10'000u);
  EXPECT_EQ(sub_group_elems(10'000, 5000), 4096u);  // 2 * kSubGroupAlign
  EXPECT_EQ(sub_group_elems(10'000, 1), kSubGroupAlign);
  EXPECT_EQ(sub_group_elems(3000, 2500), 2048u);
  EXPECT_EQ(sub_group_elems(3000, 2500, 4096), 3000u);  // the alignment past the shard
  EXPECT_EQ(sub_group_elems(200'000, 150'000, kStatsTileElems), 2 * kStatsTileElems);
}

// Each object's bytes and tier: parameters in the model dtype, fp32 master weights and
// gradients, two moments in the moment dtype; a frozen module has parameters only; the
// delayed update adds a second gradient accumulator like the first.
TEST(MemoryModel, ModuleHomesBytesAndTiers) {
  const ModelLayout l = layout_of({{"a", 1000, true}, {"frozen", 300, false}});
  const Placement pl{Tier::kDevice, Tier::kNvme, Tier::kHost, Tier::kHost, 1.0};
  auto h = module_homes(l, pl, 1, DType::kBF16, DType::kF32, false, 0);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  ASSERT_EQ(h->size(), 2u);
  const ModuleHomes& a = (*h)[0];
  EXPECT_EQ(a.name, "a");
  EXPECT_EQ(a.numel, 1000u);
  EXPECT_EQ(a.shard_numel, 1000u);
  EXPECT_EQ(a.padded_numel, 1000u);
  EXPECT_EQ(a.params.tier, Tier::kDevice);
  EXPECT_EQ(a.params.bytes, 2000u);
  EXPECT_EQ(a.master.tier, Tier::kNvme);
  EXPECT_EQ(a.master.bytes, 4000u);
  EXPECT_EQ(a.moments.tier, Tier::kHost);
  EXPECT_EQ(a.moments.bytes, 8000u);
  EXPECT_EQ(a.grads.bytes, 4000u);
  EXPECT_EQ(a.grads2.bytes, 0u);
  EXPECT_EQ(a.sub_group, 1000u);
  EXPECT_EQ(a.sub_groups(), 1u);
  const ModuleHomes& f = (*h)[1];
  EXPECT_EQ(f.params.bytes, 600u);
  EXPECT_EQ(f.master.bytes + f.moments.bytes + f.grads.bytes, 0u);

  h = module_homes(l, pl, 1, DType::kF32, DType::kBF16, true, 0);
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ((*h)[0].params.bytes, 4000u);
  EXPECT_EQ((*h)[0].moments.bytes, 4000u);
  EXPECT_EQ((*h)[0].grads2.bytes, 4000u);
  EXPECT_EQ((*h)[0].grads2.tier, Tier::kHost);
}

// optimizer_ratio < 1 keeps the first (1 - ratio) of the optimizer bytes, in module order, on
// the device, with their gradients; the rest where the placement puts them.
TEST(MemoryModel, OptimizerRatioKeepsTheFirstModulesOnTheDevice) {
  const ModelLayout l =
      layout_of({{"a", 1000, true}, {"b", 1000, true}, {"c", 1000, true}, {"d", 1000, true}});
  Placement pl{Tier::kDevice, Tier::kHost, Tier::kHost, Tier::kHost, 0.5};
  auto h = module_homes(l, pl, 1, DType::kBF16, DType::kF32, false, 0);
  ASSERT_TRUE(h.is_ok());
  std::vector<Tier> want = {Tier::kDevice, Tier::kDevice, Tier::kHost, Tier::kHost};
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ((*h)[i].master.tier, want[i]);
    EXPECT_EQ((*h)[i].moments.tier, want[i]);
    EXPECT_EQ((*h)[i].grads.tier, want[i]);
    EXPECT_EQ((*h)[i].params.tier, Tier::kDevice);
  }
  pl.optimizer_ratio = 1.0;
  h = module_homes(l, pl, 1, DType::kBF16, DType::kF32, false, 0);
  ASSERT_TRUE(h.is_ok());
  for (const ModuleHomes& m : *h) EXPECT_EQ(m.master.tier, Tier::kHost);
  pl.optimizer_ratio = 0.0;
  h = module_homes(l, pl, 1, DType::kBF16, DType::kF32, false, 0);
  ASSERT_TRUE(h.is_ok());
  for (const ModuleHomes& m : *h) EXPECT_EQ(m.master.tier, Tier::kDevice);
}

// Over ranks each module is padded to whole 4 KiB shards of the model dtype and every object
// holds one shard; the sub-groups cut the shard, the last one shorter.
TEST(MemoryModel, ShardsAndSubGroups) {
  const ModelLayout l = layout_of({{"a", 10'000, true}});
  const Placement pl{Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0};
  auto h = module_homes(l, pl, 3, DType::kBF16, DType::kF32, false, 0);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  const ModuleHomes& m = (*h)[0];
  EXPECT_EQ(m.numel, 10'000u);
  EXPECT_EQ(m.shard_numel % 2048, 0u);  // 4096 bytes of bf16
  EXPECT_GE(3 * m.shard_numel, 10'000u);
  EXPECT_LT(3 * (m.shard_numel - 2048), 10'000u);
  EXPECT_EQ(m.padded_numel, 3 * m.shard_numel);
  EXPECT_EQ(m.params.bytes, 2 * m.shard_numel);
  EXPECT_EQ(m.master.bytes, 4 * m.shard_numel);

  h = module_homes(layout_of({{"a", 5000, true}}), pl, 1, DType::kBF16, DType::kF32, false, 2048);
  ASSERT_TRUE(h.is_ok());
  const ModuleHomes& s = (*h)[0];
  EXPECT_EQ(s.sub_group, 2048u);
  EXPECT_EQ(s.sub_groups(), 3u);
  EXPECT_EQ(s.sub_group_len(0), 2048u);
  EXPECT_EQ(s.sub_group_len(2), 5000u - 4096);
  EXPECT_EQ(s.sum_over_sub_groups([](size_t len) { return len; }), 5000u);
  // An NVMe extent per sub-group, each in whole 4 KiB blocks.
  EXPECT_EQ(extent_bytes(s, 4), 8192u + 8192 + 4096);
  EXPECT_EQ(piece_bytes(2048, 4), 8192u);
  EXPECT_EQ(piece_bytes(1, 2), 4096u);
  EXPECT_EQ(piece_bytes(0, 4), 0u);
}

// Gradients on NVMe cut their sub-groups in whole statistics tiles.
TEST(MemoryModel, NvmeGradientsCutSubGroupsInStatisticsTiles) {
  const Placement pl{Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kNvme, 1.0};
  auto h = module_homes(layout_of({{"a", 3 * kStatsTileElems, true}}), pl, 1, DType::kBF16,
                        DType::kF32, false, kStatsTileElems + 5000);
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ((*h)[0].sub_group, kStatsTileElems);
}

// The host tier holds its objects in whole pages, the device in 256-byte units; NVMe state is
// its extents; a shortfall names the tier over its capacity, or state on NVMe without paths.
TEST(MemoryModel, NeedsAndShortfalls) {
  const ModelLayout l = layout_of({{"a", 1000, true}, {"b", 3000, true}});
  const Placement pl{Tier::kDevice, Tier::kHost, Tier::kHost, Tier::kHost, 1.0};
  auto h = module_homes(l, pl, 1, DType::kBF16, DType::kF32, false, 0);
  ASSERT_TRUE(h.is_ok());
  TierOptions o;
  o.placement = pl;
  const TierNeeds n = tier_needs(*h, o, 1, DType::kBF16, 1 << 20, Program{}, {});
  EXPECT_EQ(n.device.activations, size_t(1) << 20);
  EXPECT_EQ(n.device.resident_state, round_up(2000, 256) + round_up(6000, 256));
  // master 4 + moments 8 + grads 4 bytes an element, each object in whole pages.
  EXPECT_EQ(n.host.state, 2 * round_up(4000, 4096) + round_up(8000, 4096) +
                              2 * round_up(12'000, 4096) + round_up(24'000, 4096));
  EXPECT_EQ(n.nvme.state, 0u);
  EXPECT_EQ(n.device.total(),
            n.device.activations + n.device.resident_state + n.device.transient());

  o.host_capacity = n.host.total();
  EXPECT_FALSE(tier_shortfall(n, o, n.device.total()).any());
  TierShortfall s = tier_shortfall(n, o, n.device.total() - 1);
  EXPECT_TRUE(s.device);
  EXPECT_FALSE(s.host);
  o.host_capacity = n.host.total() - 1;
  s = tier_shortfall(n, o, n.device.total());
  EXPECT_TRUE(s.host);
  EXPECT_FALSE(s.device);

  // Master weights on NVMe without a path.
  Placement nv = pl;
  nv.master = Tier::kNvme;
  o.placement = nv;
  auto hn = module_homes(l, nv, 1, DType::kBF16, DType::kF32, false, 0);
  ASSERT_TRUE(hn.is_ok());
  const TierNeeds nn = tier_needs(*hn, o, 1, DType::kBF16, 0, Program{}, {});
  EXPECT_EQ(nn.nvme.state, extent_bytes((*hn)[0], 4) + extent_bytes((*hn)[1], 4));
  o.host_capacity = SIZE_MAX;
  EXPECT_TRUE(tier_shortfall(nn, o, SIZE_MAX).nvme_paths);
  o.nvme_paths = {"/swap"};
  EXPECT_FALSE(tier_shortfall(nn, o, SIZE_MAX).any());
}

// The pipeline's staging: buffer_count read ahead and one stepped, with the writes in flight
// behind; none without NVMe-homed state; at most 2 * buffer_count + 1 with both master weights
// and moments on NVMe.
TEST(MemoryModel, PipelineStagingCounts) {
  EXPECT_EQ(pipeline_sub_groups_held(4, 0, false), 0u);
  for (int bc : {1, 2, 4, 8}) {
    SCOPED_TRACE(bc);
    EXPECT_LE(pipeline_sub_groups_held(bc, 2, false), pipeline_staging_sub_groups(bc));
    EXPECT_GE(pipeline_sub_groups_held(bc, 1, false), size_t(bc) + 1);
    EXPECT_EQ(publish_staging_pieces(bc, true), size_t(bc) + 1);
    EXPECT_EQ(publish_staging_pieces(bc, false), 2u);
  }
  EXPECT_EQ(pipeline_sub_groups_held(4, 2, false), 4u + 1 + 3);
  EXPECT_EQ(pipeline_sub_groups_held(0, 2, false), pipeline_sub_groups_held(1, 2, false));
  EXPECT_EQ(publish_staging_pieces(0, true), 2u);
}

// auto picks the whole group only when its further activation sets fit and cost no more
// parameter fetches than one set at a time.
TEST(MemoryModel, AutoForwardGroup) {
  TierNeeds one;
  one.device.activations = 100;
  EXPECT_EQ(auto_forward_group(1, one, 50, 0, 1000, 0, false), 1);
  EXPECT_EQ(auto_forward_group(4, one, 50, 0, 1000, 0, false), 4);  // every parameter resident
  EXPECT_EQ(auto_forward_group(4, one, 50, 0, 249, 0, false), 1);   // 100 + 3 * 50 > 249
  EXPECT_EQ(auto_forward_group(4, one, 50, 0, 250, 0, false), 4);
  // The parameters (500 bytes off the device) stay cached either way: fewer fetches grouped.
  EXPECT_EQ(auto_forward_group(4, one, 50, 0, 10'000, 500, false), 4);
  // Sharded, nothing stays cached; grouped fetches 1 + A per step against 2A one at a time.
  EXPECT_EQ(auto_forward_group(4, one, 50, 0, 10'000, 500, true), 4);
  // The group's sets squeeze out the cache that one set at a time keeps: not worth it.
  EXPECT_EQ(auto_forward_group(4, one, 3000, 0, 10'000, 9000, false), 1);
}

}  // namespace
}  // namespace strata
