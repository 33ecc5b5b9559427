// The optimizer pipeline: one path that reads a module's optimizer state ahead, steps it with
// the fused CPU optimizer, publishes its new parameters and writes its state behind.
//
// The unit of work is a sub-group: elements [a, a + len) of module k's shard, at most
// TierOptions::sub_group_elems of them (Module::sub_group). A Slot points at one sub-group's
// master weights and moments: into their homes when those are in host-visible memory, else
// into host-tier staging buffers that NVMe reads of the sub-group's own extents fill
// (prepare() starts the reads, take() waits for them). step_sub_group() runs the optimizer over
// the slot with GACC * grad_mult into the module's low-precision parameters and queues NVMe
// writes of the state it changed; each sub-group's new parameters are then published
// (publish_piece(): to their home and to a cached device copy, write-through). The optimizer
// is elementwise, so the numbers do not depend on the sub-group size. Writes drain
// behind later work (a later read of the same extent is ordered after them by the IoWorker);
// retire_writes() bounds how many are in flight and frees the finished ones' buffers. run() is
// the pass over a list of modules with buffer_count sub-groups read ahead; the step after
// backward, the optimizer under backward (speculation.h, through step()) and the delayed
// update (delayed_update.h) all go through it.
//
// The host tier's staging for the pipeline is reserved for 2 * buffer_count + 1 sub-groups
// (the memory model): buffer_count being read, as many being written, one being stepped.
// New low-precision parameters that cannot be written in place (NVMe homes, a device that is
// not host-addressable) are staged a sub-group at a time, at most
// publish_staging_pieces() pieces at once (piece() waits for the oldest write or
// copy to free one), counted apart in the memory model (param_publish_staging).
// A buffer that copies on the h2d stream read from (a piece, a delayed update's shadow) is
// held with an event recorded after those copies, and goes back to the host tier only once
// the event has completed (release_copied(): as a new piece is staged, before the pipeline
// takes host buffers, as writes retire and at the ends of passes and steps; the tier
// manager's points that synchronize the h2d stream; finish_copies_up() waits for them all).
// No host function holds a stream for it.
//
// Thread safety: one thread at a time: the host thread, or the delayed update's thread while
// it runs (the host thread then stays out); release_copied() from any thread (Homes'
// reclaim, when the host tier is full).
#pragma once

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "src/tiers/counters.h"
#include "src/tiers/device_cache.h"
#include "src/tiers/homes.h"
#include "strata/optimizer.h"

namespace strata {

class OptimizerPipeline {
 public:
  // One sub-group's optimizer state in host memory: pointers into its homes, or into staging
  // buffers being read from NVMe (tickets rm, rmo until waited for). With NVMe-homed moments
  // the staging holds the sub-group's first moments then its second (v == m + len moments).
  struct Slot {
    int k = -1;
    size_t j = 0, a = 0, len = 0;  // sub-group j: elements [a, a + len) of the shard
    std::shared_ptr<PinnedBuffer> master_buf, mom_buf;
    IoWorker::Ticket rm = 0, rmo = 0;
    float* master = nullptr;
    void* m = nullptr;
    void* v = nullptr;
    // Stepped out of place (the speculation's undo, a BeforeStep): the pre-step state is read
    // from these and the new written to master/m/v (ShardState's *_src); null: in place.
    const float* master_src = nullptr;
    const void* m_src = nullptr;
    const void* v_src = nullptr;
    // Gradients on NVMe: the sub-group's accumulator, read by a pass with the state
    // (prepare_grad), under the rest of backward once the module's are final and written
    // (prepare_grads_of), or else by take() — never before they are final; else null (the
    // module's GACC home is used).
    std::shared_ptr<PinnedBuffer> grad_buf;
    const float* grad = nullptr;
    IoWorker::Ticket rg = 0;
    // Kept from the last pass (its staging, written from, stays as the next step's slot): no
    // reads; its writes must land before it is stepped again.
    bool kept = false;
    // Read ahead for a step an fp16 overflow skipped (end_step `skipped`): the state as it is,
    // for the next step; dropped with the kept slots (drop_kept), else like a slot just read.
    bool retained = false;
  };
  // Where a module's new low-precision parameters go while its sub-groups are stepped: its
  // home when host-visible, a shadow (the delayed update), else (null) a staging piece per
  // sub-group.
  struct Target {
    void* lp = nullptr;
  };
  // Where one sub-group's new parameters go: into the target, or a staging piece (`keep`).
  struct Piece {
    void* dst = nullptr;
    std::shared_ptr<PinnedBuffer> keep;
  };
  // Called with each sub-group's slot (its reads done) just before it is stepped; it may point
  // the step's output elsewhere (Slot::master_src and the others).
  using BeforeStep = std::function<void(Slot&)>;

