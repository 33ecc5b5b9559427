#include "src/tiers/homes.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

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
  po.budget_key = "strata.host_memory_limit";
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
  {
    std::lock_guard<std::mutex> l(undo_mu_);
    undo_stop_ = true;
  }
  undo_cv_.notify_all();
  if (undo_thread_.joinable()) undo_thread_.join();
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

// A region the size of the buffer (in whole huge pages from 2 MiB on): each module's undo
// buffers are reused step after step (Speculation's spares), so the regions are taken once.
size_t Homes::undo_region_bytes(size_t bytes) {
  const size_t hp = BufferPool::kHugePage;
  return bytes >= hp ? (bytes + hp - 1) / hp * hp : (bytes + 4095) / 4096 * 4096;
}

Result<std::unique_ptr<BufferPool>> Homes::make_undo_region(size_t bytes, bool touch) {
  BufferPoolOptions po;
  po.name = "host tier's undo room";
  po.lock = lock_;
  po.huge_pages = false;  // no I/O: 4 KiB pages, no compaction when they are faulted in
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<BufferPool> p, BufferPool::create(bytes, po), "");
  if (touch && !p->locked()) {
    // Fresh anonymous pages read as zero: writing one makes it resident.
    auto* c = static_cast<volatile char*>(p->base());
    for (size_t at = 0; at < p->capacity(); at += 4096) c[at] = 0;
  }
  dev_.register_host(p->base(), p->capacity()).ignore();
  return p;
}

void Homes::undo_failed(size_t bytes, const Status& why) {
  if (!undo_warned_) {
    log_warn(
        "host tier: the undo room could not take {} ({}); the optimizer steps modules after "
        "backward instead of under it where a step needs undo state",
        format_bytes(double(bytes)), why.message());
  }
  undo_warned_ = true;
}

void Homes::add_undo_region(std::unique_ptr<BufferPool> region) {
  if (undo_.empty()) {
    log_info(
        "host tier: undo room taken for the optimizer under backward, as it is used (up to {})",
        format_bytes(double(undo_bytes_)));
  }
  undo_.push_back(std::move(region));
  size_t held = 0;
  for (const auto& p : undo_) held += p->capacity();
  undo_held_peak_ = std::max(undo_held_peak_, held);
}

std::optional<PinnedBuffer> Homes::undo_from_regions(size_t bytes) {
  for (auto& p : undo_) {
    if (auto b = p->acquire(bytes); b.is_ok()) return std::move(b).value();
  }
  return std::nullopt;
}

Result<PinnedBuffer> Homes::undo_buf(size_t bytes) {
  std::lock_guard<std::mutex> l(undo_mu_);
  size_t held = 0;
  if (std::optional<PinnedBuffer> b = undo_from_regions(bytes)) return std::move(*b);
  for (const auto& p : undo_) held += p->capacity();
  const size_t want = undo_region_bytes(bytes);
  if (held + undo_pending_ + want > undo_bytes_) {
    return out_of_memory(fmt::format("the host tier's undo room ({} of {}) has no {} left",
                                     format_bytes(double(held + undo_pending_)),
                                     format_bytes(double(undo_bytes_)),
                                     format_bytes(double(bytes))));
  }
  auto made = make_undo_region(want, /*touch=*/false);
  if (!made.is_ok()) {
    undo_failed(want, made.status());
    return made.status().with_context("the host tier's undo room");
  }
  add_undo_region(std::move(made).value());
  return undo_.back()->acquire(bytes);
}

bool Homes::undo_ready(const std::vector<size_t>& bytes) {
  std::unique_lock<std::mutex> l(undo_mu_);
  if (undo_warned_) return true;  // regions cannot be had: undo_buf says so
  // Take what the regions there hold, to see what is missing; given back on return.
  std::vector<PinnedBuffer> taken;
  std::vector<size_t> missing;
  size_t held = 0;
  for (const auto& p : undo_) held += p->capacity();
  for (size_t b : bytes) {
    if (std::optional<PinnedBuffer> got = undo_from_regions(b)) {
      taken.push_back(std::move(*got));
    } else if (undo_region_bytes(b) >= kUndoPrepareBytes) {
      missing.push_back(b);
    }
  }
  if (missing.empty()) return true;
  size_t want = 0;
  for (size_t b : missing) want += undo_region_bytes(b);
  if (undo_pending_ > 0) return false;         // being prepared: a later step takes them
  if (held + want > undo_bytes_) return true;  // beyond the room: undo_buf refuses them
  undo_queue_ = std::move(missing);
  undo_pending_ = want;
  if (!undo_thread_.joinable()) undo_thread_ = std::thread([this] { undo_preparer(); });
  l.unlock();
  undo_cv_.notify_one();
  return false;
}

void Homes::undo_preparer() {
  std::unique_lock<std::mutex> l(undo_mu_);
  for (;;) {
    undo_cv_.wait(l, [&] { return undo_stop_ || !undo_queue_.empty(); });
    if (undo_stop_) return;
    const std::vector<size_t> queue = std::move(undo_queue_);
    undo_queue_.clear();
    for (size_t b : queue) {
      const size_t want = undo_region_bytes(b);
      l.unlock();
      auto made = make_undo_region(want, /*touch=*/true);
      l.lock();
      undo_pending_ -= want;
      if (undo_stop_) {
        if (made.is_ok()) dev_.unregister_host((*made)->base());
        return;
      }
      if (!made.is_ok()) {
        undo_failed(want, made.status());
        undo_pending_ = 0;
        break;
      }
      add_undo_region(std::move(made).value());
    }
  }
}

size_t Homes::close_undo_room() {
  {
    std::lock_guard<std::mutex> l(undo_mu_);
    undo_stop_ = true;
  }
  undo_cv_.notify_all();
  if (undo_thread_.joinable()) undo_thread_.join();  // a region it was making is freed
  std::lock_guard<std::mutex> l(undo_mu_);
  undo_queue_.clear();
  undo_pending_ = 0;
  undo_bytes_ = 0;
  size_t freed = 0;
  std::erase_if(undo_, [&](const std::unique_ptr<BufferPool>& p) {
    if (p->in_use() > 0) return false;
    dev_.unregister_host(p->base());
    freed += p->capacity();
    undo_freed_peaks_ += p->peak_in_use();
    return true;
  });
  undo_freed_ += freed;
  return freed;
}

bool Homes::in_undo_room(const void* p) const {
  std::lock_guard<std::mutex> l(undo_mu_);
  const auto* c = static_cast<const char*>(p);
  for (const auto& r : undo_) {
    const auto* base = static_cast<const char*>(r->base());
    if (c >= base && c < base + r->capacity()) return true;
  }
  return false;
}

size_t Homes::undo_capacity() const {
  std::lock_guard<std::mutex> l(undo_mu_);
  return undo_held_peak_;
}

size_t Homes::undo_given_back() const {
  std::lock_guard<std::mutex> l(undo_mu_);
  return undo_freed_;
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
  size_t n = pool_->peak_in_use() + undo_freed_peaks_;
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
