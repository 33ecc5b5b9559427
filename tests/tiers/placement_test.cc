// Where training state lives (src/tiers/placement.h) alone: the placement a config asks for and
// what it refuses, which splits a device can run, the sub-group cap, the automatic home of the
// gradients, the adapters from the config to io/'s options and the NVMe preflight, the most
// micro-batches a forward group takes, and TierOptions::from_config. Pure data: no device but a
// CPU one to ask whether it is host-addressable.
#include "src/tiers/placement.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "strata/config.h"
#include "strata/device.h"
#include "tests/test_util.h"

namespace strata {
namespace {

TEST(Placement, TierNames) {
  EXPECT_STREQ(tier_name(Tier::kDevice), "device");
  EXPECT_STREQ(tier_name(Tier::kHost), "host");
  EXPECT_STREQ(tier_name(Tier::kNvme), "nvme");
}

// offload_param.device places the parameters, offload_optimizer.device the master weights and
// moments, with the gradients on the device only beside a device optimizer; "none" is the
// device and "cpu" the host.
TEST(Placement, FromTheOffloadKeys) {
  Config c;
  auto p = parse_placement(c);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(*p, (Placement{Tier::kDevice, Tier::kDevice, Tier::kDevice, Tier::kDevice, 1.0}));
  c.zero.offload_param.device = "cpu";
  c.zero.offload_optimizer.device = "nvme";
  c.zero.offload_optimizer.ratio = 0.25;
  p = parse_placement(c);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(*p, (Placement{Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 0.25}));
  c.zero.offload_param.device = "nvme";
  c.zero.offload_optimizer.device = "cpu";
  p = parse_placement(c);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->params, Tier::kNvme);
  EXPECT_EQ(p->master, Tier::kHost);
  EXPECT_EQ(p->grads, Tier::kHost);
}

// Each strata.placement key that is set overrides its kind alone.
TEST(Placement, StrataPlacementKeysOverrideEachKind) {
  Config c;
  c.zero.offload_optimizer.device = "cpu";
  c.strata.placement_moments = "nvme";
  c.strata.placement_grads = "device";
  auto p = parse_placement(c);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->params, Tier::kDevice);
  EXPECT_EQ(p->master, Tier::kHost);
  EXPECT_EQ(p->moments, Tier::kNvme);
  EXPECT_EQ(p->grads, Tier::kDevice);
  c.strata.placement_params = "host";
  c.strata.placement_master = "none";
  p = parse_placement(c);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->params, Tier::kHost);
  EXPECT_EQ(p->master, Tier::kDevice);
}

// An unknown tier name is kInvalidArgument naming the key and the names it takes.
TEST(Placement, UnknownTierNamesTheKey) {
  struct Case {
    const char* key;
    void (*set)(Config&);
  } cases[] = {
      {"zero_optimization.offload_param.device",
       [](Config& c) { c.zero.offload_param.device = "gpu"; }},
      {"zero_optimization.offload_optimizer.device",
       [](Config& c) { c.zero.offload_optimizer.device = "gpu"; }},
      {"strata.placement.params", [](Config& c) { c.strata.placement_params = "gpu"; }},
      {"strata.placement.master", [](Config& c) { c.strata.placement_master = "gpu"; }},
      {"strata.placement.moments", [](Config& c) { c.strata.placement_moments = "gpu"; }},
      {"strata.placement.grads", [](Config& c) { c.strata.placement_grads = "GPU"; }},
  };
  for (const Case& k : cases) {
    Config c;
    k.set(c);
    auto p = parse_placement(c);
    ASSERT_FALSE(p.is_ok()) << k.key;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << k.key;
    const std::string msg = p.status().message();
    EXPECT_NE(msg.find(k.key), std::string::npos) << msg;
    EXPECT_NE(msg.find("is not one of device, host, nvme"), std::string::npos) << msg;
  }
}

// A host-addressable device runs any split; another one only all three of master weights,
// moments and gradients on the device or all off it.
TEST(Placement, SplitOptimizerStateOnlyOnAHostAddressableDevice) {
  const Placement split{Tier::kDevice, Tier::kDevice, Tier::kHost, Tier::kDevice, 1.0};
  const Placement on{Tier::kHost, Tier::kDevice, Tier::kDevice, Tier::kDevice, 1.0};
  const Placement off{Tier::kDevice, Tier::kHost, Tier::kNvme, Tier::kHost, 1.0};
  EXPECT_TRUE(check_placement(split, true, "cpu").is_ok());
  EXPECT_TRUE(check_placement(on, false, "gpu0").is_ok());
  EXPECT_TRUE(check_placement(off, false, "gpu0").is_ok());
  Status s = check_placement(split, false, "gpu0");
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("master weights device, moments host, gradients device"),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("'gpu0'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("strata.placement.master"), std::string::npos) << s.message();

  auto cpu = create_cpu_device({.capacity = 1 << 20, .threads = 1});
  ASSERT_TRUE(cpu.is_ok());
  EXPECT_TRUE(check_placement(split, **cpu).is_ok());
  Config c;
  c.strata.placement_moments = "host";
  auto p = placement_from_config(c, **cpu);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->moments, Tier::kHost);
  c.strata.placement_moments = "disk";
  EXPECT_FALSE(placement_from_config(c, **cpu).is_ok());
}

