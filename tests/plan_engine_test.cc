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
#include "src/train/trainer.h"
#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/log.h"
#include "tests/plan_util.h"
#include "tests/schedule_fuzz.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata {
namespace {

using test::small_request;
PlacementOption find(const std::string& name) { return test::find_placement(name); }

// A communicator that only says its shape: rank `rank` of `size` on one node, host buffers. What
// TierManager::create reads of its communicators; every collective fails.
class ShapeComm final : public Communicator {
 public:
  ShapeComm(int rank, int size) : Communicator(300.0), rank_(rank), size_(size) {}
  const char* backend() const override { return "shape"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return rank_; }
  int node() const override { return 0; }
  BufferSpace buffer_space() const override { return BufferSpace::kHost; }
  Status synchronize(Stream&) override { return unavailable("shape-only communicator"); }
  Status health() const override { return Status::ok(); }
  double busy_seconds() override { return 0; }
  uint64_t bytes_sent() const override { return 0; }
  Result<std::unique_ptr<Communicator>> split(int, int) override {
    return unavailable("shape-only communicator");
  }
  Status enqueue(Stream&, const Op&) override { return unavailable("shape-only communicator"); }
  Status run_blocking(const Op&) override { return unavailable("shape-only communicator"); }

 private:
  int rank_, size_;
};

// The planner is the engine's preflight, through the config path: the planner writes the config
// of a placement (plan_config_json); from it the planner plans (request_from_config,
// placement_of_config, add_placement: the engine's TierOptions::from_config with each rank's
// share of the host, the engine's default for unset gradients) and the engine builds
// (TierOptions::from_config, parse_placement, TierManager::create). For every placement the
// planner names and strata.placement-style ones, every activation mode, with and without the
// delayed update, on 1 and 2 ranks: at the planner's device and host needs both say it fits,
// and a page less on either tier both say the same (no fit, or — a host budget too small for
// the gradients with the optimizer on NVMe — both move them to NVMe and fit).
TEST(Plan, PlannerIsThePreflightThroughTheConfigPath) {
  set_log_level(LogLevel::kError);
  char tmpl[] = "/tmp/strata_plan_preflight_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string swap_dir = tmpl;
  struct Case {
    PlacementOption option;
    bool tied = true;
  };
  std::vector<Case> cases;
  for (const auto& p : placement_options()) cases.push_back({p});
  using T = Tier;
  // strata.placement variants: master on the host with moments on NVMe; gradients on the device
  // with the optimizer on the host; half the optimizer state kept on the device; an untied head.
  cases.push_back({{"config", {T::kDevice, T::kHost, T::kNvme, T::kHost, 1.0}}});
  cases.push_back({{"config", {T::kHost, T::kHost, T::kHost, T::kDevice, 1.0}}});
  cases.push_back({{"config", {T::kDevice, T::kHost, T::kHost, T::kHost, 0.5}}});
  cases.push_back({{"config", {T::kNvme, T::kNvme, T::kNvme, T::kHost, 0.5}}});
  cases.push_back({find("params-host"), /*tied=*/false});
  cases.push_back({find("opt-nvme"), /*tied=*/false});
  int checked = 0;
  for (const int world : {1, 2})
    for (const bool delayed : {false, true})
      for (const Case& c : cases)
        for (const ActivationMode mode :
             {ActivationMode::kKeep, ActivationMode::kRecompute, ActivationMode::kOffload}) {
          const Placement& w = c.option.where;
          // Gradients on NVMe run on one rank without the delayed update (the engine refuses).
          if (w.grads == T::kNvme && (world > 1 || delayed)) continue;
          const std::string what = fmt::format(
              "{} (params {} master {} moments {} grads {} ratio {}{}{}) {}, {} rank(s)",
              c.option.name, tier_name(w.params), tier_name(w.master), tier_name(w.moments),
              tier_name(w.grads), w.optimizer_ratio, c.tied ? "" : ", untied",
              delayed ? ", delayed update" : "", activation_mode_name(mode), world);
          // The config the planner writes for this placement.
          PlanReport written;
          written.request = small_request();
          written.request.set_model(gpt_model("t", 2, 64, 2, 100, 32, c.tied));
          written.request.config.data.seq_len = 32;
          written.request.config.train_micro_batch_size_per_gpu = 2;
          written.request.config.strata.activations = activation_mode_name(mode);
          written.request.config.strata.delayed_update = delayed;
          written.request.hw.gpus = world;
          written.request.hw.nvme_paths = {swap_dir};
          PlanOption as_option;
          as_option.placement = c.option;
          auto cfg = parse_config(plan_config_json(written, as_option), "plan", {}, world);
          ASSERT_TRUE(cfg.is_ok()) << what << ": " << cfg.status().message();
          auto arch = create_architecture(cfg->model);
          ASSERT_TRUE(arch.is_ok());
          const ActivationSizes acts = (*arch)->activation_plan(2, 32, DType::kBF16, mode);

          // The planner's verdict and needs (per node) on a machine of these capacities.
          auto plan = [&](uint64_t gpu_mem, uint64_t host_mem) -> PlanOption {
            Hardware hw;
            hw.gpus = world;
            hw.gpu_mem = gpu_mem;
            hw.host_mem = host_mem;
            hw.nvme_paths = {swap_dir};
            PlanReport rep;
            rep.request = request_from_config(*cfg, hw, default_profile(true));
            auto p = placement_of_config(*cfg);
            EXPECT_TRUE(p.is_ok()) << what;
            auto i = add_placement(rep, *p);
            EXPECT_TRUE(i.is_ok()) << what << ": " << i.status().message();
            return i.is_ok() ? rep.options[size_t(*i)] : PlanOption{};
          };
          // The engine's verdict: rank 0 of `world` on a device of `device_cap` with a host
          // budget of `host_cap` per rank.
          // `shortfall` receives which tiers the preflight found short.
          auto build = [&](size_t device_cap, size_t host_cap, TierShortfall* shortfall) -> Status {
            auto dev = create_cpu_device({.capacity = device_cap, .threads = 1});
            if (!dev.is_ok()) return dev.status();
            Config ec = *cfg;
            ec.strata.host_memory_limit = host_cap;
            TierOptions to = TierOptions::from_config(ec, DType::kBF16);
            auto where = parse_placement(ec);
            if (!where.is_ok()) return where.status();
            to.placement = *where;
            to.stash_layers = acts.stash_layers;
            to.stash_bytes = acts.stash_bytes;
            ShapeComm pc(0, world), gc(0, world);
            if (world > 1) {
              to.param_comm = &pc;
              to.grad_comm = &gc;
            }
            auto tm = TierManager::create(**dev, **arch, DType::kBF16, DType::kF32, to, acts.bytes,
                                          shortfall);
            return tm.is_ok() ? Status::ok() : tm.status();
          };

          const PlanOption roomy = plan(uint64_t{1} << 30, uint64_t{1} << 32);
          ASSERT_TRUE(roomy.fits) << what;
          EXPECT_EQ(roomy.device.activations, acts.bytes) << what;
          EXPECT_EQ(roomy.host.activations, acts.host_bytes * uint64_t(world)) << what;
          const uint64_t dev_need = roomy.device.total();
          const uint64_t host_need = roomy.host.total() / uint64_t(world);  // per rank
          for (const int64_t slack : {int64_t{0}, int64_t{-4096}}) {
            const uint64_t d = uint64_t(int64_t(dev_need) + slack);
            const uint64_t h = uint64_t(int64_t(host_need) + slack);
            // Device short (the host with room).
            const PlanOption pd = plan(d, (host_need + (1 << 20)) * uint64_t(world));
            TierShortfall sd, sh;
            const Status ed = build(size_t(d), size_t(host_need + (1 << 20)), &sd);
            EXPECT_EQ(pd.fits, ed.is_ok())
                << what << " device slack " << slack << ": " << ed.message()
                << " | planner: " << (pd.why.empty() ? std::string("fits") : pd.why[0]);
            EXPECT_EQ(ed.is_ok(), slack == 0) << what << " device slack " << slack;
            // The preflight says which tier was short (the trainer's advice reads it).
            EXPECT_EQ(sd.device, slack != 0) << what;
            EXPECT_FALSE(sd.host) << what;
            // Host short (the device at its need).
            const PlanOption ph = plan(dev_need, h * uint64_t(world));
            const Status eh = build(size_t(dev_need), size_t(h), &sh);
            EXPECT_EQ(ph.fits, eh.is_ok())
                << what << " host slack " << slack << ": " << eh.message()
                << " | planner: " << (ph.why.empty() ? std::string("fits") : ph.why[0]);
            if (slack == 0) {
              EXPECT_TRUE(eh.is_ok()) << what << ": " << eh.message();
            }
            EXPECT_EQ(sh.host, !eh.is_ok()) << what;
            EXPECT_FALSE(sh.device) << what;
            ++checked;
          }
        }
  EXPECT_GT(checked, 100);
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

// The planner's bytes per step (NVMe read + written, host<->device) for the config's placement.
std::pair<double, double> minimum_bytes(const Config& cfg, const std::string& swap) {
  Hardware hw;
  hw.gpu_mem = cfg.device.memory_limit;
  hw.host_mem = cfg.strata.host_memory_limit > 0 ? cfg.strata.host_memory_limit : 64ull << 30;
  hw.nvme_paths = {swap};
  auto rep = make_plan(request_from_config(cfg, hw, default_profile(true)));
  EXPECT_TRUE(rep.is_ok()) << rep.status().to_string();
  if (!rep.is_ok()) return {0, 0};
  auto p = placement_of_config(cfg);
  EXPECT_TRUE(p.is_ok());
  if (!p.is_ok()) return {0, 0};
  auto i = add_placement(*rep, *p);
  EXPECT_TRUE(i.is_ok());
  if (!i.is_ok()) return {0, 0};
  const PlanOption& o = rep->options[size_t(*i)];
  return {double(o.nvme_read_bytes + o.nvme_write_bytes), double(o.link_bytes)};
}

// Each step after the first two of a 6-step run moves at least 99% of the minimum bytes (NVMe,
// host<->device) and at most `above` times them.
void expect_steps_near(const TrainResult& r, double nvme_min, double link_min, double above) {
  ASSERT_EQ(r.step_device_bytes.size(), r.step_nvme_bytes.size());
  for (size_t s = 2; s < r.step_nvme_bytes.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s + 1));
    const double nvme = double(r.step_nvme_bytes[s]), link = double(r.step_device_bytes[s]);
    EXPECT_LE(nvme, above * nvme_min);
    EXPECT_GE(nvme, 0.99 * nvme_min);
    EXPECT_LE(link, above * link_min);
    EXPECT_GE(link, 0.99 * link_min);
  }
}

