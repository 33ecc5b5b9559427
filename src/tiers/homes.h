// Homes: where each module's state lives on this rank, and the tiers that hold it.
//
// Built from the memory model's ModuleHomes (src/tiers/memory_model.h): every module's P,
// MASTER, MOM and GACC (and the delayed update's second GACC) get a home in the device's
// memory, the host tier (a BufferPool arena, mlocked when pin_memory) or the NVMe tier (swap
// extents over the nvme_paths, moved by an IoWorker thread). Homes owns the host tier and the
// NVMe tier; the other parts of the tier manager borrow their buffers and extents from it.
//
// Ownership: every home is freed by ~Homes (device memory released, host buffers returned,
// swap files removed), which must run after the device's streams have been synchronized and
// after every buffer borrowed from the host tier has been returned.
//
// Thread safety: the host thread (and the delayed update's thread, which borrows buffers)
// call it; host_buf, the pool and the IoWorker are thread-safe; the NVMe usage counts have
// their own lock.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "io/io_worker.h"
#include "src/tiers/memory_model.h"
#include "src/tiers/placement.h"
#include "strata/buffer_pool.h"
#include "strata/device.h"
#include "strata/storage.h"
#include "strata/swap_space.h"

namespace strata {

// Where one object's bytes live.
struct Home {
  Tier tier = Tier::kHost;
  size_t bytes = 0;
  PinnedBuffer host;    // tier == host
  void* dev = nullptr;  // tier == device
  // tier == nvme: one extent per sub-group of the module (moments: the sub-group's first
  // moments, then its second).
  std::vector<SwapExtent> subs;
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
  // The optimizer's sub-groups of the shard (ModuleHomes::sub_group): elements
  // [sub_start(j), sub_start(j) + sub_len(j)), j < sub_groups().
  size_t sub_group = 0;
  size_t sub_groups() const { return (sn + sub_group - 1) / sub_group; }
  size_t sub_start(size_t j) const { return j * sub_group; }
  size_t sub_len(size_t j) const { return std::min(sub_group, sn - j * sub_group); }
  // Bytes per element of the master weights (4) and of the moments (2 x moment dtype).
  size_t master_elem() const { return sn ? master.bytes / sn : 0; }
  size_t mom_elem() const { return sn ? mom.bytes / sn : 0; }
  // A frozen module (LoRA's base): parameters only, never stepped, saved or drained.
  bool frozen() const { return master.bytes == 0; }
};

class Homes {
 public:
  // Builds the host tier (an arena of `arena_bytes`), the NVMe tier when `swap` is given, and
  // every module's homes as `plan` places them, this rank's shard (rank of world_size).
  // `undo_bytes` (host_undo_bytes) bounds the undo room, allocated as it is used (undo_buf()).
  static Result<std::unique_ptr<Homes>> create(Device& device, const std::vector<ModuleHomes>& plan,
                                               int rank, int world_size, size_t arena_bytes,
                                               const TierOptions& options, const SwapOptions* swap,
                                               size_t undo_bytes = 0);
  ~Homes();

  Device& device() const { return dev_; }
  std::vector<Module>& modules() { return mods_; }
  const std::vector<Module>& modules() const { return mods_; }
  Module& module(int m) { return mods_[size_t(m)]; }
  BufferPool& pool() const { return *pool_; }
  // A buffer of the undo room, for the undo state of a speculated step
  // (Speculation::take_undo): pinned regions of their own beside the arena, each allocated when
  // a buffer finds no room in those before it and registered with the device as the arena is
  // (a home swapped into one is reached as one in the arena is), together at most the
  // `undo_bytes` given to create(). The room holds what speculated steps have used, not all
  // they may. kOutOfMemory beyond it, or when a region cannot be allocated. Any thread.
  Result<PinnedBuffer> undo_buf(size_t bytes);
  // Whether undo_buf() can take buffers of these sizes now without allocating a region of
  // kUndoPrepareBytes or more. A fresh region's pages cost the kernel's faults (mlock, or the
  // first touch; cudaHostRegister pins them): 140-200 ms for a GPT-2 block's 85 MB on a 2-core
  // VM, on the thread that steps under backward. So where such a region is missing and the
  // room has space for it, it is prepared on a thread of its own (created, its pages faulted
  // in, registered with the device) for a later step, and this says false. Smaller regions,
  // or buffers beyond the room, say true: undo_buf() takes or refuses them as it did. Any
  // thread.
  bool undo_ready(const std::vector<size_t>& bytes);
  static constexpr size_t kUndoPrepareBytes = size_t{8} << 20;
  // Gives the undo room back and takes no more: the regions nothing holds are unregistered
  // from the device and freed, undo_buf() refuses from then on and undo_ready() says true
  // (a run that no longer steps under backward: Speculation::release_undo_room). Returns the
  // bytes freed. Host thread, no speculation active.
  size_t close_undo_room();
  // Whether `p` lies in one of the undo room's regions.
  bool in_undo_room(const void* p) const;
  // The undo room taken: the most its regions held at once (those given back count).
  size_t undo_capacity() const;
  size_t undo_given_back() const;  // of it, the bytes close_undo_room() freed
  size_t undo_in_use() const;
  // The host tier's bytes: the arena, and the undo room's regions (capacity: the arena and
  // undo_capacity(); in use; the sum of the regions' peaks, given back or not).
  size_t host_capacity() const;
  size_t host_in_use() const;
  size_t host_peak() const;
  bool host_locked() const { return pool_->locked(); }
  IoWorker* io() const { return io_.get(); }  // null without NVMe state
  SwapSpace* swap() const { return swap_.get(); }
  Storage* storage() const { return storage_.get(); }

