#include "src/tiers/optimizer_pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string_view>

#include "src/tiers/device_optimizer.h"
#include "strata/cpu_optim.h"

namespace strata {

OptimizerPipeline::OptimizerPipeline(Homes& homes, DeviceCache& cache, const TierOptions& options,
                                     DType dt, DType moment_dt, bool sharded,
                                     TierCounters& counters)
    : homes_(homes),
      dev_(homes.device()),
      cache_(cache),
      counters_(counters),
      opt_(options),
      dt_(dt),
      mdt_(moment_dt),
      sharded_(sharded) {
  drained_.resize(homes.modules().size());
  homes_.set_reclaim([this] { release_copied(); });
}

OptimizerPipeline::~OptimizerPipeline() {
  homes_.set_reclaim(nullptr);
  finish_copies_up().ignore();
}

// ---- the order modules become ready ----------------------------------------------------------

void OptimizerPipeline::grads_final(int m) {
  order_.push_back(m);
  if (steps_on_device(homes_.module(m))) {
    auto drained = std::shared_ptr<Event>(dev_.create_event());
    dev_.record(*drained, dev_.d2h_stream());
    drained_[size_t(m)] = std::move(drained);
  }
}

std::vector<int> OptimizerPipeline::prepared_first(std::vector<int> order) const {
  std::stable_partition(order.begin(), order.end(), [this](int k) {
    for (size_t j = 0; j < sub_groups(k); ++j) {
      if (prepared(k, j)) return true;
    }
    return false;
  });
  return order;
}

std::vector<int> OptimizerPipeline::step_order(std::vector<bool> skip) const {
  std::vector<int> order;
  for (size_t k = 0; k < skip.size(); ++k) skip[k] = skip[k] || homes_.module(int(k)).frozen();
  for (int k : order_) {
    if (!skip[size_t(k)]) order.push_back(k);
    skip[size_t(k)] = true;  // a skipped (overflow) step may leave duplicates behind
  }
  for (size_t k = 0; k < skip.size(); ++k) {
    if (!skip[k]) order.push_back(int(k));
  }
  return order;
}

void OptimizerPipeline::end_step(bool skipped) {
  drain_prepared(skipped);
  release_copied();
  if (!order_.empty()) last_order_ = order_;
  order_.clear();
}

// ---- slots -------------------------------------------------------------------------------------

void OptimizerPipeline::point_at_homes(Slot& s) const {
  const Module& m = homes_.module(s.k);
  const size_t mb = dtype_size(mdt_);
  if (m.master.tier != Tier::kNvme) s.master = static_cast<float*>(m.master.ptr()) + s.a;
  if (m.mom.tier != Tier::kNvme) {
    s.m = static_cast<char*>(m.mom.ptr()) + s.a * mb;
    s.v = static_cast<char*>(m.mom.ptr()) + (m.sn + s.a) * mb;
  }
}

void OptimizerPipeline::repoint_homes() {
  for (auto& [key, s] : prepared_) point_at_homes(s);
}

Result<bool> OptimizerPipeline::prepare(int k, size_t j, bool try_only, bool urgent) {
  Module& m = homes_.module(k);
  Slot s;
  s.k = k;
  s.j = j;
  s.a = m.sub_start(j);
  s.len = m.sub_len(j);
  const size_t mb = dtype_size(mdt_);
  point_at_homes(s);
  auto buf = [&](size_t bytes) -> Result<std::shared_ptr<PinnedBuffer>> {
    auto b = host_buf(bytes, "optimizer pipeline", try_only);
    if (!b.is_ok()) return b.status();
    return std::make_shared<PinnedBuffer>(std::move(b).value());
  };
  const std::string what = m.sub_groups() > 1 ? fmt::format(" (sub-group {})", j) : "";
  if (m.master.tier == Tier::kNvme) {
    auto b = buf(s.len * 4);
    if (!b.is_ok()) {
      if (try_only) return false;
      return b.status().with_context("staging " + m.name + " master weights" + what);
    }
    s.master_buf = *b;
  }
  if (m.mom.tier == Tier::kNvme) {
    auto b = buf(s.len * 2 * mb);
    if (!b.is_ok()) {
      if (try_only) return false;
      return b.status().with_context("staging " + m.name + " moments" + what);
    }
    s.mom_buf = *b;
  }
  IoWorker* io = homes_.io();
  if (s.master_buf) {
    s.master = s.master_buf->as<float>();
    s.rm = io->read(m.master.subs[j], s.master, urgent);
  }
  if (s.mom_buf) {
    s.m = s.mom_buf->data();
    s.v = static_cast<char*>(s.m) + s.len * mb;
    s.rmo = io->read(m.mom.subs[j], s.m, urgent);
  }
  prepared_[{k, j}] = std::move(s);
  return true;
}

void OptimizerPipeline::prepare_grads_of(int k) {
  if (homes_.module(k).gacc.tier != Tier::kNvme) return;
  for (size_t j = 0; j < sub_groups(k); ++j) {
    if (prepared(k, j) && prepare_grad(k, j, /*urgent=*/false)) {
      counters_.update([](TierCounts& n) { ++n.schedule.grad_sub_groups_read_under_backward; });
    }
  }
}

bool OptimizerPipeline::prepare_grad(int k, size_t j, bool urgent) {
  Module& m = homes_.module(k);
  if (m.gacc.tier != Tier::kNvme) return false;
  Slot& s = prepared_.at({k, j});
  if (s.grad_buf) return false;
  // Within the read-ahead's room, which the memory model sizes with a gradient sub-group per
  // read-ahead sub-group: at most extra_ slots hold gradients (with no read-ahead, none do).
  if (grads_held_ >= extra_) return false;
  auto b = host_buf(s.len * 4, "optimizer pipeline", /*try_only=*/true);
  if (!b.is_ok()) return false;  // no room now: take() reads them when it steps the sub-group
  ++grads_held_;
  s.grad_buf = std::make_shared<PinnedBuffer>(std::move(b).value());
  s.grad = s.grad_buf->as<float>();
  s.rg = homes_.io()->read(m.gacc.subs[j], s.grad_buf->data(), urgent);
  counters_.update([](TierCounts& n) { ++n.schedule.grad_sub_groups_read_ahead; });
  return true;
}

Status OptimizerPipeline::wait_reads(Slot& s) {
  Status st;
  for (IoWorker::Ticket t : {s.rm, s.rmo, s.rg}) {
    if (!t) continue;
    Status r = homes_.io()->wait(t);
    if (st.is_ok()) st = r;
  }
  s.rm = s.rmo = s.rg = 0;
  return st;
}

Status OptimizerPipeline::take(int k, size_t j, Slot* out) {
  const Module& m = homes_.module(k);
  const std::string what = "reading " + m.name + " optimizer state" +
                           (m.sub_groups() > 1 ? fmt::format(" (sub-group {})", j) : "");
  if (!prepared(k, j)) {
    STRATA_ASSIGN_OR_RETURN(bool ok, prepare(k, j, /*try_only=*/false, /*urgent=*/true), what);
    (void)ok;
  }
  auto it = prepared_.find({k, j});
  *out = std::move(it->second);
  prepared_.erase(it);
  out->retained = false;
  if (out->grad_buf) --grads_held_;
  if (out->kept) {
    --kept_;
    out->kept = false;
    STRATA_RETURN_IF_ERROR(wait_writes_from(*out), what);
  }
  STRATA_RETURN_IF_ERROR(wait_reads(*out), what);
  return load_grad(out).with_context(what);
}

Status OptimizerPipeline::load_grad(Slot* s) {
  Module& m = homes_.module(s->k);
  if (m.gacc.tier != Tier::kNvme || s->grad_buf) return Status::ok();
  STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, host_buf(s->len * 4, "optimizer pipeline"),
                          "staging " + m.name + " gradients");
  s->grad_buf = std::make_shared<PinnedBuffer>(std::move(b));
  s->grad = s->grad_buf->as<float>();
  IoWorker* io = homes_.io();
  // Urgent: the pass waits for it (behind the writes draining it would wait for them too).
  return io->wait(io->read(m.gacc.subs[s->j], s->grad_buf->data(), /*urgent=*/true))
      .with_context("reading " + m.name + " gradients");
}

