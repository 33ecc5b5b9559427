#include "src/tiers/grad_buckets.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "src/comm/zeropp.h"
#include "src/tiers/memory_model.h"
#include "strata/cpu_optim.h"
#include "strata/kernels.h"

namespace strata {

GradBuckets::GradBuckets(Homes& homes, DeviceCache& cache, const TierOptions& options, bool sharded,
                         TierCounters& counters, AsyncError& errors,
                         std::function<void(int)> on_final)
    : homes_(homes),
      dev_(homes.device()),
      cache_(cache),
      opt_(options),
      sharded_(sharded),
      counters_(counters),
      errors_(errors),
      on_final_(std::move(on_final)),
      gdev_(homes.modules().size(), nullptr),
      in_place_(homes.modules().size(), 0),
      gstats_(homes.modules().size()),
      stats_on_device_(homes.modules().size(), 0),
      spill_(homes, counters, errors, options.optimizer_threads) {}

Status GradBuckets::init_bucket(size_t shard_elems, size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(void* b, dev_.allocate(bytes, "gradient reduce bucket"),
                          "device tier: zero_optimization.reduce_bucket_size");
  bucket_ = static_cast<float*>(b);
  bucket_kc_ = shard_elems;
  if (opt_.zeropp != nullptr && opt_.zeropp->quantized_gradients()) {
    // qgZ: one scratch for the largest bucket; the reductions run one after another on d2h.
    STRATA_ASSIGN_OR_RETURN(
        qgz_scratch_,
        dev_.allocate(opt_.zeropp->shape().qgz_scratch_bytes(shard_elems, true), "qgZ scratch"),
        "device tier: zero_optimization.zero_quantized_gradients' scratch");
  }
  return Status::ok();
}

bool GradBuckets::in_place(int m, int micro) const {
  const Home& acc = homes_.module(m).gacc;
  const bool kernels_reach =
      dev_.host_addressable() ? acc.tier != Tier::kNvme : acc.tier == Tier::kDevice;
  return micro == 0 && !sharded_ && kernels_reach && acc.ptr() != nullptr;
}

size_t GradBuckets::device_reserve(int micro) const {
  size_t r = 0, part = 0;
  for (size_t m = 0; m < homes_.modules().size(); ++m) {
    const Module& mod = homes_.module(int(m));
    if (mod.frozen()) continue;  // LoRA's base: no gradients
    part = std::max(part, round_up(mod.padded * 4, 256));
    if (!in_place(int(m), micro)) r = std::max(r, round_up(mod.padded * 4, 256));
  }
  return parts_ ? r + part : r;
}

Result<float*> GradBuckets::acquire(int m, int micro) {
  if (gdev_[size_t(m)]) return gdev_[size_t(m)];
  const Module& mod = homes_.module(m);
  const size_t bytes = mod.padded * 4;  // the whole (padded) group
  if (in_place(m, micro)) {
    // In compute-stream order, as a device buffer's zeroing: the accumulator's last reader
    // (the optimizer pass of the step before) is done (TierManager::acquire_grads).
    auto* acc = static_cast<float*>(mod.gacc.ptr());
    dev_.memset_zero(dev_.compute_stream(), acc, bytes);
    gdev_[size_t(m)] = acc;
    in_place_[size_t(m)] = 1;
    return acc;
  }
  STRATA_ASSIGN_OR_RETURN(float* p, zeroed_buffer(m, ".grad"), "gradients of " + mod.name);
  gdev_[size_t(m)] = p;
  return p;
}

Result<float*> GradBuckets::zeroed_buffer(int m, const char* tag) {
  const size_t bytes = homes_.module(m).padded * 4;  // the whole (padded) group
  STRATA_ASSIGN_OR_RETURN(void* p,
                          cache_.allocate(bytes, homes_.module(m).name + tag, -1, UINT64_MAX,
                                          /*may_block=*/true),
                          "");
  dev_.memset_zero(dev_.compute_stream(), p, bytes);
  return static_cast<float*>(p);
}

Result<float*> GradBuckets::acquire_part(int m) {
  STRATA_ASSIGN_OR_RETURN(
      float* p, zeroed_buffer(m, ".grad part"),
      "gradients of " + homes_.module(m).name + " (a backward group's further micro-batch)");
  return p;
}

void GradBuckets::add_part(int m, float* part) {
  float* g = gdev_[size_t(m)];
  STRATA_CHECK(g != nullptr && part != nullptr, "add_part without acquire and acquire_part");
  const size_t bytes = homes_.module(m).padded * 4;
  Stream& s = dev_.compute_stream();
  dev_.kernels().add_inplace(s, DType::kF32, g, part, homes_.module(m).padded);
  auto added = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*added, s);
  cache_.release_after(part, bytes, std::move(added));
}

