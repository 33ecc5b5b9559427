#include "src/tiers/optimizer_pipeline.h"

#include <cstring>
#include <set>
#include <string_view>

#include "src/tiers/device_optimizer.h"
#include "strata/cpu_optim.h"

namespace strata {

OptimizerPipeline::OptimizerPipeline(Homes& homes, DeviceCache& cache, const TierOptions& options,
                                     DType dt, DType moment_dt, bool sharded)
    : homes_(homes),
      dev_(homes.device()),
      cache_(cache),
      opt_(options),
      dt_(dt),
      mdt_(moment_dt),
      sharded_(sharded) {}

// ---- the order modules become ready ----------------------------------------------------------

std::vector<int> OptimizerPipeline::step_order(std::vector<bool> skip) const {
  std::vector<int> order;
  for (int k : order_) {
    if (!skip[size_t(k)]) order.push_back(k);
    skip[size_t(k)] = true;  // a skipped (overflow) step may leave duplicates behind
  }
  for (size_t k = 0; k < skip.size(); ++k) {
    if (!skip[k]) order.push_back(int(k));
  }
  return order;
}

void OptimizerPipeline::end_step() {
  drain_prepared();
  if (!order_.empty()) last_order_ = order_;
  order_.clear();
}

// ---- slots -------------------------------------------------------------------------------------

Result<bool> OptimizerPipeline::prepare(int k, bool try_only) {
  Module& m = homes_.module(k);
  Slot s;
  s.master = static_cast<float*>(m.master.ptr());
  s.mom = m.mom.ptr();
  auto buf = [&](size_t bytes) -> Result<std::shared_ptr<PinnedBuffer>> {
    auto b = try_only ? homes_.pool().acquire(bytes) : homes_.host_buf(bytes, "optimizer pipeline");
    if (!b.is_ok()) return b.status();
    return std::make_shared<PinnedBuffer>(std::move(b).value());
  };
  if (m.master.tier == Tier::kNvme) {
    auto b = buf(m.master.bytes);
    if (!b.is_ok()) {
      if (try_only) return false;
      return b.status().with_context("staging " + m.name + " master weights");
    }
    s.master_buf = *b;
  }
  if (m.mom.tier == Tier::kNvme) {
    auto b = buf(m.mom.bytes);
    if (!b.is_ok()) {
      if (try_only) return false;
      return b.status().with_context("staging " + m.name + " moments");
    }
    s.mom_buf = *b;
  }
  IoWorker* io = homes_.io();
  if (s.master_buf) {
    s.master = s.master_buf->as<float>();
    s.rm = io->read(m.master.ext, s.master);
  }
  if (s.mom_buf) {
    s.mom = s.mom_buf->data();
    s.rmo = io->read(m.mom.ext, s.mom);
  }
  prepared_[k] = std::move(s);
  return true;
}

Status OptimizerPipeline::wait_reads(Slot& s) {
  Status st;
  if (s.rm) st = homes_.io()->wait(s.rm);
  if (s.rmo) {
    Status s2 = homes_.io()->wait(s.rmo);
    if (st.is_ok()) st = s2;
  }
  s.rm = s.rmo = 0;
  return st;
}

Status OptimizerPipeline::take(int k, Slot* out) {
  const std::string& name = homes_.module(k).name;
  if (!prepared_.count(k)) {
    STRATA_ASSIGN_OR_RETURN(bool ok, prepare(k, /*try_only=*/false),
                            "reading " + name + " optimizer state");
    (void)ok;
  }
  *out = std::move(prepared_[k]);
  prepared_.erase(k);
  return wait_reads(*out).with_context("reading " + name + " optimizer state");
}

void OptimizerPipeline::drain_prepared() {
  for (auto& [k, slot] : prepared_) wait_reads(slot).ignore();
  prepared_.clear();
}

// ---- stepping ----------------------------------------------------------------------------------

void* OptimizerPipeline::host_visible_params(const Module& m) const {
  if (m.p.tier == Tier::kHost) return m.p.host.data();
  if (m.p.tier == Tier::kDevice && dev_.host_addressable()) return m.p.dev;
  return nullptr;
}

Status OptimizerPipeline::step(int k, Slot& s, const OptimizerHyper& hyper, float grad_mult,
                               const float* grad, void* shadow) {
  Module& m = homes_.module(k);
  const size_t mb = dtype_size(mdt_);
  // A prefetch of these parameters may still be copying from their home: let it land first
  // (publishing then replaces the cached copy).
  if (!shadow) STRATA_RETURN_IF_ERROR(cache_.wait_fetch(k), "stepping " + m.name);
  // Device-resident state is stepped by the device's optimizer kernel (device_optimizer.h);
  // with the delayed update (host-addressable devices only) every step stays on the host.
  if (!opt_.delayed_update && steps_on_device(m)) return step_on_device(k, hyper, grad_mult);
  std::shared_ptr<PinnedBuffer> lp_buf;
  void* lp = shadow ? shadow : host_visible_params(m);
  if (!lp) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, homes_.host_buf(m.p.bytes, "parameter staging"),
                            "stepping " + m.name);
    lp_buf = std::make_shared<PinnedBuffer>(std::move(b));
    lp = lp_buf->data();
  }
  ShardState sh;
  sh.n = m.sn;  // the padding's grads, master and moments are zero and stay zero
  sh.grad = grad ? static_cast<const void*>(grad) : m.gacc.ptr();
  sh.grad_dtype = DType::kF32;
  sh.grad_mult = grad_mult;
  sh.master = s.master;
  sh.m = s.mom;
  sh.v = static_cast<char*>(s.mom) + m.sn * mb;
  sh.moment_dtype = mdt_;
  sh.lp_out = lp;
  sh.lp_dtype = dt_;
  strata::optimizer_step(hyper, sh, opt_.optimizer_threads);
  if (!shadow) {  // with a shadow the parameters are published later (finish_delayed_update)
    STRATA_CHECK(!sharded_ || !cache_.resident(k), "sharded: a gathered group outlived its use");
    STRATA_RETURN_IF_ERROR(publish(k, lp, lp_buf, /*wait=*/false), "stepping " + m.name);
  }
  if (m.master.tier == Tier::kNvme) queue_write(m.master.ext, s.master, s.master_buf, m.name);
  if (m.mom.tier == Tier::kNvme) queue_write(m.mom.ext, s.mom, s.mom_buf, m.name);
  return Status::ok();
}

