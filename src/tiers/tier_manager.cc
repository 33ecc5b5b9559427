#include "src/tiers/tier_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <thread>

#include "io/io_worker.h"
#include "strata/checksum.h"
#include "strata/cpu_optim.h"
#include "strata/log.h"
#include "strata/swap_space.h"

namespace strata {

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

namespace {

using Clock = std::chrono::steady_clock;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

Result<Tier> parse_tier(const std::string& key, const std::string& v, bool allow_nvme) {
  if (v == "device" || v == "none") return Tier::kDevice;
  if (v == "host" || v == "cpu") return Tier::kHost;
  if (v == "nvme" && allow_nvme) return Tier::kNvme;
  return invalid_argument(
      fmt::format("{}: '{}' is not one of device, host{}", key, v, allow_nvme ? ", nvme" : ""));
}

size_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  size_t kb = 0;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

}  // namespace

Result<Placement> placement_from_config(const Config& cfg, const Device& device) {
  Placement p;
  const auto& zp = cfg.zero.offload_param;
  const auto& zo = cfg.zero.offload_optimizer;
  STRATA_ASSIGN_OR_RETURN(
      p.params, parse_tier("zero_optimization.offload_param.device", zp.device, true), "");
  STRATA_ASSIGN_OR_RETURN(
      Tier opt, parse_tier("zero_optimization.offload_optimizer.device", zo.device, true), "");
  p.master = p.moments = opt;
  p.grads = opt == Tier::kDevice ? Tier::kDevice : Tier::kHost;
  p.optimizer_ratio = zo.ratio;
  const StrataConfig& s = cfg.strata;
  if (!s.placement_params.empty()) {
    STRATA_ASSIGN_OR_RETURN(p.params,
                            parse_tier("strata.placement.params", s.placement_params, true), "");
  }
  if (!s.placement_master.empty()) {
    STRATA_ASSIGN_OR_RETURN(p.master,
                            parse_tier("strata.placement.master", s.placement_master, true), "");
  }
  if (!s.placement_moments.empty()) {
    STRATA_ASSIGN_OR_RETURN(p.moments,
                            parse_tier("strata.placement.moments", s.placement_moments, true), "");
  }
  if (!s.placement_grads.empty()) {
    STRATA_ASSIGN_OR_RETURN(p.grads, parse_tier("strata.placement.grads", s.placement_grads, false),
                            "");
  }
  const bool dev_opt = p.master == Tier::kDevice || p.moments == Tier::kDevice ||
                       p.grads == Tier::kDevice || p.optimizer_ratio < 1.0;
  if (dev_opt && !device.host_addressable()) {
    return invalid_argument(
        "optimizer state or gradients on the device need the optimizer step to run on the "
        "device, which this backend cannot do yet: set zero_optimization.offload_optimizer."
        "device to \"cpu\" or \"nvme\" (and offload_optimizer.ratio to 1)");
  }
  return p;
}

TierOptions TierOptions::from_config(const Config& cfg, DType dt) {
  TierOptions o;
  const auto& zp = cfg.zero.offload_param;
  const auto& zo = cfg.zero.offload_optimizer;
  std::set<std::string> seen;
  for (const auto* list : {&zp.nvme_path, &zo.nvme_path}) {
    for (const auto& p : *list) {
      if (seen.insert(p).second) o.nvme_paths.push_back(p);
    }
  }
  o.storage = StorageOptions::from_config(cfg);
  o.pin_memory = zp.pin_memory || zo.pin_memory;
  o.buffer_count = std::max(1, zo.buffer_count);
  const size_t es = dtype_size(dt);
  o.prefetch_bytes = cfg.zero.stage3_prefetch_bucket_size * es;
  o.max_reuse_distance = cfg.zero.stage3_max_reuse_distance >= (UINT64_MAX / 8)
                             ? UINT64_MAX
                             : cfg.zero.stage3_max_reuse_distance * es;
  o.persistence_threshold = cfg.zero.stage3_param_persistence_threshold;
  o.reduce_bucket_elems = cfg.zero.reduce_bucket_size;
  o.overlap_comm = cfg.zero.overlap_comm;
  o.optimizer_threads = cfg.device.cpu_threads;
  o.delayed_update = cfg.strata.delayed_update;
  o.undo_copies = cfg.strata.optimizer_overlap && (cfg.gradient_clipping > 0 || cfg.fp16.enabled);
  size_t avail = host_available_bytes();
  o.host_capacity = cfg.strata.host_memory_limit > 0 ? cfg.strata.host_memory_limit
                                                     : static_cast<size_t>(double(avail) * 0.9);
  return o;
}

// ---------------------------------------------------------------------------------------------

struct TierManager::Impl {
  // Where one object's bytes live.
  struct Home {
    Tier tier = Tier::kHost;
    size_t bytes = 0;
    PinnedBuffer host;    // tier == host
    void* dev = nullptr;  // tier == device
    SwapExtent ext;       // tier == nvme
    // Host-visible pointer for host homes, and device homes on a host-addressable device.
    void* ptr() const { return tier == Tier::kHost ? host.data() : dev; }
  };
  struct Module {
    std::string name;
    size_t numel = 0;
    // This rank's shard: elements [off, off + sn) of the group padded to `padded` elements, of
    // which `valid` are real. Unsharded: off 0, sn == padded == valid == numel.
    size_t sn = 0, off = 0, padded = 0, valid = 0;
    Home p, master, mom, gacc;
    Home gacc2;  // delayed update: the gradients the update thread reads while gacc fills
  };
  // The device cache entry of a module's parameters (unused when their home is the device).
  struct Cache {
    void* ptr = nullptr;
    bool resident = false;
    bool persistent = false;
    int pins = 0;
    uint64_t acq_pos = 0;   // trace position of the current/last acquire
    uint64_t last_pos = 0;  // LRU key
    std::shared_ptr<Event> ready, last_use;
  };
  struct PendingFree {
    void* ptr;
    size_t bytes;
    std::shared_ptr<Event> after;
  };
  // One module's optimizer state in host memory for the optimizer pass: its home pointers, or
  // staging buffers being read from NVMe.
  struct Slot {
    std::shared_ptr<PinnedBuffer> master_buf, mom_buf;
    IoWorker::Ticket rm = 0, rmo = 0;
    float* master = nullptr;
    void* mom = nullptr;
  };
  // A write to NVMe still in flight, with the buffer it reads from.
  struct Write {
    IoWorker::Ticket t;
    std::shared_ptr<PinnedBuffer> keep;
    std::string what;
  };

  Impl(Device& d, const ModelLayout& l, DType dt_, DType mdt_, const TierOptions& o)
      : dev(d), lay(l), dt(dt_), mdt(mdt_), opt(o) {}

  Device& dev;
  bool sharded = false;  // world size > 1
  ModelLayout lay;
  DType dt, mdt;
  TierOptions opt;
  std::unique_ptr<BufferPool> pool;
  std::unique_ptr<Storage> storage;
  std::unique_ptr<SwapSpace> swap;
  std::unique_ptr<IoWorker> io;
  std::vector<Module> mods;
  std::vector<Cache> cache;
  std::vector<float*> gdev;
  std::vector<GradStats> gstats;
  std::deque<PendingFree> pending;
  std::map<int, Slot> prepared;       // optimizer state read ahead (during backward)
  std::deque<Write> writes;           // optimizer/parameter writes draining behind later work
  std::vector<int> opt_order;         // modules in the order their gradients became final
  std::vector<int> last_drain_order;  // the last step's opt_order
  TierManager* owner = nullptr;

  // The optimizer under backward (TierManager::begin_speculation): modules whose gradients
  // are final (d2h event) wait in `ready`; those stepped keep their undo copies in `stepped`.
  // A stepped module's pre-step master weights and moments: for NVMe-homed state its old
  // extent (the step was written to a fresh one, `*_shadow`), else a host copy.
  struct Undo {
    std::shared_ptr<PinnedBuffer> master, mom;  // host copies; null when none
    SwapExtent old_master, old_mom;             // the pre-step extents, while *_shadow
    bool master_shadow = false, mom_shadow = false;
    bool kept() const { return master || mom || master_shadow || mom_shadow; }
  };
  struct Speculation {
    bool active = false, undo = false;
    bool step_modules = true;  // false: only read state ahead during backward
    bool stopped = false;      // no host memory for undo copies: the rest waits for validation
    OptimizerHyper hyper;
    float mult = 1.0f;
    std::deque<std::pair<int, std::shared_ptr<Event>>> ready;
    std::map<int, Undo> stepped;
    std::vector<int> expected;  // expected gradient completion order, for read-ahead
    size_t next_prep = 0;
    std::vector<std::pair<Clock::time_point, Clock::time_point>> intervals;
    Clock::time_point bwd_end{};  // when the compute stream finished the backward
  } spec;
  uint64_t rollbacks = 0, modules_redone = 0, modules_speculated = 0;
  double optimizer_hidden_s = 0;

  Status step_module(int k, Slot& s, const OptimizerHyper& hyper, float grad_mult,
                     const float* grad = nullptr, void* shadow = nullptr);
  // The delayed update (TierManager::start_delayed_update): a thread stepping every module from
  // the gradients in gacc2 into per-module parameter shadows.
  struct Delayed {
    std::thread thread;
    bool pending = false;
    Status status;
    std::vector<std::shared_ptr<PinnedBuffer>> shadow;  // [module] new parameters
    double busy_s = 0;                                  // the thread's time
  } dpu;
  void run_delayed(OptimizerHyper hyper, float grad_mult, std::vector<int> order);
  Status run_pass(const std::vector<int>& order, const OptimizerHyper& hyper, float grad_mult,
                  bool delayed);
  std::vector<int> step_order(std::vector<bool> skip) const;
  void end_step_reads();
  Status retire_writes(size_t keep_at_most);
  Status take_slot(int k, Slot* out);
  void read_ahead();
  Status undo_speculation(bool redo, const OptimizerHyper& hyper, float grad_mult);
  bool take_undo(int k, const Slot& s, Undo* u);
  void drop_shadows(int k, Undo* u);
  void end_speculation();
  size_t device_state_bytes = 0;  // resident homes + cache + grads (manager's share)
  size_t nvme_capacity = 0, nvme_used = 0, nvme_peak = 0;
  bool shadow_room = false;  // the swap files have room for shadow extents (see take_undo)

  // trace
  std::map<std::string, Trace> traces;
  std::string phase;
  std::vector<Access> rec;
  bool mismatch = false;
  uint64_t pos = 0;
  const Trace* cur = nullptr;

  // stats (device counters are also updated from stream threads)
  mutable std::mutex mu;
  Status async_error;
  uint64_t dev_in = 0, dev_out = 0, host_in = 0, host_out = 0;
  uint64_t fetches = 0, prefetches = 0, grad_reductions = 0, grad_shared_reductions = 0;
  double compute_wait_s = 0, optimizer_s = 0, io_wait_base = 0;

  // ---- sharded gradient buckets (TierOptions): pieces drained but not yet reduced ----------
  // Piece: elements [a, a + len) of every rank's shard of module m's gradient buffer g.
  struct Piece {
    int m;
    float* g;
    size_t a, len;
    int micro;
    bool last;   // the step's last micro-batch: the module's grad stats follow its final piece
    bool final;  // the module's last piece: g is freed after this bucket
  };
  float* bucket = nullptr;  // device: world * bucket_kc floats
  size_t bucket_kc = 0;     // per-rank capacity of a bucket, elements
  std::vector<Piece> open;  // the bucket being filled
  size_t open_k = 0;        // per-rank elements in it

  void set_async_error(const Status& s) {
    std::lock_guard<std::mutex> l(mu);
    if (async_error.is_ok()) async_error = s;
  }
  Status take_async_error() {
    std::lock_guard<std::mutex> l(mu);
    Status s = async_error;
    async_error = Status::ok();
    return s;
  }