void GradBuckets::drain(int m, int micro, bool last) {
  float* g = gdev_[size_t(m)];
  STRATA_CHECK(g != nullptr, "drain_grads without acquire_grads");
  gdev_[size_t(m)] = nullptr;
  auto ev = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*ev, dev_.compute_stream());
  dev_.wait(dev_.d2h_stream(), *ev);
  // Sharded: every rank's gradient of this micro-batch is summed into this rank's shard by
  // bucketed reduce-scatters; only the shard leaves the device.
  if (sharded_) {
    drain_sharded(m, g, micro, last);
    return;
  }
  const bool own = !in_place_[size_t(m)];
  in_place_[size_t(m)] = 0;
  if (!own) {
    // GACC holds this micro-batch's gradients already.
  } else if (homes_.module(m).gacc.tier == Tier::kNvme) {  // strata.placement.grads = nvme
    spill_.accumulate(m, g, micro, last, &gstats_[size_t(m)]);
  } else {
    accumulate(m, g, 0, homes_.module(m).sn, micro);
  }
  // The first micro-batch's buffer is the last: it holds the step's whole gradient (one
  // micro-batch, or a backward group's parts added into it).
  finish(m, own ? g : nullptr, last, /*whole=*/own && micro == 0);
}

GradStats GradBuckets::stats() const {
  GradStats s;
  for (size_t m = 0; m < gstats_.size(); ++m) {
    if (stats_on_device_[m]) {
      // Squares cannot overflow fp64: the sum is non-finite iff some gradient is.
      s.merge({stats_host_[m], !std::isfinite(stats_host_[m])});
    } else {
      s.merge(gstats_[m]);
    }
  }
  return s;
}

bool GradBuckets::stats_buffers() {
  const size_t bytes = gstats_.size() * 8;
  if (!stats_host_) {
    auto h = dev_.allocate_host(bytes);
    if (!h.is_ok()) {
      errors_.set(h.status().with_context("gradient statistics"));
      return false;
    }
    stats_host_ = static_cast<double*>(*h);
  }
  if (!stats_dev_) {
    auto b = dev_.allocate(round_up(bytes, 256), "gradient statistics");
    if (!b.is_ok()) {
      errors_.set(b.status().with_context("gradient statistics"));
      return false;
    }
    stats_dev_ = static_cast<double*>(*b);
  }
  return true;
}

bool GradBuckets::gacc_on_device(int m) const {
  return homes_.module(m).gacc.tier == Tier::kDevice && !dev_.host_addressable();
}

