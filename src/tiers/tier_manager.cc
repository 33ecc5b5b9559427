#include "src/tiers/tier_manager.h"

#include <fmt/format.h>

#include <algorithm>

#include "src/comm/zeropp.h"
#include "src/tiers/memory_model.h"
#include "src/tiers/tier_manager_impl.h"
#include "strata/log.h"
#include "strata/swap_space.h"

namespace strata {

// ---- construction: the preflight, then the tiers ---------------------------------------------

namespace {

// Checks every tier's need against its capacity and the swap paths, reporting every shortfall
// together with the config key to change. Fills `swap` (the swap files' size) and
// `shadow_extents` (whether the swap files are sized for the optimizer's shadow extents).
// When the host tier is short: what the host would need with the gradient accumulators on
// NVMe, and with everything on NVMe, each with whether it fits the budget.
// A placement that would need more of the host than the run's own (`need_now`: with few or
// small modules the gradients' NVMe staging outweighs the accumulators it replaces) is not named.
std::string host_hint(const Architecture& arch, const TierOptions& options, int world, DType dt,
                      DType moment_dt, size_t activation_bytes, size_t need_now) {
  std::string hint;
  auto try_placement = [&](Placement p, const char* what) {
    if (p == options.placement) return;
    TierOptions o = options;
    o.placement = p;
    auto homes =
        module_homes(arch.layout(), p, world, dt, moment_dt, o.delayed_update, o.sub_group_elems);
    if (!homes.is_ok()) return;
    const TierNeeds n =
        tier_needs(*homes, o, world, dt, activation_bytes, arch.program(Pass::kTrain), {});
    if (n.host.total() >= need_now) return;
    hint += fmt::format("; {} it would need {}{}", what, format_bytes(double(n.host.total())),
                        n.host.total() <= options.host_capacity ? " (fits)" : "");
  };
  if (world > 1 || options.delayed_update || options.nvme_paths.empty()) return hint;
  Placement g = options.placement;
  if (g.grads == Tier::kHost) g.grads = Tier::kNvme;
  try_placement(g, "with strata.placement.grads = nvme");
  try_placement({Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme, 1.0},
                "with params, optimizer state and gradients on nvme");
  return hint;
}

// The least strata.host_memory_limit whose host tier holds this placement's need: the need
// `need_now` at the run's budget, unless the sub-group size is the budget's (max_sub_group_elems:
// an eighth of the budget for the optimizer's staging), where a larger budget allows larger
// sub-groups whose staging grows the need with it. Then the budget is raised to the need at it
// until the need fits (it grows by at most an eighth of each raise: a few rounds).
size_t least_host_budget(const Architecture& arch, const TierOptions& options, int world, DType dt,
                         DType moment_dt, size_t activation_bytes, const ZeroPPShape& zeropp,
                         size_t need_now) {
  if (options.sub_group_size_key == 0 || options.sub_group_elems >= options.sub_group_size_key) {
    return need_now;  // the key's size, not the budget's: the need does not move with it
  }
  auto need_at = [&](size_t budget) -> size_t {
    TierOptions o = options;
    o.host_capacity = budget;
    o.sub_group_elems =
        std::min<uint64_t>(options.sub_group_size_key, max_sub_group_elems(budget, o.buffer_count));
    auto homes = module_homes(arch.layout(), o.placement, world, dt, moment_dt, o.delayed_update,
                              o.sub_group_elems);
    if (!homes.is_ok()) return 0;
    return tier_needs(*homes, o, world, dt, activation_bytes, arch.program(Pass::kTrain), zeropp)
        .host.total();
  };
  size_t budget = need_now;
  for (int round = 0; round < 64; ++round) {
    const size_t n = need_at(budget);
    if (n == 0) return need_now;
    if (n <= budget) return budget;
    budget = n;
  }
  return budget;
}

// ", ZeRO++ buffers X: qwZ gather buffer (key) a, ..." naming the buffers the switches take on
// the device, with their keys; empty without ZeRO++.
std::string zeropp_parts(const TierNeeds::DeviceNeed& d) {
  if (d.zeropp() == 0) return "";
  std::string parts;
  auto add = [&](size_t bytes, const char* what) {
    if (bytes == 0) return;
    parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", what, format_bytes(double(bytes)));
  };
  add(d.qwz_buffer, "qwZ gather buffer (zero_optimization.zero_quantized_weights)");
  add(d.hpz_secondary, "hpZ secondary partition (zero_optimization.zero_hpz_partition_size)");
  add(d.qgz_scratch, "qgZ scratch (zero_optimization.zero_quantized_gradients)");
  return fmt::format(", ZeRO++ buffers {}: {}", format_bytes(double(d.zeropp())), parts);
}

Status preflight(Device& device, const TierOptions& options, const TierNeeds& need, bool sharded,
                 size_t least_host, const std::string& host_hint, SwapOptions* swap,
                 bool* shadow_extents, TierShortfall* shortfall) {
  std::vector<std::string> short_of;
  const size_t dev_cap = device.memory_stats().capacity;
  const size_t dev_need = need.device.total();
  *shortfall = tier_shortfall(need, options, dev_cap);
  if (shortfall->device) {
    short_of.push_back(fmt::format(
        "device tier needs {} (activations {}, resident state {}, working set {}{}{}) but has "
        "{}: raise device.memory_limit, offload more state "
        "(zero_optimization.offload_param.device / offload_optimizer.device), or lower "
        "train_micro_batch_size_per_gpu{}{}",
        format_bytes(double(dev_need)), format_bytes(double(need.device.activations)),
        format_bytes(double(need.device.resident_state)),
        format_bytes(double(need.device.transient())),
        sharded ? fmt::format(" with a gradient bucket of {} and a prefetch window of {}",
                              format_bytes(double(need.device.bucket)),
                              format_bytes(double(need.device.prefetch_window)))
                : std::string(),
        zeropp_parts(need.device), format_bytes(double(dev_cap)),
        sharded ? ", zero_optimization.reduce_bucket_size or stage3_prefetch_bucket_size" : "",
        need.device.zeropp() ? " (or turn off the ZeRO++ switches named)" : ""));
    const Placement& pl = options.placement;
    if (pl.optimizer_ratio < 1 && (pl.master != Tier::kDevice || pl.moments != Tier::kDevice)) {
      // The ratio keeps the first modules' optimizer state on the device whatever
      // offload_optimizer.device says: of the resident state, that share is its.
      short_of.back() += fmt::format(
          "; zero_optimization.offload_optimizer.ratio {:g} keeps {:.0f}% of the optimizer "
          "state on the device: a higher ratio (1: none) moves it to {}",
          pl.optimizer_ratio, 100.0 * (1.0 - pl.optimizer_ratio),
          tier_name(pl.master != Tier::kDevice ? pl.master : pl.moments));
    }
  }
  const size_t host_need = need.host.total();
  const size_t staging = need.host.staging + need.host.param_shadows;
  const size_t act_host = need.host.stash;
  if (shortfall->host) {
    short_of.push_back(fmt::format(
        "host tier needs {} (state {}, staging buffers {}{}{}) but its budget is {}: set "
        "strata.host_memory_limit (default 90% of MemAvailable){}, offload more to nvme "
        "(zero_optimization.offload_*.device = \"nvme\", strata.placement.grads = \"nvme\"), "
        "or use a smaller model{}{}",
        format_bytes(double(host_need)), format_bytes(double(need.host.state)),
        format_bytes(double(staging)),
        need.host.optimizer_staging ? fmt::format(" of which optimizer sub-groups {}",
                                                  format_bytes(double(need.host.optimizer_staging)))
                                    : std::string(),
        act_host ? fmt::format(", offloaded activations {}", format_bytes(double(act_host))) : "",
        format_bytes(double(options.host_capacity)),
        least_host > host_need
            ? fmt::format(
                  " to at least {} ({} bytes: the optimizer's sub-groups grow with the budget, "
                  "an eighth of it, up to zero_optimization.sub_group_size)",
                  format_bytes(double(least_host)), least_host)
            : std::string(),
        act_host ? " (or strata.activations = recompute, which keeps block inputs on the device)"
                 : "",
        host_hint));
  }
  swap->paths = options.nvme_paths;
  swap->rank = options.rank;
  if (shortfall->nvme_paths) {
    short_of.push_back(
        "nvme tier: state is placed on nvme but no swap directory is configured: set "
        "zero_optimization.offload_param.nvme_path or offload_optimizer.nvme_path");
  } else if (need.nvme.state > 0) {
    swap->bytes_per_path = need.nvme.bytes_per_path;
    const bool direct = options.storage.backend != "posix";
    for (const auto& path : swap->paths) {
      Result<bool> made = create_nvme_path(path);  // as DeepSpeed makes its swap folder
      if (!made.is_ok()) {
        short_of.push_back("nvme tier: " + made.status().message());
        continue;
      }
      if (*made) log_info("nvme tier: created nvme_path {}", path);
      Status s = check_nvme_path(path, swap->bytes_per_path + kSwapHeaderBytes, direct,
                                 swap_file_path(path, options.rank));
      if (!s.is_ok()) short_of.push_back("nvme tier: " + s.message());
    }
    // The optimizer under backward writes NVMe-homed master weights and moments to fresh
    // extents and keeps the old ones until the step is validated (Speculation): room for all
    // of them once more when the disks have it, else their undo copies go to host memory.
    if (short_of.empty() && need.nvme.shadows > 0) {
      const uint64_t more = need.nvme.bytes_per_path_with_shadows;
      bool room = true;
      for (const auto& path : swap->paths) {
        room = room && check_nvme_path(path, more + kSwapHeaderBytes, direct,
                                       swap_file_path(path, options.rank))
                           .is_ok();
      }
      if (room) {
        swap->bytes_per_path = more;
        *shadow_extents = true;
      } else {
        log_info(
            "tier manager: no room on the swap paths for the optimizer's shadow extents ({}); "
            "its undo copies under backward go to host memory",
            format_bytes(double(need.nvme.shadows)));
      }
    }
  }
  if (short_of.empty()) return Status::ok();
  std::string msg = "preflight: this run does not fit:";
  for (const auto& line : short_of) msg += "\n  - " + line;
  if (short_of.size() == 1 && short_of[0].rfind("nvme tier", 0) == 0) return no_space(msg);
  return out_of_memory(msg);
}

}  // namespace

Result<std::unique_ptr<TierManager>> TierManager::create(Device& device, const Architecture& arch,
                                                         DType dt, DType moment_dt,
                                                         const TierOptions& requested,
                                                         size_t activation_bytes,
                                                         TierShortfall* shortfall) {
  if (shortfall) *shortfall = TierShortfall{};
  auto impl = std::make_unique<Impl>(device, requested, dt, moment_dt);
  Impl& I = *impl;
  const TierOptions& options = I.opt;  // the request, with the gradients' default decided
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
  if (options.placement.grads == Tier::kNvme && (I.sharded || options.delayed_update)) {
    return invalid_argument(
        "strata.placement.grads: nvme runs on one rank without strata.optimizer.delayed_update "
        "for now: set it to host, or run one rank without the delayed update");
  }

  size_t with_host = 0, with_nvme = 0;
  const Tier grads = default_grads_tier(arch, options, world, dt, moment_dt, activation_bytes,
                                        &with_host, &with_nvme);
  if (grads != options.placement.grads) {
    log_info(
        "tier manager: gradients on {} (strata.placement.grads unset; on the host they would "
        "take the host tier to {} of its {} budget, on nvme {})",
        tier_name(grads), format_bytes(double(with_host)),
        format_bytes(double(options.host_capacity)), format_bytes(double(with_nvme)));
    I.opt.placement.grads = grads;
  }

  // Every tier's need against its capacity, before anything is allocated or written.
  STRATA_ASSIGN_OR_RETURN(const std::vector<ModuleHomes> plan,
                          module_homes(arch.layout(), options.placement, world, dt, moment_dt,
                                       options.delayed_update, options.sub_group_elems),
                          "tier manager");
  if (options.delayed_update && !device.host_addressable()) {
    for (const auto& m : plan) {
      if (m.master.tier != Tier::kDevice) continue;
      return invalid_argument(fmt::format(
          "strata.optimizer.delayed_update steps the optimizer on the host, but {}'s optimizer "
          "state is on device '{}', which the host cannot address: set "
          "strata.optimizer.delayed_update false, or offload the optimizer "
          "(zero_optimization.offload_optimizer.device cpu or nvme, ratio 1)",
          m.name, device.name()));
    }
  }
  // The device's working set: the most the training program holds at once.
  const ZeroPPShape zeropp = I.sharded && options.zeropp ? options.zeropp->shape() : ZeroPPShape{};
  TierNeeds need =
      tier_needs(plan, options, world, dt, activation_bytes, arch.program(Pass::kTrain), zeropp);
  I.opt.forward_group =
      resolve_forward_group(plan, options, world, dt, activation_bytes, arch.program(Pass::kTrain),
                            zeropp, device.memory_stats().capacity, I.sharded, &need);
  SwapOptions so;
  bool shadow_extents = false;
  // The message starts with "preflight:" and names every tier that is short.
  const bool host_short = need.host.total() > options.host_capacity;
  const std::string hint = host_short ? host_hint(arch, options, world, dt, moment_dt,
                                                  activation_bytes, need.host.total())
                                      : std::string();
  const size_t least_host = host_short
                                ? least_host_budget(arch, options, world, dt, moment_dt,
                                                    activation_bytes, zeropp, need.host.total())
                                : 0;
  TierShortfall short_of;
  const Status fits = preflight(device, options, need, I.sharded, least_host, hint, &so,
                                &shadow_extents, &short_of);
  if (shortfall) *shortfall = short_of;
  STRATA_RETURN_IF_ERROR(fits, "");

  // The tiers and the homes; then the parts that borrow from them.
  I.undo_room = host_undo_bytes(need, options, shadow_extents);
  STRATA_ASSIGN_OR_RETURN(
      I.homes,
      Homes::create(device, plan, rank, world, host_arena_bytes(need, options, shadow_extents),
                    I.opt, need.nvme.state > 0 ? &so : nullptr, I.undo_room),
      "tier manager");
  for (size_t m = 0; m < plan.size(); ++m) I.stored_fill.push_back(arch.stored_fill(int(m)));
  I.stamps = std::make_unique<StreamStamps>(device);
  I.cache = std::make_unique<DeviceCache>(*I.homes, I.opt, dt, I.sharded, I.counters, I.errors);
  I.pipeline = std::make_unique<OptimizerPipeline>(*I.homes, *I.cache, I.opt, dt, moment_dt,
                                                   I.sharded, I.counters);
  const size_t read_ahead = read_ahead_sub_groups(need, options, shadow_extents);
  if (read_ahead > 0) {
    log_info(
        "tier manager: optimizer read-ahead room {} sub-groups ({}), besides the pipeline's "
        "staging of {} (2 x buffer_count + 1) (strata.optimizer.read_ahead): a pass keeps them "
        "in host memory for the next step (written to NVMe, not read back)",
        read_ahead, format_bytes(double(read_ahead * need.host.optimizer_sub_group)),
        pipeline_staging_sub_groups(options.buffer_count));
  }
  I.pipeline->set_read_ahead(read_ahead);
  I.spec = std::make_unique<Speculation>(*I.homes, *I.pipeline, *I.stamps, shadow_extents,
                                         I.counters, I.errors);
  Impl* ip = &I;
  I.grads = std::make_unique<GradBuckets>(*I.homes, *I.cache, I.opt, I.sharded, I.counters,
                                          I.errors, [ip](int m) {
                                            ip->pipeline->grads_final(m);
                                            ip->spec->grads_final(m);
                                          });
  I.grads->set_parts(I.opt.forward_group > 1 && I.opt.grouped_backward && !I.sharded);
  // Until the trainer sets each micro-batch's (begin_micro): a later micro-batch's room.
  I.cache->set_prefetch_reserve(I.grads->device_reserve(1));
  if (I.sharded) {
    STRATA_RETURN_IF_ERROR(I.grads->init_bucket(need.bucket_shard_elems, need.device.bucket),
                           "tier manager");
  }
  I.cache->set_before_fetch([ip](int m) { return ip->step_deferred(m); });
  I.dpu = std::make_unique<DelayedUpdate>(*I.homes, *I.cache, *I.pipeline, I.counters);
  I.acts = std::make_unique<ActivationStash>(*I.homes, *I.cache, I.counters, I.errors);
  STRATA_RETURN_IF_ERROR(I.acts->reserve(options.stash_layers, options.stash_bytes),
                         "tier manager");
  return std::unique_ptr<TierManager>(new TierManager(std::move(impl)));
}

TierManager::TierManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) { opt_ = impl_->opt; }

