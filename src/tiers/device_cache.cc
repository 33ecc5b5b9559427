#include "src/tiers/device_cache.h"

#include <fmt/format.h>

#include <map>
#include <mutex>

#include "src/tiers/device_optimizer.h"
#include "src/tiers/memory_model.h"
#include "strata/log.h"

namespace strata {

// Piece g of all NVMe fetches uses bufs[g % size]; its read starts once piece g - size has
// been copied out of that buffer (by the host thread when enqueued, else by the h2d stream's
// callback after that copy). Tickets and the waiting reads are handed between the host thread
// and the h2d stream's callbacks under `mu`.
struct DeviceCache::FetchRing {
  IoWorker* io = nullptr;
  std::vector<PinnedBuffer> bufs;
  uint64_t next = 0;  // the host thread's next piece number
  std::mutex mu;
  uint64_t copied = 0;                            // pieces copied out of their buffer
  std::map<uint64_t, const SwapExtent*> waiting;  // pieces whose buffer is still in use
  std::map<uint64_t, IoWorker::Ticket> reading;   // pieces whose read was started

  void start(uint64_t g, const SwapExtent* e) {  // under mu
    reading[g] = io->read(*e, bufs[g % bufs.size()].data(), /*urgent=*/true);
  }
};

namespace {

CachePolicyOptions policy_options(const TierOptions& o) {
  CachePolicyOptions p;
  p.prefetch_bytes = o.prefetch_bytes;
  p.max_reuse_distance = o.max_reuse_distance;
  return p;
}

}  // namespace

DeviceCache::DeviceCache(Homes& homes, const TierOptions& options, DType dt, bool sharded,
                         TierCounters& counters, AsyncError& errors)
    : homes_(homes),
      dev_(homes.device()),
      opt_(options),
      dt_(dt),
      sharded_(sharded),
      counters_(counters),
      errors_(errors),
      policy_(policy_options(options)),
      cache_(homes.modules().size()),
      secondary_(homes.modules().size(), nullptr) {}

// ---- phases --------------------------------------------------------------------------------

void DeviceCache::begin_phase(const std::string& phase) {
  drop_secondaries();  // hpZ's secondary shards live within one phase
  phase_ = phase;
  rec_.clear();
  pos_ = 0;
  mismatch_ = false;
  auto it = traces_.find(phase);
  cur_ = it == traces_.end() ? nullptr : &it->second;
  policy_.set_trace(cur_);
}

void DeviceCache::end_phase() {
  if (!cur_ || mismatch_ || rec_.size() != cur_->size()) {
    if (cur_ && !mismatch_) {
      log_warn("tier manager: {} step ended after {} of {} recorded accesses; re-recording", phase_,
               rec_.size(), cur_->size());
    }
    traces_[phase_] = Trace(rec_);
  }
  cur_ = nullptr;
  policy_.set_trace(nullptr);
}

const Trace* DeviceCache::trace(const std::string& phase) const {
  auto it = traces_.find(phase);
  return it == traces_.end() ? nullptr : &it->second;
}

// ---- parameters ------------------------------------------------------------------------------

Result<const void*> DeviceCache::acquire(int m) {
  Module& mod = homes_.module(m);
  rec_.push_back({m, mod.p.bytes, 0.0});
  if (trace_known() && (pos_ >= cur_->size() || cur_->accesses()[pos_].object != m)) {
    log_warn(
        "tier manager: {} access order changed at position {} (expected {}, got {}); "
        "fetching on demand for this step and re-recording",
        phase_, pos_,
        pos_ < cur_->size() ? homes_.module(cur_->accesses()[pos_].object).name
                            : std::string("end of step"),
        mod.name);
    mismatch_ = true;
    policy_.set_trace(nullptr);
  }
  if (mod.p.tier == Tier::kDevice && !sharded_) {
    ++pos_;
    return static_cast<const void*>(mod.p.dev);
  }
  Entry& c = cache_[size_t(m)];
  if (!c.resident) {
    bool fetched = false;
    STRATA_RETURN_IF_ERROR(fetch(m, UINT64_MAX, /*may_block=*/true, &fetched),
                           "fetching " + mod.name + " parameters");
  }
  ++c.pins;
  c.acq_pos = pos_;
  c.last_pos = pos_;
  compute_waits_for(c.ready);
  ++pos_;
  prefetch_after_acquire();
  return static_cast<const void*>(c.ptr);
}

void DeviceCache::release(int m) {
  if (homes_.module(m).p.tier == Tier::kDevice && !sharded_) return;
  Entry& c = cache_[size_t(m)];
  STRATA_CHECK(c.pins > 0, "release_params without acquire");
  --c.pins;
  c.last_use = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*c.last_use, dev_.compute_stream());
  // Sharded: a gathered group is released as soon as nobody holds it (see TierOptions).
  if (c.pins == 0 && sharded_) {
    if (!keep_gathered(m)) drop(m);
  } else if (c.pins == 0 && !c.persistent && policy_.drop_after_use(c.acq_pos) &&
             !(steps_on_device(homes_.module(m)) && policy_.last_in_step(c.acq_pos))) {
    // A copy the device's optimizer steps is kept after its last use of the step: it is
    // stepped in place and copied down to its home, where a dropped one would be stepped in a
    // buffer of the same size, copied down and fetched again by the next step's first use (the
    // link crossed twice). Room needed before then evicts it as any copy.
    drop(m);
  }
}