void GradBuckets::accumulate(int m, const float* src, size_t a, size_t len, int micro) {
  Stream& d2h = dev_.d2h_stream();
  if (gacc_on_device(m)) {  // stays on the device
    float* acc = static_cast<float*>(homes_.module(m).gacc.dev) + a;
    if (micro == 0) {
      dev_.copy_d2d(d2h, acc, src, len * 4);
    } else {
      dev_.kernels().add_inplace(d2h, DType::kF32, acc, src, len);
    }
    return;
  }
  float* acc = static_cast<float*>(homes_.module(m).gacc.ptr()) + a;
  const size_t bytes = len * 4;
  if (micro == 0) {
    dev_.copy_d2h(d2h, acc, src, bytes);
  } else if (dev_.host_addressable()) {
    // The host reads the device buffer in place (it is released after this, in stream order):
    // the same sums as through a landing buffer, without copying the gradients first.
    dev_.host_fn(d2h, [src, acc, len, threads = opt_.optimizer_threads] {
      add_into(acc, src, len, threads);
    });
  } else {
    auto landing = homes_.host_buf(bytes, "gradient landing buffer");
    if (!landing.is_ok()) {
      errors_.set(
          landing.status().with_context("accumulating " + homes_.module(m).name + " gradients"));
      return;
    }
    auto lb = std::make_shared<PinnedBuffer>(std::move(landing).value());
    dev_.copy_d2h(d2h, lb->data(), src, bytes);
    dev_.host_fn(d2h, [lb, acc, len, threads = opt_.optimizer_threads] {
      add_into(acc, lb->as<float>(), len, threads);
      lb->reset();
    });
  }
  // A device-tier accumulator on a host-addressable device (the CPU backend keeps it where the
  // host steps it) is the device's own memory: the copy crosses no link, as on a GPU, where it
  // stays on the device (above).
  if (homes_.module(m).gacc.tier != Tier::kDevice) {
    counters_.update([bytes](TierCounts& n) { n.dev_out += bytes; });
  }
}

void GradBuckets::finish(int m, float* g, bool last, bool whole) {
  Stream& d2h = dev_.d2h_stream();
  // The statistics come from the device where the whole gradient is there: GACC on the device,
  // or the buffer just copied into a host GACC when it held the whole step (on a GPU the host's
  // pass over GACC would be a host function holding the d2h stream, and the host's memory
  // bandwidth is the CPU optimizer's).
  const bool host_gacc = homes_.module(m).gacc.tier == Tier::kHost;
  const float* on_device = gacc_on_device(m) ? static_cast<const float*>(homes_.module(m).gacc.dev)
                           : (whole && g && host_gacc && !dev_.host_addressable()) ? g
                                                                                   : nullptr;
  // Read by stats() once the host has waited for the d2h stream: no host function stalls it.
  if (last) stats_on_device_[size_t(m)] = on_device != nullptr;
  if (last && on_device && !stats_buffers()) {
    // No room for the statistics: the error ends the step at end_backward.
  } else if (last && on_device) {
    double* dev_sq = stats_dev_ + size_t(m);
    dev_.memset_zero(d2h, dev_sq, 8);  // (a simulated device's kernel writes nothing)
    dev_.kernels().norm_sq_and_nonfinite(d2h, dev_sq, on_device, homes_.module(m).sn);
    dev_.copy_d2h(d2h, stats_host_ + size_t(m), dev_sq, 8);
  } else if (last && homes_.module(m).gacc.tier != Tier::kNvme) {  // (GradSpill reduces its own)
    GradStats* out = &gstats_[size_t(m)];
    const float* acc = static_cast<const float*>(homes_.module(m).gacc.ptr());
    const size_t n = homes_.module(m).sn;
    dev_.host_fn(d2h, [out, acc, n] { *out = strata::grad_stats(acc, DType::kF32, n); });
  }
  // Freed once the drain has run (the cache counts it as room on its way meanwhile).
  if (g) {
    auto drained = std::shared_ptr<Event>(dev_.create_event());
    dev_.record(*drained, d2h);
    cache_.release_after(g, homes_.module(m).padded * 4, std::move(drained));
  }
  if (last) on_final_(m);
}

