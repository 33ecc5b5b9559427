// The planner against the engine: its device and host needs are the tier manager's preflight's,
// and it reads a config's placement (an unset strata.placement.grads included) as the trainer does.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "src/model/gpt2.h"
#include "src/plan/plan.h"
#include "src/plan/probe_machine.h"
#include "src/tiers/memory_model.h"
#include "src/tiers/tier_manager.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/log.h"

namespace strata {
namespace {

PlacementOption find(const std::string& name) {
  for (const auto& p : placement_options()) {
    if (p.name == name) return p;
  }
  ADD_FAILURE() << "no placement " << name;
  return {};
}

PlanRequest small_request() {
  PlanRequest r;
  r.model = gpt_model("t", 1, 64, 1, 64, 64);
  r.micro_batch = 1;
  r.seq = 64;
  r.hw.gpu_mem = uint64_t{1} << 30;
  r.hw.host_mem = uint64_t{1} << 30;
  r.hw.nvme_paths = {"/tmp"};
  r.profile = default_profile(true);
  return r;
}

// The planner's device and host needs are exactly what TierManager::create's preflight demands,
// for every placement the planner names and for strata.placement-style ones it evaluates as a
// config's: at the predicted bytes it builds, a page less and it refuses.
TEST(Plan, DeviceAndHostNeedsMatchTierManagerPreflight) {
  set_log_level(LogLevel::kError);
  char tmpl[] = "/tmp/strata_plan_preflight_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string swap_dir = tmpl;
  struct Case {
    PlacementOption option;
    bool tied = true;
    bool delayed = false;
  };
  std::vector<Case> cases;
  for (const auto& p : placement_options()) cases.push_back({p});
  using T = Tier;
  // strata.placement variants: master on the host with moments on NVMe; gradients on the device
  // with the optimizer on the host; half the optimizer state kept on the device; an untied head;
  // the delayed update's second accumulator and parameter shadows.
  cases.push_back({{"config", {T::kDevice, T::kHost, T::kNvme, T::kHost, 1.0}}});
  cases.push_back({{"config", {T::kHost, T::kHost, T::kHost, T::kDevice, 1.0}}});
  cases.push_back({{"config", {T::kDevice, T::kHost, T::kHost, T::kHost, 0.5}}});
  cases.push_back({{"config", {T::kNvme, T::kNvme, T::kNvme, T::kHost, 0.5}}});
  cases.push_back({find("params-host"), /*tied=*/false});
  cases.push_back({find("opt-nvme"), /*tied=*/false});
  cases.push_back({find("params-nvme+opt-host"), true, /*delayed=*/true});
  for (const Case& c : cases)
    for (const ActivationMode mode :
         {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
      ModelConfig mc;
      mc.n_layer = 2;
      mc.n_head = 2;
      mc.n_embd = 64;
      mc.vocab_size = 100;
      mc.context = 32;
      mc.tied_embeddings = c.tied;
      auto arch = create_gpt2(mc);
      ASSERT_TRUE(arch.is_ok());
      PlanRequest r = small_request();
      r.model = gpt_model("t", 2, 64, 2, 100, 32, c.tied);
      r.seq = 32;
      r.micro_batch = 2;
      r.activations = mode;
      r.delayed_update = c.delayed;
      r.overlap_optimizer = !c.delayed;  // request_from_config: no overlap with the delayed update
      r.hw.nvme_paths = {swap_dir};
      const Placement& w = c.option.where;
      const std::string what =
          fmt::format("{} (params {} master {} moments {} grads {} ratio {}{}{}) {}", c.option.name,
                      tier_name(w.params), tier_name(w.master), tier_name(w.moments),
                      tier_name(w.grads), w.optimizer_ratio, c.tied ? "" : ", untied",
                      c.delayed ? ", delayed" : "", activation_mode_name(mode));
      auto o = evaluate_placement(r, c.option);
      ASSERT_TRUE(o.is_ok()) << what << ": " << o.status().message();
      const size_t act = o->device.activations;
      const ActivationSizes sizes = (*arch)->activation_plan(2, 32, DType::kBF16, mode);
      EXPECT_EQ(act, sizes.bytes);
      EXPECT_EQ(o->host.activations, sizes.host_bytes);
      TierOptions to;
      to.placement = w;
      to.nvme_paths = {swap_dir};
      to.delayed_update = c.delayed;
      to.undo_copies = r.overlap_optimizer && r.undo_copies;
      to.stash_layers = sizes.stash_layers;
      to.stash_bytes = sizes.stash_bytes;
      for (const int64_t slack : {int64_t{0}, int64_t{-4096}}) {
        {
          auto dev = create_cpu_device(
              {.capacity = size_t(int64_t(o->device.total()) + slack), .threads = 1});
          ASSERT_TRUE(dev.is_ok());
          to.host_capacity = size_t(o->host.total() + uint64_t(1 << 20));
          auto tm = TierManager::create(**dev, **arch, DType::kBF16, DType::kF32, to, act);
          EXPECT_EQ(tm.is_ok(), slack == 0) << what << " device slack " << slack << ": "
                                            << (tm.is_ok() ? "" : tm.status().message());
        }
        // Host: the same at the host budget.
        auto dev2 = create_cpu_device({.capacity = size_t(o->device.total()), .threads = 1});
        ASSERT_TRUE(dev2.is_ok());
        to.host_capacity = size_t(int64_t(o->host.total()) + slack);
        auto tm2 = TierManager::create(**dev2, **arch, DType::kBF16, DType::kF32, to, act);
        EXPECT_EQ(tm2.is_ok(), slack == 0) << what << " host slack " << slack << ": "
                                           << (tm2.is_ok() ? "" : tm2.status().message());
      }
    }
  std::filesystem::remove_all(swap_dir);
}

// A config's placement is the engine's: the named option it equals, else "config" with every
// strata.placement key and the optimizer ratio; an unknown tier is the engine's error.
TEST(Plan, PlacementOfConfigIsTheEnginesParse) {
  auto named = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization":
      {"stage": 3, "offload_param": {"device":
      "cpu"}, "offload_optimizer": {"device": "cpu"}}})",
                            "t");
  ASSERT_TRUE(named.is_ok()) << named.status().message();
  auto p = placement_of_config(*named);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->name, "params-host");
  auto mixed = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization":
      {"stage": 3, "offload_optimizer":
      {"device": "cpu", "ratio": 0.5}}, "strata": {"placement": {"moments": "nvme"}}})",
                            "t");
  ASSERT_TRUE(mixed.is_ok()) << mixed.status().message();
  auto q = placement_of_config(*mixed);
  ASSERT_TRUE(q.is_ok());
  EXPECT_EQ(q->name, "config");
  EXPECT_EQ(q->where.master, Tier::kHost);
  EXPECT_EQ(q->where.moments, Tier::kNvme);
  EXPECT_EQ(q->where.grads, Tier::kHost);
  EXPECT_EQ(q->where.optimizer_ratio, 0.5);
  // The plan evaluates it as one more row; best still chooses among the named ones.
  PlanRequest r = small_request();
  auto rep = make_plan(r);
  ASSERT_TRUE(rep.is_ok());
  const int best = rep->best;
  auto i = add_placement(*rep, *q);
  ASSERT_TRUE(i.is_ok());
  const size_t n = placement_options().size();
  EXPECT_EQ(*i, int(n));
  EXPECT_EQ(rep->options[n].placement.name, "config");
  EXPECT_EQ(rep->best, best);
  auto again = add_placement(*rep, *p);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(rep->options[size_t(*again)].placement.name, "params-host");
  // The config the planner writes for it asks for the same placement.
  auto back = parse_config(plan_config_json(*rep, rep->options[n]), "plan");
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  auto bq = placement_of_config(*back);
  ASSERT_TRUE(bq.is_ok());
  EXPECT_TRUE(bq->where == q->where);
  // all-nvme (gradients on NVMe too) round-trips through the config it writes.
  for (size_t k = 0; k < n; ++k) {
    if (rep->options[k].placement.name != "all-nvme") continue;
    auto nv = parse_config(plan_config_json(*rep, rep->options[k]), "plan");
    ASSERT_TRUE(nv.is_ok()) << nv.status().message();
    auto pn = placement_of_config(*nv);
    ASSERT_TRUE(pn.is_ok());
    EXPECT_EQ(pn->name, "all-nvme");
    EXPECT_EQ(pn->where.grads, Tier::kNvme);
  }
}

