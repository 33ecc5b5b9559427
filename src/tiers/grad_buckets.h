// Gradients: a fresh device buffer per module and micro-batch, drained into the module's fp32
// accumulator GACC on the d2h stream as soon as its backward is done.
//
// Unsharded, each module is drained alone: copied to GACC for the first micro-batch, added
// for the later ones (through a host landing buffer; read in place where the host can address
// the device, as the CPU backend), the same on every placement. Where the device's kernels
// address GACC (the CPU backend, GACC not on NVMe; a GPU, GACC on the device), the first
// micro-batch's backward writes GACC itself instead: the same zeroing and kernels, so the same
// bits, without the copy and without a device buffer the next module's backward would wait
// for (in_place). With
// several ranks the drained buffers go into buckets of reduce_bucket_size elements that are
// reduce-scattered over the ranks (one collective per bucket; a module larger than the bucket
// in bucket-sized pieces; see TierOptions), and only this rank's shard of each piece is
// accumulated (with ZeRO++'s qgZ, TierOptions::zeropp, each bucket's reduce-scatter is its
// hierarchical int4 one). Either way, after the last micro-batch a module's norm² and inf/nan flag
// are reduced from GACC on the d2h stream, and `on_final(m)` is called once the work that makes its
// gradients final has been enqueued.
//
// A device-homed GACC (the optimizer on the device) on a device the host cannot address is
// filled on the device (in place, then Kernels::add_inplace) and its statistics reduced by
// Kernels::norm_sq_and_nonfinite into a small device buffer copied down: the fp64 norm² in the
// host's order (grad_stats), so a norm taken on the device clips as the host's does, whichever
// schedule or placement took it.
//
// Thread safety: the host thread calls everything; the d2h stream's callbacks write the
// module's grad stats and touch the counters and the async error.
#pragma once

#include <functional>
#include <vector>

#include "src/tiers/counters.h"
#include "src/tiers/device_cache.h"
#include "src/tiers/grad_spill.h"
#include "src/tiers/homes.h"
#include "strata/optimizer.h"

namespace strata {

class GradBuckets {
 public:
  GradBuckets(Homes& homes, DeviceCache& cache, const TierOptions& options, bool sharded,
              TierCounters& counters, AsyncError& errors, std::function<void(int)> on_final);

  // Sharded: allocates the device bucket of `shard_elems` elements per rank (`bytes`), and with
  // qgZ the scratch of its reduce-scatter (ZeroPPShape::qgz_scratch_bytes(shard_elems, true)).
  Status init_bucket(size_t shard_elems, size_t bytes);

  // A zeroed buffer for module m's gradients (the whole padded group) in micro-batch `micro`:
  // a device buffer, or GACC[m] itself where backward can write it in place (in_place).
  Result<float*> acquire(int m, int micro);
  // After module m's backward: drains its buffer into GACC[m] (and frees it) on the d2h stream.
  void drain(int m, int micro, bool last);
  // A backward group (TierManager::acquire_grad_part): a zeroed device buffer for a further
  // micro-batch's gradients of module m, and its add to module m's acquired buffer on the
  // compute stream (Kernels::add_inplace: the fp32 sum the drain's accumulation would make),
  // after which it is freed in stream order.
  Result<float*> acquire_part(int m);
  void add_part(int m, float* part);
  // Backward groups: the prefetches leave room for a part beside each gradient buffer.
  void set_parts(bool on) { parts_ = on; }
  // The device bytes a prefetch leaves free in micro-batch `micro` for the gradient buffer its
  // backward allocates next: the largest not acquired in place; 0 where every one is. (Two,
  // room for one still draining too, read 1.21-1.59x the on-demand NVMe bytes of TierTest's
  // tight device once the first micro-batch's were in place; one reads 0.95-0.98x, and
  // bench-25m and hostmem-190m at 4 GiB step as fast: docs/RELIABILITY.md.)
  size_t device_reserve(int micro) const;
  // Sharded: reduce-scatters the open bucket now (before a forward, at the end of backward).
  void flush_bucket();
  // The step's gradient norm² and inf/nan flag over this rank's modules; valid after the d2h
  // stream ran the last micro-batch's drains.
  GradStats stats() const;

  // Frees the gradient buffers and the bucket; call after the streams have been synchronized.
  void release_all();

 private:
  // Piece: elements [a, a + len) of every rank's shard of module m's gradient buffer g.
  struct Piece {
    int m;
    float* g;
    size_t a, len;
    int micro;
    bool last;   // the step's last micro-batch: the module's grad stats follow its final piece
    bool final;  // the module's last piece: g is freed after this bucket
  };
  // GACC[m][a, a + len) <- (micro 0) or += (later) `len` floats at device `src`, on d2h.
  void accumulate(int m, const float* src, size_t a, size_t len, int micro);
  // After module m's gradient buffer g has been accumulated: its grad stats (last), its
  // buffer freed (g null: written in place, nothing to free), and on_final (last), all in d2h
  // stream order. `whole`: g holds the step's whole gradient of the module (its statistics
  // may come from g on the device).
  void finish(int m, float* g, bool last, bool whole);
  void drain_sharded(int m, float* g, int micro, bool last);
  // A zeroed device buffer for module m's whole (padded) gradient group, named <module><tag>.
  Result<float*> zeroed_buffer(int m, const char* tag);

  Homes& homes_;
  Device& dev_;
  DeviceCache& cache_;
  const TierOptions& opt_;
  bool sharded_;
  TierCounters& counters_;
  AsyncError& errors_;
  std::function<void(int)> on_final_;
  std::vector<float*> gdev_;       // this micro-batch's device buffers
  std::vector<char> in_place_;     // gdev_[m] is GACC[m] (acquired in place)
  bool parts_ = false;             // backward groups: device_reserve counts a part too
  std::vector<GradStats> gstats_;  // written by the d2h stream
  // Module m's statistics are computed on the device and land in stats_host_[m] (norm², fp64,
  // non-finite where some gradient is) by the d2h stream's copy.
  std::vector<char> stats_on_device_;
  float* bucket_ = nullptr;      // device: world * bucket_kc_ floats
  size_t bucket_kc_ = 0;         // per-rank capacity of a bucket, elements
  void* qgz_scratch_ = nullptr;  // device: qgZ's scratch for a bucket of bucket_kc_
  std::vector<Piece> open_;      // the bucket being filled
  size_t open_k_ = 0;            // per-rank elements in it
  GradSpill spill_;              // gradient accumulators on NVMe (unsharded)
  // Statistics taken on the device (a device-homed GACC on a device the host cannot address, or
  // a whole step's gradient before its copy down): [m] holds module m's norm² on the device,
  // copied to stats_host_ (pinned: an asynchronous copy).
  double* stats_dev_ = nullptr;
  double* stats_host_ = nullptr;
  // Whether module m's GACC is filled and reduced on the device.
  bool gacc_on_device(int m) const;
  // Whether backward writes module m's gradients of micro-batch `micro` straight into GACC[m]:
  // the first micro-batch, one rank, GACC in memory the device's kernels address (the CPU
  // backend: host and device memory are one). Zeroed and written by the same kernels as a
  // device buffer, it holds the same bits as the copy it replaces; nothing crosses a link.
  bool in_place(int m, int micro) const;
  // Allocates stats_dev_ and stats_host_ once; false (the error set) when there is no room.
  bool stats_buffers();
};

}  // namespace strata