  // A host-tier buffer; when the tier is full, waits for the h2d and d2h streams (staging
  // buffers come back as copies and writes finish), runs the reclaim function and tries again,
  // twice.
  Result<PinnedBuffer> host_buf(size_t bytes, const char* what);
  // What host_buf runs once the streams are synchronized, before it tries again: it returns
  // staging buffers held until copies from them ran (the optimizer pipeline's published pieces,
  // OptimizerPipeline::release_copied). Called from any thread host_buf is; empty: none. Set
  // before other threads use the tier, cleared before what it calls is destroyed.
  void set_reclaim(std::function<void()> fn) { reclaim_ = std::move(fn); }

  // Whether `h` is reached through a host staging buffer (an NVMe home, or device memory the
  // host cannot address): such state moves through the host a sub-group piece at a time.
  bool staged(const Home& h) const {
    return h.tier == Tier::kNvme || (h.tier == Tier::kDevice && !dev_.host_addressable());
  }

  // Swap extents beyond the homes (the optimizer's shadow extents), counted in the NVMe
  // tier's use.
  Result<SwapExtent> allocate_extent(size_t bytes);
  void free_extent(const SwapExtent& e);
  size_t nvme_capacity() const { return nvme_capacity_; }
  size_t nvme_used() const;
  size_t nvme_peak() const;

 private:
  explicit Homes(Device& device) : dev_(device) {}
  Device& dev_;
  std::unique_ptr<BufferPool> pool_;
  std::unique_ptr<Storage> storage_;
  std::unique_ptr<SwapSpace> swap_;
  std::unique_ptr<IoWorker> io_;
  std::vector<Module> mods_;
  std::function<void()> reclaim_;  // set_reclaim
  size_t undo_bytes_ = 0;
  bool lock_ = true;
  // A region of the undo room for buffers of `bytes` (locked as the arena is, when it is;
  // else, with `touch`, its pages written once), registered with the device. undo_mu_ not held.
  Result<std::unique_ptr<BufferPool>> make_undo_region(size_t bytes, bool touch);
  static size_t undo_region_bytes(size_t bytes);
  void undo_preparer();  // undo_thread_'s loop
  // With undo_mu_ held: a buffer from the regions there, or none where none has room.
  std::optional<PinnedBuffer> undo_from_regions(size_t bytes);
  // With undo_mu_ held: a region could not be allocated (warns once); a region joins undo_.
  void undo_failed(size_t bytes, const Status& why);
  void add_undo_region(std::unique_ptr<BufferPool> region);
  mutable std::mutex undo_mu_;  // undo_, undo_warned_, undo_queue_, undo_pending_, undo_stop_
  std::vector<std::unique_ptr<BufferPool>> undo_;  // undo_buf()'s regions
  bool undo_warned_ = false;                       // a region could not be allocated
  // The most undo_ held at once; of it, what close_undo_room() freed and the freed regions'
  // peaks.
  size_t undo_held_peak_ = 0, undo_freed_ = 0, undo_freed_peaks_ = 0;
  // undo_ready()'s regions to prepare (their buffer sizes), and their region bytes queued or
  // being prepared (counted against undo_bytes_).
  std::vector<size_t> undo_queue_;
  size_t undo_pending_ = 0;
  bool undo_stop_ = false;
  std::condition_variable undo_cv_;
  std::thread undo_thread_;  // started by the first preparation
  size_t nvme_capacity_ = 0;
  mutable std::mutex nvme_mu_;  // nvme_used_, nvme_peak_
  size_t nvme_used_ = 0, nvme_peak_ = 0;
};

}  // namespace strata