// A config that leaves strata.placement.grads unset gets the engine's default: with params and
// the optimizer on NVMe and a host budget that cannot hold the whole model's fp32 gradients,
// the gradients go to NVMe (the all-nvme row, which fits), as TierManager::create puts them;
// with strata.placement.grads = host the config asks for exactly that, which does not fit.
TEST(Plan, ConfigWithoutGradsPlacementGetsTheEnginesDefault) {
  const std::string base = R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
      "model": {"n_layer": 8, "n_head": 8, "n_embd": 1024, "vocab_size": 256, "context": 64},
      "device": {"backend": "cpu", "memory_limit": "512MiB"},
      "strata": {"host_memory_limit": "256MiB" GRADS}})";
  auto plan_for = [&](const std::string& grads) -> std::pair<std::string, bool> {
    std::string text = base;
    text.replace(text.find("GRADS"), 5, grads);
    auto cfg = parse_config(text, "t");
    EXPECT_TRUE(cfg.is_ok()) << cfg.status().message();
    Hardware hw;
    hw.gpu_mem = cfg->device.memory_limit;
    hw.host_mem = cfg->strata.host_memory_limit;
    hw.nvme_paths = {"/tmp"};
    PlanRequest r = request_from_config(*cfg, hw, default_profile(true));
    auto rep = make_plan(r);
    EXPECT_TRUE(rep.is_ok()) << rep.status().message();
    auto p = placement_of_config(*cfg);
    EXPECT_TRUE(p.is_ok());
    EXPECT_EQ(p->grads_auto, grads.empty());
    auto i = add_placement(*rep, *p);
    EXPECT_TRUE(i.is_ok()) << i.status().message();
    const PlanOption& o = rep->options[size_t(*i)];
    return {o.placement.name, o.fits};
  };
  // 100M parameters: 400 MB of fp32 gradients against a 256 MiB budget.
  const auto unset = plan_for("");
  EXPECT_EQ(unset.first, "all-nvme");
  EXPECT_TRUE(unset.second);
  const auto host = plan_for(R"(, "placement": {"grads": "host"})");
  EXPECT_EQ(host.first, "params-nvme+opt-nvme");
  EXPECT_FALSE(host.second);
  // The same config with a budget that holds the gradients keeps them on the host.
  std::string roomy = base;
  roomy.replace(roomy.find("256MiB"), 6, "64GiB");
  roomy.replace(roomy.find("GRADS"), 5, "");
  auto cfg = parse_config(roomy, "t");
  ASSERT_TRUE(cfg.is_ok());
  Hardware hw;
  hw.gpu_mem = cfg->device.memory_limit;
  hw.host_mem = cfg->strata.host_memory_limit;
  auto rep = make_plan(request_from_config(*cfg, hw, default_profile(true)));
  ASSERT_TRUE(rep.is_ok());
  auto i = add_placement(*rep, *placement_of_config(*cfg));
  ASSERT_TRUE(i.is_ok());
  EXPECT_EQ(rep->options[size_t(*i)].placement.name, "params-nvme+opt-nvme");
}

}  // namespace
}  // namespace strata
