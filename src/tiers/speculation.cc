#include "src/tiers/speculation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "src/tiers/device_optimizer.h"
#include "strata/log.h"

namespace strata {

Speculation::Speculation(Homes& homes, OptimizerPipeline& pipeline, bool shadow_extents,
                         TierCounters& counters, AsyncError& errors)
    : homes_(homes),
      dev_(homes.device()),
      pipeline_(pipeline),
      shadow_extents_(shadow_extents),
      counters_(counters),
      errors_(errors) {}

void Speculation::begin(const OptimizerHyper& hyper, float grad_mult, bool keep_undo,
                        bool step_modules) {
  active_ = true;
  step_modules_ = step_modules;
  undo_ = keep_undo;
  stopped_ = false;
  hyper_ = hyper;
  mult_ = grad_mult;
  ready_.clear();
  stepped_.clear();
  intervals_.clear();
  {
    std::lock_guard<std::mutex> l(bwd_end_mu_);
    bwd_end_ = {};
  }
  // Gradients become final in the order the last step's did (first step: reverse module
  // order, which is backward's); read that order's optimizer state ahead.
  expected_ = pipeline_.last_order();
  if (expected_.empty()) {
    for (int k = int(homes_.modules().size()) - 1; k >= 0; --k) expected_.push_back(k);
  }
  next_prep_ = 0;
  if (homes_.io()) {
    // The last pass's writes have drained behind this step's start: their buffers go back to
    // the host tier before the read-ahead takes its own (else both are held through backward).
    Status ws = pipeline_.retire_writes(SIZE_MAX);
    if (!ws.is_ok()) errors_.set(ws.with_context("the last optimizer pass"));
    // The reads start now, under the forward: on a disk-bound step the earlier the better
    // (measured: bench-25m at batch 1, 580 ms per step vs 734 ms when they started with
    // backward).
    read_ahead();
  }
}

void Speculation::grads_final(int m) {
  if (!active_) return;
  auto done = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*done, dev_.d2h_stream());
  ready_.emplace_back(m, std::move(done));
}

// Starts the reads of the next modules the speculative pass expects, `depth` ahead.
void Speculation::read_ahead() {
  const size_t depth = pipeline_.depth();
  size_t inflight = pipeline_.prepared_count();
  // The optimizer pipeline's staging is reserved for 2 * buffer_count + 1 modules (the memory
  // model): the last pass's writes still draining count against it.
  const size_t writing = pipeline_.modules_writing();
  while (next_prep_ < expected_.size() && inflight < depth && inflight + writing < 2 * depth + 1) {
    const int k = expected_[next_prep_++];
    if (pipeline_.prepared(k) || stepped_.count(k)) continue;
    auto r = pipeline_.prepare(k, /*try_only=*/true);
    if (!r.is_ok() || !*r) break;  // the host tier is busy: read on demand instead
    ++inflight;
  }
}

Status Speculation::step_ready(bool wait_all) {
  if (!active_) return Status::ok();
  if (wait_all) {
    // The time the compute stream finishes the backward: optimizer work after it is not hidden.
    Speculation* self = this;
    dev_.host_fn(dev_.compute_stream(), [self] {
      std::lock_guard<std::mutex> l(self->bwd_end_mu_);
      self->bwd_end_ = TierClock::now();
    });
  }
  const bool io = homes_.io() != nullptr;
  if (io) {
    STRATA_RETURN_IF_ERROR(pipeline_.retire_writes(SIZE_MAX), "the optimizer's writes");
    read_ahead();
  }
  Status st;
  while (!ready_.empty() && st.is_ok()) {
    auto [k, ev] = ready_.front();
    if (!wait_all && !dev_.query(*ev)) break;
    if (stopped_ || !step_modules_) {
      ready_.pop_front();
      continue;
    }
    if (undo_ && !dev_.host_addressable() && steps_on_device(homes_.module(k))) {
      // Its undo state would be a host copy of device memory: stepped after backward instead
      // (on the device that takes milliseconds).
      ready_.pop_front();
      continue;
    }
    const std::string& name = homes_.module(k).name;
    STRATA_RETURN_IF_ERROR(dev_.synchronize(*ev), "waiting for " + name + " gradients");
    ready_.pop_front();
    // The step's gradients may be bad (a failed drain): validate before touching state.
    STRATA_RETURN_IF_ERROR(errors_.take(), "before stepping " + name);
    const auto t0 = TierClock::now();
    OptimizerPipeline::Slot s;
    st = pipeline_.take(k, &s);
    Undo undo;
    if (st.is_ok() && undo_ && !take_undo(k, s, &undo)) {
      // No room for undo state: this and the remaining modules are stepped after backward.
      stopped_ = true;
      pipeline_.put_back(k, std::move(s));
      continue;
    }
    if (st.is_ok()) st = pipeline_.step(k, s, hyper_, mult_);
    if (st.is_ok()) {
      stepped_[k] = std::move(undo);
      counters_.update([](TierCounts& n) { ++n.modules_stepped_under_backward; });
    }
    if (st.is_ok() && io) {
      st = pipeline_.retire_writes(3 * pipeline_.depth());
      read_ahead();
    }
    const auto t1 = TierClock::now();
    intervals_.emplace_back(t0, t1);
    counters_.update([&](TierCounts& n) { n.optimizer_s += seconds_between(t0, t1); });
  }
  return st.with_context("optimizer step under backward");
}