TierManager::~TierManager() {
  if (!impl_) return;
  Impl& I = *impl_;
  I.dpu.reset();  // joins a running delayed update
  I.pipeline->retire_writes(0).ignore();
  I.pipeline->drain_prepared();
  I.pipeline->drop_kept();
  I.dev.synchronize(I.dev.compute_stream()).ignore();
  I.dev.synchronize(I.dev.h2d_stream()).ignore();
  I.dev.synchronize(I.dev.d2h_stream()).ignore();
  I.cache->release_all();
  I.grads->release_all();
  I.acts->release_all();
  // The parts go in reverse order; the homes last (their tiers remove the swap files).
}

std::string TierManager::describe() const {
  const Impl& I = *impl_;
  const Placement& p = opt_.placement;
  std::string s = fmt::format(
      "placement: params {}, master {}, moments {}, grads {}{}", tier_name(p.params),
      tier_name(p.master), tier_name(p.moments), tier_name(p.grads),
      p.optimizer_ratio < 1.0 ? fmt::format(" (optimizer ratio {:g})", p.optimizer_ratio) : "");
  const size_t undo = I.undo_room;
  s += fmt::format(
      "; device {} capacity, host tier {}{} (pinned: {}), nvme {}",
      format_bytes(double(I.dev.memory_stats().capacity)),
      format_bytes(double(I.homes->pool().capacity())),
      undo ? fmt::format(" + up to {} undo room, as speculated steps use it",
                         format_bytes(double(undo)))
           : std::string(),
      I.homes->host_locked() ? "yes" : "no",
      I.homes->swap()
          ? fmt::format("{} over {} path(s), {}", format_bytes(double(I.homes->nvme_capacity())),
                        opt_.nvme_paths.size(), I.homes->storage()->capabilities().backend)
          : std::string("unused"));
  return s;
}

