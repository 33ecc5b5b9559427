#include "src/tiers/homes.h"

#include <fmt/format.h>

#include <algorithm>

#include "strata/log.h"

namespace strata {

Result<std::unique_ptr<Homes>> Homes::create(Device& device, const std::vector<ModuleHomes>& plan,
                                             int rank, int world_size, size_t arena_bytes,
                                             const TierOptions& options, const SwapOptions* swap,
                                             size_t undo_bytes) {
  std::unique_ptr<Homes> h(new Homes(device));
  h->undo_bytes_ = undo_bytes;
  h->lock_ = options.pin_memory;
  BufferPoolOptions po;
  po.name = "host tier";
  po.lock = options.pin_memory;
  STRATA_ASSIGN_OR_RETURN(h->pool_, BufferPool::create(arena_bytes, po), "host tier");
  device.register_host(h->pool_->base(), h->pool_->capacity()).ignore();
  if (swap) {
    STRATA_ASSIGN_OR_RETURN(h->storage_, open_storage(options.storage), "nvme tier");
    h->storage_->register_buffer(h->pool_->base(), h->pool_->capacity()).ignore();
    STRATA_ASSIGN_OR_RETURN(h->swap_, SwapSpace::create(h->storage_.get(), *swap), "nvme tier");
    h->nvme_capacity_ = h->swap_->capacity();
    h->io_ = std::make_unique<IoWorker>(h->storage_.get(), h->swap_.get());
  }
  h->mods_.resize(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    const ModuleHomes& mh = plan[i];
    Module& m = h->mods_[i];
    m.name = mh.name;
    m.numel = mh.numel;
    m.sn = mh.shard_numel;
    m.padded = mh.padded_numel;
    m.off = world_size > 1 ? size_t(rank) * m.sn : 0;
    m.valid = m.off >= m.numel ? 0 : std::min(m.numel - m.off, m.sn);
    m.p = {mh.params.tier, mh.params.bytes, {}, nullptr, {}};
    m.master = {mh.master.tier, mh.master.bytes, {}, nullptr, {}};
    m.mom = {mh.moments.tier, mh.moments.bytes, {}, nullptr, {}};
    m.gacc = {mh.grads.tier, mh.grads.bytes, {}, nullptr, {}};
    m.gacc2 = {mh.grads2.tier, mh.grads2.bytes, {}, nullptr, {}};
    m.sub_group = std::max<size_t>(1, mh.sub_group);
  }
  for (auto& m : h->mods_) {
    for (auto* home : {&m.p, &m.master, &m.mom, &m.gacc, &m.gacc2}) {
      if (home->bytes == 0) continue;
      const std::string tag = fmt::format("{}.{}", m.name,
                                          home == &m.p        ? "params"
                                          : home == &m.master ? "master"
                                          : home == &m.mom    ? "moments"
                                                              : "grads");
      if (home->tier == Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(home->dev, device.allocate(home->bytes, tag),
                                "device tier: " + tag);
      } else if (home->tier == Tier::kHost) {
        STRATA_ASSIGN_OR_RETURN(home->host, h->pool_->acquire(home->bytes), "host tier: " + tag);
      } else {  // one extent per sub-group
        const size_t e = home->bytes / m.sn;
        for (size_t j = 0; j < m.sub_groups(); ++j) {
          STRATA_ASSIGN_OR_RETURN(SwapExtent x, h->allocate_extent(m.sub_len(j) * e),
                                  fmt::format("nvme tier: {} sub-group {}", tag, j));
          home->subs.push_back(std::move(x));
        }
      }
    }
  }
  return h;
}

Homes::~Homes() {
  for (auto& m : mods_) {
    for (auto* h : {&m.p, &m.master, &m.mom, &m.gacc, &m.gacc2}) {
      if (h->tier == Tier::kDevice && h->dev) dev_.release(h->dev);
      h->host.reset();
    }
  }
  for (const auto& p : undo_) dev_.unregister_host(p->base());
  undo_.clear();
  io_.reset();
  swap_.reset();  // removes the swap files
  storage_.reset();
}

Result<PinnedBuffer> Homes::undo_buf(size_t bytes) {
  std::lock_guard<std::mutex> l(undo_mu_);
  size_t held = 0;
  for (auto& p : undo_) {
    auto b = p->acquire(bytes);
    if (b.is_ok()) return b;
    held += p->capacity();
  }
  // A region the size of the buffer (in whole huge pages from 2 MiB on): each module's undo
  // buffers are reused step after step (Speculation's spares), so the regions are taken once.
  const size_t hp = BufferPool::kHugePage;
  const size_t want = bytes >= hp ? (bytes + hp - 1) / hp * hp : (bytes + 4095) / 4096 * 4096;
  if (held + want > undo_bytes_) {
    return out_of_memory(fmt::format("the host tier's undo room ({} of {}) has no {} left",
                                     format_bytes(double(held)), format_bytes(double(undo_bytes_)),
                                     format_bytes(double(bytes))));
  }
  BufferPoolOptions po;
  po.name = "host tier's undo room";
  po.lock = lock_;
  auto made = BufferPool::create(want, po);
  if (!made.is_ok()) {
    if (!undo_warned_) {
      log_warn(
          "host tier: the undo room could not take {} ({}); the optimizer steps modules after "
          "backward instead of under it where a step needs undo state",
          format_bytes(double(want)), made.status().message());
    }
    undo_warned_ = true;
    return made.status().with_context("the host tier's undo room");
  }
  std::unique_ptr<BufferPool> p = std::move(made).value();
  dev_.register_host(p->base(), p->capacity()).ignore();
  if (undo_.empty()) {
    log_info(
        "host tier: undo room taken for the optimizer under backward, as it is used (up to {})",
        format_bytes(double(undo_bytes_)));
  }
  undo_.push_back(std::move(p));
  return undo_.back()->acquire(bytes);
}

size_t Homes::undo_capacity() const {
  std::lock_guard<std::mutex> l(undo_mu_);
  size_t n = 0;
  for (const auto& p : undo_) n += p->capacity();
  return n;
}

size_t Homes::undo_in_use() const {
  std::lock_guard<std::mutex> l(undo_mu_);
  size_t n = 0;
  for (const auto& p : undo_) n += p->in_use();
  return n;
}

size_t Homes::host_capacity() const { return pool_->capacity() + undo_capacity(); }
size_t Homes::host_in_use() const { return pool_->in_use() + undo_in_use(); }
size_t Homes::host_peak() const {
  std::lock_guard<std::mutex> l(undo_mu_);
  size_t n = pool_->peak_in_use();
  for (const auto& p : undo_) n += p->peak_in_use();
  return n;
}

Result<PinnedBuffer> Homes::host_buf(size_t bytes, const char* what) {
  for (int round = 0;; ++round) {
    auto r = pool_->acquire(bytes);
    if (r.is_ok() || round >= 2) {
      if (!r.is_ok()) return r.status().with_context(what);
      return r;
    }
    // Staging buffers come back as copies and writes finish.
    dev_.synchronize(dev_.h2d_stream()).ignore();
    dev_.synchronize(dev_.d2h_stream()).ignore();
    if (reclaim_) reclaim_();
  }
}

Result<SwapExtent> Homes::allocate_extent(size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(SwapExtent e, swap_->allocate(bytes), "nvme tier");
  std::lock_guard<std::mutex> l(nvme_mu_);
  nvme_used_ += e.bytes;
  nvme_peak_ = std::max(nvme_peak_, nvme_used_);
  return e;
}

void Homes::free_extent(const SwapExtent& e) {
  swap_->free(e);
  std::lock_guard<std::mutex> l(nvme_mu_);
  nvme_used_ -= e.bytes;
}

size_t Homes::nvme_used() const {
  std::lock_guard<std::mutex> l(nvme_mu_);
  return nvme_used_;
}

size_t Homes::nvme_peak() const {
  std::lock_guard<std::mutex> l(nvme_mu_);
  return nvme_peak_;
}

}  // namespace strata