TEST(Placement, DeviceOptimizerWhenAnyOptimizerStateIsOnTheDevice) {
  EXPECT_FALSE(needs_device_optimizer({Tier::kDevice, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}));
  EXPECT_TRUE(needs_device_optimizer({Tier::kHost, Tier::kDevice, Tier::kHost, Tier::kHost, 1.0}));
  EXPECT_TRUE(needs_device_optimizer({Tier::kHost, Tier::kHost, Tier::kDevice, Tier::kHost, 1.0}));
  EXPECT_TRUE(needs_device_optimizer({Tier::kHost, Tier::kHost, Tier::kHost, Tier::kDevice, 1.0}));
  EXPECT_TRUE(needs_device_optimizer({Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 0.5}));
}

// The sub-group cap: its staging ((2 * buffer_count + 1) sub-groups of 12 bytes an element)
// within an eighth of the host budget, a multiple of kSubGroupAlign, at least one.
TEST(Placement, SubGroupCapIsAnEighthOfTheHostBudget) {
  EXPECT_EQ(pipeline_staging_sub_groups(4), 9u);
  EXPECT_EQ(pipeline_staging_sub_groups(0), 3u);
  EXPECT_EQ(pipeline_staging_sub_groups(1), 3u);
  EXPECT_EQ(max_sub_group_elems(0, 4), kSubGroupAlign);
  for (size_t host : {size_t(1) << 30, size_t(64) << 30, size_t(3) << 20}) {
    for (int bc : {1, 4, 8}) {
      const uint64_t g = max_sub_group_elems(host, bc);
      SCOPED_TRACE(testing::Message() << host << " " << bc);
      EXPECT_EQ(g % kSubGroupAlign, 0u);
      EXPECT_GE(g, kSubGroupAlign);
      if (g > kSubGroupAlign) {
        EXPECT_LE(g * 12 * pipeline_staging_sub_groups(bc), host / 8);
        EXPECT_GT((g + kSubGroupAlign) * 12 * pipeline_staging_sub_groups(bc), host / 8);
      }
    }
  }
}

// Gradients move to NVMe only where they may (host-homed, optimizer state on NVMe, one rank,
// no delayed update) and where it helps (the host need with them on the host is over the budget
// and with them on NVMe smaller).
TEST(Placement, AutoGradsGoToNvmeOnlyWhenAllowedAndUseful) {
  const Placement nv{Tier::kDevice, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0};
  EXPECT_EQ(auto_grads_placement(nv, 100, 10, 50, false, false), Tier::kNvme);
  EXPECT_EQ(auto_grads_placement(nv, 50, 10, 50, false, false), Tier::kHost);    // fits
  EXPECT_EQ(auto_grads_placement(nv, 100, 100, 50, false, false), Tier::kHost);  // no gain
  EXPECT_EQ(auto_grads_placement(nv, 100, 10, 50, true, false), Tier::kHost);    // sharded
  EXPECT_EQ(auto_grads_placement(nv, 100, 10, 50, false, true), Tier::kHost);    // delayed
  Placement host_master = nv;
  host_master.master = Tier::kHost;
  EXPECT_EQ(auto_grads_placement(host_master, 100, 10, 50, false, false), Tier::kHost);
  Placement dev_grads = nv;
  dev_grads.grads = Tier::kDevice;
  EXPECT_EQ(auto_grads_placement(dev_grads, 100, 10, 50, false, false), Tier::kDevice);
}

// The adapters from the config to io/'s own options live above io/ (src/tiers/placement.h).
TEST(TierOptions, StorageOptionsFromConfig) {
  Config c;
  c.aio.backend = "libaio";
  c.aio.block_size = 2 << 20;
  c.aio.queue_depth = 32;
  c.strata.io_checksum = true;
  StorageOptions o = storage_options_from_config(c);
  EXPECT_EQ(o.backend, "libaio");
  EXPECT_EQ(o.block_size, size_t(2) << 20);
  EXPECT_EQ(o.queue_depth, 32);
  EXPECT_TRUE(o.checksum);
}

