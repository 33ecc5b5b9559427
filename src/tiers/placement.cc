#include "src/tiers/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <set>

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

Result<Tier> parse_tier(const std::string& key, const std::string& v, bool allow_nvme) {
  if (v == "device" || v == "none") return Tier::kDevice;
  if (v == "host" || v == "cpu") return Tier::kHost;
  if (v == "nvme" && allow_nvme) return Tier::kNvme;
  return invalid_argument(
      fmt::format("{}: '{}' is not one of device, host{}", key, v, allow_nvme ? ", nvme" : ""));
}

}  // namespace

size_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  size_t kb = 0;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

Result<Placement> parse_placement(const Config& cfg) {
  Placement p;
  const auto& zp = cfg.zero.offload_param;
  const auto& zo = cfg.zero.offload_optimizer;
  // parse_tier's message names the key; no context to add.
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
    STRATA_ASSIGN_OR_RETURN(p.grads, parse_tier("strata.placement.grads", s.placement_grads, true),
                            "");
  }
  return p;
}

bool needs_device_optimizer(const Placement& p) {
  return p.master == Tier::kDevice || p.moments == Tier::kDevice || p.grads == Tier::kDevice ||
         p.optimizer_ratio < 1.0;
}

Status check_placement(const Placement& p, const Device& device) {
  return check_placement(p, device.host_addressable(), device.name());
}

Status check_placement(const Placement& p, bool host_addressable, const std::string& device) {
  if (host_addressable) return Status::ok();  // the host steps whatever it can reach
  // The device's optimizer steps a module whose master weights, moments and gradients are all
  // in its memory; with some of them offloaded the host would need to reach the others.
  const bool master = p.master == Tier::kDevice, mom = p.moments == Tier::kDevice,
             grads = p.grads == Tier::kDevice;
  if (master != mom || master != grads) {
    return invalid_argument(fmt::format(
        "optimizer state split between the device and the host (master weights {}, moments {}, "
        "gradients {}): on device '{}' the optimizer steps a module on the device only when all "
        "three are there; set strata.placement.master, .moments and .grads to the same side (or "
        "leave them unset: zero_optimization.offload_optimizer.device and .ratio place them "
        "together)",
        tier_name(p.master), tier_name(p.moments), tier_name(p.grads), device));
  }
  return Status::ok();
}

Result<Placement> placement_from_config(const Config& cfg, const Device& device) {
  // parse_placement's and check_placement's messages name the keys; no context to add.
  STRATA_ASSIGN_OR_RETURN(Placement p, parse_placement(cfg), "");
  STRATA_RETURN_IF_ERROR(check_placement(p, device), "");
  return p;
}

uint64_t max_sub_group_elems(size_t host_capacity, int buffer_count) {
  const uint64_t per_elem = uint64_t(pipeline_staging_sub_groups(buffer_count)) * 12;
  const uint64_t g = uint64_t(host_capacity) / 8 / per_elem / kSubGroupAlign * kSubGroupAlign;
  return std::max<uint64_t>(g, kSubGroupAlign);
}

Tier auto_grads_placement(const Placement& p, size_t host_need_with_host_grads,
                          size_t host_need_with_nvme_grads, size_t host_capacity, bool sharded,
                          bool delayed_update) {
  const bool may_spill = p.grads == Tier::kHost && p.master == Tier::kNvme &&
                         p.moments == Tier::kNvme && !sharded && !delayed_update;
  const bool helps = host_need_with_host_grads > host_capacity &&
                     host_need_with_nvme_grads < host_need_with_host_grads;
  return may_spill && helps ? Tier::kNvme : p.grads;
}

StorageOptions storage_options_from_config(const Config& config) {
  StorageOptions o;
  o.backend = config.aio.backend;
  o.block_size = config.aio.block_size;
  o.queue_depth = config.aio.queue_depth;
  o.posix_threads = std::max(4, config.aio.intra_op_parallelism);
  o.checksum = config.strata.io_checksum;
  return o;
}

Status check_nvme_config(const Config& config, uint64_t bytes_per_path) {
  const bool direct = config.aio.backend != "posix";
  const std::pair<const char*, const OffloadConfig*> offloads[] = {
      {"zero_optimization.offload_param", &config.zero.offload_param},
      {"zero_optimization.offload_optimizer", &config.zero.offload_optimizer}};
  for (const auto& [key, off] : offloads) {
    if (off->device != "nvme") continue;
    if (off->nvme_path.empty())
      return invalid_argument(fmt::format(
          "{}.device is \"nvme\" but {}.nvme_path is empty; set it to a directory (or a list "
          "of directories, one per drive) on NVMe",
          key, key));
    for (const std::string& p : off->nvme_path)
      STRATA_RETURN_IF_ERROR(check_nvme_path(p, bytes_per_path + kSwapHeaderBytes, direct),
                             fmt::format("{}.nvme_path", key));
  }
  return Status::ok();
}

int forward_group_max(const Config& cfg) {
  const bool may_defer = cfg.strata.optimizer_overlap && !cfg.strata.delayed_update &&
                         (cfg.gradient_clipping > 0 || cfg.fp16.enabled);
  const bool groups_backward = cfg.strata.grouped_backwards && !cfg.strata.delayed_update;
  return (may_defer || groups_backward) && cfg.strata.activations != "offload"
             ? int(std::max<int64_t>(1, cfg.gradient_accumulation_steps))
             : 1;
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
  o.storage = storage_options_from_config(cfg);
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
  o.grads_auto = cfg.strata.placement_grads.empty();
  // No speculative step (strata.optimizer.speculate never) takes undo state: no room for it.
  o.undo_copies = cfg.strata.optimizer_overlap && cfg.strata.optimizer_speculate != "never" &&
                  (cfg.gradient_clipping > 0 || cfg.fp16.enabled);
  // Read ahead during backward by the overlap's Speculation, which the delayed update does not run.
  o.read_ahead_bytes = cfg.strata.optimizer_overlap && !cfg.strata.delayed_update
                           ? cfg.strata.optimizer_read_ahead
                           : 0;
  o.forward_group = int(cfg.strata.grouped_forwards);
  o.grouped_backward = cfg.strata.grouped_backwards;
  o.forward_group_max = strata::forward_group_max(cfg);
  o.micro_batches = int(std::max<int64_t>(1, cfg.gradient_accumulation_steps));
  size_t avail = host_available_bytes();
  o.host_capacity = cfg.strata.host_memory_limit > 0 ? cfg.strata.host_memory_limit
                                                     : static_cast<size_t>(double(avail) * 0.9);
  o.sub_group_size_key = cfg.zero.sub_group_size;
  o.sub_group_elems = std::min<uint64_t>(cfg.zero.sub_group_size,
                                         max_sub_group_elems(o.host_capacity, o.buffer_count));
  return o;
}

}  // namespace strata