  // ---- device memory -------------------------------------------------------------------
  void reclaim(bool block_oldest) {
    while (!pending.empty()) {
      PendingFree& f = pending.front();
      if (f.after && !dev.query(*f.after)) {
        if (!block_oldest) break;
        dev.synchronize(*f.after).ignore();
        block_oldest = false;
      }
      dev.release(f.ptr);
      {
        std::lock_guard<std::mutex> l(mu);
        device_state_bytes -= f.bytes;
      }
      pending.pop_front();
    }
  }

  uint64_t next_use(int m, uint64_t from) const {
    if (!cur || mismatch) return 0;
    return cur->next_use_of(m, from);
  }

  // Evicts one cached parameter object: the one used furthest in the future (Belady) when the
  // trace is known, else the least recently used. Never `keep`, pinned or persistent ones, and
  // (for prefetch) none needed at or before `need_before`. Returns false if none qualifies.
  bool evict_one(int keep, uint64_t need_before) {
    int victim = -1;
    uint64_t best = 0;
    const bool belady = cur && !mismatch;
    for (size_t m = 0; m < cache.size(); ++m) {
      const Cache& c = cache[m];
      if (!c.resident || c.pins > 0 || c.persistent || int(m) == keep) continue;
      uint64_t key;
      if (belady) {
        key = next_use(int(m), pos);
        if (need_before != UINT64_MAX && key <= need_before) continue;
      } else {
        if (need_before != UINT64_MAX) continue;  // no prefetch without a trace
        key = UINT64_MAX - c.last_pos;
      }
      if (victim < 0 || key > best) {
        victim = int(m);
        best = key;
      }
    }
    if (victim < 0) return false;
    drop(victim);
    return true;
  }

  // Device bytes of a gathered (cached) parameter group.
  size_t cache_bytes(const Module& m) const { return m.padded * dtype_size(dt); }

  void drop(int m) {
    Cache& c = cache[size_t(m)];
    // The memory is freed once its last use (and its fetch) have run.
    if (c.ready) dev.synchronize(*c.ready).ignore();
    pending.push_back({c.ptr, round_up(cache_bytes(mods[size_t(m)]), 256), c.last_use});
    c.ptr = nullptr;
    c.resident = false;
  }

  // Device allocation for manager-owned buffers, evicting as needed. With `may_block`, waits for
  // pending frees and gradient drains before giving up; the error names the tier and the key.
  Result<void*> dev_alloc(size_t bytes, const std::string& tag, int keep, uint64_t need_before,
                          bool may_block) {
    // Waits for pending frees as often as there are any, then for the gradient drains twice
    // (counted apart: how many frees were pending depends on timing, the outcome must not).
    for (int drain_waits = 0;;) {
      reclaim(false);
      auto r = dev.allocate(bytes, tag);
      if (r.is_ok()) {
        std::lock_guard<std::mutex> l(mu);
        device_state_bytes += round_up(bytes, 256);
        return r;
      }
      // Sharded: never evict for room (whether an allocation fails depends on timing; an
      // eviction would change which gathers follow, and every rank must issue the same ones).
      if (!sharded && evict_one(keep, need_before)) continue;
      if (!may_block) return r.status();
      if (!pending.empty()) {
        reclaim(true);
        continue;
      }
      if (drain_waits++ < 2) {  // gradient drains in flight free device memory when they finish
        dev.synchronize(dev.d2h_stream()).ignore();
        continue;
      }
      auto st = dev.memory_stats();
      return out_of_memory(fmt::format(
          "device tier full: {} for {} does not fit ({} of {} in use, every cached object "
          "pinned); raise device.memory_limit or lower train_micro_batch_size_per_gpu{}",
          format_bytes(double(bytes)), tag, format_bytes(double(st.used)),
          format_bytes(double(st.capacity)),
          sharded ? " or zero_optimization.stage3_prefetch_bucket_size (with several ranks, "
                    "gathered groups in the prefetch window are never evicted)"
                  : ""));
    }
  }

  Result<PinnedBuffer> host_buf(size_t bytes, const char* what) {
    for (int round = 0;; ++round) {
      auto r = pool->acquire(bytes);
      if (r.is_ok() || round >= 2) {
        if (!r.is_ok()) return r.status().with_context(what);
        return r;
      }
      // Staging buffers come back as copies and writes finish.
      dev.synchronize(dev.h2d_stream()).ignore();
      dev.synchronize(dev.d2h_stream()).ignore();
    }
  }

  // Module i's master weights and moments in host memory: their homes when host-visible, else
  // staging buffers from the host tier (filled from NVMe first when `read`). `write_back`
  // stores staged state to its NVMe homes.
  struct HostState {
    PinnedBuffer mst, mom;  // staging, when the home is NVMe
    float* master = nullptr;
    char* moments = nullptr;
  };
  Status host_state(size_t i, bool read, const char* what, HostState* out) {
    Module& m = mods[i];
    out->mst.reset();
    out->mom.reset();
    out->master = static_cast<float*>(m.master.ptr());
    out->moments = static_cast<char*>(m.mom.ptr());
    if (m.master.tier == Tier::kNvme) {
      STRATA_ASSIGN_OR_RETURN(out->mst, host_buf(m.master.bytes, what), "");
      if (read) STRATA_RETURN_IF_ERROR(io->wait(io->read(m.master.ext, out->mst.data())), "");
      out->master = out->mst.as<float>();
    }
    if (m.mom.tier == Tier::kNvme) {
      STRATA_ASSIGN_OR_RETURN(out->mom, host_buf(m.mom.bytes, what), "");
      if (read) STRATA_RETURN_IF_ERROR(io->wait(io->read(m.mom.ext, out->mom.data())), "");
      out->moments = static_cast<char*>(out->mom.data());
    }
    return Status::ok();
  }
  Status write_back(size_t i, const HostState& st) {
    Module& m = mods[i];
    if (m.master.tier == Tier::kNvme) {
      STRATA_RETURN_IF_ERROR(io->wait(io->write(m.master.ext, st.master)), "");
    }
    if (m.mom.tier == Tier::kNvme) {
      STRATA_RETURN_IF_ERROR(io->wait(io->write(m.mom.ext, st.moments)), "");
    }
    return Status::ok();
  }

  // ---- optimizer state --------------------------------------------------------------------
  // Points the slot at module k's optimizer state, starting NVMe reads into staging buffers.
  // With `try_only`, gives up (returns false) instead of waiting when the pool is full.
  Result<bool> prepare_slot(int k, bool try_only) {
    Module& m = mods[size_t(k)];
    Slot s;
    s.master = static_cast<float*>(m.master.ptr());
    s.mom = m.mom.ptr();
    auto buf = [&](size_t bytes) -> Result<std::shared_ptr<PinnedBuffer>> {
      auto b = try_only ? pool->acquire(bytes) : host_buf(bytes, "optimizer pipeline");
      if (!b.is_ok()) return b.status();
      return std::make_shared<PinnedBuffer>(std::move(b).value());
    };
    if (m.master.tier == Tier::kNvme) {
      auto b = buf(m.master.bytes);
      if (!b.is_ok()) {
        if (try_only) return false;
        return b.status();
      }
      s.master_buf = *b;
    }
    if (m.mom.tier == Tier::kNvme) {
      auto b = buf(m.mom.bytes);
      if (!b.is_ok()) {
        if (try_only) return false;
        return b.status();
      }
      s.mom_buf = *b;
    }
    if (s.master_buf) {
      s.master = s.master_buf->as<float>();
      s.rm = io->read(m.master.ext, s.master);
    }
    if (s.mom_buf) {
      s.mom = s.mom_buf->data();
      s.rmo = io->read(m.mom.ext, s.mom);
    }
    prepared[k] = std::move(s);
    return true;
  }

  // Frees the buffers of writes that have finished; with `all`, waits for every write.
  Status reap_writes(bool all) {
    Status first;
    while (!writes.empty() && (all || io->done(writes.front().t))) {
      Write w = std::move(writes.front());
      writes.pop_front();
      Status s = io->wait(w.t);
      if (!s.is_ok() && first.is_ok()) first = s.with_context("writing " + w.what);
    }
    return first;
  }

  // ---- parameters ----------------------------------------------------------------------
  // Fetches (gathers, when sharded) module m's parameters into the device cache. need_before
  // is UINT64_MAX for a fetch on demand, else the prefetch's eviction horizon (unused when
  // sharded: nothing is evicted then).
  Status fetch(int m, uint64_t need_before, bool may_block, bool* fetched) {
    Module& mod = mods[size_t(m)];
    Cache& c = cache[size_t(m)];
    *fetched = false;
    const size_t full = cache_bytes(mod);
    auto r = dev_alloc(full, mod.name + ".params", m, need_before, may_block);
    if (!r.is_ok()) return may_block ? r.status() : Status::ok();
    c.ptr = *r;
    // This rank's shard lands at its offset in the group; the all-gather fills the rest.
    char* mine = static_cast<char*>(c.ptr) + mod.off * dtype_size(dt);
    Stream& h2d = dev.h2d_stream();
    if (mod.p.tier == Tier::kDevice) {
      dev.copy_d2d(h2d, mine, mod.p.dev, mod.p.bytes);
    } else if (mod.p.tier == Tier::kHost) {
      dev.copy_h2d(h2d, mine, mod.p.host.data(), mod.p.bytes);
    } else {
      auto staging = host_buf(mod.p.bytes, "staging a parameter fetch");
      if (!staging.is_ok()) {
        dev.release(c.ptr);
        std::lock_guard<std::mutex> l(mu);
        device_state_bytes -= round_up(full, 256);
        c.ptr = nullptr;
        return may_block ? staging.status() : Status::ok();
      }
      auto sp = std::make_shared<PinnedBuffer>(std::move(staging).value());
      IoWorker::Ticket t = io->read(mod.p.ext, sp->data());
      IoWorker* iow = io.get();
      dev.host_fn(h2d, [this, iow, t] {
        Status s = iow->wait(t);
        if (!s.is_ok()) set_async_error(s);
      });
      dev.copy_h2d(h2d, mine, sp->data(), mod.p.bytes);
      dev.host_fn(h2d, [sp] { sp->reset(); });
      std::lock_guard<std::mutex> l(mu);
      host_in += mod.p.bytes;
      host_out += mod.p.bytes;
    }
    if (sharded) {
      Status s = opt.param_comm->all_gather(h2d, mine, c.ptr, mod.sn, dt);
      if (!s.is_ok()) set_async_error(s.with_context("gathering " + mod.name + " parameters"));
    }
    c.ready = std::shared_ptr<Event>(dev.create_event());
    dev.record(*c.ready, h2d);
    c.resident = true;
    c.persistent = !sharded && mod.numel < opt.persistence_threshold;
    {
      std::lock_guard<std::mutex> l(mu);
      dev_in += full;
      ++fetches;
      if (need_before != UINT64_MAX) ++prefetches;  // a prefetch (demand fetches pass MAX)
    }
    *fetched = true;
    return Status::ok();
  }

  void compute_waits_for(const std::shared_ptr<Event>& ev) {
    if (!ev) return;
    if (dev.host_addressable()) {
      // Timed wait: how long the compute stream stalls on this fetch.
      dev.host_fn(dev.compute_stream(), [this, ev] {
        auto t0 = Clock::now();
        dev.synchronize(*ev).ignore();
        double w = std::chrono::duration<double>(Clock::now() - t0).count();
        std::lock_guard<std::mutex> l(mu);
        compute_wait_s += w;
      });
    } else {
      dev.wait(dev.compute_stream(), *ev);
    }
  }

