// Where training state lives: the three tiers, the placement of each kind of state, and the
// options the tier manager is built with, all read from the config.
//
// Pure data and parsing: nothing here allocates or touches a device, so the memory model
// (src/tiers/memory_model.h) and the planner use the same structs the tier manager does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/status.h"
#include "strata/storage.h"

namespace strata {

class ZeroPP;

enum class Tier : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
const char* tier_name(Tier t);  // "device", "host", "nvme"

// Where each kind of state lives. optimizer_ratio < 1 keeps the first (1-ratio) share of the
// modules' master weights and moments (by bytes, in module order) on the device instead.
struct Placement {
  Tier params = Tier::kDevice;
  Tier master = Tier::kHost;
  Tier moments = Tier::kHost;
  Tier grads = Tier::kHost;
  double optimizer_ratio = 1.0;
  bool operator==(const Placement&) const = default;
};

// The placement a config asks for: zero_optimization.offload_param.device and
// offload_optimizer.device (master and moments follow the optimizer's tier; gradients stay on the
// device with it, else on the host) and offload_optimizer.ratio, then each strata.placement key
// that is set overrides its kind (gradients on nvme: grad_spill.h). An unknown tier name is
// kInvalidArgument naming the key. Checks nothing about the device: the planner calls this
// for machines it does not run on.
Result<Placement> parse_placement(const Config& cfg);

// Whether `device` can run `placement`. A module whose master weights, moments and gradients
// are all in device memory is stepped by the device's optimizer kernel (device_optimizer.h);
// a host-addressable device (the CPU backend) runs any split, but on another device (CUDA) the
// three must be all on the device or all off it (strata.placement.* can split them;
// offload_optimizer.device and .ratio never do). kInvalidArgument naming the keys, else OK.
Status check_placement(const Placement& placement, const Device& device);
// The same for a device that is (or is not) host-addressable, named `device` (the planner's).
Status check_placement(const Placement& placement, bool host_addressable,
                       const std::string& device);
// Whether `placement` keeps optimizer state on the device (some modules stepped there).
bool needs_device_optimizer(const Placement& placement);

// parse_placement, then check_placement against `device`.
Result<Placement> placement_from_config(const Config& cfg, const Device& device);

// Sub-groups start at multiples of this many elements, so every sub-group's fp32 and bf16
// bytes start on a 4096-byte boundary (O_DIRECT transfers into a whole module's buffer).
inline constexpr uint64_t kSubGroupAlign = 2048;

// The optimizer pipeline's host staging in sub-groups: buffer_count being read, as many being
// written, one being stepped (memory_model.cc reserves it; under backward the read-ahead may
// fill all of it: OptimizerPipeline::read_ahead_room).
inline size_t pipeline_staging_sub_groups(int buffer_count) {
  return 2 * size_t(buffer_count > 1 ? buffer_count : 1) + 1;
}

// The largest sub-group whose optimizer staging ((2 * buffer_count + 1) sub-groups of fp32
// master weights and two fp32 moments) takes at most an eighth of the host budget (at least
// kSubGroupAlign). The sub-group size is zero_optimization.sub_group_size (DeepSpeed's 1e9 by
// default) capped by this: the size changes no number, so a user with little RAM gets small
// sub-groups without knowing the key, and one with much RAM gets DeepSpeed's behaviour.
uint64_t max_sub_group_elems(size_t host_capacity, int buffer_count);

// MemAvailable of /proc/meminfo, in bytes (0 when it cannot be read): what a new allocation
// can take without pushing other processes out (the host tier's default budget is 90% of it).
size_t host_available_bytes();

// The default home of the gradient accumulators, for a user with little RAM. With
// strata.placement.grads unset they stay on the host (parse_placement), except where the
// optimizer state is on NVMe, the run is one rank without the delayed update (what gradients
// on NVMe support), and the host tier's need with host gradients (`host_need_with_host_grads`:
// the whole model's fp32 accumulators) exceeds its budget while the need with them on NVMe
// (`host_need_with_nvme_grads`: a few sub-groups of staging) is smaller: then NVMe, where the
// gradients cost disk traffic (written by each micro-batch, read by the next and by the
// optimizer) instead of RAM. A run that fits keeps them on the host, the faster place.
Tier auto_grads_placement(const Placement& placement, size_t host_need_with_host_grads,
                          size_t host_need_with_nvme_grads, size_t host_capacity, bool sharded,
                          bool delayed_update);

// The adapters from the config to io/'s own options (io/ never reads the Config):
// aio.backend, aio.block_size, aio.queue_depth, aio.intra_op_parallelism (posix threads) and
// strata.io_checksum.
StorageOptions storage_options_from_config(const Config& config);
// Start-up preflight from the config: for each of zero_optimization.offload_param and
// offload_optimizer whose device is "nvme", checks every nvme_path (as check_nvme_path, O_DIRECT
// required unless aio.backend is "posix") for `bytes_per_path` free. An nvme offload with an
// empty nvme_path is an error too. The Status names the config key, the path and the fix.
Status check_nvme_config(const Config& config, uint64_t bytes_per_path);

// The most micro-batches auto groups (TierOptions::forward_group_max):
// gradient_accumulation_steps where the activations are kept or recomputed and a group pays
// off — a step's optimizer can be deferred into the next forward (strata.optimizer.overlap
// with gradient_clipping or fp16), or the group's backwards run together
// (strata.grouped_backwards) — without the delayed update; else 1.
int forward_group_max(const Config& cfg);

struct TierOptions {
  Placement placement;
  size_t host_capacity = 0;             // host tier budget, bytes
  bool pin_memory = false;              // mlock the host tier
  std::vector<std::string> nvme_paths;  // swap directories
  StorageOptions storage;
  int rank = 0;
  // ZeRO-3 over ranks. With both communicators set and size() > 1, every module's flat group
  // is padded (ShardLayout, 4096-byte shards) and split: this rank's homes hold only its shard
  // of P, MASTER, MOM and GACC. acquire_params gathers the whole group into the device cache
  // on the h2d stream (param_comm); drain_grads reduce-scatters each micro-batch's gradient
  // into the owned shard on the d2h stream (grad_comm). Two communicators because the two
  // streams run collectives concurrently. Both must be host-buffer communicators on a
  // host-addressable device, or device-buffer ones (nccl) on a CUDA device; they must outlive
  // the manager.
  // Every rank must issue the same collectives in the same order whatever its timing, so when
  // sharded every decision to gather or drop is a function of the recorded trace and object
  // sizes only (never of free memory or of which copies have finished):
  //   - prefetch: after each acquire, every group in the prefetch window is gathered: the
  //     upcoming trace positions whose distinct groups' gathered bytes add up to at most
  //     prefetch_bytes (no wrap past the step's end: the optimizer updates the shards);
  //   - release: a group nobody holds stays cached if its next use lies inside the window from
  //     the next position, else it is dropped; at end_backward every unheld group is dropped;
  //   - device memory: nothing is evicted for room; an allocation waits for pending frees and
  //     fails (out of memory, naming stage3_prefetch_bucket_size) rather than skip a gather;
  //     the preflight counts the window;
  //   - no persistence threshold (a persistent group would miss the optimizer's update).
  // Gradients are reduce-scattered in buckets of reduce_bucket_elems elements (DeepSpeed's
  // zero_optimization.reduce_bucket_size, over the whole padded groups): the modules drained
  // one after another share one reduce-scatter until the next would overflow the bucket (or a
  // new micro-batch starts, or the next forward acquires parameters), through a device bucket
  // buffer they are copied into; a module larger than the bucket is reduced in bucket-sized
  // pieces; a bucket that is exactly one whole module is reduced in place. A bucket is capped
  // at the largest module's padded group, so the device need grows by at most one bucket. All
  // of it runs on the d2h stream, so with overlap_comm it overlaps the next module's backward;
  // without, the compute stream waits for each bucket's reduction (DeepSpeed's meaning).
  Communicator* param_comm = nullptr;
  Communicator* grad_comm = nullptr;
  // ZeRO++ (src/comm/zeropp.h), sharded only; null: plain gathers and reduce-scatters. With
  // qwZ or hpZ the gathers go through DeviceCache::gather_zeropp (device memory for the
  // quantized payloads and hpZ's secondary shards comes from the device cache); with qgZ each
  // gradient bucket is reduced by ZeroPP::reduce_scatter. Must outlive the manager.
  ZeroPP* zeropp = nullptr;
  uint64_t reduce_bucket_elems = 500'000'000;  // zero_optimization.reduce_bucket_size
  bool overlap_comm = true;                    // zero_optimization.overlap_comm
  int buffer_count = 4;                        // optimizer pipeline depth (NVMe state)
  // zero_optimization.sub_group_size: the optimizer pipeline reads, steps and writes a
  // module's master weights and moments in sub-groups of at most this many elements (rounded
  // down to a multiple of kSubGroupAlign, at least that), each with its own swap extents when
  // NVMe-homed, so its host staging is (2 * buffer_count + 1) sub-groups whatever the
  // module's size. 0 or more than a module's elements: that module is one sub-group.
  // from_config: the key's value, at most max_sub_group_elems() of the host budget.
  uint64_t sub_group_elems = 0;
  // The key's own value (from_config), before the host budget's cap: a budget other than
  // host_capacity caps it otherwise (the preflight's least host budget). 0: not from a config
  // (sub_group_elems holds whatever the budget).
  uint64_t sub_group_size_key = 0;
  uint64_t prefetch_bytes = 50'000'000;      // bytes in flight ahead
  uint64_t max_reuse_distance = UINT64_MAX;  // bytes
  uint64_t persistence_threshold = 0;        // elements
  int optimizer_threads = 0;
  // strata.optimizer.delayed_update: a second gradient accumulator per module and host
  // shadows of the parameters (see start_delayed_update), counted in the preflight.
  bool delayed_update = false;
  // strata.placement.grads unset: TierManager::create may move the gradient accumulators from
  // the host to NVMe (auto_grads_placement).
  bool grads_auto = false;
  // The optimizer under backward keeps undo state (clipping or fp16, and
  // strata.optimizer.speculate not never): shadow extents on the
  // swap files for NVMe-homed state when the disks have room, else host copies; the host
  // tier's arena is sized for the copies when its budget allows.
  bool undo_copies = false;
  // strata.optimizer.read_ahead: host bytes of NVMe-homed master weights and moments the
  // optimizer reads ahead during backward beyond buffer_count sub-groups (Speculation), taken
  // from what the host budget leaves after the tier's needs (read_ahead_sub_groups());
  // SIZE_MAX: auto, all of it.
  size_t read_ahead_bytes = SIZE_MAX;
  // strata.activations = offload: host-tier buffers for `stash_layers` block inputs of
  // `stash_bytes` each (activation_bytes()'s stash_*), reserved at create and counted in the
  // host preflight. 0: none (keep, recompute).
  int stash_layers = 0;
  size_t stash_bytes = 0;
  // strata.grouped_forwards: the activation sets the device holds, one per micro-batch of a
  // forward group (TierManager::create's activation_bytes is one set's); 0: auto, decided by
  // create (auto_forward_group), at most forward_group_max (strata::forward_group_max).
  int forward_group = 1;
  int forward_group_max = 1;
  // strata.grouped_backwards: a forward group of more than one micro-batch on one rank runs
  // its backwards together too, module by module (TierManager::backward_grouped): each further
  // micro-batch's gradients go to a part buffer added to the first's on the device.
  bool grouped_backward = true;
  // Micro-batches per step (gradient_accumulation_steps); 0: not known. With one, or with all
  // of them in one backward group, no micro-batch after the first drains its own gradients:
  // the host tier holds no landing buffers for them (HostNeed::grad_landing).
  int micro_batches = 0;
  // What each activation set after the first adds on the device (ActivationSizes::slot_bytes:
  // the rest of a set is shared by the group); 0: a whole set (create's activation_bytes).
  size_t activation_slot_bytes = 0;
  // Everything above but the placement, the communicators and the stash from the config; the
  // host budget defaults to 90% of MemAvailable.
  static TierOptions from_config(const Config& cfg, DType dt);
};

}  // namespace strata