// ---- one step ----------------------------------------------------------------------------------

void TierManager::begin_phase(const std::string& phase) { impl_->cache->begin_phase(phase); }

void TierManager::begin_micro(int micro) {
  impl_->cache->set_prefetch_reserve(impl_->grads->device_reserve(micro));
}

Result<const void*> TierManager::acquire_params(int m) {
  // A bucket left open by the last backward is reduced before the next forward starts.
  if (impl_->sharded) impl_->grads->flush_bucket();
  // The deferred step publishes module m's new parameters first (its forward waits only for
  // its own update).
  STRATA_RETURN_IF_ERROR(impl_->step_deferred(m),
                         "before " + impl_->homes->module(m).name + " forward");
  return impl_->cache->acquire(m);
}

void TierManager::release_params(int m) { impl_->cache->release(m); }

Result<float*> TierManager::acquire_grads(int m, int micro) {
  // A gradient accumulator is overwritten from here: the deferred step must have read it.
  STRATA_RETURN_IF_ERROR(impl_->step_deferred(-1),
                         "before " + impl_->homes->module(m).name + " backward");
  return impl_->grads->acquire(m, micro);
}

void TierManager::drain_grads(int m, int micro, bool last) { impl_->grads->drain(m, micro, last); }

bool TierManager::backward_grouped() const {
  return opt_.forward_group > 1 && opt_.grouped_backward && !impl_->sharded;
}

