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
  // The gradients were drained into GACC on the d2h stream: the step runs after those drains.
  auto drained = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*drained, d2h);
  dev_.wait(compute, *drained);
  // The new parameters go straight to their device home; any other home gets them through a
  // device buffer copied down, then published as the host path publishes them.
  const bool params_on_device = m.p.tier == Tier::kDevice;
  void* lp_dev = params_on_device ? m.p.dev : nullptr;
  if (!params_on_device) {
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
  // Parameters homed on the host or NVMe: down into their host-visible home, or a sub-group at a
  // time through staging pieces, then published.
  auto stepped = std::shared_ptr<Event>(dev_.create_event());
  dev_.record(*stepped, compute);
  dev_.wait(d2h, *stepped);
  STRATA_CHECK(!sharded_ || !cache_.resident(k), "sharded: a gathered group outlived its use");
  const Target t = {host_visible_params(m)};
  const size_t es = dtype_size(dt_);
  Status st;
  for (size_t j = 0; j < m.sub_groups() && st.is_ok(); ++j) {
    auto p = piece(k, j, t);
    if (!p.is_ok()) {
      st = p.status();
      break;
    }
    dev_.copy_d2h(d2h, p->dst, static_cast<char*>(lp_dev) + m.sub_start(j) * es, m.sub_len(j) * es);
    st = dev_.synchronize(d2h).with_context("copying " + m.name + " new parameters down");
    if (st.is_ok()) st = publish_piece(k, j, p->dst, std::move(p->keep), /*wait=*/false);
  }
  dev_.synchronize(d2h).ignore();
  dev_.release(lp_dev);
  return st.with_context("stepping " + m.name);
}

}  // namespace strata