Status DeviceCache::fetch(int m, uint64_t need_before, bool may_block, bool* fetched) {
  Module& mod = homes_.module(m);
  Entry& c = cache_[size_t(m)];
  *fetched = false;
  if (before_fetch_) {
    Status s = before_fetch_(m);
    if (!s.is_ok()) {
      if (may_block) return s;
      errors_.set(s.with_context("prefetching " + mod.name + " parameters"));
      return Status::ok();
    }
  }
  const size_t full = cache_bytes(mod);
  auto r = allocate(full, mod.name + ".params", m, need_before, may_block);
  if (!r.is_ok()) return may_block ? r.status() : Status::ok();
  c.ptr = *r;
  // This rank's shard lands at its offset in the group; the all-gather fills the rest.
  char* mine = static_cast<char*>(c.ptr) + mod.off * dtype_size(dt_);
  Stream& h2d = dev_.h2d_stream();
  if (mod.p.tier == Tier::kDevice) {
    dev_.copy_d2d(h2d, mine, mod.p.dev, mod.p.bytes);
  } else if (mod.p.tier == Tier::kHost) {
    if (c.home_written) dev_.wait(h2d, *c.home_written);  // the home's new parameters first
    dev_.copy_h2d(h2d, mine, mod.p.host.data(), mod.p.bytes);
  } else {
    Status st = fetch_from_nvme(mod, mine);
    if (!st.is_ok()) {
      dev_.release(c.ptr);
      c.ptr = nullptr;
      return may_block ? st : Status::ok();
    }
  }
  if (sharded_) all_gather(m, mine);
  c.ready = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*c.ready, h2d);
  c.resident = true;
  c.persistent = persistent_copy(mod.numel, opt_, sharded_);
  counters_.update([&](TierCounts& n) {
    n.dev_in += full;
    ++n.fetches;
    if (need_before != UINT64_MAX) ++n.prefetches;  // a prefetch (demand fetches pass MAX)
  });
  *fetched = true;
  return Status::ok();
}

Status DeviceCache::fetch_from_nvme(Module& mod, char* mine) {
  if (!ring_) {
    auto ring = std::make_shared<FetchRing>();
    ring->io = homes_.io();
    size_t piece = 0;  // the largest NVMe-homed parameters' first (largest) sub-group
    for (const Module& m : homes_.modules()) {
      if (m.p.tier == Tier::kNvme)
        piece = std::max(piece, piece_bytes(m.sub_len(0), dtype_size(dt_)));
    }
    for (size_t i = 0; i < kFetchStagingPieces; ++i) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, homes_.host_buf(piece, "parameter fetch staging"),
                              "staging parameter fetches from nvme");
      ring->bufs.push_back(std::move(b));
    }
    ring_ = std::move(ring);
  }
  const size_t K = ring_->bufs.size(), es = dtype_size(dt_);
  Stream& h2d = dev_.h2d_stream();
  AsyncError* errors = &errors_;
  for (size_t j = 0; j < mod.sub_groups(); ++j) {
    const uint64_t g = ring_->next++;
    const SwapExtent* ext = &mod.p.subs[j];
    {
      std::lock_guard<std::mutex> l(ring_->mu);
      if (g < ring_->copied + K) {
        ring_->start(g, ext);
      } else {
        ring_->waiting[g] = ext;
      }
    }
    std::shared_ptr<FetchRing> ring = ring_;
    dev_.host_fn(h2d, [ring, g, errors] {
      IoWorker::Ticket t;
      {
        std::lock_guard<std::mutex> l(ring->mu);
        auto it = ring->reading.find(g);
        STRATA_CHECK(it != ring->reading.end(), "a parameter piece's read was never started");
        t = it->second;
        ring->reading.erase(it);
      }
      Status s = ring->io->wait(t);
      if (!s.is_ok()) errors->set(s);
    });
    dev_.copy_h2d(h2d, mine + mod.sub_start(j) * es, ring_->bufs[g % K].data(),
                  mod.sub_len(j) * es);
    dev_.host_fn(h2d, [ring, g, K] {
      std::lock_guard<std::mutex> l(ring->mu);
      ring->copied = g + 1;
      auto it = ring->waiting.find(g + K);
      if (it == ring->waiting.end()) return;
      ring->start(g + K, it->second);
      ring->waiting.erase(it);
    });
  }
  counters_.update([&](TierCounts& n) {
    n.host_in += mod.p.bytes;
    n.host_out += mod.p.bytes;
  });
  return Status::ok();
}