Result<float*> TierManager::acquire_grad_part(int m) { return impl_->grads->acquire_part(m); }

void TierManager::add_grad_part(int m, float* part) { impl_->grads->add_part(m, part); }

Status TierManager::end_backward() {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(I.step_deferred(-1), "end of backward");
  if (I.sharded) I.grads->flush_bucket();
  STRATA_RETURN_IF_ERROR(I.stamps->synchronize(I.dev.compute_stream()), "the compute stream");
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.d2h_stream()), "the gradient drains");
  STRATA_RETURN_IF_ERROR(I.dev.synchronize(I.dev.h2d_stream()), "the parameter fetches");
  I.cache->reclaim(false);       // the drained gradient buffers
  I.pipeline->release_copied();  // the last step's published parameters' staging
  if (I.sharded) I.cache->drop_unheld();
  STRATA_RETURN_IF_ERROR(I.errors.take(), "");  // each kept error says where it happened
  if (I.sharded) {
    // A stream-ordered collective that failed while running (a timeout, a dead peer) is kept
    // by its communicator, not by the stream: without this the step would go on with
    // gradients or parameters that never arrived.
    STRATA_RETURN_IF_ERROR(opt_.param_comm->health(), "gathering parameters");
    STRATA_RETURN_IF_ERROR(opt_.grad_comm->health(), "reducing gradients");
    if (opt_.zeropp) STRATA_RETURN_IF_ERROR(opt_.zeropp->health(), "ZeRO++ collectives");
  }
  return Status::ok();
}

