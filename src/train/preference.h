// Preference training: DPO's sigmoid loss over pairs of sequences (TRL's DPOTrainer with
// loss_type "sigmoid", label_smoothing for cDPO), for data that holds preference pairs
// (tools/prepare_data.py --format preference; src/train/data.h's pair batches: row 2j is pair
// j's chosen sequence, row 2j + 1 its rejected one).
//
// A sequence's log-probability is the sum of its completion's token log-probabilities, minus
// the sum of the per-token losses the head computes (the ignored targets' are 0). With pi the
// policy (the model trained) and ref the reference (the run's initial model, whose sums are
// computed once before the first step),
//   z = beta ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))
//   L = -(1 - eps) log sigma(z) - eps log sigma(-z)             (eps: dpo.label_smoothing)
// and the batch's loss is the mean over its pairs. Its gradient reaches each token through its
// sequence's sum: dL/d(sum of c's losses) = -beta dL/dz, for r +beta dL/dz, so each row's
// logits' gradient is the plain cross-entropy gradient times that row's weight
// (MicroBatch::row_weights).
#pragma once

#include <cstddef>
#include <vector>

#include "src/model/architecture.h"

namespace strata {

// One pair's terms from its sequences' loss sums (minus log-probabilities) and the
// reference's log-probabilities.
struct DpoPair {
  double z = 0;
  double loss = 0;
  double dloss_dz = 0;
  double reward_chosen = 0, reward_rejected = 0;  // beta (log pi - log ref), TRL's rewards
};
DpoPair dpo_pair(double nll_chosen, double nll_rejected, double ref_chosen, double ref_rejected,
                 double beta, double label_smoothing);

// A row's sum of per-token losses, in order, in double, rounded to fp32 as the reference's
// values are kept (so a policy equal to the reference gives z = 0 exactly on the same rows).
double row_loss_sum(const float* token_losses, int T);

// A micro-batch's row weights: `ref` holds its B rows' reference log-probabilities; `scale`
// (the loss scale over the pairs of the global batch) multiplies every weight.
class DpoRowWeights final : public RowWeights {
 public:
  DpoRowWeights(double beta, double label_smoothing, double scale, const float* ref)
      : beta_(beta), label_smoothing_(label_smoothing), scale_(scale), ref_(ref) {}
  void weigh(const float* token_losses, int B, int T, float* weights) const override;

 private:
  double beta_, label_smoothing_, scale_;
  const float* ref_;
};

// Sums over pairs, for the loss and TRL's reward metrics.
struct DpoSums {
  double loss = 0, reward_chosen = 0, reward_rejected = 0, correct = 0, pairs = 0;
  // Adds the pairs of B rows of per-token losses against their reference log-probabilities.
  void add(const float* token_losses, const float* ref, int B, int T, double beta,
           double label_smoothing);
};

// The means a report shows: the loss and rewards per pair, accuracy = the share of pairs whose
// chosen reward is above the rejected one (TRL's rewards/accuracies).
struct DpoMetrics {
  double loss = 0, reward_chosen = 0, reward_rejected = 0, accuracy = 0;
  double margin() const { return reward_chosen - reward_rejected; }
};
DpoMetrics dpo_metrics(const DpoSums& s);

}  // namespace strata