  // Sets the homes' reclaim to release_copied() (cleared again by the destructor).
  OptimizerPipeline(Homes& homes, DeviceCache& cache, const TierOptions& options, DType dt,
                    DType moment_dt, bool sharded, TierCounters& counters);
  // Waits for the copies from the buffers it still holds and returns them (the device and the
  // host tier outlive it).
  ~OptimizerPipeline();
  OptimizerPipeline(const OptimizerPipeline&) = delete;
  OptimizerPipeline& operator=(const OptimizerPipeline&) = delete;

  // ---- the order modules become ready ------------------------------------------------
  // Module m's gradients are final for this step once the d2h stream's work enqueued so far
  // has run (a device-stepped module's step waits for that, not for what the stream runs
  // after: other modules' new parameters copied down).
  void grads_final(int m);
  // This step's modules in the order their gradients became final (whose state may already be
  // read ahead), then any not drained in index order; none marked in `skip`.
  std::vector<int> step_order(std::vector<bool> skip) const;
  // `order` with the modules whose state is read ahead (any sub-group) first, each part in
  // its given order: the pass after backward steps what it already holds while it reads the
  // rest (modules are independent: the same numbers in any order).
  std::vector<int> prepared_first(std::vector<int> order) const;
  // The last step's order (empty before the first step).
  const std::vector<int>& last_order() const { return last_order_; }
  // The step's optimizer work is over: waits for the reads of slots prepared but never stepped,
  // returns the buffers whose copies ran (release_copied) and remembers this step's order.
  // `skipped` (fp16 overflow, the state unchanged): the slots read ahead under its backward stay
  // for the next step (drain_prepared's `retain`), which would read the same bytes again (no byte
  // is read twice).
  void end_step(bool skipped = false);

  // ---- slots -------------------------------------------------------------------------
  size_t sub_groups(int k) const { return homes_.module(k).sub_groups(); }
  // Points a slot at sub-group j of module k, starting NVMe reads into staging buffers. With
  // `try_only`, returns false instead of waiting when the host tier is full. `urgent`: a pass
  // is waiting for it (the reads go to the disk before the writes draining behind; the
  // speculation's read-ahead under backward is not, leaving the disk to backward's fetches).
  Result<bool> prepare(int k, size_t j, bool try_only, bool urgent = false);
  bool prepared(int k, size_t j) const { return prepared_.count({k, j}) > 0; }
  size_t prepared_count() const { return prepared_.size(); }
  // Of the prepared slots, those kept from the last pass (Pass::keep).
  size_t kept_count() const { return kept_; }
  // Takes sub-group j of module k (preparing it if needed) and waits for its reads.
  Status take(int k, size_t j, Slot* out);
  // With gradients on NVMe: reads the slot's sub-group of the accumulator into s->grad, unless
  // prepare_grad() already did.
  Status load_grad(Slot* s);
  // With gradients on NVMe, for a prepared sub-group of a pass (its gradients final): starts the
  // read of its accumulator beside the state's, within the read-ahead's room (the memory model
  // counts a gradient sub-group in its unit; at most set_read_ahead() slots hold one), so that
  // stepping it does not wait for its state's read and then its gradients' alone (without it,
  // hostmem-190m's pass at 256 MiB had waited 1.6-1.8 s on 738 one-at-a-time gradient reads).
  // True when it started a read.
  bool prepare_grad(int k, size_t j, bool urgent = true);
  // prepare_grad() for every prepared sub-group of module k, whose gradients are final and
  // written to NVMe (the speculation, under the rest of backward, when it does not step them):
  // the pass then steps them without reading (without it, hostmem-190m at 4 GiB with gradients
  // on NVMe read them all in the next forward's window, the disk idle under the backward).
  // Not urgent: backward's fetches go first.
  void prepare_grads_of(int k);
  // Waits for every prepared slot's reads and drops the slots, but the kept ones and, with
  // `retain`, those whose reads succeeded (Slot::retained); their gradients are dropped.
  void drain_prepared(bool retain = false);
  // Drops the kept slots: call before anything but a pass writes the state's homes (init, a
  // checkpoint's load); with `modules` (indexed by module), only theirs (the speculation's
  // undo restores the modules it stepped, the others' state is as their kept slots hold it).
  void drop_kept(const std::vector<bool>* modules = nullptr);
  // Points the prepared slots at their modules' homes again, where they are not staged: a home's
  // buffer moved (Speculation::release_undo_room), its bytes with it.
  void repoint_homes();

