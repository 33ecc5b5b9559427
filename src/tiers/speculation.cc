#include "src/tiers/speculation.h"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "src/tiers/device_optimizer.h"
#include "strata/log.h"

namespace strata {

Speculation::Speculation(Homes& homes, OptimizerPipeline& pipeline, StreamStamps& stamps,
                         bool shadow_extents, TierCounters& counters, AsyncError& errors)
    : homes_(homes),
      dev_(homes.device()),
      pipeline_(pipeline),
      stamps_(stamps),
      shadow_extents_(shadow_extents),
      counters_(counters),
      errors_(errors) {}

void Speculation::begin(const OptimizerHyper& hyper, float grad_mult, bool keep_undo,
                        bool step_modules) {
  active_ = true;
  step_modules_ = step_modules;
  undo_ = keep_undo;
  stopped_ = false;
  undo_not_ready_ = false;
  hyper_ = hyper;
  mult_ = grad_mult;
  ready_.clear();
  retire_stepped();
  intervals_.clear();
  bwd_end_.reset();
  // Gradients become final in the order the last step's did (first step: reverse module
  // order, which is backward's); read that order's optimizer state ahead. Without stepping,
  // the step after backward is deferred to the next forward, which steps the modules in module
  // order: read that order ahead.
  std::vector<int> order = step_modules ? pipeline_.last_order() : std::vector<int>{};
  if (order.empty()) {
    for (int k = int(homes_.modules().size()) - 1; k >= 0; --k) {
      if (!homes_.module(k).frozen()) order.push_back(k);
    }
    if (!step_modules) std::reverse(order.begin(), order.end());
  }
  expected_.clear();
  for (int k : order) {
    for (size_t j = 0; j < pipeline_.sub_groups(k); ++j) expected_.emplace_back(k, j);
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

// Starts the reads of the next sub-groups the speculative pass expects, `depth` ahead plus the
// pipeline's read-ahead (strata.optimizer.read_ahead).
void Speculation::read_ahead() {
  // Within the pipeline's reservation, the last pass's writes still draining counted against
  // it (OptimizerPipeline::read_ahead_room).
  while (next_prep_ < expected_.size() && pipeline_.read_ahead_room() > 0) {
    const auto [k, j] = expected_[next_prep_++];
    if (pipeline_.prepared(k, j) || stepped_.count(k)) continue;
    auto r = pipeline_.prepare(k, j, /*try_only=*/true);
    if (!r.is_ok() || !*r) break;  // the host tier is busy: read on demand instead
    counters_.update([](TierCounts& n) { ++n.schedule.sub_groups_read_ahead; });
  }
}

Status Speculation::step_ready(bool wait_all) {
  if (!active_) return Status::ok();
  if (wait_all) {
    // The time the compute stream finishes the backward: optimizer work after it is not hidden.
    bwd_end_ = stamps_.stamp(dev_.compute_stream());
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
      // Stepped after backward or deferred: with gradients on NVMe, the sub-groups read ahead
      // read the module's final gradients now, under the rest of backward (or, at its end,
      // before the pass). Once the event has run, so have the spill's writes (GradSpill's last
      // callback waits for them); at the end, end_backward waits for the drains anyway.
      if (io && (!wait_all || dev_.synchronize(*ev).is_ok())) pipeline_.prepare_grads_of(k);
      ready_.pop_front();
      continue;
    }
    if (undo_ && !dev_.host_addressable() && steps_on_device(homes_.module(k))) {
      // Its undo state would be a host copy of device memory: stepped after backward instead
      // (on the device that takes milliseconds).
      ready_.pop_front();
      continue;
    }
    if (undo_ && wait_all && undo_takes_host(k) && dev_.query(*ready_.back().second)) {
      // Every gradient of the step is final (the d2h stream runs in order): the norm, so
      // whether the step clips, is known once the trainer asks; the modules left are stepped
      // then, exactly, and take no undo room, which only steps under backward need. (NVMe
      // state shadowed on the disk costs no host memory: it goes on as it was.)
      stopped_ = true;
      continue;
    }
    const std::string& name = homes_.module(k).name;
    STRATA_RETURN_IF_ERROR(dev_.synchronize(*ev), "waiting for " + name + " gradients");
    ready_.pop_front();
    // The step's gradients may be bad (a failed drain): validate before touching state.
    STRATA_RETURN_IF_ERROR(errors_.take(), "before stepping " + name);
    const auto t0 = TierClock::now();
    Undo undo;
    if (undo_ && !take_undo(k, &undo)) {
      // No room for undo state: this and the remaining modules are stepped after backward.
      stopped_ = true;
      continue;
    }
    OptimizerPipeline::BeforeStep keep;
    if (undo_) keep = [&, k = k](OptimizerPipeline::Slot& s) { keep_sub_group(k, s, &undo); };
    // Its staging may stay for the next step (Pass::keep), undo state or not: a step that is
    // rolled back drops every kept slot before its restore writes the homes (undo()). Keeping
    // only without undo state had every step that clipping could roll back, bitten or not,
    // read its whole state again (GPT-2 124M with the optimizer on NVMe on an H200: 2.78 GiB
    // of NVMe a step where a pass that keeps moves 1.63).
    st = pipeline_.step(k, hyper_, mult_, keep);
    if (st.is_ok()) {
      swap_homes(k, &undo);
      stepped_[k] = std::move(undo);
      counters_.update([](TierCounts& n) { ++n.schedule.modules_stepped_under_backward; });
    }
    if (st.is_ok() && io) {
      st = pipeline_.bound_writes();
      read_ahead();
    }
    const auto t1 = TierClock::now();
    intervals_.emplace_back(t0, t1);
    counters_.update([&](TierCounts& n) { n.schedule.optimizer_s += seconds_between(t0, t1); });
  }
  return st.with_context("optimizer step under backward");
}

bool Speculation::undo_takes_host(int k) const {
  const Module& m = homes_.module(k);
  auto shadowed = [&](const Home& h) { return h.tier == Tier::kNvme && shadow_extents_; };
  return !shadowed(m.master) || !shadowed(m.mom);
}

bool Speculation::matches(const OptimizerHyper& hyper, float grad_mult) const {
  return active_ && grad_mult == mult_ && hyper.lr == hyper_.lr && hyper.step == hyper_.step;
}

std::vector<bool> Speculation::stepped_mask() const {
  std::vector<bool> done(homes_.modules().size(), false);
  for (const auto& [k, u] : stepped_) done[size_t(k)] = true;
  return done;
}

// What a rollback of module k's speculative step restores, set up before the step: for state
// homed on NVMe fresh extents the step's sub-groups are written to, the old ones kept as they
// are on the disk (no host memory, no copy; the old extents are freed when the step is kept);
// for state homed in the host tier a shadow buffer the step writes to out of place, the old
// home kept (no copy); for state in device memory, or when the swap files are full, a host
// copy. False when there is room for none: nothing is taken.
// A spare undo buffer that nothing else holds and that is large enough for `bytes`.
static bool spare_fits(const std::shared_ptr<PinnedBuffer>& b, size_t bytes) {
  return b && b.use_count() == 1 && b->size() >= bytes;
}

bool Speculation::take_undo(int k, Undo* u) {
  Module& m = homes_.module(k);
  Spare& spare = spares_[k];
  // Buffers its last undo state did not leave come from the undo room; a large one whose region
  // is not ready yet would have this thread wait for the kernel to fault its pages in: the
  // module is stepped after backward this time and the region made ready for a later step.
  std::vector<size_t> fresh_bytes;
  for (auto [h, reuse] : {std::pair{&m.master, &spare.master}, std::pair{&m.mom, &spare.mom}}) {
    const bool reused = spare_fits(*reuse, h->bytes);
    if (!(h->tier == Tier::kNvme && shadow_extents_) && !reused) fresh_bytes.push_back(h->bytes);
  }
  if (!fresh_bytes.empty() && !homes_.undo_ready(fresh_bytes)) {
    undo_not_ready_ = true;
    counters_.update([](TierCounts& n) { ++n.schedule.undo_not_ready; });
    return false;
  }
  auto one = [&](Home& h, std::vector<SwapExtent>* fresh, bool* shadow, bool* swap,
                 std::shared_ptr<PinnedBuffer>* copy, std::shared_ptr<PinnedBuffer>* reuse) {
    if (h.tier == Tier::kNvme && shadow_extents_) {
      bool room = true;
      for (size_t j = 0; j < h.subs.size() && room; ++j) {
        auto e = homes_.allocate_extent(h.subs[j].bytes);
        room = e.is_ok();
        if (room) fresh->push_back(*e);
      }
      if (room) {
        *shadow = true;
        return true;
      }
      for (const auto& e : *fresh) homes_.free_extent(e);
      fresh->clear();
    }
    if (spare_fits(*reuse, h.bytes)) {
      *copy = std::move(*reuse);  // the buffer its last undo state held
    } else {
      // From the undo room, not the arena: its free space is the pipeline's staging.
      Result<PinnedBuffer> b = homes_.undo_buf(h.bytes);
      if (!b.is_ok()) {
        log_debug("tier manager: no room for {}'s undo copy ({}); stepping the rest after backward",
                  m.name, b.status().message());
        return false;
      }
      *copy = std::make_shared<PinnedBuffer>(std::move(b).value());
    }
    if (h.tier == Tier::kHost) {
      *swap = true;  // the step writes here (keep_sub_group), then it becomes the home
    } else if (h.tier != Tier::kNvme) {
      // NVMe-homed state is copied from each sub-group's slot (keep_sub_group).
      std::memcpy((*copy)->data(), h.ptr(), h.bytes);
      counters_.update([&](TierCounts& n) { n.schedule.undo_copy_bytes += h.bytes; });
    }
    return true;
  };
  if (one(m.master, &u->fresh_master, &u->master_shadow, &u->master_swap, &u->master,
          &spare.master) &&
      one(m.mom, &u->fresh_mom, &u->mom_shadow, &u->mom_swap, &u->mom, &spare.mom)) {
    return true;
  }
  drop_shadows(k, u);
  *u = Undo{};
  return false;
}

void Speculation::keep_sub_group(int k, OptimizerPipeline::Slot& s, Undo* u) {
  Module& m = homes_.module(k);
  const size_t b = m.mom_elem() / 2;
  if (u->master_swap) {  // the slot points into the home: the step reads it, writes the shadow
    s.master_src = s.master;
    s.master = u->master->as<float>() + s.a;
  } else if (u->master_shadow) {
    u->old_master.push_back(m.master.subs[s.j]);
    m.master.subs[s.j] = u->fresh_master[s.j];
  } else if (m.master.tier == Tier::kNvme) {
    std::memcpy(u->master->as<float>() + s.a, s.master, s.len * 4);
    counters_.update([&](TierCounts& n) { n.schedule.undo_copy_bytes += s.len * 4; });
  }
  if (u->mom_swap) {
    char* c = static_cast<char*>(u->mom->data());
    s.m_src = s.m;
    s.v_src = s.v;
    s.m = c + s.a * b;
    s.v = c + (m.sn + s.a) * b;
  } else if (u->mom_shadow) {
    u->old_mom.push_back(m.mom.subs[s.j]);
    m.mom.subs[s.j] = u->fresh_mom[s.j];
  } else if (m.mom.tier == Tier::kNvme) {
    char* c = static_cast<char*>(u->mom->data());
    std::memcpy(c + s.a * b, s.m, s.len * b);
    std::memcpy(c + (m.sn + s.a) * b, s.v, s.len * b);
    counters_.update([&](TierCounts& n) { n.schedule.undo_copy_bytes += 2 * s.len * b; });
  }
}

void Speculation::swap_homes(int k, Undo* u) {
  Module& m = homes_.module(k);
  if (u->master_swap) std::swap(m.master.host, *u->master);
  if (u->mom_swap) std::swap(m.mom.host, *u->mom);
}

// Module k's homes go back to the extents its undo kept, and the shadows it was stepped into
// are freed (their writes must have landed).
void Speculation::drop_shadows(int k, Undo* u) {
  Module& m = homes_.module(k);
  for (auto [h, fresh, old, shadow] :
       {std::tuple{&m.master, &u->fresh_master, &u->old_master, &u->master_shadow},
        std::tuple{&m.mom, &u->fresh_mom, &u->old_mom, &u->mom_shadow}}) {
    if (!*shadow) continue;
    for (size_t j = 0; j < fresh->size(); ++j) {
      homes_.free_extent((*fresh)[j]);
      if (j < old->size()) h->subs[j] = (*old)[j];
    }
    fresh->clear();
    old->clear();
    *shadow = false;
  }
}

Status Speculation::undo(bool redo, const OptimizerHyper& hyper, float grad_mult) {
  counters_.update([](TierCounts& n) { ++n.schedule.rollbacks; });
  for (auto& [k, u] : stepped_) {
    if (!u.kept()) {
      if (!redo) {
        return invalid_argument(fmt::format(
            "the gradients are not finite (inf or nan): training diverged; lower "
            "optimizer.params.lr or enable gradient_clipping. The step cannot be skipped: the "
            "optimizer stepped {} under backward without undo state (kept only where a step "
            "can be rolled back: gradient_clipping > 0 or fp16); with "
            "strata.optimizer.overlap: false such a step is skipped instead",
            homes_.module(k).name));
      }
      return invalid_argument(fmt::format(
          "the optimizer stepped {} under backward without undo state (kept only where a step "
          "can be rolled back: gradient_clipping > 0 or fp16) but the step must be redone: "
          "set strata.optimizer.overlap: false to step after backward",
          homes_.module(k).name));
    }
  }
  // The device's optimizer steps (device-resident state) must have run before it is restored.
  STRATA_RETURN_IF_ERROR(dev_.synchronize(dev_.compute_stream()), "before restoring the state");
  // The speculative writes must land before their shadows are freed and before the restored
  // state's writes go to the same extents.
  if (homes_.io()) {
    STRATA_RETURN_IF_ERROR(pipeline_.retire_writes(0), "before restoring the optimizer state");
  }
  // The restores below write the stepped modules' homes; their kept slots hold the
  // speculative state. Other modules' kept slots (the last pass's, or read ahead before a
  // skipped step) hold their state as it is.
  const std::vector<bool> stepped = stepped_mask();
  pipeline_.drop_kept(&stepped);
  for (auto& [k, u] : stepped_) {
    STRATA_RETURN_IF_ERROR(restore(k, u, redo, hyper, grad_mult), "");  // names the module
  }
  return Status::ok();  // stepped_ stays: these modules are done for the optimizer step
}

// Restores module k's pre-step master weights and moments from `u` and redoes its step, or
// re-derives its parameters (a skipped step), one sub-group at a time.
Status Speculation::restore(int k, Undo& u, bool redo, const OptimizerHyper& hyper,
                            float grad_mult) {
  Module& m = homes_.module(k);
  IoWorker* io = homes_.io();
  const bool master_on_disk = u.master_shadow, mom_on_disk = u.mom_shadow;
  drop_shadows(k, &u);  // the homes are the pre-step extents again
  swap_homes(k, &u);    // and the pre-step host buffers
  // State in device memory gets its copy back whole.
  if (m.master.tier != Tier::kNvme && !u.master_swap) {
    std::memcpy(m.master.ptr(), u.master->data(), m.master.bytes);
  }
  if (m.mom.tier != Tier::kNvme && !u.mom_swap) {
    std::memcpy(m.mom.ptr(), u.mom->data(), m.mom.bytes);
  }
  u.master_swap = u.mom_swap = false;
  STRATA_ASSIGN_OR_RETURN(OptimizerPipeline::Target t, pipeline_.target(k, nullptr),
                          "restoring " + m.name);
  const size_t b = m.mom_elem() / 2;
  auto staging = [&](size_t bytes) -> Result<std::shared_ptr<PinnedBuffer>> {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer x, homes_.host_buf(bytes, "restoring optimizer state"),
                            "staging");
    return std::make_shared<PinnedBuffer>(std::move(x));
  };
  for (size_t j = 0; j < m.sub_groups(); ++j) {
    const std::string what =
        m.sub_groups() > 1 ? fmt::format("{} (sub-group {})", m.name, j) : m.name;
    OptimizerPipeline::Slot s;
    s.k = k;
    s.j = j;
    s.a = m.sub_start(j);
    s.len = m.sub_len(j);
    if (m.master.tier != Tier::kNvme) {
      s.master = static_cast<float*>(m.master.ptr()) + s.a;
    } else if (master_on_disk) {  // the pre-step state is in its home extent
      STRATA_ASSIGN_OR_RETURN(s.master_buf, staging(s.len * 4), "restoring " + what);
      s.master = s.master_buf->as<float>();
      STRATA_RETURN_IF_ERROR(io->wait(io->read(m.master.subs[j], s.master)),
                             "reading the pre-step master weights of " + what);
    } else {  // a host copy of NVMe state (the swap files were full)
      s.master_buf = u.master;
      s.master = u.master->as<float>() + s.a;
    }
    if (m.mom.tier != Tier::kNvme) {
      s.m = static_cast<char*>(m.mom.ptr()) + s.a * b;
      s.v = static_cast<char*>(m.mom.ptr()) + (m.sn + s.a) * b;
    } else if (!mom_on_disk || redo) {  // (a skip leaves shadowed moments as they are)
      STRATA_ASSIGN_OR_RETURN(s.mom_buf, staging(s.len * 2 * b), "restoring " + what);
      s.m = s.mom_buf->data();
      s.v = static_cast<char*>(s.m) + s.len * b;
      if (mom_on_disk) {
        STRATA_RETURN_IF_ERROR(io->wait(io->read(m.mom.subs[j], s.m)),
                               "reading the pre-step moments of " + what);
      } else {  // a host copy of NVMe state, in the whole module's layout
        const char* c = static_cast<const char*>(u.mom->data());
        std::memcpy(s.m, c + s.a * b, s.len * b);
        std::memcpy(s.v, c + (m.sn + s.a) * b, s.len * b);
      }
    }
    STRATA_ASSIGN_OR_RETURN(OptimizerPipeline::Piece p, pipeline_.piece(k, j, t),
                            (redo ? "redoing " : "restoring ") + what);
    if (redo) {
      STRATA_RETURN_IF_ERROR(pipeline_.load_grad(&s), "redoing " + what);
      pipeline_.step_sub_group(k, s, hyper, grad_mult, nullptr, p.dst);
      // Within the pipeline's reservation next to the sub-groups read ahead.
      if (io) STRATA_RETURN_IF_ERROR(pipeline_.bound_writes(), "redoing " + what);
      STRATA_RETURN_IF_ERROR(pipeline_.publish_piece(k, j, p.dst, std::move(p.keep), false),
                             "redoing " + what);
      continue;
    }
    // A skipped step: NVMe homes get their host copies back (shadowed ones never changed).
    if (m.master.tier == Tier::kNvme && !master_on_disk) {
      STRATA_RETURN_IF_ERROR(io->wait(io->write(m.master.subs[j], s.master)),
                             "restoring the master weights of " + what);
    }
    if (m.mom.tier == Tier::kNvme && !mom_on_disk) {
      STRATA_RETURN_IF_ERROR(io->wait(io->write(m.mom.subs[j], s.m)),
                             "restoring the moments of " + what);
    }
    pipeline_.derive(k, s, p.dst);
    STRATA_RETURN_IF_ERROR(pipeline_.publish_piece(k, j, p.dst, std::move(p.keep), true),
                           "restoring " + what);
  }
  counters_.update([](TierCounts& n) { ++n.schedule.modules_redone; });
  return Status::ok();
}

void Speculation::end() {
  if (!active_) return;
  for (auto& [k, u] : stepped_) {
    for (auto [fresh, old] :
         {std::pair{&u.fresh_master, &u.old_master}, std::pair{&u.fresh_mom, &u.old_mom}}) {
      for (const auto& e : *old) homes_.free_extent(e);
      for (size_t j = old->size(); j < fresh->size(); ++j) homes_.free_extent((*fresh)[j]);
    }
  }
  // Not dated (no end of backward was waited for): the intervals count whole.
  const int64_t end_ticks = bwd_end_ ? bwd_end_->load() : 0;
  const TierClock::time_point bwd_end = end_ticks == 0
                                            ? TierClock::time_point{}
                                            : TierClock::time_point(TierClock::duration(end_ticks));
  double hidden = 0;
  for (auto& [t0, t1] : intervals_) {
    const auto end = bwd_end == TierClock::time_point{} ? t1 : std::min(t1, bwd_end);
    if (end > t0) hidden += seconds_between(t0, end);
  }
  counters_.update([hidden](TierCounts& n) { n.schedule.optimizer_hidden_s += hidden; });
  active_ = false;
  retire_stepped();
  ready_.clear();
  intervals_.clear();
}

// memcpy(dst, src, bytes) across the cores, in 4 MiB pieces.
static void copy_parallel(void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  tbb::parallel_for(tbb::blocked_range<size_t>(0, bytes, size_t{4} << 20),
                    [&](const auto& r) { std::memcpy(d + r.begin(), s + r.begin(), r.size()); });
}

size_t Speculation::release_undo_room() {
  STRATA_CHECK(!active_, "release_undo_room during a speculation");
  retire_stepped();
  size_t moved = 0;
  for (auto& [k, spare] : spares_) {
    Module& m = homes_.module(k);
    for (auto [h, b] : {std::pair{&m.master, &spare.master}, std::pair{&m.mom, &spare.mom}}) {
      // A home in the room swapped with a buffer of the arena (its first home); the home
      // then holds the newest state, which goes back there.
      if (h->tier != Tier::kHost || !spare_fits(*b, h->bytes)) continue;
      if (!homes_.in_undo_room(h->host.data()) || homes_.in_undo_room((*b)->data())) continue;
      copy_parallel((*b)->data(), h->host.data(), h->bytes);
      std::swap(h->host, **b);
      moved += h->bytes;
    }
  }
  spares_.clear();
  pipeline_.repoint_homes();
  const size_t freed = homes_.close_undo_room();
  log_debug("tier manager: undo room given back ({}; {} of homes copied back to the arena)",
            format_bytes(double(freed)), format_bytes(double(moved)));
  return freed;
}

void Speculation::retire_stepped() {
  for (auto& [k, u] : stepped_) {
    Spare& s = spares_[k];
    if (u.master) s.master = std::move(u.master);
    if (u.mom) s.mom = std::move(u.mom);
  }
  stepped_.clear();
}

}  // namespace strata