GradStats TierManager::grad_stats() const { return impl_->grads->stats(); }

Status TierManager::end_phase() {
  impl_->cache->end_phase();
  return impl_->errors.take();  // each kept error says where it happened
}

const Trace* TierManager::trace(const std::string& phase) const {
  return impl_->cache->trace(phase);
}

std::string TierManager::object_name(int object) const {
  return impl_->homes->module(object).name + ".params";
}

// ---- the optimizer -----------------------------------------------------------------------------

Status TierManager::optimizer_step(const OptimizerHyper& hyper, float grad_mult, bool defer) {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(I.step_deferred(-1), "the last deferred optimizer step");
  const auto t0 = TierClock::now();
  STRATA_RETURN_IF_ERROR(I.errors.take(), "before the optimizer step");
  Status st;
  // Modules stepped under backward: kept when the step they took is the one asked for now,
  // else redone from their undo state.
  if (!I.spec->matches(hyper, grad_mult) && I.spec->stepped_any()) {
    st = I.spec->undo(/*redo=*/true, hyper, grad_mult);
  }
  const std::vector<bool> done = I.spec->stepped_mask();
  if (st.is_ok()) st = I.pipeline->retire_writes(SIZE_MAX);
  std::vector<int> order = I.pipeline->step_order(done);
  if (st.is_ok() && defer && !order.empty()) {
    // The rest runs as the next forward needs it, in module order (the forward's).
    std::sort(order.begin(), order.end());
    I.spec->end();
    I.deferred = I.pipeline->begin_pass(order, hyper, grad_mult, nullptr, {}, /*keep=*/true);
    const double s = seconds_between(t0, TierClock::now());
    const uint64_t n_deferred = order.size();
    I.counters.update([&](TierCounts& n) {
      n.schedule.optimizer_s += s;
      n.schedule.modules_deferred += n_deferred;
    });
    return Status::ok();
  }
  if (st.is_ok())
    st = I.pipeline->run(I.pipeline->prepared_first(order), hyper, grad_mult, nullptr,
                         /*keep=*/true);
  I.spec->end();
  I.pipeline->end_step();
  if (!st.is_ok()) I.pipeline->retire_writes(0).ignore();
  Status hs = I.dev.synchronize(I.dev.h2d_stream());
  I.pipeline->release_copied();  // their staging: every copy from it has run
  if (st.is_ok()) st = hs.with_context("publishing parameters");
  const double s = seconds_between(t0, TierClock::now());
  I.counters.update([s](TierCounts& n) { n.schedule.optimizer_s += s; });
  return st.with_context("optimizer step");
}

