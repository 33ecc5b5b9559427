// The optimizer pipeline: one path that reads a module's optimizer state ahead, steps it with
// the fused CPU optimizer, publishes its new parameters and writes its state behind.
//
// For module k, a Slot points at its master weights and moments: their homes when those are in
// host-visible memory, else host-tier staging buffers that NVMe reads fill (prepare() starts
// the reads, take() waits for them). step() runs the optimizer over the slot with GACC *
// grad_mult, then publishes the new low-precision parameters (publish(): to their home and to
// a cached device copy, write-through) and queues NVMe writes of everything it changed. Writes
// drain behind later work (a later read of the same extent is ordered after them by the
// IoWorker); retire_writes() bounds how many are in flight and frees the finished ones'
// buffers. run() is the pass over a list of modules with buffer_count slots read ahead; the
// step after backward, the optimizer under backward (speculation.h) and the delayed update
// (delayed_update.h) all go through it.
//
// The host tier's staging for the pipeline is reserved for 2 * buffer_count + 1 modules (the
// memory model): buffer_count being read, as many being written, one being stepped.
//
// Thread safety: one thread at a time: the host thread, or the delayed update's thread while
// it runs (the host thread then stays out).
#pragma once

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "src/tiers/counters.h"
#include "src/tiers/device_cache.h"
#include "src/tiers/homes.h"
#include "strata/optimizer.h"

namespace strata {

class OptimizerPipeline {
 public:
  // One module's optimizer state in host memory: its home pointers, or staging buffers being
  // read from NVMe (tickets rm, rmo until waited for).
  struct Slot {
    std::shared_ptr<PinnedBuffer> master_buf, mom_buf;
    IoWorker::Ticket rm = 0, rmo = 0;
    float* master = nullptr;
    void* mom = nullptr;
  };

  OptimizerPipeline(Homes& homes, DeviceCache& cache, const TierOptions& options, DType dt,
                    DType moment_dt, bool sharded);

  // ---- the order modules become ready ------------------------------------------------
  // Module m's gradients are final for this step.
  void grads_final(int m) { order_.push_back(m); }
  // This step's modules in the order their gradients became final (whose state may already be
  // read ahead), then any not drained in index order; none marked in `skip`.
  std::vector<int> step_order(std::vector<bool> skip) const;
  // The last step's order (empty before the first step).
  const std::vector<int>& last_order() const { return last_order_; }
  // The step's optimizer work is over: waits for the reads of slots prepared but never stepped
  // (an error, or a skipped step) and remembers this step's order.
  void end_step();

  // ---- slots -------------------------------------------------------------------------
  // Points a slot at module k's state, starting NVMe reads into staging buffers. With
  // `try_only`, returns false instead of waiting when the host tier is full.
  Result<bool> prepare(int k, bool try_only);
  bool prepared(int k) const { return prepared_.count(k) > 0; }
  size_t prepared_count() const { return prepared_.size(); }
  // Takes module k's slot (preparing it if needed) and waits for its reads.
  Status take(int k, Slot* out);
  // Gives a taken slot back unstepped (its reads done).
  void put_back(int k, Slot s) { prepared_[k] = std::move(s); }
  // Waits for every prepared slot's reads and drops the slots.
  void drain_prepared();

  // ---- stepping ----------------------------------------------------------------------
  // Steps module k's state in `s` with `grad` (default GACC) * grad_mult. With `shadow`, the new
  // parameters go there and are published later (the delayed update); else they are
  // published now. NVMe writes of the state are queued behind later work.
  Status step(int k, Slot& s, const OptimizerHyper& hyper, float grad_mult,
              const float* grad = nullptr, void* shadow = nullptr);
  // The pipeline over `order`: buffer_count modules read ahead while one is stepped, writes
  // draining behind. With `shadows` (indexed by module): gradients from the second
  // accumulator, parameters into a fresh shadow per module (the delayed update).
  Status run(const std::vector<int>& order, const OptimizerHyper& hyper, float grad_mult,
             std::vector<std::shared_ptr<PinnedBuffer>>* shadows);

  // ---- publishing parameters ---------------------------------------------------------
  // New low-precision parameters of module k at host `lp` go to their home (unless `lp` is the
  // home) and to a cached device copy (write-through; a gathered group, sharded, is dropped
  // instead). `keep` is held until the copies from it ran. With `wait`, returns after
  // everything landed (the h2d stream and the NVMe write); else the NVMe write is queued.
  Status publish(int k, void* lp, std::shared_ptr<PinnedBuffer> keep, bool wait);
  // Derives module k's parameters from fp32 `master` and publishes them, synchronously.
  Status write_params(int k, const float* master);

  // ---- writes ------------------------------------------------------------------------
  // Waits for the oldest writes until at most `keep_at_most` are in flight, and frees the
  // buffers of every finished one; the first failure, naming what was written.
  Status retire_writes(size_t keep_at_most);
  // Distinct modules with writes in flight.
  size_t modules_writing() const;
  size_t depth() const { return size_t(std::max(1, opt_.buffer_count)); }

 private:
  // A write to NVMe still in flight, with the buffer it reads from.
  struct Write {
    IoWorker::Ticket t;
    std::shared_ptr<PinnedBuffer> keep;
    std::string what;
  };
  void queue_write(const SwapExtent& ext, const void* src, std::shared_ptr<PinnedBuffer> keep,
                   const std::string& what);
  // Host-visible home of module k's parameters, or null (NVMe, or a device that is not
  // host-addressable).
  void* host_visible_params(const Module& m) const;
  // Waits for a slot's reads; the first failure.
  Status wait_reads(Slot& s);
  // step() for a module whose state is device-resident (device_optimizer.cc).
  Status step_on_device(int k, const OptimizerHyper& hyper, float grad_mult);

  Homes& homes_;
  Device& dev_;
  DeviceCache& cache_;
  const TierOptions& opt_;
  DType dt_, mdt_;
  bool sharded_;
  std::map<int, Slot> prepared_;  // optimizer state read ahead (during backward)
  std::deque<Write> writes_;      // optimizer/parameter writes draining behind later work
  std::vector<int> order_;        // this step: modules in the order their gradients became final
  std::vector<int> last_order_;   // the last step's order_
};

}  // namespace strata