bool Speculation::matches(const OptimizerHyper& hyper, float grad_mult) const {
  return active_ && grad_mult == mult_ && hyper.lr == hyper_.lr && hyper.step == hyper_.step;
}

std::vector<bool> Speculation::stepped_mask() const {
  std::vector<bool> done(homes_.modules().size(), false);
  for (const auto& [k, u] : stepped_) done[size_t(k)] = true;
  return done;
}

// What a rollback of module k's speculative step restores, taken before the step: for state
// homed on NVMe a fresh extent the step is written to, the old one kept as it is on the disk
// (no host memory, no copy; the old extent is freed when the step is kept); for state in host
// or device memory, or when the swap files are full, a host copy. False when there is room
// for neither: nothing is taken.
bool Speculation::take_undo(int k, const OptimizerPipeline::Slot& s, Undo* u) {
  Module& m = homes_.module(k);
  auto one = [&](Home& h, const void* now, SwapExtent* old, bool* shadow,
                 std::shared_ptr<PinnedBuffer>* copy) {
    if (h.tier == Tier::kNvme && shadow_extents_) {
      auto e = homes_.allocate_extent(h.bytes);
      if (e.is_ok()) {
        *old = h.ext;
        h.ext = *e;
        *shadow = true;
        return true;
      }
    }
    auto b = homes_.pool().acquire(h.bytes);
    if (!b.is_ok()) {
      log_debug("tier manager: no room for {}'s undo copy ({}); stepping the rest after backward",
                m.name, b.status().message());
      return false;
    }
    *copy = std::make_shared<PinnedBuffer>(std::move(b).value());
    std::memcpy((*copy)->data(), now, h.bytes);
    return true;
  };
  if (one(m.master, s.master, &u->old_master, &u->master_shadow, &u->master) &&
      one(m.mom, s.mom, &u->old_mom, &u->mom_shadow, &u->mom)) {
    return true;
  }
  drop_shadows(k, u);
  *u = Undo{};
  return false;
}

// Module k's homes go back to the extents its undo kept, and the shadows it was stepped into
// are freed (their writes must have landed).
void Speculation::drop_shadows(int k, Undo* u) {
  Module& m = homes_.module(k);
  for (auto [h, old, shadow] : {std::tuple{&m.master, &u->old_master, &u->master_shadow},
                                std::tuple{&m.mom, &u->old_mom, &u->mom_shadow}}) {
    if (!*shadow) continue;
    homes_.free_extent(h->ext);
    h->ext = *old;
    *shadow = false;
  }
}

Status Speculation::undo(bool redo, const OptimizerHyper& hyper, float grad_mult) {
  counters_.update([](TierCounts& n) { ++n.rollbacks; });
  for (auto& [k, u] : stepped_) {
    if (!u.kept()) {
      return invalid_argument(fmt::format(
          "the optimizer stepped {} under backward without undo state (bf16, "
          "gradient_clipping 0) but the step must be {}: set strata.optimizer.overlap: false "
          "to train through non-finite bf16 gradients",
          homes_.module(k).name, redo ? "redone" : "skipped (non-finite gradients)"));
    }
  }
  // The device's optimizer steps (device-resident state) must have run before it is restored.
  STRATA_RETURN_IF_ERROR(dev_.synchronize(dev_.compute_stream()), "before restoring the state");
  // The speculative writes must land before their shadows are freed and before the restored
  // state's writes go to the same extents.
  if (homes_.io()) {
    STRATA_RETURN_IF_ERROR(pipeline_.retire_writes(0), "before restoring the optimizer state");
  }
  for (auto& [k, u] : stepped_) {
    STRATA_RETURN_IF_ERROR(restore(k, u, redo, hyper, grad_mult), "");  // names the module
  }
  return Status::ok();  // stepped_ stays: these modules are done for the optimizer step
}