void DeviceCache::prefetch_after_acquire() {
  if (sharded_) {
    if (trace_known() && !cur_->empty() && opt_.prefetch_bytes > 0) gather_window();
    return;
  }
  if (!policy_.trace()) return;
  uint64_t in_flight = 0;
  for (size_t m = 0; m < cache_.size(); ++m) {
    if (cache_[m].resident && cache_[m].ready && !dev_.query(*cache_[m].ready)) {
      in_flight += homes_.modules()[m].p.bytes;
    }
  }
  policy_.prefetch(*this, pos_ - 1, in_flight);  // after the access at pos_ - 1
}

bool DeviceCache::evictable(int m) const {
  const Entry& c = cache_[size_t(m)];
  return c.resident && c.pins == 0 && !c.persistent;
}

bool DeviceCache::fetchable(int m) const {
  return homes_.modules()[size_t(m)].p.tier != Tier::kDevice && !cache_[size_t(m)].resident;
}

bool DeviceCache::prefetch(int m, uint64_t /*bytes*/, uint64_t horizon) {
  bool fetched = false;
  return fetch(m, horizon, /*may_block=*/false, &fetched).is_ok() && fetched;
}

void DeviceCache::compute_waits_for(const std::shared_ptr<Event>& ev) {
  if (!ev) return;
  if (dev_.host_addressable()) {
    // Timed wait: how long the compute stream stalls on this copy.
    Device* dev = &dev_;
    TierCounters* counters = &counters_;
    dev_.host_fn(dev_.compute_stream(), [dev, counters, ev] {
      auto t0 = TierClock::now();
      dev->synchronize(*ev).ignore();
      const double w = seconds_between(t0, TierClock::now());
      counters->update([w](TierCounts& n) { n.schedule.compute_wait_s += w; });
    });
  } else {
    dev_.wait(dev_.compute_stream(), *ev);
  }
}

// ---- device memory ---------------------------------------------------------------------------

void DeviceCache::reclaim(bool block_oldest) {
  if (block_oldest && !pending_.empty()) {
    const PendingFree& f = pending_.front();
    if (f.after && !dev_.query(*f.after)) dev_.synchronize(*f.after).ignore();
  }
  // Every free whose event has run, not only up to the first that has not: the pending frees
  // wait on different streams (a cached copy's last use on compute, a gradient buffer's drain
  // on d2h), and a drain still queued must not hold back memory that is already free.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->after && !dev_.query(*it->after)) {
      ++it;
      continue;
    }
    dev_.release(it->ptr);
    it = pending_.erase(it);
  }
}

void DeviceCache::release_after(void* ptr, size_t bytes, std::shared_ptr<Event> after) {
  pending_.push_back({ptr, round_up(bytes, 256), std::move(after)});
}

void DeviceCache::drop(int m) {
  Entry& c = cache_[size_t(m)];
  // The memory is freed once its last use (and its fetch) have run, and the copy down into
  // the home that reads it (copied_down).
  if (c.ready) dev_.synchronize(*c.ready).ignore();
  if (c.home_written && !dev_.query(*c.home_written)) {
    dev_.synchronize(*c.home_written).ignore();
  }
  pending_.push_back({c.ptr, round_up(cache_bytes(homes_.module(m)), 256), c.last_use});
  c.ptr = nullptr;
  c.resident = false;
}