// tiny-cpu in `dir` for 6 steps with `overrides` (no prefetch: which fetches a prefetch saves
// depends on timing; no final checkpoint): each step after the first two moves at least 99% of
// the placement's minimum bytes (NVMe, host<->device) and at most `above` times them.
void expect_run_at_minimum(const std::string& dir, const std::vector<std::string>& overrides,
                           double above) {
  std::vector<std::string> ov = {"train.steps=6", "scheduler.params.warmup_num_steps=1",
                                 "train.final_checkpoint=false",
                                 "zero_optimization.stage3_prefetch_bucket_size=0"};
  ov.insert(ov.end(), overrides.begin(), overrides.end());
  const Config cfg = test::tiny_cpu(dir, ov);
  const TrainResult r = test::must_train(cfg);
  ASSERT_EQ(r.step_nvme_bytes.size(), 6u);
  ASSERT_EQ(r.step_device_bytes.size(), 6u);
  const auto [nvme_min, link_min] = minimum_bytes(cfg, dir + "/swap");
  ASSERT_GT(nvme_min, 0);
  ASSERT_GT(link_min, 0);
  expect_steps_near(r, nvme_min, link_min, above);
}

// Bytes per step at the placement's minimum: tiny-cpu with parameters, optimizer state and
// gradients on NVMe on a device (10 MiB) that holds every parameter only while the gradient
// buffers of backward drain to NVMe on time. An allocation that needs their room waits for the
// drains instead of evicting a cached parameter copy (fetched again from NVMe later: +9.7%
// NVMe bytes before). Every step after the first two moves the planner's bytes for the
// placement, NVMe and host<->device, on the plain schedule, deferred, after backward and under
// backward (clipping on but never biting). With
// the gradient accumulators in host memory instead, the first of the 4 micro-batches writes them
// in place (GradBuckets::in_place): 3 of 4 micro-batches' gradients cross, planner and run alike.
TEST(Plan, StepBytesAreThePlacementsMinimum) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("plan", "bytes");
  std::filesystem::create_directories(dir + "/swap");
  const std::string swap = "\"" + dir + "/swap\"";
  for (const char* grads : {"strata.placement.grads=\"nvme\"", "strata.placement.grads=\"host\""}) {
    for (const char* schedule :
         {"strata.optimizer.overlap=false", "strata.optimizer.defer=\"always\"",
          "strata.optimizer.defer=\"never\"",
          // Clipping that never bites: every step after the first speculated under backward
          // with undo state, its sub-groups kept as a pass keeps them.
          "gradient_clipping=1000"}) {
      SCOPED_TRACE(std::string(grads) + ", " + schedule);
      // Each step after the first two, within 1%. NVMe bytes are counted as they are asked for:
      // counted as they landed, a write behind one step's end fell in the next (on a busy machine
      // one step showed -5% and the next +5%; CI saw steps 3-6 together at -2.6%).
      expect_run_at_minimum(dir,
                            {"zero_optimization.offload_param.device=\"nvme\"",
                             "zero_optimization.offload_param.nvme_path=" + swap,
                             "zero_optimization.offload_optimizer.nvme_path=" + swap, grads,
                             "device.memory_limit=\"10MiB\"", schedule},
                            1.01);
    }
  }
  std::filesystem::remove_all(dir);
}