// Restores module k's pre-step master weights and moments from `u` and redoes its step, or
// re-derives its parameters (a skipped step).
Status Speculation::restore(int k, Undo& u, bool redo, const OptimizerHyper& hyper,
                            float grad_mult) {
  Module& m = homes_.module(k);
  IoWorker* io = homes_.io();
  const bool master_on_disk = u.master_shadow, mom_on_disk = u.mom_shadow;
  drop_shadows(k, &u);  // the homes are the pre-step extents again
  OptimizerPipeline::Slot s;
  auto restore_one = [&](Home& h, bool on_disk, const std::shared_ptr<PinnedBuffer>& copy,
                         bool needed, std::shared_ptr<PinnedBuffer>* buf, void** ptr) -> Status {
    if (on_disk) {  // the pre-step state is in its home extent; read it when needed
      if (!needed) return Status::ok();
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, homes_.host_buf(h.bytes, "restoring optimizer state"),
                              "staging");
      *buf = std::make_shared<PinnedBuffer>(std::move(b));
      *ptr = (*buf)->data();
      return io->wait(io->read(h.ext, *ptr)).with_context("reading the pre-step state");
    }
    if (h.tier == Tier::kNvme) {  // a host copy of NVMe state (the swap files were full)
      *buf = copy;
      *ptr = copy->data();
      return Status::ok();
    }
    *ptr = h.ptr();
    std::memcpy(*ptr, copy->data(), h.bytes);
    return Status::ok();
  };
  void* master = nullptr;
  void* mom = nullptr;
  STRATA_RETURN_IF_ERROR(
      restore_one(m.master, master_on_disk, u.master, true, &s.master_buf, &master),
      "restoring " + m.name + " master weights");
  STRATA_RETURN_IF_ERROR(restore_one(m.mom, mom_on_disk, u.mom, redo, &s.mom_buf, &mom),
                         "restoring " + m.name + " moments");
  s.master = static_cast<float*>(master);
  s.mom = static_cast<char*>(mom);
  counters_.update([](TierCounts& n) { ++n.modules_redone; });
  if (redo) {
    STRATA_RETURN_IF_ERROR(pipeline_.step(k, s, hyper, grad_mult), "redoing " + m.name);
    // Within the pipeline's reservation next to the slots read ahead (<= depth modules).
    if (io) STRATA_RETURN_IF_ERROR(pipeline_.retire_writes(pipeline_.depth()), "redoing " + m.name);
    return Status::ok();
  }
  // A skipped step: NVMe homes get their host copies back (shadowed ones never changed).
  if (m.master.tier == Tier::kNvme && !master_on_disk) {
    STRATA_RETURN_IF_ERROR(io->wait(io->write(m.master.ext, s.master)),
                           "restoring " + m.name + " master weights");
  }
  if (m.mom.tier == Tier::kNvme && !mom_on_disk) {
    STRATA_RETURN_IF_ERROR(io->wait(io->write(m.mom.ext, s.mom)),
                           "restoring " + m.name + " moments");
  }
  STRATA_RETURN_IF_ERROR(pipeline_.write_params(k, s.master), "restoring " + m.name);
  return Status::ok();
}

void Speculation::end() {
  if (!active_) return;
  for (auto& [k, u] : stepped_) {
    for (auto [old, shadow] :
         {std::pair{&u.old_master, u.master_shadow}, std::pair{&u.old_mom, u.mom_shadow}}) {
      if (shadow) homes_.free_extent(*old);
    }
  }
  TierClock::time_point bwd_end;
  {
    std::lock_guard<std::mutex> l(bwd_end_mu_);
    bwd_end = bwd_end_;
  }
  double hidden = 0;
  for (auto& [t0, t1] : intervals_) {
    const auto end = bwd_end == TierClock::time_point{} ? t1 : std::min(t1, bwd_end);
    if (end > t0) hidden += seconds_between(t0, end);
  }
  counters_.update([hidden](TierCounts& n) { n.optimizer_hidden_s += hidden; });
  active_ = false;
  stepped_.clear();
  ready_.clear();
  intervals_.clear();
}

}  // namespace strata