Result<void*> DeviceCache::allocate(size_t bytes, const std::string& tag, int keep,
                                    uint64_t need_before, bool may_block) {
  // Waits for pending frees as often as there are any, then for the gradient drains twice
  // (counted apart: how many frees were pending depends on timing, the outcome must not).
  const bool prefetch = need_before != UINT64_MAX;
  for (int drain_waits = 0;;) {
    reclaim(false);
    // A prefetch leaves room for the gradient buffers backward allocates before the prefetched
    // copy is used: the trace does not hold them, and taking their room would only have the
    // next gradient buffer evict the copy again before its use.
    Result<void*> r = out_of_memory("the gradient buffers' room");
    const DeviceMemoryStats ms = dev_.memory_stats();
    if (!prefetch || sharded_ || ms.used + bytes + prefetch_reserve_ <= ms.capacity) {
      r = dev_.allocate(bytes, tag);
    }
    if (r.is_ok()) return r;
    // Frees already on their way (evicted copies whose last use has not run yet, gradient
    // buffers still draining) make the room: evicting another object now would throw away a
    // copy that is still wanted and fetch it again later. A prefetch gives up until they ran; a
    // demand fetch waits for the oldest. The room they make is what they add to the free bytes
    // (a prefetch's reserve counted), so the shortfall is what they must cover.
    size_t on_the_way = 0;
    for (const PendingFree& f : pending_) on_the_way += f.bytes;
    const size_t want = bytes + (prefetch && !sharded_ ? prefetch_reserve_ : 0);
    const size_t shortfall = ms.used + want > ms.capacity ? ms.used + want - ms.capacity : want;
    if (on_the_way >= std::min(shortfall, bytes)) {
      if (!may_block) return r.status();
      reclaim(true);
      continue;
    }
    // Sharded: never evict for room (whether an allocation fails depends on timing; an
    // eviction would change which gathers follow, and every rank must issue the same ones).
    if (!sharded_) {
      const int victim = policy_.victim(*this, pos_, keep, need_before);
      if (victim >= 0) {
        drop(victim);
        continue;
      }
    }
    if (!may_block) return r.status();
    if (!pending_.empty()) {
      reclaim(true);
      continue;
    }
    if (drain_waits++ < 2) {  // gradient drains in flight free device memory when they finish
      dev_.synchronize(dev_.d2h_stream()).ignore();
      continue;
    }
    auto st = dev_.memory_stats();
    return out_of_memory(fmt::format(
        "device tier full: {} for {} does not fit ({} of {} in use, every cached object "
        "pinned); raise device.memory_limit or lower train_micro_batch_size_per_gpu{}",
        format_bytes(double(bytes)), tag, format_bytes(double(st.used)),
        format_bytes(double(st.capacity)),
        sharded_ ? " or zero_optimization.stage3_prefetch_bucket_size (with several ranks, "
                   "gathered groups in the prefetch window are never evicted)"
                 : ""));
  }
}

// ---- new parameters --------------------------------------------------------------------------

Status DeviceCache::wait_fetch(int m) {
  const Entry& c = cache_[size_t(m)];
  if (c.resident && c.ready) {
    STRATA_RETURN_IF_ERROR(dev_.synchronize(*c.ready),
                           "waiting for the fetch of " + homes_.module(m).name + " parameters");
  }
  return Status::ok();
}

void* DeviceCache::step_in_place(int m) {
  Entry& c = cache_[size_t(m)];
  if (!c.resident || sharded_) return nullptr;
  compute_waits_for(c.ready);
  return c.ptr;
}

void DeviceCache::copied_down(int m, std::shared_ptr<Event> down) {
  cache_[size_t(m)].home_written = std::move(down);
}

void DeviceCache::write_through(int m, size_t offset, const void* lp, size_t bytes) {
  Entry& c = cache_[size_t(m)];
  Stream& h2d = dev_.h2d_stream();
  dev_.copy_h2d(h2d, static_cast<char*>(c.ptr) + offset, lp, bytes);
  // Under backward the copy may be evicted before the h2d stream runs this write: its memory
  // is freed only after it (the compute stream's last use of it came earlier, or this module's
  // gradients would not be final).
  c.last_use = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*c.last_use, h2d);
  // The next use waits for it too (the deferred step publishes while the forward runs).
  c.ready = c.last_use;
  counters_.update([bytes](TierCounts& n) { n.dev_in += bytes; });
}

void DeviceCache::release_all() {
  for (void*& p : secondary_) {
    if (p) dev_.release(p);
    p = nullptr;
  }
  reclaim(true);
  while (!pending_.empty()) reclaim(true);
  for (auto& c : cache_) {
    if (c.resident) dev_.release(c.ptr);
    c.resident = false;
  }
  // The ring's buffers go back to the host tier now, whatever callbacks still hold the ring.
  if (ring_) {
    std::lock_guard<std::mutex> l(ring_->mu);
    ring_->bufs.clear();
  }
  ring_.reset();
}

}  // namespace strata