// A device that caches only part of the parameters (tiny-cpu's 1.6 MiB of bf16 parameters on NVMe,
// an 8 MiB device of which activations and gradient buffers take most): the planner's room for
// the cache counts the parameters in use, which are cached copies themselves. Counted beside the
// room, the minimum was 10-14% above what the run moves (and lora-hostmem-350m's 93% above);
// the cache model (a share of every pass cached) stays a few percent under the
// engine's Belady eviction here. Each step after the first two: at or above the minimum, within
// 5% of it.
TEST(Plan, StepBytesOnADeviceThatCachesPartOfTheParameters) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("plan", "bytes_tight");
  std::filesystem::create_directories(dir + "/swap");
  const std::string swap = "\"" + dir + "/swap\"";
  expect_run_at_minimum(
      dir,
      {"zero_optimization.offload_param.device=\"nvme\"",
       "zero_optimization.offload_param.nvme_path=" + swap,
       "zero_optimization.offload_optimizer.nvme_path=" + swap, "device.memory_limit=\"8MiB\""},
      1.05);
  std::filesystem::remove_all(dir);
}

// A cache with room for every parameter that still releases the early blocks' copies between
// their forward and their backward: stage3_max_reuse_distance under the bytes of the other
// parameters in between (tiny-cpu's parameters and optimizer state on NVMe, a 16 MiB device).
// The planner counts those fetches, over the link and from NVMe (as it does the H200's ~1B
// Llama's, where they were 14.7% of the step's host<->device bytes); without them its minimum
// is under what the run moves. Each step after the first two: within 1%.
TEST(Plan, StepBytesWithCopiesReleasedByTheReuseDistance) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("plan", "bytes_reuse");
  std::filesystem::create_directories(dir + "/swap");
  const std::string swap = "\"" + dir + "/swap\"";
  for (const char* reuse : {"zero_optimization.stage3_max_reuse_distance=100000",
                            "zero_optimization.stage3_max_reuse_distance=300000"}) {
    SCOPED_TRACE(reuse);
    expect_run_at_minimum(dir,
                          {"zero_optimization.offload_param.device=\"nvme\"",
                           "zero_optimization.offload_param.nvme_path=" + swap,
                           "zero_optimization.offload_optimizer.nvme_path=" + swap,
                           "device.memory_limit=\"16MiB\"", reuse},
                          1.01);
  }
  std::filesystem::remove_all(dir);
}