  // ---- sharded prefetch: decided from trace positions and group sizes only ---------------
  // The end of the prefetch window that starts at trace position `from`: the accesses
  // [from, end) whose distinct groups' gathered bytes add up to at most prefetch_bytes. It
  // stops at the step's end (the optimizer step updates every shard before the next use).
  uint64_t window_end(uint64_t from) {
    if (!cur || mismatch || from >= cur->size()) return from;
    std::vector<char> seen(mods.size(), 0);
    uint64_t bytes = 0, j = from;
    for (; j < cur->size(); ++j) {
      const int m = cur->accesses()[j].object;
      if (seen[size_t(m)]) continue;
      const uint64_t b = round_up(cache_bytes(mods[size_t(m)]), 256);
      if (bytes + b > opt.prefetch_bytes) break;
      bytes += b;
      seen[size_t(m)] = 1;
    }
    return j;
  }
  // Gathers every group of the window from `pos` that is not cached, in trace order. Same
  // decisions on every rank; a shortage of device memory blocks (then fails), never skips.
  void prefetch_sharded() {
    const uint64_t end = window_end(pos);
    for (uint64_t j = pos; j < end; ++j) {
      const int m = cur->accesses()[j].object;
      if (cache[size_t(m)].resident) continue;
      bool fetched = false;
      Status s = fetch(m, /*need_before=*/j, /*may_block=*/true, &fetched);
      if (!s.is_ok()) {
        // Remembered for end_backward; the acquire of m fetches (and fails) on demand.
        set_async_error(s.with_context("prefetching " + mods[size_t(m)].name + " parameters"));
        return;
      }
    }
  }
  // Whether an unheld gathered group stays cached: its next use lies in the window from `pos`.
  bool keep_gathered(int m) {
    if (!cur || mismatch) return false;
    const uint64_t next = cur->next_use_of(m, pos);
    return next != UINT64_MAX && next < window_end(pos);
  }

  void prefetch() {
    if (sharded) {
      if (cur && !mismatch && !cur->empty() && opt.prefetch_bytes > 0) prefetch_sharded();
      return;
    }
    if (!cur || mismatch || cur->empty()) return;
    const uint64_t n = cur->size();
    uint64_t in_flight = 0;
    for (size_t m = 0; m < cache.size(); ++m) {
      if (cache[m].resident && cache[m].ready && !dev.query(*cache[m].ready)) {
        in_flight += mods[m].p.bytes;
      }
    }
    for (uint64_t j = pos; j < pos + n; ++j) {
      const int m = cur->accesses()[j % n].object;
      if (mods[size_t(m)].p.tier == Tier::kDevice || cache[size_t(m)].resident) continue;
      if (in_flight + mods[size_t(m)].p.bytes > opt.prefetch_bytes) break;
      bool fetched = false;
      const uint64_t horizon = prefetch_horizon(*cur, pos - 1, j);
      if (!fetch(m, horizon, /*may_block=*/false, &fetched).is_ok() || !fetched) break;
      in_flight += mods[size_t(m)].p.bytes;
    }
  }

  // Module m's gradients for this step are complete in GACC once the d2h stream has run as far
  // as it is now: called for the last micro-batch right after the work that writes them is
  // enqueued — by drain_grads unsharded, by flush_bucket for a module's final piece when
  // sharded (a module's gradients are final only when its bucket has been reduced).
  // Module m's gradients for this step are complete once the d2h stream has run this far:
  // its optimizer step may start (under backward when speculating, see begin_speculation).
  void grads_final(int m) {
    opt_order.push_back(m);
    if (spec.active) {
      auto done = std::shared_ptr<Event>(dev.create_event());
      dev.record(*done, dev.d2h_stream());
      spec.ready.emplace_back(m, std::move(done));
    }
  }

  // ---- sharded gradient reduction in buckets (TierOptions) ----------------------------------
  // GACC[m][a, a + len) <- (micro 0) or += (later) `len` reduced floats at device `src`, on
  // the d2h stream.
  void accumulate(int m, const float* src, size_t a, size_t len, int micro) {
    Stream& d2h = dev.d2h_stream();
    float* acc = static_cast<float*>(mods[size_t(m)].gacc.ptr()) + a;
    const size_t bytes = len * 4;
    if (micro == 0) {
      dev.copy_d2h(d2h, acc, src, bytes);
    } else {
      auto landing = host_buf(bytes, "gradient landing buffer");
      if (!landing.is_ok()) {
        set_async_error(landing.status());
        return;
      }
      auto lb = std::make_shared<PinnedBuffer>(std::move(landing).value());
      dev.copy_d2h(d2h, lb->data(), src, bytes);
      dev.host_fn(d2h, [lb, acc, len] {
        const float* x = lb->as<float>();
        for (size_t i = 0; i < len; ++i) acc[i] += x[i];
        lb->reset();
      });
    }
    std::lock_guard<std::mutex> l(mu);
    dev_out += bytes;
  }

  // Reduce-scatters the open bucket on the d2h stream and empties it. One whole module is
  // reduced in place in its own buffer; anything else is first copied into `bucket`, laid out
  // as the collective wants it: rank q's part of every piece, in piece order, at q * k.
  void flush_bucket() {
    if (open.empty()) return;
    Stream& d2h = dev.d2h_stream();
    const int world = opt.grad_comm->size(), rank = opt.grad_comm->rank();
    const size_t k = open_k;
    const Piece& p0 = open.front();
    const bool in_place = open.size() == 1 && p0.a == 0 && p0.len == mods[size_t(p0.m)].sn;
    float* buf = in_place ? p0.g : bucket;
    if (!in_place) {
      size_t o = 0;
      for (const Piece& p : open) {
        const size_t sn = mods[size_t(p.m)].sn;
        for (int q = 0; q < world; ++q) {
          dev.copy_d2d(d2h, buf + size_t(q) * k + o, p.g + size_t(q) * sn + p.a, p.len * 4);
        }
        o += p.len;
      }
    }
    float* mine = buf + size_t(rank) * k;
    Status st = opt.grad_comm->reduce_scatter(d2h, buf, mine, k, DType::kF32, ReduceOp::kSum);
    if (!st.is_ok()) {
      set_async_error(
          st.with_context(fmt::format("reducing the gradients of {}{}", mods[size_t(p0.m)].name,
                                      open.size() > 1 ? " and the modules after it" : "")));
    }
    size_t o = 0;
    for (const Piece& p : open) {
      accumulate(p.m, mine + o, p.a, p.len, p.micro);
      o += p.len;
      if (!p.final) continue;
      Module& mod = mods[size_t(p.m)];
      if (p.last) {
        Impl* ip = this;
        const int m = p.m;
        float* acc = static_cast<float*>(mod.gacc.ptr());
        const size_t n = mod.sn;
        dev.host_fn(d2h, [ip, m, acc, n] {
          ip->gstats[size_t(m)] = strata::grad_stats(acc, DType::kF32, n);
        });
        grads_final(m);
      }
      Impl* ip = this;
      float* g = p.g;
      const size_t dev_bytes = mod.padded * 4;
      dev.host_fn(d2h, [ip, g, dev_bytes] {
        ip->dev.release(g);
        std::lock_guard<std::mutex> l(ip->mu);
        ip->device_state_bytes -= round_up(dev_bytes, 256);
      });
    }
    if (!opt.overlap_comm) {
      // overlap_comm false: the compute stream waits for this reduction.
      auto ev = std::shared_ptr<Event>(dev.create_event());
      dev.record(*ev, d2h);
      dev.wait(dev.compute_stream(), *ev);
    }
    const bool shared =
        std::any_of(open.begin(), open.end(), [&](const Piece& p) { return p.m != p0.m; });
    {
      std::lock_guard<std::mutex> l(mu);
      ++grad_reductions;
      grad_shared_reductions += shared;
    }
    open.clear();
    open_k = 0;
  }

  // Module m's gradient buffer g (whole padded group) after its backward: into buckets.
  void drain_sharded(int m, float* g, int micro, bool last) {
    const size_t sn = mods[size_t(m)].sn, kc = bucket_kc;
    // A bucket never spans micro-batches (a module's pieces of two micro-batches would be
    // accumulated out of order with respect to their copies).
    if (!open.empty() && open.front().micro != micro) flush_bucket();
    if (sn <= kc && open_k + sn > kc) flush_bucket();  // a whole module that does not fit
    if (sn > kc) flush_bucket();  // a large module: bucket-sized pieces of its own
    for (size_t a = 0; a < sn;) {
      const size_t len = std::min(kc - open_k, sn - a);
      open.push_back({m, g, a, len, micro, last, a + len == sn});
      open_k += len;
      a += len;
      if (open_k == kc) flush_bucket();
    }
  }

  // ---- offloaded activations ---------------------------------------------------------------
  std::vector<PinnedBuffer> act_host;          // one per stashed layer, from the pool
  std::vector<size_t> act_len;                 // bytes stashed (0: never)
  std::vector<std::shared_ptr<Event>> act_ev;  // latest stash or restore of each layer
  std::shared_ptr<Event> act_last_stash;       // the latest stash (the d2h stream is FIFO)
};

// ---------------------------------------------------------------------------------------------

TierManager::TierManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  opt_ = impl_->opt;
  impl_->owner = this;
}

TierManager::~TierManager() {
  if (!impl_) return;
  Impl& I = *impl_;
  if (I.dpu.pending) I.dpu.thread.join();
  if (I.io) {
    I.reap_writes(/*all=*/true).ignore();
    for (auto& [k, slot] : I.prepared) {
      if (slot.rm) I.io->wait(slot.rm).ignore();
      if (slot.rmo) I.io->wait(slot.rmo).ignore();
    }
  }
  I.prepared.clear();
  I.dev.synchronize(I.dev.compute_stream()).ignore();
  I.dev.synchronize(I.dev.h2d_stream()).ignore();
  I.dev.synchronize(I.dev.d2h_stream()).ignore();
  I.reclaim(true);
  while (!I.pending.empty()) I.reclaim(true);
  for (size_t m = 0; m < I.mods.size(); ++m) {
    if (I.cache[m].resident) I.dev.release(I.cache[m].ptr);
    if (I.gdev[m]) I.dev.release(I.gdev[m]);
    for (auto* h : {&I.mods[m].p, &I.mods[m].master, &I.mods[m].mom, &I.mods[m].gacc}) {
      if (h->tier == Tier::kDevice && h->dev) I.dev.release(h->dev);
      h->host.reset();
    }
  }
  if (I.bucket) I.dev.release(I.bucket);
  I.io.reset();
  I.swap.reset();  // removes the swap files
  I.storage.reset();
}