void OptimizerPipeline::drain_prepared(bool retain) {
  for (auto it = prepared_.begin(); it != prepared_.end();) {
    Slot& s = it->second;
    const bool read = wait_reads(s).is_ok();  // a failed one is read again when stepped
    if (!s.kept && !(retain && read)) {
      it = prepared_.erase(it);
      continue;
    }
    s.grad_buf.reset();  // gradients are read anew each pass
    s.grad = nullptr;
    if (!s.kept) s.retained = true;
    ++it;
  }
  grads_held_ = 0;
}

void OptimizerPipeline::drop_kept(const std::vector<bool>* modules) {
  std::erase_if(prepared_, [&](const auto& e) {
    const Slot& s = e.second;
    const bool drop = (s.kept || s.retained) && (!modules || (*modules)[size_t(s.k)]);
    if (drop && s.kept) --kept_;
    return drop;
  });
}

Status OptimizerPipeline::wait_writes_from(const Slot& s) {
  size_t last = 0;  // one past the newest write from the slot's buffers
  for (size_t w = 0; w < writes_.size(); ++w) {
    const auto& keep = writes_[w].keep;
    if (keep && (keep == s.master_buf || keep == s.mom_buf)) last = w + 1;
  }
  return last ? retire_writes(writes_.size() - last) : Status::ok();
}

