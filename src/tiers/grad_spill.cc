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

void GradSpill::drop_read(Slot& s) {
  if (s.read != 0) (void)homes_.io()->wait(s.read);  // left by a step given up half-way
  s.read = 0;
  s.read_of = -1;
}

void GradSpill::start_read(Slot& s, int64_t key, const SwapExtent& ext) {
  if (s.read_of == key) return;
  drop_read(s);
  finish_write(s);
  s.read = homes_.io()->read(ext, s.stage->data());
  s.read_of = key;
}

void GradSpill::accumulate(int m, const float* src, int micro, bool last, GradStats* stats) {
  Module& mod = homes_.module(m);
  if (slots_.empty()) {
    // The largest sub-group of an accumulator on NVMe (the memory model's max_gsub): a frozen
    // module's home is where the placement puts it but holds nothing.
    size_t most = 0;
    for (const auto& x : homes_.modules()) {
      if (x.gacc.tier == Tier::kNvme && x.gacc.bytes > 0) most = std::max(most, x.sub_len(0) * 4);
    }
    auto buf = [&]() -> std::shared_ptr<PinnedBuffer> {
      auto r = homes_.host_buf(most, "gradient landing buffer");
      if (!r.is_ok()) {
        errors_.set(r.status().with_context("accumulating " + mod.name + " gradients on nvme"));
        return nullptr;
      }
      return std::make_shared<PinnedBuffer>(std::move(r).value());
    };
    std::vector<Slot> slots(kSlots);
    for (Slot& s : slots) {
      if (!(s.stage = buf())) return;
    }
    if (!dev_.host_addressable() && !(landing_ = buf())) return;
    slots_ = std::move(slots);
    tiles_.resize(homes_.modules().size());
  }
  Stream& d2h = dev_.d2h_stream();
  if (last) tiles_[size_t(m)].assign((mod.sn + kStatsTileElems - 1) / kStatsTileElems, 0.0);
  IoWorker* io = homes_.io();
  AsyncError* errors = &errors_;
  const size_t first_slot = next_slot_, n = mod.sub_groups();
  next_slot_ += n;
  const int64_t call = ++calls_;  // a read's key: this call and its sub-group, never reused
  auto key = [call](size_t j) { return (call << 24) | int64_t(j); };
  for (size_t j = 0; j < n; ++j) {
    const size_t a = mod.sub_start(j), len = mod.sub_len(j);
    Slot* slot = &slots_[(first_slot + j) % slots_.size()];
    const SwapExtent* ext = &mod.gacc.subs[j];
    // The first micro-batch lands in the slot's buffer and is written from there; a later one
    // lands in the one landing buffer (free again: its add ran before this copy, in stream
    // order) and is added into the slot's — or, where the host reads device memory, is added
    // from the device buffer in place (released after this, in stream order), no copy first.
    float* acc = slot->stage->as<float>();
    const bool in_place = micro > 0 && dev_.host_addressable();
    const float* in = micro == 0 ? acc : in_place ? src + a : landing_->as<float>();
    // Free the slot (micro 0); or start reading the sum of the earlier micro-batches under the
    // copy, and the next kReadAhead sub-groups' sums too (their slots' writes were issued
    // kSlots - kReadAhead sub-groups ago or more).
    dev_.host_fn(d2h, [this, slot, &mod, first_slot, key, j, n, micro] {
      if (micro == 0) {
        drop_read(*slot);
        finish_write(*slot);
        return;
      }
      for (size_t r = j; r < std::min(n, j + 1 + size_t(kReadAhead)); ++r) {
        start_read(slots_[(first_slot + r) % slots_.size()], key(r), mod.gacc.subs[r]);
      }
    });
    if (!in_place) dev_.copy_d2h(d2h, const_cast<float*>(in), src + a, len * 4);
    std::vector<double>* tiles = last ? &tiles_[size_t(m)] : nullptr;
    const std::string what = fmt::format("{} gradients (sub-group {})", mod.name, j);
    const int threads = threads_;
    dev_.host_fn(d2h, [=] {
      const float* out = acc;
      if (micro > 0) {
        Status s = io->wait(slot->read);
        slot->read = 0;
        slot->read_of = -1;
        if (!s.is_ok()) {
          errors->set(s.with_context("reading " + what));
          return;
        }
        add_into(acc, in, len, threads);
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