Result<std::unique_ptr<TierManager>> TierManager::create(Device& device, const Architecture& arch,
                                                         DType dt, DType moment_dt,
                                                         const TierOptions& options,
                                                         size_t activation_bytes) {
  const ModelLayout& layout = arch.layout();
  auto impl = std::make_unique<Impl>(device, layout, dt, moment_dt, options);
  Impl& I = *impl;
  const Placement& pl = options.placement;
  const size_t es = dtype_size(dt), mb = dtype_size(moment_dt);
  const size_t M = layout.modules.size();
  int world = 1, rank = 0;
  if (options.param_comm && options.grad_comm && options.param_comm->size() > 1) {
    world = options.param_comm->size();
    rank = options.param_comm->rank();
    if (options.grad_comm->size() != world || options.grad_comm->rank() != rank) {
      return invalid_argument("tier manager: param_comm and grad_comm disagree on rank/size");
    }
    if (options.param_comm->buffer_space() == BufferSpace::kHost && !device.host_addressable()) {
      return invalid_argument(fmt::format(
          "strata.comm.backend: the {} communicator moves host buffers but device '{}' is not "
          "host-addressable; use the nccl backend with a CUDA device, or device.backend cpu",
          options.param_comm->backend(), device.name()));
    }
    I.sharded = true;
  }

  // Homes. The optimizer ratio keeps the first (1 - ratio) of the optimizer bytes on the device.
  size_t total_opt = 0;
  for (const auto& m : layout.modules) total_opt += m.numel * (4 + 2 * mb) / size_t(world);
  const double keep_on_device = (1.0 - pl.optimizer_ratio) * double(total_opt);
  double acc_opt = 0;
  I.mods.resize(M);
  for (size_t i = 0; i < M; ++i) {
    Impl::Module& m = I.mods[i];
    m.name = layout.modules[i].name;
    m.numel = layout.modules[i].numel;
    m.sn = m.padded = m.valid = m.numel;
    if (I.sharded) {
      STRATA_ASSIGN_OR_RETURN(ShardLayout sl, ShardLayout::make(m.numel, world, 4096, dt),
                              "sharding " + m.name);
      m.sn = sl.shard_numel;
      m.padded = sl.padded_numel;
      m.off = sl.offset(rank);
      m.valid = sl.valid(rank);
    }
    m.p = {pl.params, m.sn * es, {}, nullptr, {}};
    const bool opt_on_device = acc_opt < keep_on_device;
    acc_opt += double(m.sn * (4 + 2 * mb));
    m.master.tier = opt_on_device ? Tier::kDevice : pl.master;
    m.mom.tier = opt_on_device ? Tier::kDevice : pl.moments;
    m.master.bytes = m.sn * 4;
    m.mom.bytes = m.sn * 2 * mb;
    m.gacc.tier = opt_on_device ? Tier::kDevice : pl.grads;
    m.gacc.bytes = m.sn * 4;
    if (options.delayed_update) m.gacc2 = {m.gacc.tier, m.gacc.bytes, {}, nullptr, {}};
  }
  I.cache.resize(M);
  I.gdev.assign(M, nullptr);
  I.gstats.assign(M, {});

  // ---- preflight: every tier's need against its capacity, before allocating anything ----
  size_t dev_home = 0, host_home = 0, nvme_home = 0, max_p = 0, max_opt = 0, max_g = 0;
  size_t shadows = 0, undo = 0;  // delayed update: parameter shadows; speculation: undo copies
  size_t undo_nvme = 0;          // the part of `undo` homed on NVMe (shadow extents instead)
  for (const auto& m : I.mods) {
    if (options.delayed_update) shadows += round_up(m.p.bytes, 4096);
    undo += round_up(m.master.bytes, 4096) + round_up(m.mom.bytes, 4096);
    for (const auto* h : {&m.master, &m.mom}) {
      if (h->tier == Tier::kNvme) undo_nvme += round_up(h->bytes, 4096);
    }
    for (const auto* h : {&m.p, &m.master, &m.mom, &m.gacc, &m.gacc2}) {
      if (h->bytes == 0) continue;
      if (h->tier == Tier::kDevice) dev_home += round_up(h->bytes, 256);
      if (h->tier == Tier::kHost) host_home += round_up(h->bytes, 4096);
      if (h->tier == Tier::kNvme) nvme_home += round_up(h->bytes, 4096);
    }
    max_p = std::max(max_p, m.p.bytes);
    max_g = std::max(max_g, m.gacc.bytes);
    if (m.master.tier == Tier::kNvme || m.mom.tier == Tier::kNvme) {
      max_opt = std::max(max_opt, round_up(m.master.bytes, 4096) + round_up(m.mom.bytes, 4096));
    }
  }
  auto pc = [&](int m) -> size_t {
    return pl.params == Tier::kDevice && !I.sharded ? 0
                                                    : round_up(I.mods[size_t(m)].padded * es, 256);
  };
  auto g = [&](int m) -> size_t { return round_up(I.mods[size_t(m)].padded * 4, 256); };
  // The most parameter copies and gradient buffers the model's program holds at once.
  size_t ws = program_peak_bytes(arch.program(Pass::kTrain), pc, g);
  // Sharded: the gradient bucket (reduce_bucket_size over the padded groups, capped at the
  // largest group), and the prefetch window's gathered groups (nothing is evicted for room).
  size_t bucket_bytes = 0, window_bytes = 0;
  if (I.sharded) {
    size_t max_sn = 0, all_gathered = 0;
    for (const auto& m : I.mods) {
      max_sn = std::max(max_sn, m.sn);
      all_gathered += round_up(m.padded * es, 256);
    }
    I.bucket_kc = std::clamp<size_t>(options.reduce_bucket_elems / size_t(world), 1, max_sn);
    bucket_bytes = round_up(I.bucket_kc * size_t(world) * 4, 256);
    window_bytes = std::min<size_t>(options.prefetch_bytes, all_gathered);
    ws += bucket_bytes + window_bytes;
  }
  // Every tier is checked and every shortfall reported together, before anything is allocated
  // or written.
  std::vector<std::string> short_of;
  const size_t dev_cap = device.memory_stats().capacity;
  const size_t dev_need = activation_bytes + dev_home + ws;
  if (dev_need > dev_cap) {
    short_of.push_back(fmt::format(
        "device tier needs {} (activations {}, resident state {}, working set {}{}) but has {}: "
        "raise device.memory_limit, offload more state (zero_optimization.offload_param.device "
        "/ offload_optimizer.device), or lower train_micro_batch_size_per_gpu{}",
        format_bytes(double(dev_need)), format_bytes(double(activation_bytes)),
        format_bytes(double(dev_home)), format_bytes(double(ws)),
        I.sharded
            ? fmt::format(" with a gradient bucket of {} and a prefetch window of {}",
                          format_bytes(double(bucket_bytes)), format_bytes(double(window_bytes)))
            : std::string(),
        format_bytes(double(dev_cap)),
        I.sharded ? ", zero_optimization.reduce_bucket_size or stage3_prefetch_bucket_size" : ""));
  }
  size_t staging = 0;
  if (pl.params == Tier::kNvme) staging += options.prefetch_bytes + 3 * round_up(max_p, 4096);
  // Optimizer pipeline: `buffer_count` modules being read and as many being written.
  if (max_opt > 0) staging += size_t(2 * options.buffer_count + 1) * max_opt;
  staging += 2 * round_up(max_g, 4096) + 2 * round_up(max_p, 4096);  // landing + lp staging
  staging += shadows;
  // Offloaded block inputs (strata.activations = offload).
  const size_t act_host =
      size_t(std::max(0, options.stash_layers)) * round_up(options.stash_bytes, 4096);
  const size_t host_need = host_home + staging + act_host;
  if (host_need > options.host_capacity) {
    short_of.push_back(fmt::format(
        "host tier needs {} (state {}, staging buffers {}{}) but its budget is {}: set "
        "strata.host_memory_limit (default 90% of MemAvailable), offload more to nvme "
        "(zero_optimization.offload_*.device = \"nvme\"), or use a smaller model{}",
        format_bytes(double(host_need)), format_bytes(double(host_home)),
        format_bytes(double(staging)),
        act_host ? fmt::format(", offloaded activations {}", format_bytes(double(act_host))) : "",
        format_bytes(double(options.host_capacity)),
        act_host ? " (or strata.activations = recompute, which keeps block inputs on the device)"
                 : ""));
  }
  size_t objects = 0;
  for (const auto& m : I.mods) {
    for (const auto* h : {&m.p, &m.master, &m.mom}) objects += h->tier == Tier::kNvme;
  }
  SwapOptions so;
  so.paths = options.nvme_paths;
  so.rank = options.rank;
  if (nvme_home > 0 && options.nvme_paths.empty()) {
    short_of.push_back(
        "nvme tier: state is placed on nvme but no swap directory is configured: set "
        "zero_optimization.offload_param.nvme_path or offload_optimizer.nvme_path");
  } else if (nvme_home > 0) {
    so.bytes_per_path =
        round_up(nvme_home / so.paths.size() + objects * so.stripe_size + (size_t{16} << 20), 4096);
    const bool direct = options.storage.backend != "posix";
    for (const auto& path : so.paths) {
      Status s = check_nvme_path(path, so.bytes_per_path + kSwapHeaderBytes, direct,
                                 swap_file_path(path, options.rank));
      if (!s.is_ok()) short_of.push_back("nvme tier: " + s.message());
    }
    // The optimizer under backward writes NVMe-homed master weights and moments to fresh
    // extents and keeps the old ones until the step is validated (take_undo): room for all of
    // them once more when the disks have it, else their undo copies go to host memory.
    size_t shadow = 0, shadow_objects = 0;
    for (const auto& m : I.mods) {
      for (const auto* h : {&m.master, &m.mom}) {
        if (!options.undo_copies || h->tier != Tier::kNvme || h->bytes == 0) continue;
        shadow += round_up(h->bytes, 4096);
        ++shadow_objects;
      }
    }
    if (short_of.empty() && shadow > 0) {
      const size_t more = round_up(
          so.bytes_per_path + shadow / so.paths.size() + shadow_objects * so.stripe_size, 4096);
      bool room = true;
      for (const auto& path : so.paths) {
        room = room && check_nvme_path(path, more + kSwapHeaderBytes, direct,
                                       swap_file_path(path, options.rank))
                           .is_ok();
      }
      if (room) {
        so.bytes_per_path = more;
        I.shadow_room = true;
      } else {
        log_info(
            "tier manager: no room on the swap paths for the optimizer's shadow extents ({}); "
            "its undo copies under backward go to host memory",
            format_bytes(double(shadow)));
      }
    }
  }
  if (!short_of.empty()) {
    std::string msg = "preflight: this run does not fit:";
    for (const auto& line : short_of) msg += "\n  - " + line;
    Status s = out_of_memory(msg);
    for (const auto& line : short_of) {
      if (line.rfind("nvme tier", 0) == 0 && short_of.size() == 1) s = no_space(msg);
    }
    return s;
  }

  // ---- build the tiers ----
  BufferPoolOptions po;
  po.name = "host tier";
  po.lock = options.pin_memory;
  // Room for the optimizer's undo copies under backward when the budget allows (without it,
  // speculation stops early; see begin_speculation); NVMe-homed state has shadow extents.
  const size_t want =
      host_need + (options.undo_copies ? undo - (I.shadow_room ? undo_nvme : 0) : 0);
  const size_t arena = std::min(options.host_capacity, want + want / 8 + (64u << 20));
  STRATA_ASSIGN_OR_RETURN(I.pool, BufferPool::create(arena, po), "host tier");
  device.register_host(I.pool->base(), I.pool->capacity()).ignore();
  if (nvme_home > 0) {
    STRATA_ASSIGN_OR_RETURN(I.storage, open_storage(options.storage), "nvme tier");
    I.storage->register_buffer(I.pool->base(), I.pool->capacity()).ignore();
    STRATA_ASSIGN_OR_RETURN(I.swap, SwapSpace::create(I.storage.get(), so), "nvme tier");
    I.nvme_capacity = I.swap->capacity();
    I.io = std::make_unique<IoWorker>(I.storage.get(), I.swap.get());
  }
  for (auto& m : I.mods) {
    for (auto* h : {&m.p, &m.master, &m.mom, &m.gacc, &m.gacc2}) {
      if (h->bytes == 0) continue;
      const std::string tag = fmt::format("{}.{}", m.name,
                                          h == &m.p        ? "params"
                                          : h == &m.master ? "master"
                                          : h == &m.mom    ? "moments"
                                                           : "grads");
      if (h->tier == Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(h->dev, device.allocate(h->bytes, tag), "device tier: " + tag);
        I.device_state_bytes += round_up(h->bytes, 256);
      } else if (h->tier == Tier::kHost) {
        STRATA_ASSIGN_OR_RETURN(h->host, I.pool->acquire(h->bytes), "host tier: " + tag);
      } else {
        STRATA_ASSIGN_OR_RETURN(h->ext, I.swap->allocate(h->bytes), "nvme tier: " + tag);
        I.nvme_used += h->ext.bytes;
        I.nvme_peak = std::max(I.nvme_peak, I.nvme_used);
      }
    }
  }
  if (I.sharded) {
    STRATA_ASSIGN_OR_RETURN(void* b, device.allocate(bucket_bytes, "gradient reduce bucket"),
                            "device tier: zero_optimization.reduce_bucket_size");
    I.bucket = static_cast<float*>(b);
    I.device_state_bytes += bucket_bytes;
  }
  for (int l = 0; l < options.stash_layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, I.pool->acquire(options.stash_bytes),
                            fmt::format("host tier: activations of block {} "
                                        "(strata.activations = offload)",
                                        l));
    I.act_host.push_back(std::move(b));
  }
  I.act_len.assign(I.act_host.size(), 0);
  I.act_ev.resize(I.act_host.size());
  return std::unique_ptr<TierManager>(new TierManager(std::move(impl)));
}

