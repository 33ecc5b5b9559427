// Where the optimizer runs on a step that clipping (or an fp16 overflow) keeps from being
// stepped under backward (docs/ARCHITECTURE.md, "The optimizer under backward"): deferred into
// the next forward (module i stepped just before its forward) or after backward. Both are
// exact and give the same bits; which is faster depends on the machine: deferral hides the
// optimizer under the forward where the two use different resources (a GPU's compute and the
// host's optimizer and disk), and costs more than it hides where the forward, the optimizer
// and the parameter fetches share a disk's bandwidth or the same cores (measured on hostmem-190m,
// CPU backend: 4.2 s deferred against 3.8 s after backward).
//
// strata.optimizer.defer: "always", "never", or "auto" (the default), which measures: the first
// kTrial * 2 such steps defer (the first kTrial are warm-up, the next kTrial are timed), the
// kTrial after them run after backward (the first pays for the last deferred pass as well and
// is not timed), and the faster median wins for the rest of the run. Runs with fewer such steps
// defer all of them. Only these steps count; one whose optimizer ran under backward is not
// timed. The caller makes the choice the same on every rank (decide() with reduced medians).
//
// strata.optimizer.speculate's "auto" is the same trial over steps after an unclipped one, with
// stepping under backward in place of deferral. Its first steps under backward are not yet
// the schedule's own: while the undo room's regions are made ready, a step speculates only
// the modules whose regions are there and steps the rest after backward
// (Homes::undo_ready). Such a step (record's `settled` false) counts for nothing, so the
// timed steps under backward are ones that speculated whatever they could; after
// kMaxUnsettled of them the trial counts them anyway.
//
// Thread safety: one Run's thread.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace strata {

class DeferChoice {
 public:
  enum class Mode { kAuto, kAlways, kNever };
  static constexpr int kTrial = 4;
  static constexpr int kMaxUnsettled = 256;

  explicit DeferChoice(Mode mode) : mode_(mode) {}
  static Mode parse(const std::string& s) {
    return s == "always" ? Mode::kAlways : s == "never" ? Mode::kNever : Mode::kAuto;
  }

  // Whether the next step not stepped under backward defers.
  bool defer() const {
    if (mode_ != Mode::kAuto) return mode_ == Mode::kAlways;
    return decided_ ? chosen_ : counted_ < 2 * kTrial;
  }

  // After such a step, its wall time; `settled` false for a deferring (under backward) step
  // that ran only part of that schedule. True when the trial is complete: call decide().
  bool record(double seconds, bool settled = true) {
    if (mode_ != Mode::kAuto || decided_) return false;
    if (!settled && counted_ < 2 * kTrial && unsettled_ < kMaxUnsettled) {
      ++unsettled_;
      return false;
    }
    const int i = counted_++;
    if (i >= kTrial && i < 2 * kTrial) deferred_.push_back(seconds);
    if (i > 2 * kTrial && i < 3 * kTrial) plain_.push_back(seconds);
    return counted_ == 3 * kTrial;
  }

  // This rank's medians of the timed steps of each trial.
  double deferred_median() const { return median(deferred_); }
  double plain_median() const { return median(plain_); }

  // Settles the choice from the (rank-reduced) medians: deferral where it is no slower.
  void decide(double deferred_s, double plain_s) {
    decided_ = true;
    chosen_ = deferred_s <= plain_s;
  }
  bool decided() const { return decided_; }
  // Steps record() did not count (`settled` false).
  int unsettled() const { return unsettled_; }

 private:
  static double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }

  Mode mode_;
  int counted_ = 0, unsettled_ = 0;
  bool decided_ = false, chosen_ = true;
  std::vector<double> deferred_, plain_;
};

}  // namespace strata