// Sub-groups that split the modules unevenly (zero_optimization.sub_group_size 30000 over a small
// Llama's modules: whole sub-groups and a short last one each): the state a pass keeps for the
// next step is the first sub-groups of each module in order, whole. The planner had given each
// kept sub-group a share of its module's state, so the short last ones' deficit fell on the
// kept ones and the minimum to read was too large (found by PlanBytesExplore: the run moved
// 3.1% less than the "minimum"). Each step after the first two: within 1% of the minimum;
// deferred and after backward.
TEST(Plan, StepBytesWithUnevenSubGroups) {
  set_log_level(LogLevel::kWarn);
  const std::string dir = test::temp_dir("plan", "bytes_subgroups");
  std::filesystem::create_directories(dir + "/swap");
  const std::string swap = "\"" + dir + "/swap\"";
  for (const char* defer :
       {"strata.optimizer.defer=\"always\"", "strata.optimizer.defer=\"never\""}) {
    SCOPED_TRACE(defer);
    expect_run_at_minimum(
        dir,
        {"model.type=\"llama\"", "model.n_layer=3", "model.num_key_value_heads=2",
         "model.intermediate_size=192", "train_micro_batch_size_per_gpu=1",
         "gradient_accumulation_steps=1", "train_batch_size=1", "gradient_clipping=0.01",
         "strata.activations=\"offload\"", "zero_optimization.offload_param.device=\"none\"",
         "zero_optimization.offload_optimizer.nvme_path=" + swap,
         "zero_optimization.sub_group_size=30000",
         "zero_optimization.offload_optimizer.buffer_count=2", defer},
        1.01);
  }
  std::filesystem::remove_all(dir);
}

