// Gradient accumulators on NVMe (strata.placement.grads = nvme): a module's fp32 GACC lives in
// one swap extent per optimizer sub-group (Module::sub_group), never whole in host memory.
//
// accumulate() enqueues on the d2h stream, for each sub-group of a module's gradient buffer: a
// callback that frees the sub-group's slot (waits for the write that last used it) or, for a
// later micro-batch, starts reading the sub-group's extent into the slot's staging buffer, and
// those of the module's next kReadAhead sub-groups into theirs (each slot freed first); a
// device-to-host copy, into the slot's staging buffer for the first micro-batch, into the one
// landing buffer for later ones (none on a host-addressable device: the add reads the device
// buffer in place); and a callback that adds the landing buffer into the staging one (later
// micro-batches) and starts the write of the result. So the reads run kReadAhead
// sub-groups ahead of the adds, and the writes drain under the next sub-groups' copies, reads
// and adds: the disk sees reads and writes at once, several deep, instead of one read at a
// time whose latency each add would wait out.
// A read of an extent waits for a write in flight to it (IoWorker), so the order of the
// micro-batches is the disk's. With `last` it also reduces the module's norm² and inf/nan flag
// over the final values, tile by tile (kStatsTileElems; sub-groups are whole tiles when
// gradients are on NVMe, see module_homes) and summed in tile order, exactly as grad_stats()
// over the whole accumulator, so the clipping coefficient and the losses are bit-identical to
// host-homed gradients; its last callback waits for the module's writes, so a failed write is
// reported before the statistics (and the optimizer's reads) are used.
//
// Host memory: kSlots staging buffers and a landing one of the largest sub-group, taken from
// the host tier at the first accumulate and held until destruction (the memory model counts
// them: host.grad_staging).
//
// Thread safety: the host thread calls accumulate(); the callbacks run on the d2h stream's
// thread, one at a time (they alone touch the slots' tickets), and report failures to the
// AsyncError. Destruction waits for the writes still in flight; the d2h stream must be idle.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "io/io_worker.h"
#include "src/tiers/counters.h"
#include "src/tiers/homes.h"
#include "strata/optimizer.h"

namespace strata {

class GradSpill {
 public:
  // Sub-groups in flight, each in a staging buffer of its own; one landing buffer besides.
  static constexpr int kSlots = 6;
  // A later micro-batch's reads run this many sub-groups ahead of its adds (within a module);
  // the rest of the slots are the writes draining behind.
  static constexpr int kReadAhead = 3;

  // `threads`: the host's adds of later micro-batches (TierOptions::optimizer_threads).
  GradSpill(Homes& homes, TierCounters& counters, AsyncError& errors, int threads)
      : homes_(homes),
        dev_(homes.device()),
        counters_(counters),
        errors_(errors),
        threads_(threads) {}
  ~GradSpill();
  GradSpill(const GradSpill&) = delete;
  GradSpill& operator=(const GradSpill&) = delete;

  // Module m's whole gradient (its sn elements at device `src`) into its NVMe accumulator on
  // the d2h stream: copied for micro 0, added for later ones; with `last`, *stats is written
  // once the final values are stored.
  void accumulate(int m, const float* src, int micro, bool last, GradStats* stats);

 private:
  Homes& homes_;
  Device& dev_;
  TierCounters& counters_;
  AsyncError& errors_;
  const int threads_;
  struct Slot {
    std::shared_ptr<PinnedBuffer> stage;
    IoWorker::Ticket read = 0, write = 0;  // in flight (0: none); only callbacks touch them
    int64_t read_of = -1;                  // the key of the sub-group `read` is for
    std::string what;                      // the write's module and sub-group, for its error
  };
  // Waits for slot s's write in flight, if any (on the d2h thread, or at destruction).
  void finish_write(Slot& s);
  // On the d2h thread: waits for a read into slot s that no add took (a step given up half-way).
  void drop_read(Slot& s);
  // On the d2h thread: frees slot s and starts reading `ext` into its staging buffer, unless
  // that read (`key`) is already in flight there.
  void start_read(Slot& s, int64_t key, const SwapExtent& ext);

  std::vector<Slot> slots_;
  std::shared_ptr<PinnedBuffer> landing_;   // a later micro-batch's copy, before its add (none
                                            // where the host reads device memory)
  size_t next_slot_ = 0;                    // the slot of the next sub-group (host thread)
  int64_t calls_ = 0;                       // accumulate() calls so far (host thread)
  std::vector<std::vector<double>> tiles_;  // per module: the last micro-batch's tile sums
};

}  // namespace strata