Status TierManager::flush_writes() {
  STRATA_RETURN_IF_ERROR(finish_pending_step(), "flushing writes");
  STRATA_RETURN_IF_ERROR(impl_->pipeline->finish_copies_down(), "flushing writes");
  STRATA_RETURN_IF_ERROR(impl_->pipeline->finish_copies_up(), "flushing writes");
  return impl_->pipeline->retire_writes(0);
}

Status TierManager::finish_pending_step() {
  STRATA_RETURN_IF_ERROR(impl_->step_deferred(-1), "finishing the pending step");
  STRATA_RETURN_IF_ERROR(finish_delayed_update(), "");
  return impl_->pipeline->finish_copies_up().with_context("finishing the pending step");
}

Status TierManager::Impl::step_deferred(int m) {
  if (!deferred) return Status::ok();
  OptimizerPipeline::Pass& p = *deferred;
  const size_t until = m < 0 ? p.units.size() : p.end_of(m);
  if (until <= p.i) return Status::ok();
  const auto t0 = TierClock::now();
  // When the compute stream has run what was enqueued before now: the interval's part before
  // that is hidden under its work.
  StreamStamps::Stamp caught_up = stamps->stamp(dev.compute_stream());
  Status st = pipeline->advance(p, until);
  if (!dev.host_addressable()) {
    // New parameters of device-homed modules were copied up on the h2d stream (a host-visible
    // device takes them by memcpy, at once): the forward that follows reads them.
    auto published = std::shared_ptr<Event>(dev.create_event());
    dev.record(*published, dev.h2d_stream());
    dev.wait(dev.compute_stream(), *published);
    stamps->hold(dev.compute_stream(), published);  // alive until the wait ran
  }
  const auto t1 = TierClock::now();
  deferred_intervals.push_back({t0, t1, std::move(caught_up)});
  counters.update([&](TierCounts& n) { n.schedule.optimizer_s += seconds_between(t0, t1); });
  if (st.is_ok() && !p.done()) return Status::ok();
  deferred.reset();
  pipeline->end_step();
  if (!st.is_ok()) pipeline->retire_writes(0).ignore();
  if (st.is_ok() && spec_pending) {
    const SpecArgs a = *spec_pending;
    spec->begin(a.hyper, a.grad_mult, a.keep_undo, a.step_modules);
  }
  spec_pending.reset();
  return st.with_context("optimizer step (deferred to the next forward)");
}

