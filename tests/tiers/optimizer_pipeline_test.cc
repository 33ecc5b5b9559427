// The optimizer pipeline (src/tiers/optimizer_pipeline.h) alone, over Homes and a device cache
// on the CPU device: a pass over modules whose state lives in the host tier or on NVMe, in one
// sub-group or several, gives the fused optimizer's bits over each whole module (the optimizer
// is elementwise); slots kept from one pass serve the next; the order modules are stepped in;
// a failed read names the module and sub-group; the new parameters' staging pieces go back to
// the host tier once the copies from them ran, held by events and never by host functions.
#include "src/tiers/optimizer_pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "src/tiers/device_optimizer.h"
#include "strata/device_wrapper.h"
#include "strata/storage_faults.h"
#include "tests/tiers/state_rig.h"

namespace strata {
namespace {

using test::ModuleState;
using test::StateRig;

OptimizerHyper hyper(int64_t step) { return test::step_hyper(step, 0.1f); }

struct Case {
  const char* name;
  Placement placement;
  uint64_t sub_group;
};

const Case kCases[] = {
    {"host state, one sub-group", {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 0},
    {"host state, sub-groups", {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 2048},
    {"nvme state, one sub-group", {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 0},
    {"nvme state, sub-groups", {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048},
    {"nvme master, host moments", {Tier::kHost, Tier::kNvme, Tier::kHost, Tier::kHost, 1.0}, 2048},
    {"nvme state and parameters", {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048},
    {"device parameters", {Tier::kDevice, Tier::kHost, Tier::kNvme, Tier::kHost, 1.0}, 2048},
    // Master weights, moments and gradients in device memory: the device's optimizer kernel
    // (device_optimizer.h), which on the CPU backend gives the host path's bits.
    {"device state, host parameters",
     {Tier::kHost, Tier::kDevice, Tier::kDevice, Tier::kDevice, 1.0},
     2048},
    {"device state and parameters",
     {Tier::kDevice, Tier::kDevice, Tier::kDevice, Tier::kDevice, 1.0},
     0},
};

// Two steps of a pass over three modules, in an order of their own: every module's master
// weights, moments and new parameters are the fused optimizer's over the whole module.
TEST(OptimizerPipeline, PassGivesTheFusedOptimizersBitsOnEveryPlacement) {
  const std::vector<size_t> numel = {5000, 3000, 9000};
  int c = 0;
  for (const Case& k : kCases) {
    SCOPED_TRACE(k.name);
    StateRig r("pass" + std::to_string(c++), numel, k.placement, k.sub_group);
    EXPECT_EQ(steps_on_device(r.homes->module(0)), k.placement.master == Tier::kDevice);
    std::vector<ModuleState> want;
    for (int m = 0; m < 3; ++m) {
      want.push_back(test::random_state(numel[size_t(m)], 100 + m));
      r.set_state(m, want.back());
    }
    for (int step = 1; step <= 2; ++step) {
      ASSERT_TRUE(r.pipeline->run({2, 0, 1}, hyper(step), 0.5f, nullptr).is_ok());
      ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
      for (int m = 0; m < 3; ++m) test::reference_step(want[size_t(m)], hyper(step), 0.5f);
    }
    for (int m = 0; m < 3; ++m) {
      EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "module " << m;
    }
    EXPECT_TRUE(r.errors.take().is_ok());
  }
}

// A pass that keeps its staging (Pass::keep, within the read-ahead's room) leaves the kept
// sub-groups prepared; the next pass steps them without reading and gives the same bits.
TEST(OptimizerPipeline, KeptSlotsServeTheNextPass) {
  const std::vector<size_t> numel = {5000, 3000};
  StateRig r("kept", numel, {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048);
  r.pipeline->set_read_ahead(2);
  std::vector<ModuleState> want;
  for (int m = 0; m < 2; ++m) {
    want.push_back(test::random_state(numel[size_t(m)], 200 + m));
    r.set_state(m, want.back());
  }
  ASSERT_TRUE(r.pipeline->run({0, 1}, hyper(1), 1.0f, nullptr, /*keep=*/true).is_ok());
  EXPECT_EQ(r.pipeline->kept_count(), 2u);  // the first two sub-groups of NVMe state
  EXPECT_TRUE(r.pipeline->prepared(0, 0));
  EXPECT_TRUE(r.pipeline->prepared(0, 1));
  EXPECT_FALSE(r.pipeline->prepared(1, 0));
  ASSERT_TRUE(r.pipeline->run({1, 0}, hyper(2), 1.0f, nullptr, /*keep=*/true).is_ok());
  ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
  r.pipeline->drop_kept();
  EXPECT_EQ(r.pipeline->kept_count(), 0u);
  for (int m = 0; m < 2; ++m) {
    test::reference_step(want[size_t(m)], hyper(1), 1.0f);
    test::reference_step(want[size_t(m)], hyper(2), 1.0f);
    EXPECT_TRUE(test::same_bits(r.state(m), want[size_t(m)])) << "module " << m;
  }
}

// Modules in the order their gradients became final, then the rest in index order; skipped
// and duplicate ones left out; end_step remembers the order and starts afresh.
TEST(OptimizerPipeline, StepOrder) {
  StateRig r("order", {100, 100, 100, 100},
             {Tier::kHost, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 0);
  EXPECT_EQ(r.pipeline->step_order({false, false, false, false}), (std::vector<int>{0, 1, 2, 3}));
  r.pipeline->grads_final(2);
  r.pipeline->grads_final(0);
  r.pipeline->grads_final(2);
  EXPECT_EQ(r.pipeline->step_order({false, false, false, false}), (std::vector<int>{2, 0, 1, 3}));
  EXPECT_EQ(r.pipeline->step_order({true, false, false, true}), (std::vector<int>{2, 1}));
  EXPECT_TRUE(r.pipeline->last_order().empty());
  r.pipeline->end_step();
  EXPECT_EQ(r.pipeline->last_order(), (std::vector<int>{2, 0, 2}));
  EXPECT_EQ(r.pipeline->step_order({false, false, false, false}), (std::vector<int>{0, 1, 2, 3}));
}

// prepared_first: the modules with state read ahead first, each part in its order; preparing
// reads the state and drain_prepared drops it.
TEST(OptimizerPipeline, PreparedModulesFirst) {
  StateRig r("prepared", {5000, 3000, 3000},
             {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048);
  auto p = r.pipeline->prepare(2, 1, false);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(*p);
  EXPECT_TRUE(r.pipeline->prepared(2, 1));
  EXPECT_EQ(r.pipeline->prepared_count(), 1u);
  EXPECT_EQ(r.pipeline->prepared_first({0, 1, 2}), (std::vector<int>{2, 0, 1}));
  r.pipeline->drain_prepared();
  EXPECT_EQ(r.pipeline->prepared_count(), 0u);
  EXPECT_EQ(r.pipeline->prepared_first({0, 1, 2}), (std::vector<int>{0, 1, 2}));
}

// An EIO on one of the pass's reads fails the pass, naming the module, the sub-group and the
// swap file.
TEST(OptimizerPipeline, AFailedReadNamesTheModuleAndSubGroup) {
  auto faults = std::make_shared<FaultPlan>();
  faults->fail_nth = 1;
  faults->fail_nth_kind = 1;  // reads
  StateRig r("eio", {5000}, {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost, 1.0}, 2048, false,
             faults);
  r.set_state(0, test::random_state(5000, 1));
  Status s = r.pipeline->run({0}, hyper(1), 1.0f, nullptr);
  ASSERT_FALSE(s.is_ok());
  // Which sub-group's read the disk served first is the I/O worker's timing.
  EXPECT_NE(s.to_string().find("reading m0 optimizer state (sub-group "), std::string::npos)
      << s.to_string();
  EXPECT_NE(s.to_string().find("strata-swap-r0.bin"), std::string::npos) << s.to_string();
  r.pipeline->drain_prepared();
  (void)r.pipeline->retire_writes(0);
}

// A device double that watches what the pipeline asks of the streams: it counts the host
// functions enqueued through it, the synchronizations of the h2d stream and the waits for an
// event, and notes the host tier's use at each copy to the device. With `late`, a copy to the
// device runs only once the host has waited for the device (any synchronize) after enqueueing
// it: until then no piece's copies have run, whatever the threads' timing. `addressable`: what
// it claims of host access.
class CopyWatch final : public DeviceWrapper {
 public:
  CopyWatch(std::unique_ptr<Device> inner, bool addressable, bool late)
      : DeviceWrapper(std::move(inner)), addressable_(addressable), late_(late) {}
  ~CopyWatch() override { open(UINT64_MAX); }  // the wrapped device drains its streams

  const BufferPool* pool = nullptr;  // whose use copy_h2d notes
  std::atomic<int> host_fns{0}, h2d_syncs{0}, event_waits{0};
  size_t most_in_use = 0;  // the pool's use at the copies to the device since reset()

  void reset() {
    host_fns = h2d_syncs = event_waits = 0;
    most_in_use = 0;
  }

  bool host_addressable() const override { return addressable_; }
  void copy_h2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    if (pool) most_in_use = std::max(most_in_use, pool->in_use());
    if (late_) {
      uint64_t t = 0;
      {
        std::lock_guard<std::mutex> l(gate_->mu);
        t = ++gate_->enqueued;
      }
      wrapped().host_fn(s, [g = gate_, t] {
        std::unique_lock<std::mutex> l(g->mu);
        g->cv.wait(l, [&] { return g->opened >= t; });
      });
    }
    wrapped().copy_h2d(s, dst, src, bytes);
  }
  void host_fn(Stream& s, std::function<void()> fn) override {
    ++host_fns;
    wrapped().host_fn(s, std::move(fn));
  }
  Status synchronize(Stream& s) override {
    if (&s == &wrapped().h2d_stream()) ++h2d_syncs;
    open();
    return wrapped().synchronize(s);
  }
  Status synchronize(Event& e) override {
    ++event_waits;
    open();
    return wrapped().synchronize(e);
  }

 private:
  // The copies held back: those enqueued run once `opened` reaches their number.
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t enqueued = 0, opened = 0;
  };
  // Lets the copies enqueued so far run (or all, with `up_to`).
  void open(uint64_t up_to = 0) {
    std::lock_guard<std::mutex> l(gate_->mu);
    gate_->opened = std::max(up_to, gate_->enqueued);
    gate_->cv.notify_all();
  }

  const bool addressable_, late_;
  const std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
};

struct PublishCase {
  const char* name;
  Tier params;     // device: copied to their home; nvme: written, and through to a cached copy
  bool simulated;  // the simulated H200 (not host-addressable), else the CPU backend
  bool addressable, late;  // the double's claim (over the CPU backend) and its late copies
};

const PublishCase kPublishCases[] = {
    {"cpu backend, nvme parameters written through to cached copies", Tier::kNvme, false, true,
     true},
    {"device parameters on a device the host cannot address", Tier::kDevice, false, false, true},
    {"device parameters on the simulated h200", Tier::kDevice, true, false, false},
};

// Each sub-group's new parameters are staged in a piece that the h2d stream copies to the
// device from: at most publish_staging_pieces() of them in the host tier at once, each reused
// only once the copies from it ran (the parameters land intact while the copies run late: at
// the limit the pass waits for the oldest piece's event), with no host function and no
// synchronization of the whole h2d stream; once the stream has run, or finish_copies_up() has
// waited, the host tier is back to its use before the pass.
TEST(OptimizerPipeline, PublishedPiecesGoBackToTheTierOnceTheirCopiesRan) {
  const std::vector<size_t> numel = {5000, 3000, 9000};
  int n = 0;
  for (const PublishCase& c : kPublishCases) {
    SCOPED_TRACE(c.name);
    std::unique_ptr<Device> inner;
    if (c.simulated) {
      auto sim = create_simulated_device({.capacity = 16 << 20, .threads = 1},
                                         simulated_device_preset("h200").value());
      ASSERT_TRUE(sim.is_ok()) << sim.status().to_string();
      inner = std::move(*sim);
    } else {
      inner = test::cpu_device(16 << 20);
    }
    const bool addressable = c.simulated ? false : c.addressable;
    auto watch = std::make_unique<CopyWatch>(std::move(inner), addressable, c.late);
    CopyWatch* w = watch.get();
    StateRig r("publish" + std::to_string(n++), numel,
               {c.params, Tier::kHost, Tier::kHost, Tier::kHost, 1.0}, 2048, false, nullptr,
               std::move(watch));
    Device& dev = *r.dev;
    std::vector<ModuleState> want;
    for (int m = 0; m < 3; ++m) {
      want.push_back(test::random_state(numel[size_t(m)], 300 + m));
      r.set_state(m, want.back());
    }
    // NVMe-homed parameters cached on the device: each step writes them through.
    std::vector<const void*> copies;
    if (c.params == Tier::kNvme) {
      r.cache->begin_phase("train");
      for (int m = 0; m < 3; ++m) {
        auto p = r.cache->acquire(m);
        ASSERT_TRUE(p.is_ok()) << p.status().to_string();
        copies.push_back(*p);
        r.cache->release(m);
      }
      r.cache->end_phase();
    }
    r.sync();
    const size_t base = r.homes->pool().in_use();
    const size_t limit = publish_staging_pieces(r.options.buffer_count, c.params == Tier::kNvme);
    w->pool = &r.homes->pool();
    w->reset();
    for (int step = 1; step <= 2; ++step) {
      ASSERT_TRUE(r.pipeline->run({2, 0, 1}, hyper(step), 0.5f, nullptr).is_ok());
      for (int m = 0; m < 3; ++m) test::reference_step(want[size_t(m)], hyper(step), 0.5f);
    }
    EXPECT_EQ(w->host_fns, 0);
    EXPECT_EQ(w->h2d_syncs, 0);
    // At the limit the pipeline waited for the oldest piece's copies, not the whole stream.
    if (c.late && c.params == Tier::kDevice) {
      EXPECT_GT(w->event_waits, 0);
    }
    EXPECT_GT(w->most_in_use, base);
    EXPECT_LE(w->most_in_use - base, limit * piece_bytes(2048, 2));
    EXPECT_LE(r.pipeline->copies_up_held(), limit);

    // The end of the step: once the h2d stream has run, every piece goes back.
    r.pipeline->end_step();
    ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
    ASSERT_TRUE(dev.synchronize(dev.h2d_stream()).is_ok());
    r.pipeline->release_copied();
    EXPECT_EQ(r.pipeline->copies_up_held(), 0u);
    EXPECT_EQ(r.homes->pool().in_use(), base);
    for (int m = 0; m < 3; ++m) {
      const ModuleState got = r.state(m);
      EXPECT_TRUE(test::same_bits(got, want[size_t(m)])) << "module " << m;
      if (!copies.empty()) {
        EXPECT_EQ(std::memcmp(copies[size_t(m)], got.params.data(), got.params.size() * 2), 0)
            << "module " << m << "'s cached copy";
      }
    }

    // A pass whose copies are still held: finish_copies_up() waits for them and returns them.
    ASSERT_TRUE(r.pipeline->run({0, 1, 2}, hyper(3), 0.5f, nullptr).is_ok());
    ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
    ASSERT_TRUE(r.pipeline->finish_copies_up().is_ok());
    EXPECT_EQ(r.pipeline->copies_up_held(), 0u);
    EXPECT_EQ(r.homes->pool().in_use(), base);
    // And one whose copies the pipeline's destructor returns (the host tier checks, when it is
    // destroyed, that every buffer came back).
    ASSERT_TRUE(r.pipeline->run({0, 1, 2}, hyper(4), 0.5f, nullptr).is_ok());
    ASSERT_TRUE(r.pipeline->retire_writes(0).is_ok());
    w->pool = nullptr;
    EXPECT_TRUE(r.errors.take().is_ok());
  }
}

}  // namespace
}  // namespace strata