void OptimizerPipeline::set_read_ahead(size_t extra) {
  extra_ = extra;
  keep_before_.assign(homes_.modules().size(), 0);
  size_t n = 0;
  for (size_t k = 0; k < keep_before_.size(); ++k) {
    keep_before_[k] = n;
    const Module& m = homes_.modules()[k];
    if (!m.frozen() && (m.master.tier == Tier::kNvme || m.mom.tier == Tier::kNvme)) {
      n += m.sub_groups();
    }
  }
}

bool OptimizerPipeline::keeps(const Slot& s) const {
  return (s.master_buf || s.mom_buf) && size_t(s.k) < keep_before_.size() &&
         keep_before_[size_t(s.k)] + s.j < extra_ && kept_ < extra_;
}

void OptimizerPipeline::keep_slot(Slot&& s) {
  s.grad_buf.reset();
  s.grad = nullptr;
  s.rm = s.rmo = s.rg = 0;
  s.kept = true;
  ++kept_;
  for (Write& w : writes_) {  // its writes hold no memory of their own now
    if (!w.kept && w.keep && (w.keep == s.master_buf || w.keep == s.mom_buf)) {
      w.kept = true;
      if (w.counted) --unkept_state_writes_;
      w.counted = false;
    }
  }
  prepared_[{s.k, s.j}] = std::move(s);
  counters_.update([](TierCounts& n) { ++n.schedule.sub_groups_kept; });
}

// ---- stepping ----------------------------------------------------------------------------------

void* OptimizerPipeline::host_visible_params(const Module& m) const {
  if (m.p.tier == Tier::kHost) return m.p.host.data();
  if (m.p.tier == Tier::kDevice && dev_.host_addressable()) return m.p.dev;
  return nullptr;
}

Result<OptimizerPipeline::Target> OptimizerPipeline::target(int k, void* shadow) {
  Module& m = homes_.module(k);
  Target t;
  if (shadow) {
    t.lp = shadow;
    return t;
  }
  // A prefetch of these parameters may still be copying from their home: let it land first
  // (publishing then replaces the cached copy).
  STRATA_RETURN_IF_ERROR(cache_.wait_fetch(k), "stepping " + m.name);
  t.lp = host_visible_params(m);
  return t;
}

