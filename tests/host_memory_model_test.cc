// The host tier's need as the memory model counts it (tier_needs, host_undo_bytes,
// read_ahead_sub_groups): the undo room taken only once a step is speculated, a need that does
// not grow with the model's layers, the optimizer's staging in sub-groups rather than modules,
// the read-ahead in whole sub-groups of what the budget leaves, and state, init and parameter
// pieces of one sub-group each. The training runs of the same pieces are host_memory_test's.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "src/model/gpt2.h"
#include "src/tiers/memory_model.h"
#include "src/tiers/placement.h"
#include "src/train/trainer.h"
#include "strata/config.h"
#include "strata/log.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) { return test::temp_dir("strata_hostmodel", name); }

// configs/tiny-cpu.json (clipping 1.0, AdamW, bf16) for `steps` steps, with overrides.
Config tiny(const std::string& dir, int steps, const std::vector<std::string>& extra) {
  return test::tiny_cpu(
      dir, {"train.steps=" + std::to_string(steps), "scheduler.params.warmup_num_steps=2"}, extra);
}

// A small GPT for the memory model's tests (nothing is trained): 4 heads.
std::unique_ptr<Architecture> small_gpt(int layers, int n_embd, int vocab, int context) {
  ModelConfig mc;
  mc.n_layer = layers;
  mc.n_head = 4;
  mc.n_embd = n_embd;
  mc.vocab_size = vocab;
  mc.context = context;
  auto arch = create_gpt2(mc);
  EXPECT_TRUE(arch.is_ok()) << arch.status().to_string();
  return arch.is_ok() ? std::move(*arch) : nullptr;
}

// The preflight's host need does not grow with the model: with parameters, optimizer state and
// gradients on NVMe it is the same for 2, 8 and 32 layers (the staging of a sub-group-sized
// pipeline, a module's parameter fetches and the gradient landing), while the NVMe need grows.
// The undo room (host_undo_bytes) is a region of its own, allocated when a step is first
// speculated: a run whose every step clips (gradient_clipping far under the norm) never
// speculates and never holds it, its host tier the arena alone; one whose steps do not clip
// speculates from step 2 on and holds it; and a run with strata.optimizer.speculate never has
// none. Host-homed optimizer state, the overlap on; the losses of all are the plain schedule's.
TEST(HostMemoryModel, UndoRoomOnlyOnceAStepIsSpeculated) {
  set_log_level(LogLevel::kWarn);
  auto dir = temp_dir("undo_room");
  const int steps = 5;
  auto run = [&](const std::string& name, std::vector<std::string> ov) {
    ov.push_back("zero_optimization.offload_param.device=\"cpu\"");
    ov.push_back("zero_optimization.offload_optimizer.device=\"cpu\"");
    return test::must_train(tiny(dir + "/" + name, steps, ov));
  };
  const TrainResult clips = run("clips", {"gradient_clipping=1e-6"});
  const TrainResult clips_plain =
      run("clips_plain", {"gradient_clipping=1e-6", "strata.optimizer.overlap=false"});
  const TrainResult free = run("free", {"gradient_clipping=1e6"});
  const TrainResult free_plain =
      run("free_plain", {"gradient_clipping=1e6", "strata.optimizer.overlap=false"});
  const TrainResult never =
      run("never", {"gradient_clipping=1e6", "strata.optimizer.speculate=\"never\""});
  EXPECT_EQ(clips.losses, clips_plain.losses);
  EXPECT_EQ(free.losses, free_plain.losses);
  EXPECT_EQ(never.losses, free_plain.losses);
  for (uint8_t k : clips.optimizer_schedule) EXPECT_NE(k, 1) << "a step that clips, speculated";
  EXPECT_EQ(std::count(free.optimizer_schedule.begin(), free.optimizer_schedule.end(), 1),
            steps - 1);
  const size_t arena = test::tier(clips_plain, "host").capacity;
  EXPECT_EQ(test::tier(clips, "host").capacity, arena) << "the undo room allocated unused";
  EXPECT_GT(test::tier(free, "host").capacity, arena) << "speculated without its undo room";
  EXPECT_EQ(test::tier(never, "host").capacity, test::tier(free_plain, "host").capacity);
  fs::remove_all(dir);
}

