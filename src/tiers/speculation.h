// The optimizer under backward: speculation and undo.
//
// begin() opens a step's speculation with the multiplier that applies when no clipping and no
// overflow happen. From then on each module whose gradients become final (grads_final: an
// event on the d2h stream) is stepped by step_ready() through the optimizer pipeline while the
// device still runs the backward of the modules before it. With undo state, a stepped module
// first keeps what a rollback restores (take_undo): NVMe-homed master weights and moments stay
// on the disk — the step is written to fresh shadow extents that become the homes, the old
// extents are kept — state homed in the host tier is stepped out of place into a shadow
// buffer of the tier, which then becomes the home by a swap, the old home kept (no copy: the
// step reads and writes as many bytes as in place); and state in the device's memory (or NVMe
// state when the swap files have no room) is copied to the host tier; without room for any of
// these, speculation stops and the remaining modules are stepped after backward. Where undo
// state takes host memory it stops as well once every gradient of the step is final (the
// optimizer fell behind the backward): the norm is known then, and the modules left are
// stepped exactly, without undo state.
//
// After backward, the step is validated: kept when (lr, step, multiplier) are the speculated
// ones (end() frees the old extents), else undo() restores every stepped module and redoes it
// with the real multiplier, or, for a skipped step, re-derives its parameters from the
// restored master weights. A redo starts from exactly the old state with exactly the
// multiplier the plain schedule uses, so the result is bit-identical to it.
//
// Thread safety: the host thread calls everything; the compute stream's callback records when
// backward ended, under its own lock.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "src/tiers/counters.h"
#include "src/tiers/homes.h"
#include "src/tiers/optimizer_pipeline.h"
#include "src/tiers/stream_stamps.h"

namespace strata {

class Speculation {
 public:
  // `shadow_extents`: the swap files have room for a shadow of every NVMe-homed MASTER and MOM.
  Speculation(Homes& homes, OptimizerPipeline& pipeline, StreamStamps& stamps, bool shadow_extents,
              TierCounters& counters, AsyncError& errors);

  // Opens the step's speculation (see TierManager::begin_speculation) and starts reading the
  // optimizer state of the modules expected first.
  void begin(const OptimizerHyper& hyper, float grad_mult, bool keep_undo, bool step_modules);
  bool active() const { return active_; }
  // Module m's gradients are final once the d2h stream has run as far as it is now.
  void grads_final(int m);
  // Steps the modules whose gradients are final; with `wait_all`, every remaining one.
  Status step_ready(bool wait_all);

  // Whether the step asked for now is the one speculated.
  bool matches(const OptimizerHyper& hyper, float grad_mult) const;
  // Modules stepped under backward, as a mask over all modules.
  std::vector<bool> stepped_mask() const;
  bool stepped_any() const { return !stepped_.empty(); }
  // Whether this step's speculation stopped at a module whose undo room was not ready yet
  // (take_undo; counted as ScheduleCounts::undo_not_ready).
  bool undo_not_ready() const { return undo_not_ready_; }
  // Restores every stepped module from its undo state and, with `redo`, steps it again with
  // (hyper, grad_mult), else re-derives its parameters (the step is skipped). Fails with
  // INVALID_ARGUMENT naming strata.optimizer.overlap when a module kept no undo state.
  Status undo(bool redo, const OptimizerHyper& hyper, float grad_mult);
  // Ends the step's speculation: frees the undo state and counts the time that ran while the
  // compute stream was still in backward.
  void end();
  const OptimizerHyper& hyper() const { return hyper_; }
  // Gives the undo room back for a run that steps nothing under backward from now on
  // (Homes::close_undo_room): each host-tier home a kept step left in the room is copied into
  // the buffer it swapped with (its spare, in the arena) and takes it back, the spares are
  // dropped and the pipeline's slots pointed at the homes again. Not while a speculation is
  // active. Returns the bytes given back.
  size_t release_undo_room();

 private:
  // A stepped module's pre-step master weights and moments: for NVMe-homed state its old
  // extents (each sub-group's step was written to a fresh one, `fresh_*`, which replaced its
  // home as it was stepped, the old one kept in `old_*`); for host-homed state (`*_swap`) the
  // old home buffer (the step wrote into `master`/`mom`, swapped with the home once the module
  // was stepped); else a host copy in the whole module's layout (of NVMe-homed state: filled
  // from each sub-group's slot before its step).
  struct Undo {
    std::shared_ptr<PinnedBuffer> master, mom;  // host copies or old homes; null when none
    std::vector<SwapExtent> fresh_master, fresh_mom, old_master, old_mom;
    bool master_shadow = false, mom_shadow = false;
    bool master_swap = false, mom_swap = false;
    bool kept() const { return master || mom || master_shadow || mom_shadow; }
  };
  void read_ahead();
  // Sets up module k's undo state before its step; false (nothing taken) without room.
  bool take_undo(int k, Undo* u);
  // Whether module k's undo state takes host memory (the undo room): all but NVMe-homed
  // state shadowed on the disk.
  bool undo_takes_host(int k) const;
  // Before sub-group `s` is stepped: its pre-step state into the undo state, or its step
  // pointed at the shadow buffers.
  void keep_sub_group(int k, OptimizerPipeline::Slot& s, Undo* u);
  // After module k's step: host-tier homes stepped into their shadows swap with them.
  void swap_homes(int k, Undo* u);
  void drop_shadows(int k, Undo* u);
  Status restore(int k, Undo& u, bool redo, const OptimizerHyper& hyper, float grad_mult);

  Homes& homes_;
  Device& dev_;
  OptimizerPipeline& pipeline_;
  StreamStamps& stamps_;
  bool shadow_extents_;
  TierCounters& counters_;
  AsyncError& errors_;

  bool active_ = false, undo_ = false;
  bool step_modules_ = true;  // false: only read state ahead during backward
  bool stopped_ = false;      // no room for undo state: the rest waits for validation
  bool undo_not_ready_ = false;
  OptimizerHyper hyper_;
  float mult_ = 1.0f;
  std::deque<std::pair<int, std::shared_ptr<Event>>> ready_;  // gradients final (d2h events)
  std::map<int, Undo> stepped_;
  // Per module, the buffers its last undo state held (after a kept step the old homes, after a
  // rollback the speculative ones): the next step's undo state reuses them, so that once the
  // first speculated steps have taken their room (from the undo room, Homes::undo_buf), no
  // later one takes the arena's free space, which the pipeline's staging needs.
  struct Spare {
    std::shared_ptr<PinnedBuffer> master, mom;
  };
  std::map<int, Spare> spares_;
  // Moves the undo state's buffers of stepped_ into spares_, then clears it.
  void retire_stepped();
  // Expected gradient completion order, for read-ahead: (module, sub-group).
  std::vector<std::pair<int, size_t>> expected_;
  size_t next_prep_ = 0;
  std::vector<std::pair<TierClock::time_point, TierClock::time_point>> intervals_;
  // When the compute stream finished the backward (dated by the end of backward's wait for
  // it); null until step_ready(wait_all).
  StreamStamps::Stamp bwd_end_;
};

}  // namespace strata