Result<OptimizerPipeline::Piece> OptimizerPipeline::piece(int k, size_t j, const Target& t) {
  Module& m = homes_.module(k);
  const size_t es = dtype_size(dt_);
  Piece p;
  if (t.lp) {
    p.dst = static_cast<char*>(t.lp) + m.sub_start(j) * es;
    return p;
  }
  // At most publish_staging_pieces() in use, and with NVMe homes one more per sub-group read
  // ahead (their state's writes drain behind as deep: waiting here for the oldest write would
  // hold the pass to the disk's write speed). The pieces whose copies ran come back first;
  // then the oldest copy gives one back when nothing else holds its piece or no write is in
  // flight, else the oldest write (never the whole h2d stream).
  const bool nvme = m.p.tier == Tier::kNvme;
  const size_t limit = publish_staging_pieces(opt_.buffer_count, nvme) + (nvme ? extra_ : 0);
  const std::string what = "staging " + m.name + " parameters";
  for (;;) {
    release_copied();
    std::erase_if(pieces_, [](const std::weak_ptr<PinnedBuffer>& w) { return w.expired(); });
    if (pieces_.size() < limit) break;
    if (copies_up_held() > 0 && (writes_.empty() || oldest_copy_up_alone())) {
      STRATA_RETURN_IF_ERROR(wait_oldest_copy_up(), what);
    } else {
      STRATA_CHECK(!writes_.empty(), "parameter staging pieces held past their writes and copies");
      STRATA_RETURN_IF_ERROR(retire_writes(writes_.size() - 1), what);
    }
  }
  STRATA_ASSIGN_OR_RETURN(PinnedBuffer b,
                          host_buf(piece_bytes(m.sub_len(j), es), "parameter staging"),
                          "stepping " + m.name);
  p.keep = std::make_shared<PinnedBuffer>(std::move(b));
  p.dst = p.keep->data();
  pieces_.push_back(p.keep);
  return p;
}

void OptimizerPipeline::step_sub_group(int k, Slot& s, const OptimizerHyper& hyper, float grad_mult,
                                       const float* grad, void* lp, bool urgent_writes) {
  Module& m = homes_.module(k);
  ShardState sh;
  sh.n = s.len;  // the padding's grads, master and moments are zero and stay zero
  sh.grad = s.grad ? s.grad : (grad ? grad : static_cast<const float*>(m.gacc.ptr())) + s.a;
  sh.grad_dtype = DType::kF32;
  sh.grad_mult = grad_mult;
  sh.master = s.master;
  sh.m = s.m;
  sh.v = s.v;
  sh.master_src = s.master_src;
  sh.m_src = s.m_src;
  sh.v_src = s.v_src;
  sh.moment_dtype = mdt_;
  sh.lp_out = lp;
  sh.lp_dtype = dt_;
  const auto t0 = TierClock::now();
  strata::optimizer_step(hyper, sh, opt_.optimizer_threads);
  const double kernel_s = seconds_between(t0, TierClock::now());
  counters_.update([&](TierCounts& n) {
    n.schedule.cpu_optimizer_s += kernel_s;
    n.schedule.cpu_optimizer_params += sh.n;
  });
  const std::string what =
      m.sub_groups() > 1 ? fmt::format("{} (sub-group {})", m.name, s.j) : m.name;
  if (m.master.tier == Tier::kNvme) {
    queue_write(m.master.subs[s.j], s.master, s.master_buf, what, /*state=*/true, urgent_writes);
  }
  if (m.mom.tier == Tier::kNvme) {
    STRATA_CHECK(s.v == static_cast<char*>(s.m) + s.len * dtype_size(mdt_),
                 "NVMe-homed moments are staged first then second");
    queue_write(m.mom.subs[s.j], s.m, s.mom_buf, what, /*state=*/true, urgent_writes);
  }
}

