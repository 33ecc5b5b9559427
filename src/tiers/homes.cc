#include "src/tiers/homes.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace strata {

Result<std::unique_ptr<Homes>> Homes::create(Device& device, const std::vector<ModuleHomes>& plan,
                                             int rank, int world_size, size_t arena_bytes,
                                             const TierOptions& options, const SwapOptions* swap) {
  std::unique_ptr<Homes> h(new Homes(device));
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
  io_.reset();
  swap_.reset();  // removes the swap files
  storage_.reset();
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
  }
}

namespace {

// Sub-group j's moments in a whole module's layout (first moments of all sn elements, then
// second) <-> its extent's layout (the sub-group's first moments, then its second).
void gather_moments(const Module& m, size_t j, const char* whole, char* sub) {
  const size_t b = m.mom_elem() / 2, a = m.sub_start(j), n = m.sub_len(j);
  std::memcpy(sub, whole + a * b, n * b);
  std::memcpy(sub + n * b, whole + (m.sn + a) * b, n * b);
}
void scatter_moments(const Module& m, size_t j, const char* sub, char* whole) {
  const size_t b = m.mom_elem() / 2, a = m.sub_start(j), n = m.sub_len(j);
  std::memcpy(whole + a * b, sub, n * b);
  std::memcpy(whole + (m.sn + a) * b, sub + n * b, n * b);
}

}  // namespace

Status Homes::read_master(size_t i, float* master) {
  Module& m = mods_[i];
  // Every sub-group starts on a 4096-byte boundary of the buffer (kSubGroupAlign).
  std::vector<IoWorker::Ticket> t;
  for (size_t j = 0; j < m.master.subs.size(); ++j) {
    t.push_back(io_->read(m.master.subs[j], master + m.sub_start(j)));
  }
  Status st;
  for (auto x : t) {
    Status s = io_->wait(x);
    if (st.is_ok()) st = s;
  }
  return st.with_context("reading " + m.name + " master weights");
}

Status Homes::host_state(size_t i, bool read, const char* what, HostState* out) {
  Module& m = mods_[i];
  out->mst.reset();
  out->mom.reset();
  // Device-resident state may still be stepped by the device's optimizer (compute stream).
  if (m.master.tier == Tier::kDevice || m.mom.tier == Tier::kDevice) {
    STRATA_RETURN_IF_ERROR(dev_.synchronize(dev_.compute_stream()),
                           "waiting for " + m.name + " optimizer step on the device");
  }
  out->master = static_cast<float*>(m.master.ptr());
  out->moments = static_cast<char*>(m.mom.ptr());
  // Device homes the host cannot address are staged through the host tier (a copy).
  auto from_device = [&](Home& h, PinnedBuffer* buf, const char* obj) -> Result<void*> {
    STRATA_ASSIGN_OR_RETURN(*buf, host_buf(h.bytes, what), "staging " + m.name + " " + obj);
    if (!read) return buf->data();
    dev_.copy_d2h(dev_.d2h_stream(), buf->data(), h.dev, h.bytes);
    STRATA_RETURN_IF_ERROR(dev_.synchronize(dev_.d2h_stream()),
                           "copying " + m.name + " " + obj + " from the device");
    return buf->data();
  };
  if (m.master.tier == Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(out->mst, host_buf(m.master.bytes, what),
                            "staging " + m.name + " master weights");
    out->master = out->mst.as<float>();
    if (read) STRATA_RETURN_IF_ERROR(read_master(i, out->master), "");
  } else if (staged(m.master)) {
    STRATA_ASSIGN_OR_RETURN(void* p, from_device(m.master, &out->mst, "master weights"), "");
    out->master = static_cast<float*>(p);
  }
  if (m.mom.tier == Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(out->mom, host_buf(m.mom.bytes, what),
                            "staging " + m.name + " moments");
    out->moments = static_cast<char*>(out->mom.data());
    if (read && m.mom.subs.size() == 1) {
      STRATA_RETURN_IF_ERROR(io_->wait(io_->read(m.mom.subs[0], out->moments)),
                             "reading " + m.name + " moments");
    } else if (read) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer sub, host_buf(m.sub_len(0) * m.mom_elem(), what),
                              "staging " + m.name + " moments");
      for (size_t j = 0; j < m.mom.subs.size(); ++j) {
        STRATA_RETURN_IF_ERROR(io_->wait(io_->read(m.mom.subs[j], sub.data())),
                               fmt::format("reading {} moments (sub-group {})", m.name, j));
        scatter_moments(m, j, static_cast<const char*>(sub.data()), out->moments);
      }
    }
  } else if (staged(m.mom)) {
    STRATA_ASSIGN_OR_RETURN(void* p, from_device(m.mom, &out->mom, "moments"), "");
    out->moments = static_cast<char*>(p);
  }
  return Status::ok();
}

Status Homes::write_back(size_t i, const HostState& st) {
  Module& m = mods_[i];
  // Device homes the host cannot address get their staged copy back.
  auto to_device = [&](Home& h, const void* src, const char* obj) -> Status {
    dev_.copy_h2d(dev_.h2d_stream(), h.dev, src, h.bytes);
    return dev_.synchronize(dev_.h2d_stream())
        .with_context("copying " + m.name + " " + obj + " to the device");
  };
  if (m.master.tier == Tier::kDevice && staged(m.master)) {
    STRATA_RETURN_IF_ERROR(to_device(m.master, st.master, "master weights"), "");
  }
  if (m.mom.tier == Tier::kDevice && staged(m.mom)) {
    STRATA_RETURN_IF_ERROR(to_device(m.mom, st.moments, "moments"), "");
  }
  if (m.master.tier == Tier::kNvme) {
    for (size_t j = 0; j < m.master.subs.size(); ++j) {
      STRATA_RETURN_IF_ERROR(io_->wait(io_->write(m.master.subs[j], st.master + m.sub_start(j))),
                             "writing " + m.name + " master weights");
    }
  }
  if (m.mom.tier == Tier::kNvme && m.mom.subs.size() == 1) {
    STRATA_RETURN_IF_ERROR(io_->wait(io_->write(m.mom.subs[0], st.moments)),
                           "writing " + m.name + " moments");
  } else if (m.mom.tier == Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer sub, host_buf(m.sub_len(0) * m.mom_elem(), "staging"),
                            "writing " + m.name + " moments");
    for (size_t j = 0; j < m.mom.subs.size(); ++j) {
      gather_moments(m, j, st.moments, static_cast<char*>(sub.data()));
      STRATA_RETURN_IF_ERROR(io_->wait(io_->write(m.mom.subs[j], sub.data())),
                             fmt::format("writing {} moments (sub-group {})", m.name, j));
    }
  }
  return Status::ok();
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