std::string TierManager::describe() const {
  const Impl& I = *impl_;
  const Placement& p = opt_.placement;
  std::string s = fmt::format(
      "placement: params {}, master {}, moments {}, grads {}{}", tier_name(p.params),
      tier_name(p.master), tier_name(p.moments), tier_name(p.grads),
      p.optimizer_ratio < 1.0 ? fmt::format(" (optimizer ratio {:g})", p.optimizer_ratio) : "");
  s += fmt::format(
      "; device {} capacity, host tier {} (pinned: {}), nvme {}",
      format_bytes(double(I.dev.memory_stats().capacity)), format_bytes(double(I.pool->capacity())),
      I.pool->locked() ? "yes" : "no",
      I.swap ? fmt::format("{} over {} path(s), {}", format_bytes(double(I.nvme_capacity)),
                           opt_.nvme_paths.size(), I.storage->capabilities().backend)
             : std::string("unused"));
  return s;
}

// ---- state init and the optimizer ---------------------------------------------------------

Status TierManager::init_state(const std::function<void(int, float*)>& init) {
  Impl& I = *impl_;
  for (size_t i = 0; i < I.mods.size(); ++i) {
    Impl::Module& m = I.mods[i];
    Impl::HostState hs;
    STRATA_RETURN_IF_ERROR(I.host_state(i, /*read=*/false, "init", &hs), "initializing " + m.name);
    float* master = hs.master;
    char* moments = hs.moments;
    if (I.sharded) {  // the whole module's init, of which this rank keeps its shard
      std::vector<float> full(m.numel);
      init(int(i), full.data());
      std::memset(master, 0, m.master.bytes);
      std::memcpy(master, full.data() + m.off, m.valid * sizeof(float));
    } else {
      init(int(i), master);
    }
    std::memset(moments, 0, m.mom.bytes);
    std::memset(m.gacc.ptr(), 0, m.gacc.bytes);
    std::vector<IoWorker::Ticket> tickets;
    if (m.master.tier == Tier::kNvme) tickets.push_back(I.io->write(m.master.ext, master));
    if (m.mom.tier == Tier::kNvme) tickets.push_back(I.io->write(m.mom.ext, moments));
    STRATA_RETURN_IF_ERROR(write_params(int(i), master), "initializing " + m.name);
    for (auto t : tickets) STRATA_RETURN_IF_ERROR(I.io->wait(t), "initializing " + m.name);
  }
  return Status::ok();
}

Status TierManager::write_params(int mi, const float* master) {
  // Derives the low-precision parameters from `master` and stores them at home (and in the
  // cached device copy, if any). Synchronous; used at init and load.
  Impl& I = *impl_;
  Impl::Module& m = I.mods[size_t(mi)];
  Impl::Cache& c = I.cache[size_t(mi)];
  PinnedBuffer lp;
  void* dst = m.p.tier == Tier::kHost ? m.p.host.data() : nullptr;
  if (m.p.tier == Tier::kDevice && I.dev.host_addressable()) dst = m.p.dev;
  if (!dst) {
    STRATA_ASSIGN_OR_RETURN(lp, I.host_buf(m.p.bytes, "parameter staging"), "");
    dst = lp.data();
  }
  convert(master, DType::kF32, dst, I.dt, m.sn);
  Stream& h2d = I.dev.h2d_stream();
  if (m.p.tier == Tier::kDevice && dst != m.p.dev) I.dev.copy_h2d(h2d, m.p.dev, dst, m.p.bytes);
  if (c.resident && !I.sharded) I.dev.copy_h2d(h2d, c.ptr, dst, m.p.bytes);
  if (c.resident && I.sharded) I.drop(mi);
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(h2d), "");
  if (m.p.tier == Tier::kNvme) {
    STRATA_RETURN_IF_ERROR(I.io->wait(I.io->write(m.p.ext, dst)), "writing parameters");
  }
  return Status::ok();
}

// Steps module k's optimizer state held in `s` (its homes, or staging buffers whose NVMe reads
// have finished) with GACC * grad_mult, writes the new low-precision parameters to their home
// and to a cached device copy, and queues the NVMe writes of everything it changed behind later
// work. `keep` keeps staging buffers alive until their writes finish.
Status TierManager::Impl::step_module(int k, Slot& s, const OptimizerHyper& hyper, float grad_mult,
                                      const float* grad, void* shadow) {
  Module& m = mods[size_t(k)];
  Cache& c = cache[size_t(k)];
  const size_t mb = dtype_size(mdt);
  // A prefetch of these parameters may still be copying from their home: let it land first
  // (the write-through below then replaces the cached copy).
  if (!shadow && c.resident && c.ready) STRATA_RETURN_IF_ERROR(dev.synchronize(*c.ready), "");
  std::shared_ptr<PinnedBuffer> lp_buf;
  void* lp = m.p.tier == Tier::kHost ? m.p.host.data() : nullptr;
  if (m.p.tier == Tier::kDevice && dev.host_addressable()) lp = m.p.dev;
  if (shadow) lp = shadow;
  if (!lp) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, host_buf(m.p.bytes, "parameter staging"), "");
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
  sh.moment_dtype = mdt;
  sh.lp_out = lp;
  sh.lp_dtype = dt;
  strata::optimizer_step(hyper, sh, opt.optimizer_threads);
  if (shadow) {  // the parameters are applied later (finish_delayed_update)
    if (m.master.tier == Tier::kNvme) {
      writes.push_back({io->write(m.master.ext, s.master), s.master_buf, m.name});
    }
    if (m.mom.tier == Tier::kNvme)
      writes.push_back({io->write(m.mom.ext, s.mom), s.mom_buf, m.name});
    return Status::ok();
  }
  Stream& h2d = dev.h2d_stream();
  if (m.p.tier == Tier::kDevice && lp != m.p.dev) dev.copy_h2d(h2d, m.p.dev, lp, m.p.bytes);
  STRATA_CHECK(!sharded || !c.resident, "sharded: a gathered group outlived its use");
  if (c.resident) {  // write-through: the cached copy stays valid
    dev.copy_h2d(h2d, c.ptr, lp, m.p.bytes);
    // Under backward the copy may be evicted before the h2d stream runs this write: its
    // memory is freed only after it (the compute stream's last use of it came earlier, or
    // this module's gradients would not be final).
    c.last_use = std::shared_ptr<Event>(dev.create_event());
    dev.record(*c.last_use, h2d);
    std::lock_guard<std::mutex> l(mu);
    dev_in += m.p.bytes;
  }
  if (lp_buf) dev.host_fn(h2d, [lp_buf] {});  // keeps the staging alive until the copies ran
  // Writes drain behind the rest of the pass and the next forward; a later read of the same
  // extent is ordered after them by the IoWorker.
  if (m.p.tier == Tier::kNvme) writes.push_back({io->write(m.p.ext, lp), lp_buf, m.name});
  if (m.master.tier == Tier::kNvme) {
    writes.push_back({io->write(m.master.ext, s.master), s.master_buf, m.name});
  }
  if (m.mom.tier == Tier::kNvme) {
    writes.push_back({io->write(m.mom.ext, s.mom), s.mom_buf, m.name});
  }
  return Status::ok();
}

// Waits for the oldest writes until at most `keep_at_most` are in flight.
Status TierManager::Impl::retire_writes(size_t keep_at_most) {
  Status st;
  while (writes.size() > keep_at_most) {
    Write w = std::move(writes.front());
    writes.pop_front();
    Status ws = io->wait(w.t);
    if (!ws.is_ok() && st.is_ok()) st = ws.with_context("writing " + w.what);
  }
  return st;
}

// Takes module k's prepared slot (starting its reads if it has none) and waits for its reads.
Status TierManager::Impl::take_slot(int k, Slot* out) {
  if (!prepared.count(k)) {
    STRATA_ASSIGN_OR_RETURN(bool ok, prepare_slot(k, /*try_only=*/false), "");
    (void)ok;
  }
  *out = std::move(prepared[k]);
  prepared.erase(k);
  Status st;
  if (out->rm) st = io->wait(out->rm);
  if (out->rmo) {
    Status s2 = io->wait(out->rmo);
    if (st.is_ok()) st = s2;
  }
  return st;
}

// Starts the reads of the next modules the speculative pass expects, `depth` ahead.
void TierManager::Impl::read_ahead() {
  const size_t depth = size_t(std::max(1, opt.buffer_count));
  size_t inflight = prepared.size();
  // The optimizer pipeline's staging is reserved for 2 * buffer_count + 1 modules (the
  // preflight): the last pass's writes still draining count against it.
  std::set<std::string_view> writing;
  for (const auto& w : writes) writing.insert(w.what);
  while (spec.next_prep < spec.expected.size() && inflight < depth &&
         inflight + writing.size() < 2 * depth + 1) {
    const int k = spec.expected[spec.next_prep++];
    if (prepared.count(k) || spec.stepped.count(k)) continue;
    auto r = prepare_slot(k, /*try_only=*/true);
    if (!r.is_ok() || !*r) break;  // the host tier is busy: read on demand instead
    ++inflight;
  }
}

void TierManager::begin_speculation(const OptimizerHyper& hyper, float grad_mult, bool keep_undo,
                                    bool step_modules) {
  Impl& I = *impl_;
  I.spec.active = true;
  I.spec.step_modules = step_modules;
  I.spec.undo = keep_undo;
  I.spec.stopped = false;
  I.spec.hyper = hyper;
  I.spec.mult = grad_mult;
  I.spec.ready.clear();
  I.spec.stepped.clear();
  I.spec.intervals.clear();
  I.spec.bwd_end = {};
  // Gradients become final in the order the last step's did (first step: reverse module
  // order, which is backward's); read that order's optimizer state ahead.
  I.spec.expected = I.last_drain_order;
  if (I.spec.expected.empty()) {
    for (int k = int(I.mods.size()) - 1; k >= 0; --k) I.spec.expected.push_back(k);
  }
  I.spec.next_prep = 0;
  if (I.io) {
    // The last pass's writes have drained behind this step's start: their buffers go back to
    // the host tier before the read-ahead takes its own (else both are held through backward).
    Status ws = I.reap_writes(/*all=*/false);
    if (!ws.is_ok()) I.set_async_error(ws);
    // The reads start now, under the forward: on a disk-bound step the earlier the better
    // (measured: bench-25m at batch 1, 580 ms per step vs 734 ms when they started with
    // backward).
    I.read_ahead();
  }
}

Status TierManager::step_ready(bool wait_all) {
  Impl& I = *impl_;
  if (!I.spec.active) return Status::ok();
  if (wait_all) {
    // The time the compute stream finishes the backward: optimizer work after it is not hidden.
    Impl* ip = &I;
    I.dev.host_fn(I.dev.compute_stream(), [ip] {
      std::lock_guard<std::mutex> l(ip->mu);
      ip->spec.bwd_end = Clock::now();
    });
  }
  if (I.io) {
    STRATA_RETURN_IF_ERROR(I.reap_writes(/*all=*/false), "");
    I.read_ahead();
  }
  Status st;
  while (!I.spec.ready.empty() && st.is_ok()) {
    auto [k, ev] = I.spec.ready.front();
    if (!wait_all && !I.dev.query(*ev)) break;
    if (I.spec.stopped || !I.spec.step_modules) {
      I.spec.ready.pop_front();
      continue;
    }
    STRATA_RETURN_IF_ERROR(I.dev.synchronize(*ev), "waiting for gradients");
    I.spec.ready.pop_front();
    // The step's gradients may be bad (a failed drain): validate before touching state.
    STRATA_RETURN_IF_ERROR(I.take_async_error(), "");
    const auto t0 = Clock::now();
    Impl::Slot s;
    st = I.take_slot(k, &s);
    Impl::Undo undo;
    if (st.is_ok() && I.spec.undo && !I.take_undo(k, s, &undo)) {
      // No room for undo state: this and the remaining modules are stepped after backward.
      I.spec.stopped = true;
      I.prepared[k] = std::move(s);
      continue;
    }
    if (st.is_ok()) st = I.step_module(k, s, I.spec.hyper, I.spec.mult);
    if (st.is_ok()) {
      I.spec.stepped[k] = std::move(undo);
      ++I.modules_speculated;
    }
    if (st.is_ok() && I.io) {
      st = I.retire_writes(3 * size_t(std::max(1, opt_.buffer_count)));
      I.read_ahead();
    }
    const auto t1 = Clock::now();
    std::lock_guard<std::mutex> l(I.mu);
    I.spec.intervals.emplace_back(t0, t1);
    I.optimizer_s += std::chrono::duration<double>(t1 - t0).count();
  }
  return st.with_context("optimizer step under backward");
}