void OptimizerPipeline::derive(int k, const Slot& s, void* lp) const {
  (void)k;
  convert(s.master, DType::kF32, lp, dt_, s.len);
}

OptimizerPipeline::Pass OptimizerPipeline::begin_pass(
    const std::vector<int>& order, const OptimizerHyper& hyper, float grad_mult,
    std::vector<std::shared_ptr<PinnedBuffer>>* shadows, BeforeStep before, bool keep) const {
  Pass p;
  p.keep = keep && !shadows;
  for (int k : order) {
    for (size_t j = 0; j < sub_groups(k); ++j) p.units.emplace_back(k, j);
  }
  p.hyper = hyper;
  p.grad_mult = grad_mult;
  p.shadows = shadows;
  p.before = std::move(before);
  return p;
}

Status OptimizerPipeline::advance(Pass& ps, size_t until) {
  const size_t depth = this->depth();
  const auto& units = ps.units;
  const OptimizerHyper& hyper = ps.hyper;
  const float grad_mult = ps.grad_mult;
  std::vector<std::shared_ptr<PinnedBuffer>>* shadows = ps.shadows;
  const BeforeStep& before = ps.before;
  size_t& next = ps.next;
  Target& t = ps.t;
  for (size_t& i = ps.i; i < std::min(until, units.size()); ++i) {
    // Read ahead while the reservation allows (the speculation may hold slots of its own):
    // buffer_count sub-groups, and beyond them into the read-ahead's room (read_ahead_room(),
    // as the speculation reads ahead) when the pool has it free.
    for (next = std::max(next, i + 1); next < units.size() && next <= i + depth + extra_; ++next) {
      auto [nk, nj] = units[next];
      if (!prepared(nk, nj)) {
        const std::string what = "reading " + homes_.module(nk).name + " optimizer state";
        if (prepared_count() - kept_ < depth) {
          STRATA_RETURN_IF_ERROR(prepare(nk, nj, /*try_only=*/false, /*urgent=*/true).status(),
                                 what);
        } else {
          if (read_ahead_room() == 0) break;
          STRATA_ASSIGN_OR_RETURN(bool room, prepare(nk, nj, /*try_only=*/true, /*urgent=*/true),
                                  what);
          if (!room) break;
        }
      }
      // A pass's gradients are final (also those of slots read ahead during backward).
      if (!shadows) prepare_grad(nk, nj);
    }
    const auto [k, j] = units[i];
    Module& m = homes_.module(k);
    // Device-resident state is stepped by the device's optimizer kernel (device_optimizer.h),
    // the whole module once its last sub-group's slot is taken; with the delayed update
    // (host-addressable devices only) every step stays on the host.
    const bool on_device = !shadows && !opt_.delayed_update && steps_on_device(m);
    const float* grad = nullptr;
    void* shadow = nullptr;
    if (shadows) grad = static_cast<const float*>(m.gacc2.ptr());
    if (j == 0 && !on_device) {
      if (shadows) {
        STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, host_buf(m.p.bytes, "delayed update: shadow"),
                                "stepping " + m.name);
        (*shadows)[size_t(k)] = std::make_shared<PinnedBuffer>(std::move(b));
        shadow = (*shadows)[size_t(k)]->data();
      }
      STRATA_ASSIGN_OR_RETURN(t, target(k, shadow), "");
    }
    if (!shadows && !prepared(k, j)) {  // its state and gradients read together
      STRATA_RETURN_IF_ERROR(prepare(k, j, /*try_only=*/false, /*urgent=*/true).status(),
                             "reading " + m.name + " optimizer state");
      prepare_grad(k, j);
    }
    Slot s;
    STRATA_RETURN_IF_ERROR(take(k, j, &s), "stepping " + m.name);
    if (before) before(s);
    if (on_device) {
      if (j + 1 == sub_groups(k)) {
        // A prefetch of these parameters may still be copying from their home.
        STRATA_RETURN_IF_ERROR(cache_.wait_fetch(k), "stepping " + m.name);
        STRATA_RETURN_IF_ERROR(step_on_device(k, hyper, grad_mult), "");  // names m itself
      }
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(Piece p, piece(k, j, t), "");
    const bool keep = ps.keep && keeps(s);
    // A pass that keeps slots waits for the writes of those it does not keep (bound_writes):
    // they go before the kept ones' (which hold no memory of their own).
    step_sub_group(k, s, hyper, grad_mult, grad, p.dst, /*urgent_writes=*/ps.keep && !keep);
    if (keep) keep_slot(std::move(s));
    STRATA_RETURN_IF_ERROR(bound_writes(), "after stepping " + m.name);
    if (!shadows) {
      STRATA_CHECK(!sharded_ || !cache_.resident(k) || j > 0,
                   "sharded: a gathered group outlived its use");
      STRATA_RETURN_IF_ERROR(publish_piece(k, j, p.dst, std::move(p.keep), /*wait=*/false),
                             "stepping " + m.name);
    }
  }
  return Status::ok();
}