  // ---- stepping ----------------------------------------------------------------------
  // Where module k's new parameters go: `shadow` when given, else (after a prefetch of them
  // has landed) their host-visible home, else staging pieces (lp null).
  Result<Target> target(int k, void* shadow);
  // Where sub-group j of module k's new parameters go under `t`: t.lp at the sub-group's
  // offset, or a staging piece (waiting for the oldest write or copy while
  // publish_staging_pieces() of them are in use).
  Result<Piece> piece(int k, size_t j, const Target& t);
  // Steps sub-group `s` of module k with `grad` (the module's; default GACC) * grad_mult, its
  // new parameters into `lp` (the sub-group's: piece().dst); queues NVMe writes of its state
  // behind later work.
  // With `urgent_writes` the state's writes go to the disk before those queued that are not
  // urgent (a pass waits for them to free its staging: bound_writes()).
  void step_sub_group(int k, Slot& s, const OptimizerHyper& hyper, float grad_mult,
                      const float* grad, void* lp, bool urgent_writes = false);
  // Derives sub-group `s`'s low-precision parameters from its master weights into `lp` (the
  // sub-group's).
  void derive(int k, const Slot& s, void* lp) const;
  // Steps every sub-group of module k (reading the next ones ahead as the reservation allows;
  // `before` sees each slot first) and publishes its new parameters, keeping its sub-groups for
  // the next step as a pass does (Pass::keep).
  Status step(int k, const OptimizerHyper& hyper, float grad_mult, const BeforeStep& before = {});
  // The pipeline over `order`: buffer_count sub-groups read ahead while one is stepped, writes
  // draining behind. With `shadows` (indexed by module): gradients from the second
  // accumulator, parameters into a fresh shadow per module (the delayed update).
  // With `keep`, see Pass::keep.
  Status run(const std::vector<int>& order, const OptimizerHyper& hyper, float grad_mult,
             std::vector<std::shared_ptr<PinnedBuffer>>* shadows, bool keep = false);

  // A pass that may run in parts (run() and step() are one advance to its end; the deferred
  // step, TierManager::optimizer_step with `defer`, advances it module by module as the next
  // forward needs them). Its read-ahead goes on into the units after the ones advanced through.
  struct Pass {
    std::vector<std::pair<int, size_t>> units;  // (module, sub-group), in order
    size_t i = 0;                               // the next unit to step
    size_t next = 0;                            // the read-ahead's position
    Target t;                                   // the current module's target
    OptimizerHyper hyper;
    float grad_mult = 1.0f;
    std::vector<std::shared_ptr<PinnedBuffer>>* shadows = nullptr;
    BeforeStep before;
    // A stepped sub-group's staging (NVMe-homed state: the buffers its writes go from) stays
    // as a prepared slot for the next step when it is one of the read-ahead's room's (the
    // first set_read_ahead() in module order): the next step reads back none of its state
    // (without it, hostmem-190m at 4 GiB read 1.94 GiB a step that it had just written). For passes
    // whose steps are final (not the speculation's, which may be undone).
    bool keep = false;
    bool done() const { return i == units.size(); }
    // One past module k's last unit (0 when k is not in the pass).
    size_t end_of(int k) const;
  };
  Pass begin_pass(const std::vector<int>& order, const OptimizerHyper& hyper, float grad_mult,
                  std::vector<std::shared_ptr<PinnedBuffer>>* shadows, BeforeStep before,
                  bool keep = false) const;
  // Steps the pass's units up to (not including) `until`, as run() does.
  Status advance(Pass& p, size_t until);