Status TierManager::optimizer_step(const OptimizerHyper& hyper, float grad_mult) {
  Impl& I = *impl_;
  const auto t0 = Clock::now();
  STRATA_RETURN_IF_ERROR(I.take_async_error(), "before the optimizer step");
  const size_t M = I.mods.size();
  Status st;
  // Modules stepped speculatively under backward: kept when the step they took is the one
  // asked for now, else redone from their undo copies.
  const bool same = I.spec.active && grad_mult == I.spec.mult && hyper.lr == I.spec.hyper.lr &&
                    hyper.step == I.spec.hyper.step;
  if (!same && !I.spec.stepped.empty()) {
    st = I.undo_speculation(/*redo=*/true, hyper, grad_mult);
  }
  std::vector<bool> done(M, false);
  for (auto& [k, u] : I.spec.stepped) done[size_t(k)] = true;
  if (I.io && st.is_ok()) st = I.reap_writes(/*all=*/false);
  if (st.is_ok()) st = I.run_pass(I.step_order(done), hyper, grad_mult, /*delayed=*/false);
  I.end_speculation();
  I.end_step_reads();
  if (!st.is_ok() && I.io) I.reap_writes(true).ignore();
  Status hs = I.dev.synchronize(I.dev.h2d_stream());
  if (st.is_ok()) st = hs;
  {
    std::lock_guard<std::mutex> l(I.mu);
    I.optimizer_s += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return st.with_context("optimizer step");
}

// What a rollback of module k's speculative step restores, taken before the step: for state
// homed on NVMe a fresh extent the step is written to, the old one kept as it is on the disk
// (no host memory, no copy; the old extent is freed when the step is kept); for state in host
// or device memory, or when the swap files are full, a host copy. False when there is room
// for neither: nothing is taken.
bool TierManager::Impl::take_undo(int k, const Slot& s, Undo* u) {
  Module& m = mods[size_t(k)];
  auto one = [&](Home& h, const void* now, SwapExtent* old, bool* shadow,
                 std::shared_ptr<PinnedBuffer>* copy) {
    if (h.tier == Tier::kNvme && shadow_room) {
      auto e = swap->allocate(h.bytes);
      if (e.is_ok()) {
        *old = h.ext;
        h.ext = *e;
        *shadow = true;
        std::lock_guard<std::mutex> l(mu);
        nvme_used += e->bytes;
        nvme_peak = std::max(nvme_peak, nvme_used);
        return true;
      }
    }
    auto b = pool->acquire(h.bytes);
    if (!b.is_ok()) {
      log_debug("tier manager: no room for {}'s undo copy ({}); stepping the rest after backward",
                m.name, b.status().message());
      return false;
    }
    *copy = std::make_shared<PinnedBuffer>(std::move(b).value());
    std::memcpy((*copy)->data(), now, h.bytes);
    return true;
  };
  if (one(m.master, s.master, &u->old_master, &u->master_shadow, &u->master) &&
      one(m.mom, s.mom, &u->old_mom, &u->mom_shadow, &u->mom)) {
    return true;
  }
  drop_shadows(k, u);
  *u = Undo{};
  return false;
}

// Module k's homes go back to the extents its undo kept, and the shadows it was stepped into
// are freed (their writes must have landed).
void TierManager::Impl::drop_shadows(int k, Undo* u) {
  Module& m = mods[size_t(k)];
  for (auto [h, old, shadow] : {std::tuple{&m.master, &u->old_master, &u->master_shadow},
                                std::tuple{&m.mom, &u->old_mom, &u->mom_shadow}}) {
    if (!*shadow) continue;
    swap->free(h->ext);
    {
      std::lock_guard<std::mutex> l(mu);
      nvme_used -= h->ext.bytes;
    }
    h->ext = *old;
    *shadow = false;
  }
}

// Restores every speculatively stepped module's master and moments from its undo state, and
// either redoes its step with (hyper, grad_mult) or re-derives its parameters from the restored
// master (a skipped step).
Status TierManager::Impl::undo_speculation(bool redo, const OptimizerHyper& hyper,
                                           float grad_mult) {
  ++rollbacks;
  for (auto& [k, u] : spec.stepped) {
    if (!u.kept()) {
      return invalid_argument(fmt::format(
          "the optimizer stepped {} under backward without undo state (bf16, "
          "gradient_clipping 0) but the step must be {}: set strata.optimizer.overlap: false "
          "to train through non-finite bf16 gradients",
          mods[size_t(k)].name, redo ? "redone" : "skipped (non-finite gradients)"));
    }
  }
  // The speculative writes must land before their shadows are freed and before the restored
  // state's writes go to the same extents.
  if (io) STRATA_RETURN_IF_ERROR(reap_writes(/*all=*/true), "");
  const size_t depth = size_t(std::max(1, opt.buffer_count));
  for (auto& [k, u] : spec.stepped) {
    Module& m = mods[size_t(k)];
    const bool master_on_disk = u.master_shadow, mom_on_disk = u.mom_shadow;
    drop_shadows(k, &u);  // the homes are the pre-step extents again
    Slot s;
    auto restore = [&](Home& h, bool on_disk, const std::shared_ptr<PinnedBuffer>& copy,
                       bool needed, std::shared_ptr<PinnedBuffer>* buf, void** ptr) -> Status {
      if (on_disk) {  // the pre-step state is in its home extent; read it when needed
        if (!needed) return Status::ok();
        STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, host_buf(h.bytes, "restoring optimizer state"), "");
        *buf = std::make_shared<PinnedBuffer>(std::move(b));
        *ptr = (*buf)->data();
        return io->wait(io->read(h.ext, *ptr));
      }
      if (h.tier == Tier::kNvme) {  // a host copy of NVMe state (the swap files were full)
        *buf = copy;
        *ptr = copy->data();
        return Status::ok();
      }
      *ptr = h.ptr();
      std::memcpy(*ptr, copy->data(), h.bytes);
      return Status::ok();
    };
    void* master = nullptr;
    void* mom = nullptr;
    STRATA_RETURN_IF_ERROR(
        restore(m.master, master_on_disk, u.master, true, &s.master_buf, &master),
        "restoring " + m.name);
    STRATA_RETURN_IF_ERROR(restore(m.mom, mom_on_disk, u.mom, redo, &s.mom_buf, &mom),
                           "restoring " + m.name);
    s.master = static_cast<float*>(master);
    s.mom = static_cast<char*>(mom);
    ++modules_redone;
    if (redo) {
      STRATA_RETURN_IF_ERROR(step_module(k, s, hyper, grad_mult), "redoing " + m.name);
      // Within the pipeline's reservation next to the slots read ahead (<= depth modules).
      if (io) STRATA_RETURN_IF_ERROR(retire_writes(depth), "redoing " + m.name);
      continue;
    }
    // A skipped step: NVMe homes get their host copies back (shadowed ones never changed).
    if (m.master.tier == Tier::kNvme && !master_on_disk) {
      STRATA_RETURN_IF_ERROR(io->wait(io->write(m.master.ext, s.master)), "restoring " + m.name);
    }
    if (m.mom.tier == Tier::kNvme && !mom_on_disk) {
      STRATA_RETURN_IF_ERROR(io->wait(io->write(m.mom.ext, s.mom)), "restoring " + m.name);
    }
    STRATA_RETURN_IF_ERROR(owner->write_params(k, s.master), "restoring " + m.name);
  }
  return Status::ok();  // spec.stepped stays: these modules are done for optimizer_step
}

// Ends this step's speculation: frees the undo state (the pre-step extents of steps that were
// kept) and adds the share of its time that ran while the compute stream was still in
// backward.
void TierManager::Impl::end_speculation() {
  if (!spec.active) return;
  for (auto& [k, u] : spec.stepped) {
    for (auto [old, shadow] :
         {std::pair{&u.old_master, u.master_shadow}, std::pair{&u.old_mom, u.mom_shadow}}) {
      if (!shadow) continue;
      swap->free(*old);
      std::lock_guard<std::mutex> l(mu);
      nvme_used -= old->bytes;
    }
  }
  std::lock_guard<std::mutex> l(mu);
  for (auto& [t0, t1] : spec.intervals) {
    const auto end = spec.bwd_end == Clock::time_point{} ? t1 : std::min(t1, spec.bwd_end);
    if (end > t0) optimizer_hidden_s += std::chrono::duration<double>(end - t0).count();
  }
  spec.active = false;
  spec.stepped.clear();
  spec.ready.clear();
  spec.intervals.clear();
}

Status TierManager::skip_step() {
  Impl& I = *impl_;
  Status st;
  if (I.spec.active && !I.spec.stepped.empty()) {
    st = I.undo_speculation(/*redo=*/false, I.spec.hyper, 0.0f);
  }
  I.end_speculation();
  I.end_step_reads();
  return st.with_context("rolling back the optimizer step taken under backward");
}

// The delayed update's thread: the optimizer pass of optimizer_step() over gacc2, into the
// parameter shadows. Only this thread touches `prepared` and `writes` while it runs.
void TierManager::Impl::run_delayed(OptimizerHyper hyper, float grad_mult, std::vector<int> order) {
  const auto t0 = Clock::now();
  Status st = run_pass(order, hyper, grad_mult, /*delayed=*/true);
  for (auto& [k, slot] : prepared) {
    if (slot.rm) io->wait(slot.rm).ignore();
    if (slot.rmo) io->wait(slot.rmo).ignore();
  }
  prepared.clear();
  dpu.status = st.with_context("delayed optimizer update");
  const double busy = std::chrono::duration<double>(Clock::now() - t0).count();
  std::lock_guard<std::mutex> l(mu);
  dpu.busy_s = busy;
  optimizer_s += busy;
}

// The optimizer pipeline over `order`: `buffer_count` modules' state read ahead while one is
// stepped, its writes draining behind. `delayed`: gradients from gacc2, parameters to shadows.
Status TierManager::Impl::run_pass(const std::vector<int>& order, const OptimizerHyper& hyper,
                                   float grad_mult, bool delayed) {
  const size_t depth = size_t(std::max(1, opt.buffer_count));
  size_t next = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    for (; next < order.size() && next < i + depth; ++next) {
      if (!prepared.count(order[next])) {
        STRATA_RETURN_IF_ERROR(prepare_slot(order[next], /*try_only=*/false).status(), "");
      }
    }
    const int k = order[i];
    Module& m = mods[size_t(k)];
    const float* grad = nullptr;
    void* shadow = nullptr;
    if (delayed) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, host_buf(m.p.bytes, "delayed update: shadow"), "");
      dpu.shadow[size_t(k)] = std::make_shared<PinnedBuffer>(std::move(b));
      grad = static_cast<const float*>(m.gacc2.ptr());
      shadow = dpu.shadow[size_t(k)]->data();
    }
    Slot s;
    STRATA_RETURN_IF_ERROR(take_slot(k, &s), "");
    STRATA_RETURN_IF_ERROR(step_module(k, s, hyper, grad_mult, grad, shadow), "");
    if (io) STRATA_RETURN_IF_ERROR(retire_writes(3 * depth), "");
  }
  return Status::ok();
}