// Reduce-scatters the open bucket on the d2h stream and empties it. One whole module is
// reduced in place in its own buffer; anything else is first copied into the bucket buffer,
// laid out as the collective wants it: rank q's part of every piece, in piece order, at q * k.
void GradBuckets::flush_bucket() {
  if (open_.empty()) return;
  Stream& d2h = dev_.d2h_stream();
  const int world = opt_.grad_comm->size(), rank = opt_.grad_comm->rank();
  const size_t k = open_k_;
  const Piece& p0 = open_.front();
  const bool in_place = open_.size() == 1 && p0.a == 0 && p0.len == homes_.module(p0.m).sn;
  float* buf = in_place ? p0.g : bucket_;
  if (!in_place) {
    size_t o = 0;
    for (const Piece& p : open_) {
      const size_t sn = homes_.module(p.m).sn;
      for (int q = 0; q < world; ++q) {
        dev_.copy_d2d(d2h, buf + size_t(q) * k + o, p.g + size_t(q) * sn + p.a, p.len * 4);
      }
      o += p.len;
    }
  }
  float* mine = buf + size_t(rank) * k;
  Status st;
  if (opt_.zeropp != nullptr && opt_.zeropp->quantized_gradients()) {
    // qgZ: hierarchical int4 (src/comm/zeropp.h), through the scratch (k <= bucket_kc_); the
    // node's partial sums overwrite buf's blocks of other ranks, which nothing reads after.
    st = opt_.zeropp->reduce_scatter(dev_, d2h, buf, mine, k, qgz_scratch_, /*reuse_buf=*/true);
  } else {
    st = opt_.grad_comm->reduce_scatter(d2h, buf, mine, k, DType::kF32, ReduceOp::kSum);
  }
  if (!st.is_ok()) {
    errors_.set(
        st.with_context(fmt::format("reducing the gradients of {}{}", homes_.module(p0.m).name,
                                    open_.size() > 1 ? " and the modules after it" : "")));
  }
  size_t o = 0;
  for (const Piece& p : open_) {
    accumulate(p.m, mine + o, p.a, p.len, p.micro);
    o += p.len;
    if (p.final) finish(p.m, p.g, p.last, /*whole=*/false);
  }
  if (!opt_.overlap_comm) {
    // overlap_comm false: the compute stream waits for this reduction.
    auto ev = std::shared_ptr<Event>(dev_.create_event());
    dev_.record(*ev, d2h);
    dev_.wait(dev_.compute_stream(), *ev);
  }
  const bool shared =
      std::any_of(open_.begin(), open_.end(), [&](const Piece& p) { return p.m != p0.m; });
  counters_.update([shared](TierCounts& n) {
    ++n.grad_reductions;
    n.grad_shared_reductions += shared;
  });
  open_.clear();
  open_k_ = 0;
}

// Module m's gradient buffer g (whole padded group) after its backward: into buckets.
void GradBuckets::drain_sharded(int m, float* g, int micro, bool last) {
  const size_t sn = homes_.module(m).sn, kc = bucket_kc_;
  // A bucket never spans micro-batches (a module's pieces of two micro-batches would be
  // accumulated out of order with respect to their copies).
  if (!open_.empty() && open_.front().micro != micro) flush_bucket();
  if (sn <= kc && open_k_ + sn > kc) flush_bucket();  // a whole module that does not fit
  if (sn > kc) flush_bucket();  // a large module: bucket-sized pieces of its own
  for (size_t a = 0; a < sn;) {
    const size_t len = std::min(kc - open_k_, sn - a);
    open_.push_back({m, g, a, len, micro, last, a + len == sn});
    open_k_ += len;
    a += len;
    if (open_k_ == kc) flush_bucket();
  }
}

void GradBuckets::release_all() {
  for (size_t m = 0; m < gdev_.size(); ++m) {
    if (gdev_[m] && !in_place_[m]) dev_.release(gdev_[m]);
    gdev_[m] = nullptr;
    in_place_[m] = 0;
  }
  if (bucket_) dev_.release(bucket_);
  bucket_ = nullptr;
  if (qgz_scratch_) dev_.release(qgz_scratch_);
  qgz_scratch_ = nullptr;
  if (stats_dev_) dev_.release(stats_dev_);
  stats_dev_ = nullptr;
  if (stats_host_) dev_.release_host(stats_host_);
  stats_host_ = nullptr;
}

}  // namespace strata