  // ---- publishing parameters ---------------------------------------------------------
  // New low-precision parameters of sub-group j of module k at host `src` go to their home
  // (unless `src` is in the home; NVMe: the sub-group's extent) and to a cached device copy
  // (write-through; a gathered group, sharded, is dropped instead). `keep` is held until the
  // copies and the write from it ran: by an event recorded on the h2d stream after the copies
  // (release_copied() returns it once the event has completed) and by the queued write. With
  // `wait`, returns after everything landed (the h2d stream and the NVMe write); else the NVMe
  // write is queued. `copy_current`: the cached copy already holds them (the device's optimizer
  // stepped it in place), nothing is written through.
  Status publish_piece(int k, size_t j, const void* src, std::shared_ptr<PinnedBuffer> keep,
                       bool wait, bool copy_current = false);
  // Waits for the new parameters step_on_device copies down into host homes without waiting:
  // before anything reads or writes the homes on the host (checkpoints, the weights' checksum,
  // write_params).
  Status finish_copies_down();
  // Returns to the host tier the buffers held for copies up (publish_piece) whose event has
  // completed, the oldest first; never blocks. Thread-safe.
  void release_copied();
  // Waits for the copies from every buffer still held and returns them all; the first failure.
  Status finish_copies_up();
  // Buffers held until the copies from them run.
  size_t copies_up_held() const;
  // publish_piece() of every sub-group of a whole module's new parameters at host `lp`.
  Status publish(int k, const void* lp, std::shared_ptr<PinnedBuffer> keep, bool wait);
  // Derives module k's parameters from fp32 `master` and publishes them, synchronously.
  Status write_params(int k, const float* master);
  // The same for sub-group j alone, from its fp32 master weights `master` (sub_len(j) floats).
  Status write_params(int k, size_t j, const float* master);
  // Publishes sub-group j's parameters as given (sub_len(j) elements of the model dtype, copied
  // bit for bit: a quantized module's stored bytes), synchronously.
  Status write_stored_params(int k, size_t j, const void* params);

  // ---- writes ------------------------------------------------------------------------
  // Waits for the oldest writes until at most `keep_at_most` are in flight, and frees the
  // buffers of every finished one (and those whose copies up ran, release_copied); the first
  // failure, naming what was written.
  Status retire_writes(size_t keep_at_most);
  // Waits for the oldest writes until at most max_writes() of the state's from buffers not
  // kept (Pass::keep) are in flight: a kept slot's writes hold no memory of their own, and the
  // new parameters' pieces are bounded apart (piece()).
  Status bound_writes();
  // Distinct sub-groups with writes in flight from buffers not kept.
  size_t sub_groups_writing() const;
  // How many more sub-groups may be read ahead now: those held (prepared, the kept among them)
  // and those still being written stay within the staging the memory model reserves
  // (2 * buffer_count + 1) plus the read-ahead's room. Once the last pass's writes have
  // drained, the read-ahead under backward fills all of it, not only buffer_count: stepping a
  // prepared sub-group turns it into one being written, so a pass needs no more room than it
  // holds (without it, hostmem-190m's deferred pass read 5 sub-groups at 4 GiB, with the
  // forward waiting, that the idle disk could have read under backward). The speculation
  // under backward and a pass reading beyond buffer_count share this rule.
  size_t read_ahead_room() const;
  size_t depth() const { return size_t(std::max(1, opt_.buffer_count)); }
  // Sub-groups read ahead during backward beyond depth() (read_ahead_sub_groups(), in room of
  // their own in the host arena): once stepped, their buffers are written from, so as many
  // more sub-groups may drain behind.
  // The same room holds the kept slots (Pass::keep): the first `extra` sub-groups of
  // NVMe-homed state in module order, whatever the pass's order, so which state stays is
  // fixed (the planner counts those sub-groups' reads saved).
  void set_read_ahead(size_t extra);
  // The most state writes from buffers not kept that a pass leaves in flight (bound_writes):
  // a sub-group's are at most two (master weights, moments), so their buffers stay within
  // buffer_count sub-groups, plus the read-ahead's room less the slots kept in it: a deferred
  // pass's writes then drain behind the forward into the backward.
  size_t max_writes() const { return 2 * (depth() + extra_ - std::min(extra_, kept_)); }