void TierManager::begin_speculation(const OptimizerHyper& hyper, float grad_mult, bool keep_undo,
                                    bool step_modules) {
  Impl& I = *impl_;
  if (I.deferred) {
    // Its read-ahead would take the host staging the deferred step is still using.
    I.spec_pending = Impl::SpecArgs{hyper, grad_mult, keep_undo, step_modules};
    return;
  }
  I.spec->begin(hyper, grad_mult, keep_undo, step_modules);
}

Status TierManager::step_ready(bool wait_all) { return impl_->spec->step_ready(wait_all); }
bool TierManager::undo_not_ready() const { return impl_->spec->undo_not_ready(); }
size_t TierManager::release_undo_room() { return impl_->spec->release_undo_room(); }

Status TierManager::skip_step() {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(I.step_deferred(-1), "the last deferred optimizer step");
  Status st;
  if (I.spec->active() && I.spec->stepped_any()) {
    st = I.spec->undo(/*redo=*/false, I.spec->hyper(), 0.0f);
  }
  I.spec->end();
  I.pipeline->end_step(/*skipped=*/st.is_ok());  // the state read ahead is the next step's
  return st.with_context("rolling back the optimizer step taken under backward");
}

Status TierManager::start_delayed_update(const OptimizerHyper& hyper, float grad_mult) {
  Impl& I = *impl_;
  STRATA_RETURN_IF_ERROR(finish_pending_step(), "the last optimizer step");
  STRATA_RETURN_IF_ERROR(I.errors.take(), "before the delayed update");
  STRATA_CHECK(std::any_of(I.homes->modules().begin(), I.homes->modules().end(),
                           [](const Module& m) { return m.gacc2.bytes > 0; }),
               "start_delayed_update without TierOptions::delayed_update");
  std::vector<int> order =
      I.pipeline->step_order(std::vector<bool>(I.homes->modules().size(), false));
  I.pipeline->end_step();
  I.dpu->start(std::move(order), hyper, grad_mult);
  return Status::ok();
}

