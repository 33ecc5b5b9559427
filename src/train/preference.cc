#include "src/train/preference.h"

#include <algorithm>
#include <cmath>

namespace strata {
namespace {

// log(1 + e^x) without overflow.
double softplus(double x) { return std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))); }

double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

}  // namespace

DpoPair dpo_pair(double nll_chosen, double nll_rejected, double ref_chosen, double ref_rejected,
                 double beta, double label_smoothing) {
  DpoPair p;
  p.reward_chosen = beta * (-nll_chosen - ref_chosen);
  p.reward_rejected = beta * (-nll_rejected - ref_rejected);
  p.z = p.reward_chosen - p.reward_rejected;
  // -log sigma(z) = softplus(-z).
  p.loss = (1.0 - label_smoothing) * softplus(-p.z) + label_smoothing * softplus(p.z);
  p.dloss_dz = -(1.0 - label_smoothing) * sigmoid(-p.z) + label_smoothing * sigmoid(p.z);
  return p;
}

double row_loss_sum(const float* token_losses, int T) {
  double sum = 0;
  for (int t = 0; t < T; ++t) sum += double(token_losses[t]);
  return double(static_cast<float>(sum));
}

void DpoRowWeights::weigh(const float* token_losses, int B, int T, float* weights) const {
  for (int j = 0; j + 1 < B; j += 2) {
    const double c = row_loss_sum(token_losses + size_t(j) * size_t(T), T);
    const double r = row_loss_sum(token_losses + size_t(j + 1) * size_t(T), T);
    const DpoPair p = dpo_pair(c, r, ref_[j], ref_[j + 1], beta_, label_smoothing_);
    // z falls as the chosen sequence's loss sum rises: dz/dc = -beta, dz/dr = +beta.
    weights[j] = static_cast<float>(-beta_ * p.dloss_dz * scale_);
    weights[j + 1] = static_cast<float>(beta_ * p.dloss_dz * scale_);
  }
}

void DpoSums::add(const float* token_losses, const float* ref, int B, int T, double beta,
                  double label_smoothing) {
  for (int j = 0; j + 1 < B; j += 2) {
    const double c = row_loss_sum(token_losses + size_t(j) * size_t(T), T);
    const double r = row_loss_sum(token_losses + size_t(j + 1) * size_t(T), T);
    const DpoPair p = dpo_pair(c, r, ref[j], ref[j + 1], beta, label_smoothing);
    loss += p.loss;
    reward_chosen += p.reward_chosen;
    reward_rejected += p.reward_rejected;
    correct += p.reward_chosen > p.reward_rejected ? 1.0 : 0.0;
    pairs += 1.0;
  }
}

DpoMetrics dpo_metrics(const DpoSums& s) {
  DpoMetrics m;
  if (s.pairs <= 0) return m;
  m.loss = s.loss / s.pairs;
  m.reward_chosen = s.reward_chosen / s.pairs;
  m.reward_rejected = s.reward_rejected / s.pairs;
  m.accuracy = s.correct / s.pairs;
  return m;
}

}  // namespace strata