TEST(TierOptions, NvmeConfigPreflightNamesKeyAndPath) {
  const std::string dir = test::temp_dir("strata_tier", "nvme_config");
  std::filesystem::create_directories(dir + "/ok");
  Config c;
  EXPECT_TRUE(check_nvme_config(c, 1 << 20).is_ok());  // nothing on nvme: nothing to check
  c.zero.offload_optimizer.device = "nvme";
  Status empty = check_nvme_config(c, 1 << 20);
  ASSERT_FALSE(empty.is_ok());
  EXPECT_NE(empty.message().find("offload_optimizer.nvme_path is empty"), std::string::npos);
  c.zero.offload_optimizer.nvme_path = {dir + "/ok", dir + "/missing"};
  Status missing = check_nvme_config(c, 1 << 20);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("zero_optimization.offload_optimizer.nvme_path: nvme_path " +
                                   dir + "/missing does not exist"),
            std::string::npos)
      << missing.message();
  c.zero.offload_optimizer.nvme_path = {dir + "/ok"};
  EXPECT_TRUE(check_nvme_config(c, 1 << 20).is_ok());
  EXPECT_FALSE(check_nvme_config(c, uint64_t{1} << 50).is_ok());
  std::filesystem::remove_all(dir);
}

// A forward group pays off where the optimizer may be deferred (overlap with clipping or fp16)
// or the backwards run together, never with the delayed update or offloaded activations.
TEST(TierOptions, ForwardGroupMax) {
  Config c;
  c.gradient_accumulation_steps = 6;
  c.strata.grouped_backwards = true;
  EXPECT_EQ(forward_group_max(c), 6);
  c.strata.grouped_backwards = false;
  EXPECT_EQ(forward_group_max(c), 1);  // no clipping, no fp16: nothing to defer
  c.gradient_clipping = 1.0;
  c.strata.optimizer_overlap = true;
  EXPECT_EQ(forward_group_max(c), 6);
  c.strata.optimizer_overlap = false;
  EXPECT_EQ(forward_group_max(c), 1);
  c.strata.grouped_backwards = true;
  c.strata.activations = "offload";
  EXPECT_EQ(forward_group_max(c), 1);
  c.strata.activations = "recompute";
  c.strata.delayed_update = true;
  EXPECT_EQ(forward_group_max(c), 1);
  c.strata.delayed_update = false;
  c.gradient_accumulation_steps = 0;
  EXPECT_EQ(forward_group_max(c), 1);
}

// TierOptions::from_config: the DeepSpeed keys in elements become bytes of the model dtype, the
// swap paths of both offloads once each, the host budget the key's (else 90% of MemAvailable),
// the sub-group size capped by that budget.
TEST(TierOptions, FromConfig) {
  Config c;
  c.zero.offload_param.nvme_path = {"/a", "/b"};
  c.zero.offload_optimizer.nvme_path = {"/b", "/c"};
  c.zero.offload_optimizer.buffer_count = 0;
  c.zero.stage3_prefetch_bucket_size = 1000;
  c.zero.stage3_max_reuse_distance = 300;
  c.zero.sub_group_size = 1'000'000'000;
  c.strata.host_memory_limit = size_t(1) << 30;
  c.strata.placement_grads = "";
  TierOptions o = TierOptions::from_config(c, DType::kBF16);
  EXPECT_EQ(o.nvme_paths, (std::vector<std::string>{"/a", "/b", "/c"}));
  EXPECT_EQ(o.buffer_count, 1);
  EXPECT_EQ(o.prefetch_bytes, 2000u);
  EXPECT_EQ(o.max_reuse_distance, 600u);
  EXPECT_EQ(o.host_capacity, size_t(1) << 30);
  EXPECT_EQ(o.sub_group_elems, max_sub_group_elems(o.host_capacity, 1));
  EXPECT_TRUE(o.grads_auto);
  c.strata.placement_grads = "host";
  c.zero.sub_group_size = 4096;
  c.zero.stage3_max_reuse_distance = UINT64_MAX / 4;  // "never": no overflow into a small number
  o = TierOptions::from_config(c, DType::kF32);
  EXPECT_FALSE(o.grads_auto);
  EXPECT_EQ(o.sub_group_elems, 4096u);
  EXPECT_EQ(o.prefetch_bytes, 4000u);
  EXPECT_EQ(o.max_reuse_distance, UINT64_MAX);
}

// Undo state (its host room in the tier's arena) only where a step can be speculated: the
// overlap on, clipping or fp16, and strata.optimizer.speculate not never.
TEST(TierOptions, UndoRoomOnlyWhereAStepCanBeSpeculated) {
  Config c;
  c.gradient_clipping = 1.0;
  c.strata.optimizer_overlap = true;
  for (const char* s : {"auto", "always"}) {
    c.strata.optimizer_speculate = s;
    EXPECT_TRUE(TierOptions::from_config(c, DType::kBF16).undo_copies) << s;
  }
  c.strata.optimizer_speculate = "never";
  EXPECT_FALSE(TierOptions::from_config(c, DType::kBF16).undo_copies);
  c.strata.optimizer_speculate = "auto";
  c.gradient_clipping = 0;
  EXPECT_FALSE(TierOptions::from_config(c, DType::kBF16).undo_copies);
  c.fp16.enabled = true;
  EXPECT_TRUE(TierOptions::from_config(c, DType::kBF16).undo_copies);
  c.strata.optimizer_overlap = false;
  EXPECT_FALSE(TierOptions::from_config(c, DType::kBF16).undo_copies);
}

}  // namespace
}  // namespace strata
