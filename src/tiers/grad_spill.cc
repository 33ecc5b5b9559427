#include "src/tiers/grad_spill.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "strata/cpu_optim.h"

namespace strata {

GradSpill::~GradSpill() {
  for (Slot& s : slots_) {
    if (s.read != 0) (void)homes_.io()->wait(s.read);  // a step given up half-way
    finish_write(s);
  }
}

void GradSpill::finish_write(Slot& s) {
  if (s.write == 0) return;
  Status st = homes_.io()->wait(s.write);
  s.write = 0;
  if (!st.is_ok()) errors_.set(st.with_context("writing " + s.what));
}

void GradSpill::accumulate(int m, const float* src, int micro, bool last, GradStats* stats) {
  Module& mod = homes_.module(m);
  if (slots_.empty()) {
    size_t most = 0;
    for (const auto& x : homes_.modules()) {
      if (x.gacc.tier == Tier::kNvme) most = std::max(most, x.sub_len(0) * 4);
    }
    std::vector<Slot> slots(kSlots);
    for (Slot& s : slots) {
      for (auto* b : {&s.landing, &s.stage}) {
        auto r = homes_.host_buf(most, "gradient landing buffer");
        if (!r.is_ok()) {
          errors_.set(r.status().with_context("accumulating " + mod.name + " gradients on nvme"));
          return;
        }
        *b = std::make_shared<PinnedBuffer>(std::move(r).value());
      }
    }
    slots_ = std::move(slots);
    tiles_.resize(homes_.modules().size());
  }
  Stream& d2h = dev_.d2h_stream();
  if (last) tiles_[size_t(m)].assign((mod.sn + kStatsTileElems - 1) / kStatsTileElems, 0.0);
  IoWorker* io = homes_.io();
  AsyncError* errors = &errors_;
  for (size_t j = 0; j < mod.sub_groups(); ++j) {
    const size_t a = mod.sub_start(j), len = mod.sub_len(j);
    Slot* slot = &slots_[next_slot_++ % slots_.size()];
    const SwapExtent* ext = &mod.gacc.subs[j];
    float* in = slot->landing->as<float>();
    float* acc = slot->stage->as<float>();
    // Free the slot; the sum of the earlier micro-batches comes in under the copy.
    dev_.host_fn(d2h, [this, slot, io, ext, acc, micro] {
      finish_write(*slot);
      if (micro > 0) slot->read = io->read(*ext, acc);
    });
    dev_.copy_d2h(d2h, in, src + a, len * 4);
    std::vector<double>* tiles = last ? &tiles_[size_t(m)] : nullptr;
    const std::string what = fmt::format("{} gradients (sub-group {})", mod.name, j);
    dev_.host_fn(d2h, [=] {
      const float* out = in;
      if (micro > 0) {
        Status s = io->wait(slot->read);
        slot->read = 0;
        if (!s.is_ok()) {
          errors->set(s.with_context("reading " + what));
          return;
        }
        for (size_t i = 0; i < len; ++i) acc[i] += in[i];
        out = acc;
      }
      slot->what = what;
      slot->write = io->write(*ext, out);
      if (tiles) {  // sub-groups are whole tiles (module_homes); reads what is being written
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
    dev_.host_fn(d2h, [this, tiles, stats] {
      for (Slot& s : slots_) finish_write(s);  // a failed write is reported before the stats
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
