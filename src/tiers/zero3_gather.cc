// ZeRO-3 parameter gathers: the device cache's mode with several ranks (see TierOptions).
//
// A fetch copies this rank's shard to its offset in a whole-group buffer and all-gathers the
// other ranks' shards into it on the h2d stream. Every rank must issue the same gathers in the
// same order, so each decision to gather ahead or to keep a released group is a function of
// the recorded trace (the same on every rank) and the groups' sizes only: the prefetch window
// from a trace position is the positions ahead whose distinct groups' gathered bytes add up to
// at most prefetch_bytes, never past the step's end (the optimizer then updates the shards).
//
// ZeRO++ (src/comm/zeropp.h), gather_zeropp: with qwZ each rank's shard travels as a packed
// int8 chunk (packed_bytes(8, sn, kWeightBlock)); the group is the P chunks dequantized in
// rank order. With hpZ the first gather of a module in a phase keeps this rank's secondary
// chunk: the units (packed chunks, or shards in the model dtype) of ranks [j*P/h, (j+1)*P/h),
// j = its index in the hpZ group; later gathers all-gather those chunks within the group,
// which yields the same P units in the same order, hence the same weights bit for bit.
// Whether a gather is a first one depends only on the (identical) order of gathers, so every
// rank makes the same choice. The buffers' sizes are ZeroPPShape's (what the memory model
// counts), and both are freed as pending frees after the h2d stream's work that reads them, so
// an allocation short of room waits for them instead of failing on timing.
#include <vector>

#include "src/comm/zeropp.h"
#include "src/tiers/device_cache.h"

