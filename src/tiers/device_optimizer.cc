// OptimizerPipeline::step_on_device: the optimizer step of a module whose master weights,
// moments and gradient accumulator live in the device's memory (see device_optimizer.h).
#include "src/tiers/device_optimizer.h"

#include "src/tiers/optimizer_pipeline.h"
#include "strata/kernels.h"

namespace strata {

Status OptimizerPipeline::step_on_device(int k, const OptimizerHyper& hyper, float grad_mult) {
  Module& m = homes_.module(k);
  Stream& compute = dev_.compute_stream();
  Stream& d2h = dev_.d2h_stream();
  // The gradients were drained into GACC on the d2h stream: the step runs after those drains
  // (grads_final's event; else all the stream holds now).
  std::shared_ptr<Event> drained = std::move(drained_[size_t(k)]);
  if (!drained) {
    drained = std::shared_ptr<Event>(dev_.create_event());
    dev_.record(*drained, d2h);
  }
  dev_.wait(compute, *drained);
  // The new parameters go straight to their device home; any other home gets them copied down
  // from the module's cached copy, stepped in place (it is then current: nothing crosses back),
  // or from a device buffer when none is resident, then published as the host path publishes
  // them.
  const bool params_on_device = m.p.tier == Tier::kDevice;
  void* lp_dev = params_on_device ? m.p.dev : cache_.step_in_place(k);
  const bool in_copy = !params_on_device && lp_dev != nullptr;
  if (!params_on_device && !in_copy) {
    STRATA_ASSIGN_OR_RETURN(lp_dev,
                            cache_.allocate(m.p.bytes, m.name + ".new params", k, UINT64_MAX,
                                            /*may_block=*/true),
                            "stepping " + m.name + " on the device");
  }
  ShardState sh;
  sh.n = m.sn;  // the padding's grads, master and moments are zero and stay zero
  sh.grad = m.gacc.dev;
  sh.grad_dtype = DType::kF32;
  sh.grad_mult = grad_mult;
  sh.master = static_cast<float*>(m.master.dev);
  sh.m = m.mom.dev;
  sh.v = static_cast<char*>(m.mom.dev) + m.sn * dtype_size(mdt_);
  sh.moment_dtype = mdt_;
  sh.lp_out = lp_dev;
  sh.lp_dtype = dt_;
  dev_.kernels().optimizer_step(compute, hyper, sh);
  if (params_on_device) {
    // Unsharded device-homed parameters are used in place (never cached) by the compute
    // stream, which runs the step first. A gathered group is dropped, and the next use gathers
    // the new shard from its home on the h2d stream: that stream waits for the step.
    if (sharded_) {
      auto stepped = std::shared_ptr<Event>(dev_.create_event());
      dev_.record(*stepped, compute);
      dev_.wait(dev_.h2d_stream(), *stepped);
    }
    if (cache_.resident(k)) {
      STRATA_CHECK(sharded_, "a device-homed module has a cached copy");
      cache_.drop(k);
    }
    return Status::ok();
  }
  auto stepped = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*stepped, compute);
  dev_.wait(d2h, *stepped);
  STRATA_CHECK(!sharded_ || !cache_.resident(k), "sharded: a gathered group outlived its use");
  const size_t es = dtype_size(dt_);
  if (in_copy && m.p.tier == Tier::kHost) {
    // Down into the host home on the d2h stream, not waited for: the next forward reads the
    // current cached copy, a later fetch from the home waits for this copy (copied_down), and
    // whatever reads or writes the home on the host first calls finish_copies_down().
    dev_.copy_d2h(d2h, m.p.host.data(), lp_dev, m.p.bytes);
    auto down = std::shared_ptr<Event>(dev_.create_event());
    dev_.record(*down, d2h);
    cache_.copied_down(k, std::move(down));
    copies_down_ = true;
    const size_t bytes = m.p.bytes;
    counters_.update([bytes](TierCounts& n) { n.dev_out += bytes; });
    return Status::ok();
  }
  // Into an NVMe home, or from a device buffer: a sub-group at a time through host-visible
  // pieces, each published once it is down.
  const Target t = {host_visible_params(m)};
  Status st;
  for (size_t j = 0; j < m.sub_groups() && st.is_ok(); ++j) {
    auto p = piece(k, j, t);
    if (!p.is_ok()) {
      st = p.status();
      break;
    }
    const size_t bytes = m.sub_len(j) * es;
    dev_.copy_d2h(d2h, p->dst, static_cast<char*>(lp_dev) + m.sub_start(j) * es, bytes);
    counters_.update([bytes](TierCounts& n) { n.dev_out += bytes; });
    st = dev_.synchronize(d2h).with_context("copying " + m.name + " new parameters down");
    if (st.is_ok()) {
      st = publish_piece(k, j, p->dst, std::move(p->keep), /*wait=*/false,
                         /*copy_current=*/in_copy);
    }
  }
  dev_.synchronize(d2h).ignore();
  if (!in_copy) dev_.release(lp_dev);
  return st.with_context("stepping " + m.name);
}

}  // namespace strata