size_t OptimizerPipeline::Pass::end_of(int k) const {
  size_t end = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].first == k) end = u + 1;
  }
  return end;
}

Status OptimizerPipeline::step(int k, const OptimizerHyper& hyper, float grad_mult,
                               const BeforeStep& before) {
  Pass p = begin_pass({k}, hyper, grad_mult, nullptr, before, /*keep=*/true);
  return advance(p, SIZE_MAX);
}

Status OptimizerPipeline::run(const std::vector<int>& order, const OptimizerHyper& hyper,
                              float grad_mult, std::vector<std::shared_ptr<PinnedBuffer>>* shadows,
                              bool keep) {
  Pass p = begin_pass(order, hyper, grad_mult, shadows, {}, keep);
  return advance(p, SIZE_MAX);
}

// ---- publishing parameters ---------------------------------------------------------------------

Status OptimizerPipeline::publish_piece(int k, size_t j, const void* src,
                                        std::shared_ptr<PinnedBuffer> keep, bool wait,
                                        bool copy_current) {
  Module& m = homes_.module(k);
  Stream& h2d = dev_.h2d_stream();
  const size_t off = m.sub_start(j) * dtype_size(dt_), bytes = m.sub_len(j) * dtype_size(dt_);
  bool copied_up = false;  // whether the h2d stream copies from `src`
  if (m.p.tier == Tier::kHost && src != m.p.host.as<char>() + off) {
    std::memcpy(m.p.host.as<char>() + off, src, bytes);
  } else if (m.p.tier == Tier::kDevice && src != static_cast<char*>(m.p.dev) + off) {
    if (dev_.host_addressable()) {
      std::memcpy(static_cast<char*>(m.p.dev) + off, src, bytes);
    } else {
      dev_.copy_h2d(h2d, static_cast<char*>(m.p.dev) + off, src, bytes);
      copied_up = true;
    }
    // Host-stepped parameters of a device-homed module cross the link as a cached copy's
    // write-through does (the planner counts both; these had gone uncounted: -20% of the
    // minimum with the optimizer in host RAM on an H200, docs/GPU.md).
    counters_.update([bytes](TierCounts& n) { n.dev_in += bytes; });
  }
  if (cache_.resident(k) && !copy_current) {
    if (sharded_) {
      cache_.drop(k);  // a gathered group is never updated in place: the next use gathers anew
    } else {
      cache_.write_through(k, off, src, bytes);
      copied_up = true;
    }
  }
  const std::string what =
      m.sub_groups() > 1 ? fmt::format("{} parameters (sub-group {})", m.name, j) : m.name;
  if (!wait) {
    if (keep && copied_up) hold_until_copied(keep);
    if (m.p.tier == Tier::kNvme) {
      queue_write(m.p.subs[j], src, std::move(keep), what, /*state=*/false);
    }
    return Status::ok();
  }
  // `keep` lives to the end of this call, past the copies and the write.
  STRATA_RETURN_IF_ERROR(dev_.synchronize(h2d), "copying " + what);
  release_copied();  // every copy up enqueued so far has run
  if (m.p.tier == Tier::kNvme) {
    STRATA_RETURN_IF_ERROR(homes_.io()->wait(homes_.io()->write(m.p.subs[j], src)),
                           "writing " + what);
  }
  return Status::ok();
}