// Bytes per step against the planner's minimum on the schedule fuzz's configurations
// (tests/schedule_fuzz.h; the prefetch off: which fetches it saves depends on timing): prints
// each case's median NVMe and host<->device bytes per step (steps 3 on, steps an fp16 overflow
// skipped and the two after left out) over the placement's minimum, and fails where either is
// more than 1% and 128 KiB from it (nothing read or written twice; the planner's count exact).
// On demand:
// STRATA_BYTES_FUZZ_CASES=N [STRATA_BYTES_FUZZ_SEED=S].
TEST(PlanBytesExplore, BytesPerStepAgainstTheMinimum) {
  const char* n = std::getenv("STRATA_BYTES_FUZZ_CASES");
  if (!n) GTEST_SKIP() << "set STRATA_BYTES_FUZZ_CASES (and STRATA_BYTES_FUZZ_SEED) to run";
  set_log_level(LogLevel::kError);
  const char* s = std::getenv("STRATA_BYTES_FUZZ_SEED");
  int ran = 0;
  for (uint64_t seed = s ? std::strtoull(s, nullptr, 10) : 1000000; ran < std::atoi(n); ++seed) {
    const std::string dir = test::temp_dir("plan_bytes_fuzz", std::to_string(seed));
    test::FuzzCase c = test::draw_case(seed, dir, /*across=*/false);
    std::vector<std::string> ov = c.shared;
    ov.insert(ov.end(), c.schedule.begin(), c.schedule.end());
    ov.push_back("zero_optimization.stage3_prefetch_bucket_size=0");
    ov.push_back("train.final_checkpoint=false");
    auto cfg = parse_config(
        test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"), "tiny-cpu",
        [&] {
          std::vector<std::string> all = {"train.checkpoint_dir=\"" + dir + "/ckpt\"",
                                          "train.eval_interval=0", "steps_per_print=1000"};
          all.insert(all.end(), ov.begin(), ov.end());
          return all;
        }());
    TrainOptions quiet;
    quiet.progress = false;
    auto r = cfg.is_ok() ? train(*cfg, quiet) : Result<TrainResult>(cfg.status());
    if (!r.is_ok()) {
      std::filesystem::remove_all(dir);
      continue;
    }
    ++ran;
    const auto [nvme_min, link_min] = minimum_bytes(*cfg, dir + "/swap");
    // A step after a skipped or rolled-back one defers its pass into the next step, whose bytes
    // then carry two passes (so does the step where defer's auto choice turns to stepping after
    // backward): the two after either are left out, and the median needs 5 steps (a shifted
    // pass moves one of them). A rollback's redo reads its state again: the speculation's cost.
    std::vector<double> nv, ln;
    for (size_t i = 2; i < r->step_nvme_bytes.size(); ++i) {
      bool near_skip = false;
      for (size_t j = i >= 2 ? i - 2 : 0; j <= i; ++j) {
        near_skip |= j < r->step_skipped.size() && r->step_skipped[j];
        near_skip |= j < r->optimizer_schedule.size() && r->optimizer_schedule[j] == 2;
      }
      if (near_skip) continue;
      nv.push_back(double(r->step_nvme_bytes[i]));
      ln.push_back(double(r->step_device_bytes[i]));
    }
    auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      // Even: the middle two's mean (a write landing every other step alternates the bytes).
      return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    };
    const double nvr = nvme_min > 0 ? median(nv) / nvme_min : (median(nv) == 0 ? 1.0 : 99.0);
    const double lnr = link_min > 0 ? median(ln) / link_min : (median(ln) == 0 ? 1.0 : 99.0);
    // Off: more than 1% and 128 KiB from the minimum (a median of so few steps can still hold a
    // pass shifted in from the step before, where defer's auto choice turned). Each extent on
    // NVMe moves in whole 4 KiB blocks (O_DIRECT): the planner counts them (leaving them out
    // had missed 0-82 KiB a step on these models).
    auto apart = [](double got, double want) {
      return std::fabs(got - want) > std::max(0.01 * want, 131072.0);
    };
    const bool off = nv.size() >= 5 && (apart(median(nv), nvme_min) || apart(median(ln), link_min));
    std::printf(
        "seed %llu: nvme %.3f (%.1f KiB, minimum %.1f) link %.3f (%.1f KiB, minimum %.1f), "
        "median of %zu steps%s\n",
        (unsigned long long)seed, nvr, median(nv) / 1024, nvme_min / 1024, lnr, median(ln) / 1024,
        link_min / 1024, nv.size(),
        off             ? "  <-- off"
        : nv.size() < 5 ? " (too few to judge)"
                        : "");
    if (off) ADD_FAILURE() << "seed " << seed << "\n" << c.describe();
    if (off && std::getenv("STRATA_BYTES_FUZZ_VERBOSE")) {
      for (size_t i = 0; i < r->step_nvme_bytes.size(); ++i) {
        std::printf("  step %zu: nvme %.3f MiB link %.3f MiB%s schedule %d\n", i + 1,
                    double(r->step_nvme_bytes[i]) / 1048576.0,
                    double(r->step_device_bytes[i]) / 1048576.0,
                    i < r->step_skipped.size() && r->step_skipped[i] ? " skipped" : "",
                    i < r->optimizer_schedule.size() ? int(r->optimizer_schedule[i]) : -1);
      }
    }
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace strata
