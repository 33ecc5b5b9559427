#include "src/tiers/grad_spill.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "strata/cpu_optim.h"

namespace strata {

void GradSpill::accumulate(int m, const float* src, int micro, bool last, GradStats* stats) {
  Module& mod = homes_.module(m);
  if (!landing_) {
    size_t most = 0;
    for (const auto& x : homes_.modules()) {
      if (x.gacc.tier == Tier::kNvme) most = std::max(most, x.sub_len(0) * 4);
    }
    for (auto* b : {&landing_, &stage_}) {
      auto r = homes_.host_buf(most, "gradient landing buffer");
      if (!r.is_ok()) {
        errors_.set(r.status().with_context("accumulating " + mod.name + " gradients on nvme"));
        return;
      }
      *b = std::make_shared<PinnedBuffer>(std::move(r).value());
    }
    tiles_.resize(homes_.modules().size());
  }
  Stream& d2h = dev_.d2h_stream();
  if (last) tiles_[size_t(m)].assign((mod.sn + kStatsTileElems - 1) / kStatsTileElems, 0.0);
  for (size_t j = 0; j < mod.sub_groups(); ++j) {
    const size_t a = mod.sub_start(j), len = mod.sub_len(j);
    dev_.copy_d2h(d2h, landing_->data(), src + a, len * 4);
    IoWorker* io = homes_.io();
    const SwapExtent* ext = &mod.gacc.subs[j];
    float* in = landing_->as<float>();
    float* acc = stage_->as<float>();
    std::vector<double>* tiles = last ? &tiles_[size_t(m)] : nullptr;
    AsyncError* errors = &errors_;
    const std::string what = fmt::format("{} gradients (sub-group {})", mod.name, j);
    dev_.host_fn(d2h, [=] {
      const float* out = in;
      if (micro > 0) {
        Status s = io->wait(io->read(*ext, acc));
        if (!s.is_ok()) {
          errors->set(s.with_context("reading " + what));
          return;
        }
        for (size_t i = 0; i < len; ++i) acc[i] += in[i];
        out = acc;
      }
      Status s = io->wait(io->write(*ext, out));
      if (!s.is_ok()) errors->set(s.with_context("writing " + what));
      if (tiles) {  // sub-groups are whole tiles (module_homes)
        for (size_t t = 0; t * kStatsTileElems < len; ++t) {
          const size_t n = std::min(kStatsTileElems, len - t * kStatsTileElems);
          (*tiles)[a / kStatsTileElems + t] =
              strata::grad_stats(out + t * kStatsTileElems, DType::kF32, n).norm_sq;
        }
      }
    });
  }
  if (last) {
    std::vector<double>* tiles = &tiles_[size_t(m)];
    dev_.host_fn(d2h, [tiles, stats] {
      GradStats st;
      for (double p : *tiles) st.norm_sq += p;  // tile order, as grad_stats() sums
      st.nonfinite = !std::isfinite(st.norm_sq);
      *stats = st;
    });
  }
  const uint64_t bytes = mod.sn * 4;
  counters_.update([bytes](TierCounts& n) { n.dev_out += bytes; });
}

}  // namespace strata