Status OptimizerPipeline::publish(int k, const void* lp, std::shared_ptr<PinnedBuffer> keep,
                                  bool wait) {
  Module& m = homes_.module(k);
  for (size_t j = 0; j < m.sub_groups(); ++j) {
    STRATA_RETURN_IF_ERROR(
        publish_piece(k, j, static_cast<const char*>(lp) + m.sub_start(j) * dtype_size(dt_), keep,
                      wait),
        "");
  }
  return Status::ok();
}

Status OptimizerPipeline::write_params(int k, const float* master) {
  Module& m = homes_.module(k);
  for (size_t j = 0; j < m.sub_groups(); ++j) {
    STRATA_RETURN_IF_ERROR(write_params(k, j, master + m.sub_start(j)), "");
  }
  return Status::ok();
}

Status OptimizerPipeline::finish_copies_down() {
  if (!copies_down_) return Status::ok();
  copies_down_ = false;
  return dev_.synchronize(dev_.d2h_stream()).with_context("copying new parameters down");
}

void OptimizerPipeline::hold_until_copied(std::shared_ptr<PinnedBuffer> keep) {
  std::unique_ptr<Event> done;
  {
    std::lock_guard<std::mutex> l(copies_up_mu_);
    if (!free_events_.empty()) {
      done = std::move(free_events_.back());
      free_events_.pop_back();
    }
  }
  if (!done) done = dev_.create_event();
  dev_.record(*done, dev_.h2d_stream());
  std::lock_guard<std::mutex> l(copies_up_mu_);
  copies_up_.push_back({std::move(done), std::move(keep)});
}

void OptimizerPipeline::release_copied() {
  std::vector<std::shared_ptr<PinnedBuffer>> done;  // returned to the tier outside the lock
  std::lock_guard<std::mutex> l(copies_up_mu_);
  // Events on one stream complete in the order they were recorded.
  while (!copies_up_.empty() && dev_.query(*copies_up_.front().done)) {
    done.push_back(std::move(copies_up_.front().keep));
    free_events_.push_back(std::move(copies_up_.front().done));
    copies_up_.pop_front();
  }
}

Status OptimizerPipeline::wait_oldest_copy_up() {
  CopyUp c;
  {
    std::lock_guard<std::mutex> l(copies_up_mu_);
    if (copies_up_.empty()) return Status::ok();
    c = std::move(copies_up_.front());
    copies_up_.pop_front();
  }
  // The buffer goes back whatever the wait returned: a failed wait is the device's error, which
  // ends the run.
  Status st = dev_.synchronize(*c.done).with_context("copying new parameters to the device");
  c.keep.reset();
  std::lock_guard<std::mutex> l(copies_up_mu_);
  free_events_.push_back(std::move(c.done));
  return st;
}

Status OptimizerPipeline::finish_copies_up() {
  Status first;
  while (copies_up_held() > 0) {
    Status s = wait_oldest_copy_up();
    if (first.is_ok()) first = s;
  }
  return first;
}

size_t OptimizerPipeline::copies_up_held() const {
  std::lock_guard<std::mutex> l(copies_up_mu_);
  return copies_up_.size();
}

bool OptimizerPipeline::oldest_copy_up_alone() const {
  std::lock_guard<std::mutex> l(copies_up_mu_);
  return !copies_up_.empty() && copies_up_.front().keep.use_count() == 1;
}