// Modules in the order their gradients became final this step (the first ones' state may
// already have been read ahead), then any not drained in index order; none marked in `skip`.
std::vector<int> TierManager::Impl::step_order(std::vector<bool> skip) const {
  std::vector<int> order;
  for (int k : opt_order) {
    if (!skip[size_t(k)]) order.push_back(k);
    skip[size_t(k)] = true;  // a skipped (overflow) step may leave duplicates behind
  }
  for (size_t k = 0; k < mods.size(); ++k) {
    if (!skip[k]) order.push_back(int(k));
  }
  return order;
}

// The step's optimizer work is over: drains the reads of slots prepared but never stepped (an
// error, or a skipped step) so no buffer is freed under the engine, and remembers this step's
// gradient order for the next step's read-ahead.
void TierManager::Impl::end_step_reads() {
  for (auto& [k, slot] : prepared) {
    if (slot.rm) io->wait(slot.rm).ignore();
    if (slot.rmo) io->wait(slot.rmo).ignore();
  }
  prepared.clear();
  if (!opt_order.empty()) last_drain_order = opt_order;
  opt_order.clear();
}

Status TierManager::start_delayed_update(const OptimizerHyper& hyper, float grad_mult) {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(finish_delayed_update(), "");
  STRATA_RETURN_IF_ERROR(I.take_async_error(), "before the delayed update");
  STRATA_CHECK(!I.mods.empty() && I.mods[0].gacc2.bytes > 0,
               "start_delayed_update without TierOptions::delayed_update");
  std::vector<int> order = I.step_order(std::vector<bool>(I.mods.size(), false));
  I.end_step_reads();
  for (auto& m : I.mods) std::swap(m.gacc, m.gacc2);  // the thread reads gacc2
  I.dpu.shadow.assign(I.mods.size(), nullptr);
  I.dpu.status = Status::ok();
  I.dpu.pending = true;
  I.dpu.thread = std::thread(&Impl::run_delayed, &I, hyper, grad_mult, std::move(order));
  return Status::ok();
}

Status TierManager::finish_delayed_update() {
  Impl& I = *impl_;
  if (!I.dpu.pending) return Status::ok();
  const auto t0 = Clock::now();
  I.dpu.thread.join();
  I.dpu.pending = false;
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  Status st = I.dpu.status;
  Stream& h2d = I.dev.h2d_stream();
  for (size_t k = 0; k < I.mods.size() && st.is_ok(); ++k) {
    auto& sh = I.dpu.shadow[k];
    if (!sh) continue;
    Impl::Module& m = I.mods[k];
    Impl::Cache& c = I.cache[k];
    if (c.resident && c.ready) st = I.dev.synchronize(*c.ready);  // a prefetch reading the home
    if (!st.is_ok()) break;
    if (m.p.tier == Tier::kHost) {
      std::memcpy(m.p.host.data(), sh->data(), m.p.bytes);
    } else if (m.p.tier == Tier::kDevice && I.dev.host_addressable()) {
      std::memcpy(m.p.dev, sh->data(), m.p.bytes);
    } else if (m.p.tier == Tier::kDevice) {
      I.dev.copy_h2d(h2d, m.p.dev, sh->data(), m.p.bytes);
    } else {
      I.writes.push_back({I.io->write(m.p.ext, sh->data()), sh, m.name});
    }
    if (c.resident && !I.sharded) {
      I.dev.copy_h2d(h2d, c.ptr, sh->data(), m.p.bytes);
      std::lock_guard<std::mutex> l(I.mu);
      I.dev_in += m.p.bytes;
    }
    I.dev.host_fn(h2d, [keep = sh] {});  // alive until the copies ran
    sh.reset();
  }
  Status hs = I.dev.synchronize(h2d);
  if (st.is_ok()) st = hs;
  I.dpu.shadow.clear();
  std::lock_guard<std::mutex> l(I.mu);
  I.optimizer_s += std::chrono::duration<double>(Clock::now() - t0).count() - waited;
  I.optimizer_hidden_s += std::max(0.0, I.dpu.busy_s - waited);
  return st;
}

Status TierManager::flush_writes() {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(finish_delayed_update(), "");
  if (!I.io) return Status::ok();
  return I.reap_writes(/*all=*/true);
}

// ---- one step ---------------------------------------------------------------------------------

void TierManager::begin_phase(const std::string& phase) {
  Impl& I = *impl_;
  I.phase = phase;
  I.rec.clear();
  I.pos = 0;
  I.mismatch = false;
  auto it = I.traces.find(phase);
  I.cur = it == I.traces.end() ? nullptr : &it->second;
}

Result<const void*> TierManager::acquire_params(int m) {
  Impl& I = *impl_;
  Impl::Module& mod = I.mods[size_t(m)];
  I.rec.push_back({m, mod.p.bytes, 0.0});
  if (I.cur && !I.mismatch && (I.pos >= I.cur->size() || I.cur->accesses()[I.pos].object != m)) {
    log_warn(
        "tier manager: {} access order changed at position {} (expected {}, got {}); "
        "fetching on demand for this step and re-recording",
        I.phase, I.pos,
        I.pos < I.cur->size() ? I.mods[size_t(I.cur->accesses()[I.pos].object)].name
                              : std::string("end of step"),
        mod.name);
    I.mismatch = true;
  }
  if (mod.p.tier == Tier::kDevice && !I.sharded) {
    ++I.pos;
    return static_cast<const void*>(mod.p.dev);
  }
  // A bucket left open by the last backward is reduced before the next forward starts.
  if (I.sharded) I.flush_bucket();
  Impl::Cache& c = I.cache[size_t(m)];
  if (!c.resident) {
    bool fetched = false;
    STRATA_RETURN_IF_ERROR(I.fetch(m, UINT64_MAX, /*may_block=*/true, &fetched),
                           "fetching " + mod.name + " parameters");
  }
  ++c.pins;
  c.acq_pos = I.pos;
  c.last_pos = I.pos;
  I.compute_waits_for(c.ready);
  ++I.pos;
  I.prefetch();
  return static_cast<const void*>(c.ptr);
}

void TierManager::release_params(int m) {
  Impl& I = *impl_;
  if (I.mods[size_t(m)].p.tier == Tier::kDevice && !I.sharded) return;
  Impl::Cache& c = I.cache[size_t(m)];
  STRATA_CHECK(c.pins > 0, "release_params without acquire");
  --c.pins;
  c.last_use = std::shared_ptr<Event>(I.dev.create_event());
  I.dev.record(*c.last_use, I.dev.compute_stream());
  // Sharded: a gathered group is released as soon as nobody holds it (see TierOptions).
  if (c.pins == 0 && I.sharded) {
    if (!I.keep_gathered(m)) I.drop(m);
  } else if (c.pins == 0 && !c.persistent && I.cur && !I.mismatch && c.acq_pos < I.cur->size() &&
             I.cur->reuse_distance(c.acq_pos) > opt_.max_reuse_distance) {
    I.drop(m);
  }
}

Result<float*> TierManager::acquire_grads(int m) {
  Impl& I = *impl_;
  if (I.gdev[size_t(m)]) return I.gdev[size_t(m)];
  const size_t bytes = I.mods[size_t(m)].padded * 4;  // the whole (padded) group
  STRATA_ASSIGN_OR_RETURN(void* p,
                          I.dev_alloc(bytes, I.mods[size_t(m)].name + ".grad", -1, UINT64_MAX,
                                      /*may_block=*/true),
                          "gradients of " + I.mods[size_t(m)].name);
  I.dev.memset_zero(I.dev.compute_stream(), p, bytes);
  I.gdev[size_t(m)] = static_cast<float*>(p);
  return static_cast<float*>(p);
}

void TierManager::drain_grads(int m, int micro, bool last) {
  Impl& I = *impl_;
  float* g = I.gdev[size_t(m)];
  STRATA_CHECK(g != nullptr, "drain_grads without acquire_grads");
  I.gdev[size_t(m)] = nullptr;
  Impl::Module& mod = I.mods[size_t(m)];
  const size_t n = mod.sn, bytes = mod.gacc.bytes, dev_bytes = mod.padded * 4;
  float* acc = static_cast<float*>(mod.gacc.ptr());
  auto ev = std::shared_ptr<Event>(I.dev.create_event());
  I.dev.record(*ev, I.dev.compute_stream());
  Stream& d2h = I.dev.d2h_stream();
  I.dev.wait(d2h, *ev);
  // Sharded: every rank's gradient of this micro-batch is summed into this rank's shard by
  // bucketed reduce-scatters (Impl::drain_sharded); only the shard leaves the device.
  if (I.sharded) {
    I.drain_sharded(m, g, micro, last);
    return;
  }
  float* mine = g;
  if (micro == 0) {
    I.dev.copy_d2h(d2h, acc, mine, bytes);
  } else {
    auto landing = I.host_buf(bytes, "gradient landing buffer");
    if (!landing.is_ok()) {
      I.set_async_error(landing.status());
    } else {
      auto lb = std::make_shared<PinnedBuffer>(std::move(landing).value());
      I.dev.copy_d2h(d2h, lb->data(), mine, bytes);
      I.dev.host_fn(d2h, [lb, acc, n] {
        const float* src = lb->as<float>();
        for (size_t i = 0; i < n; ++i) acc[i] += src[i];
        lb->reset();
      });
    }
  }
  Impl* ip = &I;
  if (last) {
    I.dev.host_fn(
        d2h, [ip, m, acc, n] { ip->gstats[size_t(m)] = strata::grad_stats(acc, DType::kF32, n); });
  }
  I.dev.host_fn(d2h, [ip, g, bytes, dev_bytes] {
    ip->dev.release(g);
    std::lock_guard<std::mutex> l(ip->mu);
    ip->device_state_bytes -= round_up(dev_bytes, 256);
    ip->dev_out += bytes;
  });
  if (last) I.grads_final(m);
}

Status TierManager::end_backward() {
  Impl& I = *impl_;
  if (I.sharded) I.flush_bucket();
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.compute_stream()), "");
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.d2h_stream()), "");
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.h2d_stream()), "");
  if (I.sharded) {
    // Gathered groups still cached (prefetched, then a changed order) go before the optimizer
    // step updates the shards.
    for (size_t m = 0; m < I.cache.size(); ++m) {
      if (I.cache[m].resident && I.cache[m].pins == 0) I.drop(int(m));
    }
    I.reclaim(true);
  }
  STRATA_RETURN_IF_ERROR(I.take_async_error(), "");
  if (I.sharded) {
    // A stream-ordered collective that failed while running (a timeout, a dead peer) is kept
    // by its communicator, not by the stream: without this the step would go on with
    // gradients or parameters that never arrived.
    STRATA_RETURN_IF_ERROR(opt_.param_comm->health(), "gathering parameters");
    STRATA_RETURN_IF_ERROR(opt_.grad_comm->health(), "reducing gradients");
  }
  return Status::ok();
}

GradStats TierManager::grad_stats() const {
  GradStats s;
  for (const auto& g : impl_->gstats) s.merge(g);
  return s;
}

Status TierManager::end_phase() {
  Impl& I = *impl_;
  if (!I.cur || I.mismatch || I.rec.size() != I.cur->size()) {
    if (I.cur && !I.mismatch) {
      log_warn("tier manager: {} step ended after {} of {} recorded accesses; re-recording",
               I.phase, I.rec.size(), I.cur->size());
    }
    I.traces[I.phase] = Trace(I.rec);
  }
  I.cur = nullptr;
  return I.take_async_error();
}

const Trace* TierManager::trace(const std::string& phase) const {
  auto it = impl_->traces.find(phase);
  return it == impl_->traces.end() ? nullptr : &it->second;
}

