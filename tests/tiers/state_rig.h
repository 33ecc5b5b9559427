// What the tests of the optimizer's parts share (tests/tiers/optimizer_pipeline_test.cc,
// delayed_update_test.cc, speculation_test.cc): Homes for hand-made modules on the CPU device
// (master weights and moments in the host tier or on a swap file), the device cache and the
// optimizer pipeline over them, each module's state written and read back whatever its tier,
// and the fused optimizer over a whole module as the reference the pipeline must match bit for
// bit (it is elementwise: the sub-groups change no number).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "src/tiers/optimizer_pipeline.h"
#include "src/tiers/stream_stamps.h"
#include "strata/cpu_optim.h"
#include "strata/device.h"
#include "strata/log.h"
#include "strata/storage_faults.h"
#include "tests/test_util.h"
#include "tests/tiers/tier_rig.h"

namespace strata::test {

// The tier parts' optimizer step `step`: lr 1e-2 and `weight_decay`.
inline OptimizerHyper step_hyper(int64_t step, float weight_decay) {
  OptimizerHyper h;
  h.lr = 1e-2f;
  h.weight_decay = weight_decay;
  h.step = step;
  return h;
}

// One module's optimizer state and parameters, whole, in host vectors.
struct ModuleState {
  std::vector<float> master, m, v, grad;
  std::vector<uint16_t> params;  // bf16
};

struct StateRig : TierParts {
  std::string dir;
  std::unique_ptr<DeviceCache> cache;
  std::unique_ptr<OptimizerPipeline> pipeline;
  std::unique_ptr<StreamStamps> stamps;  // the speculation's timing

  // Modules of `numel` elements; parameters, optimizer state (master weights and moments) and
  // gradients where `placement` puts them (NVMe: a swap file in a fresh directory named
  // `name`); sub-groups of `sub_group` elements (0: one per module); on `device` (null: a CPU
  // device of 16 MiB).
  StateRig(const std::string& name, std::vector<size_t> numel, Placement placement,
           uint64_t sub_group, bool delayed_update = false,
           std::shared_ptr<FaultPlan> faults = nullptr, std::unique_ptr<Device> device = nullptr)
      : dir(temp_dir("strata_state_rig", name)) {
    set_log_level(LogLevel::kError);
    dev = device ? std::move(device) : cpu_device(16 << 20);
    const ModelLayout l = plain_modules(numel);
    options.placement = placement;
    options.storage.backend = "posix";
    options.storage.faults = std::move(faults);
    options.buffer_count = 2;
    options.delayed_update = delayed_update;
    options.optimizer_threads = 1;
    auto plan = module_homes(l, placement, 1, DType::kBF16, DType::kF32, delayed_update, sub_group);
    EXPECT_TRUE(plan.is_ok());
    SwapOptions so;
    so.paths = {dir};
    so.bytes_per_path = 64 << 20;
    // A 32 MiB arena, and 16 MiB of undo room for the optimizer under backward's undo state.
    auto h = Homes::create(*dev, *plan, 0, 1, 32 << 20, options, &so, 16 << 20);
    EXPECT_TRUE(h.is_ok()) << h.status().to_string();
    homes = std::move(*h);
    cache = std::make_unique<DeviceCache>(*homes, options, DType::kBF16, false, counters, errors);
    pipeline = std::make_unique<OptimizerPipeline>(*homes, *cache, options, DType::kBF16,
                                                   DType::kF32, false, counters);
    stamps = std::make_unique<StreamStamps>(*dev);
  }
  ~StateRig() {
    sync();
    pipeline.reset();
    cache->release_all();
    cache.reset();
    homes.reset();
    std::filesystem::remove_all(dir);
  }
  void sync() {
    for (Stream* s : {&dev->compute_stream(), &dev->h2d_stream(), &dev->d2h_stream()})
      EXPECT_TRUE(dev->synchronize(*s).is_ok());
  }

  // Writes `bytes` at `src` to, or reads them from, `h`'s sub-group j (offset `off` bytes into
  // a host-visible home; the sub-group's extent on NVMe).
  void put(const Home& h, size_t j, size_t off, const void* src, size_t bytes) {
    if (h.tier == Tier::kNvme) {
      auto buf = homes->host_buf(h.subs[j].bytes, "test");
      ASSERT_TRUE(buf.is_ok());
      std::memcpy(buf->data(), src, bytes);
      ASSERT_TRUE(homes->io()->wait(homes->io()->write(h.subs[j], buf->data())).is_ok());
    } else {
      std::memcpy(static_cast<char*>(h.ptr()) + off, src, bytes);
    }
  }
  void get(const Home& h, size_t j, size_t off, void* dst, size_t bytes) {
    if (h.tier == Tier::kNvme) {
      auto buf = homes->host_buf(h.subs[j].bytes, "test");
      ASSERT_TRUE(buf.is_ok());
      ASSERT_TRUE(homes->io()->wait(homes->io()->read(h.subs[j], buf->data())).is_ok());
      std::memcpy(dst, buf->data(), bytes);
    } else {
      std::memcpy(dst, static_cast<const char*>(h.ptr()) + off, bytes);
    }
  }