Result<PinnedBuffer> OptimizerPipeline::host_buf(size_t bytes, const char* what, bool try_only) {
  release_copied();
  if (try_only) return homes_.pool().acquire(bytes);
  auto b = homes_.host_buf(bytes, what);
  if (b.is_ok() || b.status().code() != StatusCode::kOutOfMemory || writes_.empty()) return b;
  // The pieces of this pipeline's writes still in flight come back as the writes finish
  // (Homes::host_buf waits for the streams' copies, not for the disk): near the host tier's
  // budget, which the memory model sizes without them, wait for those and try again.
  STRATA_RETURN_IF_ERROR(retire_writes(0), what);
  return homes_.host_buf(bytes, what);
}

Status OptimizerPipeline::write_params(int k, size_t j, const float* master) {
  Module& m = homes_.module(k);
  const std::string what = "deriving " + m.name + " parameters";
  STRATA_RETURN_IF_ERROR(finish_copies_down(), what);
  STRATA_RETURN_IF_ERROR(cache_.wait_fetch(k), what);
  STRATA_ASSIGN_OR_RETURN(Piece p, piece(k, j, Target{host_visible_params(m)}), what);
  convert(master, DType::kF32, p.dst, dt_, m.sub_len(j));
  return publish_piece(k, j, p.dst, std::move(p.keep), /*wait=*/true).with_context(what);
}

Status OptimizerPipeline::write_stored_params(int k, size_t j, const void* params) {
  Module& m = homes_.module(k);
  const std::string what = "writing " + m.name + " parameters";
  STRATA_RETURN_IF_ERROR(finish_copies_down(), what);
  STRATA_RETURN_IF_ERROR(cache_.wait_fetch(k), what);
  STRATA_ASSIGN_OR_RETURN(Piece p, piece(k, j, Target{host_visible_params(m)}), what);
  std::memcpy(p.dst, params, m.sub_len(j) * dtype_size(dt_));
  return publish_piece(k, j, p.dst, std::move(p.keep), /*wait=*/true).with_context(what);
}

// ---- writes ------------------------------------------------------------------------------------

void OptimizerPipeline::queue_write(const SwapExtent& ext, const void* src,
                                    std::shared_ptr<PinnedBuffer> keep, const std::string& what,
                                    bool state, bool urgent) {
  writes_.push_back({homes_.io()->write(ext, src, urgent), std::move(keep), what, false, state});
  if (state) ++unkept_state_writes_;
}

Status OptimizerPipeline::retire_writes(size_t keep_at_most) {
  release_copied();
  Status first;
  while (!writes_.empty() &&
         (writes_.size() > keep_at_most || homes_.io()->done(writes_.front().t))) {
    Write w = std::move(writes_.front());
    writes_.pop_front();
    if (w.counted) --unkept_state_writes_;
    Status s = homes_.io()->wait(w.t);
    if (!s.is_ok() && first.is_ok()) first = s.with_context("writing " + w.what);
  }
  return first;
}

size_t OptimizerPipeline::read_ahead_room() const {
  const size_t busy = prepared_count() + sub_groups_writing(),
               total = pipeline_staging_sub_groups(opt_.buffer_count) + extra_;
  return busy >= total ? 0 : total - busy;
}

Status OptimizerPipeline::bound_writes() {
  Status first;
  // The oldest counted write first (older writes from kept slots may still be in flight).
  while (unkept_state_writes_ > max_writes()) {
    auto w = std::find_if(writes_.begin(), writes_.end(), [](const Write& x) { return x.counted; });
    STRATA_CHECK(w != writes_.end(), "state writes counted but not queued");
    Status s = homes_.io()->wait(w->t);
    if (!s.is_ok() && first.is_ok()) first = s.with_context("writing " + w->what);
    writes_.erase(w);
    --unkept_state_writes_;
  }
  Status rest = retire_writes(SIZE_MAX);  // and whatever else has finished
  return first.is_ok() ? rest : first;
}

size_t OptimizerPipeline::sub_groups_writing() const {
  std::set<std::string_view> writing;
  for (const auto& w : writes_) {
    if (!w.kept) writing.insert(w.what);
  }
  return writing.size();
}

}  // namespace strata