 private:
  // A write to NVMe still in flight, with the buffer it reads from.
  struct Write {
    IoWorker::Ticket t;
    std::shared_ptr<PinnedBuffer> keep;
    std::string what;
    bool kept = false;     // from a kept slot's buffer
    bool counted = false;  // in unkept_state_writes_: state, not from a kept slot's buffer
  };
  // A buffer that copies enqueued on the h2d stream read from, with the event recorded after
  // them: returned to the host tier once the event has completed.
  struct CopyUp {
    std::unique_ptr<Event> done;
    std::shared_ptr<PinnedBuffer> keep;
  };
  // Holds `keep` until the copies enqueued on the h2d stream so far have run.
  void hold_until_copied(std::shared_ptr<PinnedBuffer> keep);
  // Waits for the oldest held buffer's copies and returns it (none held: ok).
  Status wait_oldest_copy_up();
  // Whether the oldest held buffer is held by nothing else (its copies are all that keep it
  // from the host tier).
  bool oldest_copy_up_alone() const;
  // A host-tier buffer for the pipeline, after returning those whose copies ran; with
  // `try_only` the pool's (none when it is full), else homes_.host_buf's.
  Result<PinnedBuffer> host_buf(size_t bytes, const char* what, bool try_only = false);
  // `state`: master weights or moments (bound_writes() bounds those; new parameters' staging
  // pieces are bounded by piece()).
  void queue_write(const SwapExtent& ext, const void* src, std::shared_ptr<PinnedBuffer> keep,
                   const std::string& what, bool state, bool urgent = false);
  // Points `s` (module s.k, sub-group s.j) at the master weights and moments in their homes,
  // those not on NVMe.
  void point_at_homes(Slot& s) const;
  // Host-visible home of module k's parameters, or null (NVMe, or a device that is not
  // host-addressable).
  void* host_visible_params(const Module& m) const;
  // Waits for a slot's reads; the first failure.
  Status wait_reads(Slot& s);
  // A kept slot: retires the writes in flight from its buffers (the oldest first).
  Status wait_writes_from(const Slot& s);
  // Whether a pass with Pass::keep keeps slot `s` once stepped: one of the first extra_
  // sub-groups of NVMe-homed state in module order (keep_before_).
  bool keeps(const Slot& s) const;
  // Keeps stepped slot `s` as a prepared slot (keeps(s)).
  void keep_slot(Slot&& s);
  // step() for a module whose state is device-resident (device_optimizer.cc).
  Status step_on_device(int k, const OptimizerHyper& hyper, float grad_mult);

  Homes& homes_;
  Device& dev_;
  DeviceCache& cache_;
  TierCounters& counters_;
  const TierOptions& opt_;
  DType dt_, mdt_;
  bool sharded_;
  size_t extra_ = 0;
  std::map<std::pair<int, size_t>, Slot> prepared_;  // state read ahead (during backward)
  size_t grads_held_ = 0;  // of prepared_, slots holding gradients read ahead (prepare_grad)
  size_t kept_ = 0;        // of prepared_, slots kept from the last pass (Slot::kept)
  std::vector<size_t> keep_before_;  // [k]: sub-groups of NVMe-homed state before module k
  size_t unkept_state_writes_ = 0;   // of writes_, the state's not from a kept slot's buffer
  std::deque<Write> writes_;         // optimizer/parameter writes draining behind later work
  // Staging pieces handed out by piece(), while anything (a write, a copy) still holds them.
  std::deque<std::weak_ptr<PinnedBuffer>> pieces_;
  // Buffers held for copies up, in the order their events were recorded on the h2d stream
  // (the order they complete in), and events to record again once theirs completed.
  mutable std::mutex copies_up_mu_;  // copies_up_, free_events_
  std::deque<CopyUp> copies_up_;
  std::vector<std::unique_ptr<Event>> free_events_;
  // Device-stepped modules: the d2h stream's event after their final drains (grads_final).
  std::vector<std::shared_ptr<Event>> drained_;
  // New parameters copied down from cached copies into host homes on the d2h stream, not yet
  // waited for (step_on_device): finish_copies_down() waits.
  bool copies_down_ = false;
  std::vector<int> order_;       // this step: modules in the order their gradients became final
  std::vector<int> last_order_;  // the last step's order_
};

}  // namespace strata