std::string TierManager::object_name(int object) const {
  return impl_->mods[size_t(object)].name + ".params";
}

// ---- statistics -------------------------------------------------------------------------------

TierStats TierManager::stats(Tier t) const {
  const Impl& I = *impl_;
  TierStats s;
  std::lock_guard<std::mutex> l(I.mu);
  switch (t) {
    case Tier::kDevice: {
      auto d = I.dev.memory_stats();
      s = {d.capacity, d.used, d.peak, I.dev_in, I.dev_out};
      s.fetches = I.fetches;
      s.prefetches = I.prefetches;
      s.grad_reductions = I.grad_reductions;
      s.grad_shared_reductions = I.grad_shared_reductions;
      break;
    }
    case Tier::kHost:
      s = {I.pool->capacity(), I.pool->in_use(), I.pool->peak_in_use(), I.host_in, I.host_out};
      break;
    case Tier::kNvme:
      s = {I.nvme_capacity, I.nvme_used, I.nvme_peak, I.io ? I.io->bytes_written() : 0,
           I.io ? I.io->bytes_read() : 0};
      break;
  }
  return s;
}

TierTimes TierManager::take_times() {
  Impl& I = *impl_;
  TierTimes t;
  const double io_total = I.io ? I.io->wait_seconds() : 0.0;
  std::lock_guard<std::mutex> l(I.mu);
  t.compute_wait_s = I.compute_wait_s;
  t.optimizer_s = I.optimizer_s;
  t.optimizer_hidden_s = I.optimizer_hidden_s;
  t.rollbacks = I.rollbacks;
  t.modules_redone = I.modules_redone;
  t.modules_stepped_under_backward = I.modules_speculated;
  t.io_wait_s = io_total - I.io_wait_base;
  I.compute_wait_s = 0;
  I.optimizer_s = 0;
  I.optimizer_hidden_s = 0;
  I.rollbacks = 0;
  I.modules_redone = 0;
  I.modules_speculated = 0;
  I.io_wait_base = io_total;
  return t;
}

// ---- checkpoints ------------------------------------------------------------------------------

Status TierManager::save(const std::string& path, const CheckpointMeta& meta) {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(flush_writes(), "before the checkpoint");
  Impl::HostState hs;
  auto source = [&](size_t i, CheckpointBuffers* out) -> Status {
    STRATA_RETURN_IF_ERROR(I.host_state(i, /*read=*/true, "checkpoint staging", &hs), "");
    *out = {hs.master, hs.moments, hs.moments + I.mods[i].sn * dtype_size(I.mdt),
            dtype_size(I.mdt)};
    return Status::ok();
  };
  if (!I.sharded) return write_checkpoint(path, meta, source);
  // A shard file: this rank's real elements of each module (its shard's head; the padding is
  // not saved), with where they start.
  CheckpointMeta shard = meta;
  shard.world_size = opt_.param_comm->size();
  shard.rank = opt_.param_comm->rank();
  for (size_t i = 0; i < I.mods.size(); ++i) {
    shard.modules[i].numel = I.mods[i].valid;
    shard.modules[i].offset = I.mods[i].off;
  }
  return write_checkpoint(path, shard, source);
}

Status TierManager::load_shards(const std::vector<std::string>& paths) {
  Impl& I = *impl_;
  const size_t M = I.mods.size(), mb = dtype_size(I.mdt);
  std::vector<size_t> covered(M, 0);
  // This rank's master and moments of module i in host memory (NVMe homes are read into
  // staging and written back: read-modify-write per old file).
  auto with_state = [&](size_t i, bool read, bool write,
                        const std::function<void(float*, char*)>& fn) -> Status {
    Impl::HostState hs;
    STRATA_RETURN_IF_ERROR(I.host_state(i, read, "checkpoint staging", &hs), "");
    fn(hs.master, hs.moments);
    if (write) STRATA_RETURN_IF_ERROR(I.write_back(i, hs), "");
    return Status::ok();
  };
  STRATA_RETURN_IF_ERROR(flush_writes(), "before loading a checkpoint");
  for (size_t i = 0; i < M; ++i) {  // padding and anything not covered start at zero
    STRATA_RETURN_IF_ERROR(with_state(i, false, true,
                                      [&](float* master, char* moments) {
                                        std::memset(master, 0, I.mods[i].master.bytes);
                                        std::memset(moments, 0, I.mods[i].mom.bytes);
                                      }),
                           "clearing " + I.mods[i].name);
  }
  for (const auto& path : paths) {
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(path), "");
    if (meta.modules.size() != M) {
      return invalid_argument(
          fmt::format("{}: {} modules, the model has {}", path, meta.modules.size(), M));
    }
    std::vector<float> st_master;
    std::vector<char> st_m, st_v;
    auto staging = [&](size_t i, CheckpointBuffers* out) -> Status {
      const size_t n = meta.modules[i].numel;
      // n == 0: a shard that is all padding (its offset may lie past the end).
      if (meta.modules[i].name != I.mods[i].name ||
          (n > 0 && meta.modules[i].offset + n > I.mods[i].numel)) {
        return invalid_argument(fmt::format(
            "{}: module {} '{}' elements [{}, {}) do not fit this model's '{}' ({} elements)", path,
            i, meta.modules[i].name, meta.modules[i].offset, meta.modules[i].offset + n,
            I.mods[i].name, I.mods[i].numel));
      }
      st_master.resize(n);
      st_m.resize(n * mb);
      st_v.resize(n * mb);
      *out = {st_master.data(), st_m.data(), st_v.data(), mb};
      return Status::ok();
    };
    auto sink = [&](size_t i, const CheckpointBuffers& b) -> Status {
      Impl::Module& m = I.mods[i];
      const size_t o_lo = meta.modules[i].offset, o_hi = o_lo + meta.modules[i].numel;
      const size_t lo = std::max(o_lo, m.off), hi = std::min(o_hi, m.off + m.valid);
      if (lo >= hi) return Status::ok();
      covered[i] += hi - lo;
      return with_state(i, true, true, [&](float* master, char* moments) {
        std::memcpy(master + (lo - m.off), b.master + (lo - o_lo), (hi - lo) * 4);
        std::memcpy(moments + (lo - m.off) * mb, static_cast<const char*>(b.m) + (lo - o_lo) * mb,
                    (hi - lo) * mb);
        std::memcpy(moments + (m.sn + lo - m.off) * mb,
                    static_cast<const char*>(b.v) + (lo - o_lo) * mb, (hi - lo) * mb);
      });
    };
    STRATA_RETURN_IF_ERROR(read_checkpoint(path, staging, sink), "");
  }
  for (size_t i = 0; i < M; ++i) {
    if (covered[i] != I.mods[i].valid) {
      return invalid_argument(fmt::format(
          "checkpoint files {} hold {} of the {} elements of {} this rank owns; a shard file "
          "is missing or duplicated (resume from the manifest strata train wrote)",
          paths.front(), covered[i], I.mods[i].valid, I.mods[i].name));
    }
    Status ws;
    STRATA_RETURN_IF_ERROR(
        with_state(i, true, false,
                   [&](float* master, char*) { ws = write_params(int(i), master); }),
        "");
    STRATA_RETURN_IF_ERROR(ws, "deriving " + I.mods[i].name + " parameters");
  }
  return Status::ok();
}

int TierManager::world_size() const { return impl_->sharded ? opt_.param_comm->size() : 1; }
int TierManager::rank() const { return impl_->sharded ? opt_.param_comm->rank() : 0; }
size_t TierManager::shard_offset(int m) const { return impl_->mods[size_t(m)].off; }
size_t TierManager::shard_count(int m) const { return impl_->mods[size_t(m)].valid; }

Status TierManager::load(const std::string& path) {
  Impl& I = *impl_;
  Impl::HostState hs;
  auto staging = [&](size_t i, CheckpointBuffers* out) -> Status {
    STRATA_RETURN_IF_ERROR(I.host_state(i, /*read=*/false, "checkpoint staging", &hs), "");
    *out = {hs.master, hs.moments, hs.moments + I.mods[i].sn * dtype_size(I.mdt),
            dtype_size(I.mdt)};
    return Status::ok();
  };
  auto sink = [&](size_t i, const CheckpointBuffers& b) -> Status {
    STRATA_CHECK(b.master == hs.master, "the sink gets the buffers staging handed out");
    STRATA_RETURN_IF_ERROR(I.write_back(i, hs), "");
    return write_params(int(i), b.master);
  };
  return read_checkpoint(path, staging, sink);
}

uint32_t TierManager::weights_crc() {
  Impl& I = *impl_;
  if (!flush_writes().is_ok()) return 0;
  uint32_t crc = 0;
  for (auto& m : I.mods) {
    if (m.master.tier == Tier::kNvme) {
      auto b = I.host_buf(m.master.bytes, "crc");
      if (!b.is_ok() || !I.io->wait(I.io->read(m.master.ext, b->data())).is_ok()) return 0;
      crc = crc32c(crc, b->data(), m.valid * 4);
    } else {
      crc = crc32c(crc, m.master.ptr(), m.valid * 4);
    }
  }
  return crc;
}

// ---- offloaded activations ---------------------------------------------------------------------

Status TierManager::stash_activation(int layer, const void* dev, size_t bytes) {
  Impl& I = *impl_;
  if (layer < 0 || size_t(layer) >= I.act_host.size() || bytes > I.act_host[size_t(layer)].size()) {
    Status s = invalid_argument(fmt::format(
        "host tier: no room to stash {} of block {}'s activations ({} block buffers of {} "
        "reserved); strata.activations = offload reserves them from the model's shape",
        format_bytes(double(bytes)), layer, I.act_host.size(),
        format_bytes(double(opt_.stash_bytes))));
    I.set_async_error(s);
    return s;
  }
  Stream& d2h = I.dev.d2h_stream();
  std::shared_ptr<Event> after(I.dev.create_event());
  I.dev.record(*after, I.dev.compute_stream());
  I.dev.wait(d2h, *after);
  I.dev.copy_d2h(d2h, I.act_host[size_t(layer)].data(), dev, bytes);
  auto done = std::shared_ptr<Event>(I.dev.create_event());
  I.dev.record(*done, d2h);
  I.act_ev[size_t(layer)] = done;
  I.act_last_stash = done;
  I.act_len[size_t(layer)] = bytes;
  std::lock_guard<std::mutex> l(I.mu);
  I.dev_out += bytes;
  I.host_in += bytes;
  return Status::ok();
}

Status TierManager::restore_activation(int layer, void* dev) {
  Impl& I = *impl_;
  if (layer < 0 || size_t(layer) >= I.act_host.size() || I.act_len[size_t(layer)] == 0) {
    Status s = invalid_argument(
        fmt::format("host tier: block {}'s activations were never stashed (strata.activations "
                    "= offload restores a block's input only after its forward)",
                    layer));
    I.set_async_error(s);
    return s;
  }
  Stream& h2d = I.dev.h2d_stream();
  std::shared_ptr<Event> after(I.dev.create_event());
  I.dev.record(*after, I.dev.compute_stream());
  I.dev.wait(h2d, *after);
  if (I.act_last_stash) I.dev.wait(h2d, *I.act_last_stash);
  const size_t bytes = I.act_len[size_t(layer)];
  I.dev.copy_h2d(h2d, dev, I.act_host[size_t(layer)].data(), bytes);
  auto done = std::shared_ptr<Event>(I.dev.create_event());
  I.dev.record(*done, h2d);
  I.act_ev[size_t(layer)] = done;
  std::lock_guard<std::mutex> l(I.mu);
  I.dev_in += bytes;
  I.host_out += bytes;
  return Status::ok();
}

void TierManager::compute_waits_activation(int layer) {
  Impl& I = *impl_;
  if (layer < 0 || size_t(layer) >= I.act_ev.size()) return;
  I.compute_waits_for(I.act_ev[size_t(layer)]);
}

}  // namespace strata