namespace strata {

void DeviceCache::all_gather(int m, void* mine) {
  const Module& mod = homes_.module(m);
  Entry& c = cache_[size_t(m)];
  const ZeroPP* z = opt_.zeropp;
  Status s;
  if (z != nullptr && (z->quantized_weights() || z->hpz())) {
    s = gather_zeropp(m, mine);
  } else {
    s = opt_.param_comm->all_gather(dev_.h2d_stream(), mine, c.ptr, mod.sn, dt_);
  }
  if (!s.is_ok()) errors_.set(s.with_context("gathering " + mod.name + " parameters"));
}

Status DeviceCache::gather_zeropp(int m, void* mine) {
  const Module& mod = homes_.module(m);
  Entry& c = cache_[size_t(m)];
  ZeroPP& z = *opt_.zeropp;
  Stream& h2d = dev_.h2d_stream();
  const int P = opt_.param_comm->size(), rank = opt_.param_comm->rank();
  const size_t sn = mod.sn, es = dtype_size(dt_);
  const bool q = z.quantized_weights();
  // The sizes come from ZeroPPShape, as the memory model's do.
  const ZeroPPShape shape = z.shape();
  const size_t unit = shape.unit_bytes(sn, dt_);            // one rank's shard
  const size_t sec_bytes = shape.secondary_bytes(sn, dt_);  // P/h units
  char* group = static_cast<char*>(c.ptr);
  // The P packed chunks (qwZ), or the group buffer itself.
  char* units = group;
  if (q) {
    STRATA_ASSIGN_OR_RETURN(
        void* b, allocate(shape.qwz_buffer_bytes(sn, dt_), mod.name + ".qwz", m, UINT64_MAX, true),
        "qwZ: the quantized gather buffer");
    units = static_cast<char*>(b);
  }
  void*& sec = secondary_[size_t(m)];
  if (sec != nullptr) {
    // hpZ: the secondary chunks of this rank's group make the whole group.
    STRATA_RETURN_IF_ERROR(z.hpz_comm()->all_gather_bytes(h2d, sec, units, sec_bytes),
                           "hpZ: gathering the secondary partition");
  } else if (q) {
    quantize_packed(dev_, h2d, 8, dt_, units + size_t(rank) * unit, mine, sn, kWeightBlock);
    STRATA_RETURN_IF_ERROR(
        opt_.param_comm->all_gather_bytes(h2d, units + size_t(rank) * unit, units, unit),
        "qwZ: gathering the int8 shards");
  } else {
    STRATA_RETURN_IF_ERROR(opt_.param_comm->all_gather(h2d, mine, group, sn, dt_),
                           "gathering the parameter shards");
  }
  if (q) {
    for (int r = 0; r < P; ++r) {
      dequantize_packed(dev_, h2d, 8, dt_, group + size_t(r) * sn * es, units + size_t(r) * unit,
                        sn, kWeightBlock, false);
    }
  }
  if (z.hpz() && sec == nullptr) {
    STRATA_ASSIGN_OR_RETURN(sec, allocate(sec_bytes, mod.name + ".hpz", m, UINT64_MAX, true),
                            "hpZ: the secondary partition (zero_hpz_partition_size)");
    dev_.copy_d2d(h2d, sec, units + size_t(z.hpz_index()) * sec_bytes, sec_bytes);
  }
  if (q) {
    // Freed once the h2d stream has dequantized it; a later allocation that needs the room
    // waits for that (a pending free), so one qwZ buffer is all the preflight counts.
    auto done = std::shared_ptr<Event>(dev_.create_event());
    dev_.record(*done, h2d);
    pending_.push_back({units, round_up(shape.qwz_buffer_bytes(sn, dt_), 256), std::move(done)});
  }
  return Status::ok();
}

void DeviceCache::drop_secondaries() {
  std::shared_ptr<Event> done;
  for (void*& p : secondary_) {
    if (p == nullptr) continue;
    if (!done) {
      // After the gathers enqueued so far, as pending frees an allocation can wait for.
      done = std::shared_ptr<Event>(dev_.create_event());
      dev_.record(*done, dev_.h2d_stream());
    }
    const size_t sn = homes_.module(int(&p - secondary_.data())).sn;
    pending_.push_back({p, round_up(opt_.zeropp->shape().secondary_bytes(sn, dt_), 256), done});
    p = nullptr;
  }
}

uint64_t DeviceCache::window_end(uint64_t from) const {
  if (!trace_known() || from >= cur_->size()) return from;
  std::vector<char> seen(cache_.size(), 0);
  uint64_t bytes = 0, j = from;
  for (; j < cur_->size(); ++j) {
    const int m = cur_->accesses()[j].object;
    if (seen[size_t(m)]) continue;
    const uint64_t b = round_up(cache_bytes(homes_.modules()[size_t(m)]), 256);
    if (bytes + b > opt_.prefetch_bytes) break;
    bytes += b;
    seen[size_t(m)] = 1;
  }
  return j;
}

// Gathers every group of the window from the current position that is not cached, in trace
// order. A shortage of device memory blocks (then fails), never skips: a skipped gather would
// leave this rank out of a collective the others issue.
void DeviceCache::gather_window() {
  const uint64_t end = window_end(pos_);
  for (uint64_t j = pos_; j < end; ++j) {
    const int m = cur_->accesses()[j].object;
    if (cache_[size_t(m)].resident) continue;
    bool fetched = false;
    Status s = fetch(m, /*need_before=*/j, /*may_block=*/true, &fetched);
    if (!s.is_ok()) {
      // Remembered for end_backward; the acquire of m fetches (and fails) on demand.
      errors_.set(s.with_context("prefetching " + homes_.module(m).name + " parameters"));
      return;
    }
  }
}

// An unheld gathered group stays cached when its next use lies in the window from here.
bool DeviceCache::keep_gathered(int m) const {
  if (!trace_known()) return false;
  const uint64_t next = cur_->next_use_of(m, pos_);
  return next != UINT64_MAX && next < window_end(pos_);
}

void DeviceCache::drop_unheld() {
  // Gathered groups still cached (prefetched, then a changed order) go before the optimizer
  // step updates the shards; so do hpZ's secondary shards.
  for (size_t m = 0; m < cache_.size(); ++m) {
    if (cache_[m].resident && cache_[m].pins == 0) drop(int(m));
  }
  drop_secondaries();
  reclaim(true);
}

}  // namespace strata