  // Module k's state into its homes: master weights, moments, the gradient accumulator (and
  // the second one, with the delayed update) and the parameters.
  void set_state(int k, const ModuleState& s) {
    Module& mod = homes->module(k);
    for (size_t j = 0; j < mod.sub_groups(); ++j) {
      const size_t a = mod.sub_start(j), len = mod.sub_len(j);
      put(mod.master, j, a * 4, s.master.data() + a, len * 4);
      put(mod.p, j, a * 2, s.params.data() + a, len * 2);
      put(mod.gacc, j, a * 4, s.grad.data() + a, len * 4);
      if (mod.gacc2.bytes) put(mod.gacc2, j, a * 4, s.grad.data() + a, len * 4);
      if (mod.mom.tier == Tier::kNvme) {  // per sub-group: its first moments, then its second
        std::vector<float> mv(s.m.begin() + a, s.m.begin() + a + len);
        mv.insert(mv.end(), s.v.begin() + a, s.v.begin() + a + len);
        put(mod.mom, j, 0, mv.data(), mv.size() * 4);
      } else {  // the whole module's first moments, then its second
        put(mod.mom, j, a * 4, s.m.data() + a, len * 4);
        put(mod.mom, j, (mod.sn + a) * 4, s.v.data() + a, len * 4);
      }
    }
  }
  ModuleState state(int k) {
    sync();
    Module& mod = homes->module(k);
    ModuleState s;
    s.master.resize(mod.sn);
    s.m.resize(mod.sn);
    s.v.resize(mod.sn);
    s.params.resize(mod.sn);
    for (size_t j = 0; j < mod.sub_groups(); ++j) {
      const size_t a = mod.sub_start(j), len = mod.sub_len(j);
      get(mod.master, j, a * 4, s.master.data() + a, len * 4);
      get(mod.p, j, a * 2, s.params.data() + a, len * 2);
      if (mod.mom.tier == Tier::kNvme) {
        std::vector<float> mv(2 * len);
        get(mod.mom, j, 0, mv.data(), mv.size() * 4);
        std::memcpy(s.m.data() + a, mv.data(), len * 4);
        std::memcpy(s.v.data() + a, mv.data() + len, len * 4);
      } else {
        get(mod.mom, j, a * 4, s.m.data() + a, len * 4);
        get(mod.mom, j, (mod.sn + a) * 4, s.v.data() + a, len * 4);
      }
    }
    return s;
  }
  // Changes the gradients (both accumulators) of module k.
  void set_grad(int k, const std::vector<float>& g) {
    Module& mod = homes->module(k);
    for (size_t j = 0; j < mod.sub_groups(); ++j) {
      const size_t a = mod.sub_start(j), len = mod.sub_len(j);
      put(mod.gacc, j, a * 4, g.data() + a, len * 4);
      if (mod.gacc2.bytes) put(mod.gacc2, j, a * 4, g.data() + a, len * 4);
    }
  }
};

// A module's state drawn from `seed`: master weights and gradients ~ N(0, 1), moments from an
// earlier step (v > 0), parameters the master weights in bf16.
inline ModuleState random_state(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  ModuleState s;
  for (size_t i = 0; i < n; ++i) {
    s.master.push_back(d(rng));
    s.m.push_back(0.1f * d(rng));
    s.v.push_back(0.01f + 0.01f * std::abs(d(rng)));
    s.grad.push_back(d(rng));
  }
  s.params.resize(n);
  convert(s.master.data(), DType::kF32, s.params.data(), DType::kBF16, n);
  return s;
}

// The reference: the fused optimizer over the whole module, in place, with new bf16 parameters.
inline void reference_step(ModuleState& s, const OptimizerHyper& h, float grad_mult) {
  ShardState sh;
  sh.n = s.master.size();
  sh.grad = s.grad.data();
  sh.grad_mult = grad_mult;
  sh.master = s.master.data();
  sh.m = s.m.data();
  sh.v = s.v.data();
  sh.lp_out = s.params.data();
  optimizer_step(h, sh, 1);
}

// Whether two states hold the same bits.
inline bool same_bits(const ModuleState& a, const ModuleState& b) {
  auto eq = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  return eq(a.master, b.master) && eq(a.m, b.m) && eq(a.v, b.v) && eq(a.params, b.params);
}

}  // namespace strata::test