Status TierManager::finish_delayed_update() { return impl_->dpu->finish(); }

// ---- statistics --------------------------------------------------------------------------------

TierStats TierManager::stats(Tier t) const {
  const Impl& I = *impl_;
  const TierCounts c = I.counters.read();
  TierStats s;
  switch (t) {
    case Tier::kDevice: {
      auto d = I.dev.memory_stats();
      s = {d.capacity, d.used, d.peak, c.dev_in, c.dev_out};
      s.fetches = c.fetches;
      s.prefetches = c.prefetches;
      s.grad_reductions = c.grad_reductions;
      s.grad_shared_reductions = c.grad_shared_reductions;
      break;
    }
    case Tier::kHost: {
      s = {I.homes->host_capacity(), I.homes->host_in_use(), I.homes->host_peak(), c.host_in,
           c.host_out};
      s.undo_room = I.homes->undo_capacity();
      s.undo_given_back = I.homes->undo_given_back();
      break;
    }
    case Tier::kNvme: {
      IoWorker* io = I.homes->io();
      s = {I.homes->nvme_capacity(), I.homes->nvme_used(), I.homes->nvme_peak(),
           io ? io->bytes_written() : 0, io ? io->bytes_read() : 0};
      s.bytes_queued = io ? io->bytes_queued() : 0;
      break;
    }
  }
  return s;
}

TierTimes TierManager::take_times() {
  Impl& I = *impl_;
  IoWorker* io = I.homes->io();
  const double io_total = io ? io->wait_seconds() : 0.0;
  // The deferred step's hidden part: each interval up to when the compute stream caught up
  // with what was enqueued before it (intervals whose marker has not run yet wait for the next
  // call).
  double deferred_hidden = 0;
  std::erase_if(I.deferred_intervals, [&](const Impl::Interval& v) {
    const int64_t c = v.compute_caught_up->load();
    if (c == 0) return false;
    const auto caught = TierClock::time_point(TierClock::duration(c));
    if (caught > v.t0) deferred_hidden += seconds_between(v.t0, std::min(caught, v.t1));
    return true;
  });
  I.counters.update([&](TierCounts& n) { n.schedule.optimizer_hidden_s += deferred_hidden; });
  const TierCounts c = I.counters.take_times();
  TierTimes t;
  t.schedule = c.schedule;
  t.io_wait_s = io_total - I.io_wait_base;
  I.io_wait_base = io_total;
  return t;
}

int TierManager::world_size() const { return impl_->sharded ? opt_.param_comm->size() : 1; }
int TierManager::rank() const { return impl_->sharded ? opt_.param_comm->rank() : 0; }
size_t TierManager::shard_offset(int m) const { return impl_->homes->module(m).off; }
size_t TierManager::shard_count(int m) const { return impl_->homes->module(m).valid; }

// ---- offloaded activations ---------------------------------------------------------------------

Status TierManager::stash_activation(int layer, const void* dev, size_t bytes) {
  return impl_->acts->stash(layer, dev, bytes);
}

Status TierManager::restore_activation(int layer, void* dev) {
  return impl_->acts->restore(layer, dev);
}

void TierManager::compute_waits_activation(int layer) { impl_->acts->compute_waits(layer); }

}  // namespace strata