Status OptimizerPipeline::run(const std::vector<int>& order, const OptimizerHyper& hyper,
                              float grad_mult,
                              std::vector<std::shared_ptr<PinnedBuffer>>* shadows) {
  const size_t depth = this->depth();
  size_t next = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    for (; next < order.size() && next < i + depth; ++next) {
      if (!prepared(order[next])) {
        STRATA_RETURN_IF_ERROR(prepare(order[next], /*try_only=*/false).status(),
                               "reading " + homes_.module(order[next]).name + " optimizer state");
      }
    }
    const int k = order[i];
    Module& m = homes_.module(k);
    const float* grad = nullptr;
    void* shadow = nullptr;
    if (shadows) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, homes_.host_buf(m.p.bytes, "delayed update: shadow"),
                              "stepping " + m.name);
      (*shadows)[size_t(k)] = std::make_shared<PinnedBuffer>(std::move(b));
      grad = static_cast<const float*>(m.gacc2.ptr());
      shadow = (*shadows)[size_t(k)]->data();
    }
    Slot s;
    STRATA_RETURN_IF_ERROR(take(k, &s), "stepping " + m.name);
    STRATA_RETURN_IF_ERROR(step(k, s, hyper, grad_mult, grad, shadow), "");  // names m itself
    STRATA_RETURN_IF_ERROR(retire_writes(3 * depth), "after stepping " + m.name);
  }
  return Status::ok();
}

// ---- publishing parameters ---------------------------------------------------------------------

Status OptimizerPipeline::publish(int k, void* lp, std::shared_ptr<PinnedBuffer> keep, bool wait) {
  Module& m = homes_.module(k);
  Stream& h2d = dev_.h2d_stream();
  if (m.p.tier == Tier::kHost && lp != m.p.host.data()) {
    std::memcpy(m.p.host.data(), lp, m.p.bytes);
  } else if (m.p.tier == Tier::kDevice && lp != m.p.dev) {
    if (dev_.host_addressable()) {
      std::memcpy(m.p.dev, lp, m.p.bytes);
    } else {
      dev_.copy_h2d(h2d, m.p.dev, lp, m.p.bytes);
    }
  }
  if (cache_.resident(k)) {
    if (sharded_) {
      cache_.drop(k);  // a gathered group is never updated in place: the next use gathers anew
    } else {
      cache_.write_through(k, lp, m.p.bytes);
    }
  }
  if (keep) dev_.host_fn(h2d, [keep] {});  // alive until the copies from it ran
  if (!wait) {
    if (m.p.tier == Tier::kNvme) queue_write(m.p.ext, lp, std::move(keep), m.name);
    return Status::ok();
  }
  STRATA_RETURN_IF_ERROR(dev_.synchronize(h2d), "copying " + m.name + " parameters");
  if (m.p.tier == Tier::kNvme) {
    STRATA_RETURN_IF_ERROR(homes_.io()->wait(homes_.io()->write(m.p.ext, lp)),
                           "writing " + m.name + " parameters");
  }
  return Status::ok();
}

Status OptimizerPipeline::write_params(int k, const float* master) {
  Module& m = homes_.module(k);
  STRATA_RETURN_IF_ERROR(cache_.wait_fetch(k), "deriving " + m.name + " parameters");
  PinnedBuffer lp;
  void* dst = host_visible_params(m);
  if (!dst) {
    STRATA_ASSIGN_OR_RETURN(lp, homes_.host_buf(m.p.bytes, "parameter staging"),
                            "deriving " + m.name + " parameters");
    dst = lp.data();
  }
  convert(master, DType::kF32, dst, dt_, m.sn);
  return publish(k, dst, nullptr, /*wait=*/true);
}

// ---- writes ------------------------------------------------------------------------------------

void OptimizerPipeline::queue_write(const SwapExtent& ext, const void* src,
                                    std::shared_ptr<PinnedBuffer> keep, const std::string& what) {
  writes_.push_back({homes_.io()->write(ext, src), std::move(keep), what});
}

Status OptimizerPipeline::retire_writes(size_t keep_at_most) {
  Status first;
  while (!writes_.empty() &&
         (writes_.size() > keep_at_most || homes_.io()->done(writes_.front().t))) {
    Write w = std::move(writes_.front());
    writes_.pop_front();
    Status s = homes_.io()->wait(w.t);
    if (!s.is_ok() && first.is_ok()) first = s.with_context("writing " + w.what);
  }
  return first;
}

size_t OptimizerPipeline::modules_writing() const {
  std::set<std::string_view> writing;
  for (const auto& w : writes_) writing.insert(w.what);
  return writing.size();
}

}  // namespace strata