TEST(HostMemoryModel, HostNeedIsConstantAsLayersAreAdded) {
  size_t host = 0, nvme = 0;
  for (int layers : {2, 8, 32}) {
    SCOPED_TRACE(fmt::format("{} layers", layers));
    auto arch = small_gpt(layers, 256, 512, 64);
    ASSERT_NE(arch, nullptr);
    TierOptions to;
    to.placement = {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme, 1.0};
    to.nvme_paths = {"/nonexistent"};
    to.sub_group_elems = 65536;
    auto n = tier_needs(*arch, to, 1, DType::kBF16, DType::kF32, 0);
    ASSERT_TRUE(n.is_ok()) << n.status().to_string();
    EXPECT_EQ(n->host.state, 0u);
    EXPECT_GT(n->host.grad_staging, 0u);
    if (host) {
      EXPECT_EQ(n->host.total(), host);
    }
    EXPECT_GT(n->nvme.state, nvme);
    host = n->host.total();
    nvme = n->nvme.state;
  }
}

// The optimizer pipeline's host staging is 2 * buffer_count + 1 sub-groups, not modules, and the
// NVMe-homed parameters' is kFetchStagingPieces + buffer_count + 1 pieces: with sub-groups
// smaller than a block they stay the same when the blocks grow, and the NVMe tier holds one
// extent per sub-group of parameters, master weights and moments.
TEST(HostMemoryModel, OptimizerStagingIsSubGroupsNotModules) {
  const int mc_layers = 2;
  auto need = [&](int n_embd, uint64_t sub_group) {
    auto arch = small_gpt(mc_layers, n_embd, 256, 32);
    TierOptions to;
    to.placement.params = Tier::kNvme;
    to.placement.master = to.placement.moments = Tier::kNvme;
    to.placement.grads = Tier::kHost;
    to.nvme_paths = {"/nonexistent"};
    to.buffer_count = 4;
    to.sub_group_elems = sub_group;
    auto n = tier_needs(*arch, to, 1, DType::kBF16, DType::kF32, 0);
    EXPECT_TRUE(n.is_ok()) << n.status().to_string();
    return *n;
  };
  const uint64_t g = 8192;
  const size_t per_sub_group = g * 4 + g * 8;  // master + two fp32 moments, 4096-aligned
  for (int w : {128, 256, 512}) {
    SCOPED_TRACE(fmt::format("n_embd {}", w));
    const TierNeeds whole = need(w, 0), sub = need(w, g);
    EXPECT_EQ(sub.host.optimizer_staging, 9 * per_sub_group);
    EXPECT_GT(whole.host.optimizer_staging, sub.host.optimizer_staging);
    // Parameter pieces: the NVMe fetch ring and the new parameters' staging, bf16 sub-groups.
    EXPECT_EQ(sub.host.param_fetch_staging, kFetchStagingPieces * g * 2);
    EXPECT_EQ(sub.host.param_publish_staging, (4 + 1) * g * 2);  // buffer_count + 1
    EXPECT_GT(whole.host.param_fetch_staging, sub.host.param_fetch_staging);
    // The same bytes on NVMe: every sub-group but a module's last is 4096-aligned (a module's
    // master and moments each round up once more).
    EXPECT_GE(sub.nvme.state, whole.nvme.state);
    EXPECT_LE(sub.nvme.state - whole.nvme.state, 3 * 2 * 4096 * size_t(mc_layers + 3));
  }
  // A sub-group size that is not a multiple of 2048 is rounded down to one.
  EXPECT_EQ(sub_group_elems(1'000'000, 5000), 4096u);
  EXPECT_EQ(sub_group_elems(1'000'000, 100), 2048u);
  EXPECT_EQ(sub_group_elems(1'000, 2048), 1000u);
  EXPECT_EQ(sub_group_elems(1'000, 0), 1000u);
  // The host budget caps the sub-group: an eighth of it for 2 * 4 + 1 sub-groups of 12 bytes
  // per element.
  EXPECT_EQ(max_sub_group_elems(size_t(256) << 20, 4), 309248u);
  EXPECT_EQ(max_sub_group_elems(size_t(128) << 30, 4), 159072256u);
  EXPECT_EQ(max_sub_group_elems(0, 4), kSubGroupAlign);
}

// The optimizer's read-ahead during backward (strata.optimizer.read_ahead) is what the host
// budget leaves after the arena's other parts, in whole sub-groups of NVMe-homed master weights
// and moments: auto at most half the budget, a given size at most that, never more than the
// sub-groups beyond buffer_count; none without NVMe-homed optimizer state. The arena holds it.
TEST(HostMemoryModel, ReadAheadIsWhatTheBudgetLeavesInWholeSubGroups) {
  const uint64_t g = 8192;
  // master + two fp32 moments, and the new bf16 parameters' piece (NVMe-homed)
  const size_t unit = g * 4 + g * 8 + piece_bytes(g, 2);
  auto arch = small_gpt(2, 256, 256, 32);
  ASSERT_NE(arch, nullptr);
  TierOptions to;
  to.placement = {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0};
  to.nvme_paths = {"/nonexistent"};
  to.buffer_count = 4;
  to.sub_group_elems = g;
  auto n = tier_needs(*arch, to, 1, DType::kBF16, DType::kF32, 0);
  ASSERT_TRUE(n.is_ok()) << n.status().to_string();
  EXPECT_EQ(n->host.optimizer_sub_group, unit);
  // Every trainable module's sub-groups: 2 blocks of 12 * 256^2 (+ biases and norms), the
  // embeddings and the final norm.
  ASSERT_GT(n->host.optimizer_sub_groups, 80u);
  const size_t all_but_depth = n->host.optimizer_sub_groups - 4;
  to.read_ahead_bytes = 0;
  to.host_capacity = size_t(1) << 30;
  const size_t base = host_arena_bytes(*n, to, false);
  EXPECT_EQ(read_ahead_sub_groups(*n, to, false), 0u);
  // A budget with room for everything: auto reads all but buffer_count ahead, the arena grows by
  // as much, within the budget.
  to.read_ahead_bytes = SIZE_MAX;
  EXPECT_EQ(read_ahead_sub_groups(*n, to, false), all_but_depth);
  EXPECT_EQ(host_arena_bytes(*n, to, false), base + all_but_depth * unit);
  EXPECT_LE(host_arena_bytes(*n, to, false), to.host_capacity);
  // A given size: its whole sub-groups.
  to.read_ahead_bytes = 10 * unit + unit / 2;
  EXPECT_EQ(read_ahead_sub_groups(*n, to, false), 10u);
  // The budget's arithmetic on a made-up need: the arena's other parts are 64 MiB (no state,
  // no staging: the slack alone). Auto takes all the budget leaves (the room keeps
  // state from one pass to the next; it had taken at most half); a small budget, what it leaves,
  // in whole sub-groups.
  TierNeeds big;
  big.host.optimizer_sub_group = unit;
  big.host.optimizer_sub_groups = 100000;
  to.read_ahead_bytes = SIZE_MAX;
  to.host_capacity = size_t(1) << 30;
  EXPECT_EQ(read_ahead_sub_groups(big, to, false), ((size_t(1) << 30) - (64u << 20)) / unit);
  EXPECT_LE(host_arena_bytes(big, to, false), to.host_capacity);
  to.host_capacity = (size_t(64) << 20) + 7 * unit + 100;
  EXPECT_EQ(read_ahead_sub_groups(big, to, false), 7u);
  EXPECT_LE(host_arena_bytes(big, to, false), to.host_capacity);
  to.host_capacity = size_t(32) << 20;  // short of even the slack
  EXPECT_EQ(read_ahead_sub_groups(big, to, false), 0u);
  // No NVMe-homed optimizer state, nothing to read ahead.
  to.placement = {Tier::kNvme, Tier::kHost, Tier::kHost, Tier::kHost, 1.0};
  auto h = tier_needs(*arch, to, 1, DType::kBF16, DType::kF32, 0);
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(read_ahead_sub_groups(*h, to, false), 0u);
}

// State moving in and out of its homes (init, checkpoints, resharding, the weights' checksum)
// is one sub-group piece, whatever the width: the larger of a sub-group of master weights not
// homed in host memory and one of NVMe-homed moments; with optimizer state on NVMe it fits in
// the idle optimizer pipeline's room, else (a GPU's device-homed master weights) it is counted
// on its own; host-homed state needs none.
TEST(HostMemoryModel, StateInAndOutIsOneSubGroupPiece) {
  const uint64_t g = 8192;
  auto need = [&](int n_embd, Tier master, Tier moments, Tier rest = Tier::kHost) {
    auto arch = small_gpt(2, n_embd, 256, 32);
    TierOptions to;
    to.placement = {rest, master, moments, rest, 1.0};
    to.nvme_paths = {"/nonexistent"};
    to.sub_group_elems = g;
    auto n = tier_needs(*arch, to, 1, DType::kBF16, DType::kF32, 0);
    EXPECT_TRUE(n.is_ok()) << n.status().to_string();
    return *n;
  };
  for (int w : {128, 512}) {
    SCOPED_TRACE(fmt::format("n_embd {}", w));
    const TierNeeds nvme = need(w, Tier::kNvme, Tier::kNvme);
    EXPECT_EQ(nvme.host.state_io_staging, g * 8);  // fp32 moments: 8 bytes per element
    EXPECT_GE(nvme.host.optimizer_staging, nvme.host.state_io_staging);
    const TierNeeds device = need(w, Tier::kDevice, Tier::kDevice);
    EXPECT_EQ(device.host.state_io_staging, g * 4);
    EXPECT_EQ(device.host.optimizer_staging, 0u);
    const TierNeeds host = need(w, Tier::kHost, Tier::kHost);
    EXPECT_EQ(host.host.state_io_staging, 0u);
    // Everything on the device: each sub-group's parameters are derived through a piece of
    // their own beside the master weights' (a GPU's init and checkpoint load).
    const TierNeeds all = need(w, Tier::kDevice, Tier::kDevice, Tier::kDevice);
    EXPECT_EQ(all.host.state_io_staging, g * 4 + g * 2);
    // Counted in the staging: the device-homed master weights' piece on top of what host-homed
    // state needs; inside the optimizer's room with NVMe state.
    EXPECT_EQ(device.host.staging, host.host.staging + g * 4);
    EXPECT_EQ(nvme.host.staging - nvme.host.optimizer_staging, host.host.staging);
  }
}

// A frozen module (LoRA's base) has parameters only, and is initialized a sub-group at a time
// from fp32 values through a host piece of its own wherever its parameters live; parameters
// not in host memory go home through one parameter piece beside it. The staging counts both.
TEST(HostMemoryModel, AFrozenModulesInitIsOneSubGroupPiece) {
  const uint64_t g = 8192;
  auto arch = small_gpt(2, 512, 256, 32);
  auto need = [&](Tier params) {
    TierOptions to;
    to.placement = {params, Tier::kHost, Tier::kHost, Tier::kHost, 1.0};
    to.nvme_paths = {"/nonexistent"};
    auto homes = module_homes(arch->layout(), to.placement, 1, DType::kBF16, DType::kF32, false, g);
    EXPECT_TRUE(homes.is_ok()) << homes.status().to_string();
    for (ModuleHomes& m : *homes) m.master.bytes = m.moments.bytes = m.grads.bytes = 0;
    return tier_needs(*homes, to, 1, DType::kBF16, 0, arch->program(Pass::kTrain), {});
  };
  const TierNeeds host = need(Tier::kHost);
  EXPECT_EQ(host.host.state_io_staging, g * 4);
  EXPECT_EQ(host.host.staging, g * 4);  // nothing else is staged
  const TierNeeds nvme = need(Tier::kNvme);
  EXPECT_EQ(nvme.host.state_io_staging, g * 4 + g * 2);
  EXPECT_GE(nvme.host.staging, nvme.host.param_fetch_staging + nvme.host.state_io_staging);
}

}  // namespace
}  // namespace strata
