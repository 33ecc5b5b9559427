// Preference training: DPO's family of losses over pairs of sequences (TRL's DPOTrainer: its
// loss_type list with loss_weights, f_divergence_type, label_smoothing, discopop_tau), for data
// that holds preference pairs (tools/prepare_data.py --format preference; src/train/data.h's
// pair batches: row 2j is pair j's chosen sequence, row 2j + 1 its rejected one).
//
// A sequence's log-probability is the sum of its completion's token log-probabilities, minus
// the sum of the per-token losses the head computes (the ignored targets' are 0). With pi the
// policy (the model trained) and ref the reference (the run's initial model, whose sums are
// computed once before the first step), each sequence's log-ratio is
//   a = log pi(chosen) - log ref(chosen),   b = log pi(rejected) - log ref(rejected),
// its score f(a), f(b) (the f-divergence's f': the identity for reverse KL, DPO's own), and
// with d = f(a) - f(b) the default loss, DPO's sigmoid,
//   L = -(1 - eps) log sigma(beta d) - eps log sigma(-beta d)     (eps: cDPO's label smoothing)
// (dpo_loss_types() names the others, each TRL's formula). A micro-batch's loss is the mean over
// its pairs of the weighted sum of the loss types (aot's sort and sft's token mean span the
// micro-batch, as TRL's per-device batch); a step's, the mean of its micro-batches' (TRL's
// gradient accumulation and data parallelism). Its gradient reaches each token through its
// row's sum of per-token losses: every token of row r gets dL/d(sum of row r's losses), so each
// row's logits' gradient is the plain cross-entropy gradient times that row's weight
// (MicroBatch::row_weights).
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "src/model/architecture.h"
#include "strata/config.h"

namespace strata {

enum class DpoLossType {
  kSigmoid,
  kHinge,
  kIpo,
  kExoPair,
  kNcaPair,
  kRobust,
  kBcoPair,
  kSppoHard,
  kAot,
  kAotUnpaired,
  kApoZero,
  kApoDown,
  kDiscopop,
  kSft,
  kSigmoidNorm,
};
// TRL's names of the loss types (kDpoLossTypes), in DpoLossType's order.
const std::vector<std::string>& dpo_loss_types();

enum class FDivergence { kReverseKl, kForwardKl, kJsDivergence, kAlphaDivergence };
const std::vector<std::string>& f_divergence_types();  // kFDivergenceTypes, in order

// The loss a run trains with, from its dpo section (checked as the config was read).
struct DpoLoss {
  std::vector<std::pair<DpoLossType, double>> terms;  // each type and its weight
  double beta = 0.1, label_smoothing = 0.0, discopop_tau = 0.05;
  FDivergence f = FDivergence::kReverseKl;
  double alpha = 0.5;  // f_alpha_divergence_coef
};
DpoLoss dpo_loss_of(const DpoConfig& c);

// The loss of one micro-batch of rows/2 pairs, as the sum over its pairs (its pairs times
// TRL's mean): nll[r] is row r's sum of per-token losses, ref[r] its reference log-probability,
// count[r] its completion targets (ipo's and sigmoid_norm's per-token means, sft's token mean).
// drow (nullptr: not wanted) gets d sum / d nll[r] of each row, pair_loss (nullptr: not wanted)
// each pair's share of the sum (aot's: its sorted position's).
double dpo_micro_batch_loss(const DpoLoss& loss, const double* nll, const float* ref,
                            const float* count, int rows, double* drow, double* pair_loss);

// A row's sum of per-token losses, in order, in double, rounded to fp32 as the reference's
// values are kept (so a policy equal to the reference gives z = 0 exactly on the same rows).
double row_loss_sum(const float* token_losses, int T);

// A micro-batch's row weights: `ref` and `count` hold its B rows' reference log-probabilities and
// completion targets; `scale` (the loss scale over the pairs of the global batch, the ranks'
// included) multiplies every weight.
class DpoRowWeights final : public RowWeights {
 public:
  DpoRowWeights(const DpoLoss* loss, double scale, const float* ref, const float* count)
      : loss_(loss), scale_(scale), ref_(ref), count_(count) {}
  void weigh(const float* token_losses, int B, int T, float* weights) const override;

 private:
  const DpoLoss* loss_;
  double scale_;
  const float* ref_;
  const float* count_;
};

// Sums over pairs, for the loss and TRL's reward metrics.
struct DpoSums {
  double loss = 0, reward_chosen = 0, reward_rejected = 0, correct = 0, pairs = 0;
  double logp_chosen = 0, logp_rejected = 0;  // the policy's log-probabilities
  // Adds a micro-batch of `rows` rows of per-token losses against their reference
  // log-probabilities and completion targets: its loss weighs as its pairs.
  void add(const DpoLoss& loss, const float* token_losses, const float* ref, const float* count,
           int rows, int T);
};

// The means a report shows: the loss and rewards per pair, accuracy = the share of pairs whose
// chosen reward beta a is above the rejected one's beta b (TRL's rewards/*), the policy's
// log-probabilities of the chosen and rejected sequences (TRL's logps/*).
struct DpoMetrics {
  double loss = 0, reward_chosen = 0, reward_rejected = 0, accuracy = 0;
  double logp_chosen = 0, logp_rejected = 0;
  double margin() const { return reward_chosen - reward_rejected; }
};
DpoMetrics dpo_metrics(const DpoSums& s);

}  // namespace strata
