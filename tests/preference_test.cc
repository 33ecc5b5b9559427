// DPO's sigmoid loss (src/train/preference.h) on the host: one pair's loss and derivative at
// z = 0, far out (|z| = 1000, no overflow) and with label smoothing, against the formula written
// here; DpoRowWeights' factors against a central difference of the batch's mean loss in each
// row's per-token losses (their signs, the pairing, the scale); DpoSums and dpo_metrics' means
// and accuracy.
#include "src/train/preference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace strata {
namespace {

// -log sigma(x) by the textbook formula, fine for the moderate x used against it.
double nls(double x) { return std::log1p(std::exp(-x)); }
double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(DpoPair, AtZeroTheLossIsLn2AndTheSlopeMinusOneHalf) {
  // Policy and reference agree on both sequences: z = 0.
  for (double eps : {0.0, 0.1, 0.3}) {
    const DpoPair p = dpo_pair(3.5, 7.25, -3.5, -7.25, 0.1, eps);
    EXPECT_DOUBLE_EQ(p.z, 0.0) << eps;
    EXPECT_DOUBLE_EQ(p.reward_chosen, 0.0);
    EXPECT_DOUBLE_EQ(p.reward_rejected, 0.0);
    EXPECT_NEAR(p.loss, std::log(2.0), 1e-15) << eps;
    // -(1 - eps)/2 + eps/2.
    EXPECT_NEAR(p.dloss_dz, -0.5 + eps, 1e-15) << eps;
  }
}

TEST(DpoPair, RewardsZAndLossFollowTheFormula) {
  const double beta = 0.25, nll_c = 10.0, nll_r = 14.0, ref_c = -11.0, ref_r = -12.0;
  for (double eps : {0.0, 0.1}) {
    const DpoPair p = dpo_pair(nll_c, nll_r, ref_c, ref_r, beta, eps);
    // log pi(c) = -10, log ref(c) = -11: reward 0.25; log pi(r) = -14, log ref(r) = -12: -0.5.
    EXPECT_NEAR(p.reward_chosen, 0.25, 1e-15);
    EXPECT_NEAR(p.reward_rejected, -0.5, 1e-15);
    EXPECT_NEAR(p.z, 0.75, 1e-15);
    EXPECT_NEAR(p.loss, (1 - eps) * nls(0.75) + eps * nls(-0.75), 1e-14) << eps;
    EXPECT_NEAR(p.dloss_dz, -(1 - eps) * sig(-0.75) + eps * sig(0.75), 1e-14) << eps;
    // The derivative against a central difference in z (through nll_c: dz = -beta dnll_c).
    const double h = 1e-4;
    const double up = dpo_pair(nll_c - h, nll_r, ref_c, ref_r, beta, eps).loss;
    const double down = dpo_pair(nll_c + h, nll_r, ref_c, ref_r, beta, eps).loss;
    EXPECT_NEAR((up - down) / (2 * h * beta), p.dloss_dz, 1e-8) << eps;
  }
}

TEST(DpoPair, FarOutNoOverflow) {
  // z = +1000: the pair is won, the loss ~0 (eps 0) or ~ eps * 1000 (the smoothed side), the
  // slope ~0 or ~eps; z = -1000: loss ~ (1 - eps) * 1000, slope ~ -(1 - eps).
  for (double eps : {0.0, 0.1}) {
    const DpoPair won = dpo_pair(0.0, 10000.0, 0.0, 0.0, 0.1, eps);
    ASSERT_NEAR(won.z, 1000.0, 1e-9);
    EXPECT_TRUE(std::isfinite(won.loss) && std::isfinite(won.dloss_dz));
    EXPECT_NEAR(won.loss, eps * 1000.0, 1e-9) << eps;
    EXPECT_NEAR(won.dloss_dz, eps, 1e-15) << eps;
    const DpoPair lost = dpo_pair(10000.0, 0.0, 0.0, 0.0, 0.1, eps);
    ASSERT_NEAR(lost.z, -1000.0, 1e-9);
    EXPECT_TRUE(std::isfinite(lost.loss) && std::isfinite(lost.dloss_dz));
    EXPECT_NEAR(lost.loss, (1 - eps) * 1000.0, 1e-9) << eps;
    EXPECT_NEAR(lost.dloss_dz, -(1 - eps), 1e-15) << eps;
  }
}

TEST(DpoPair, RowLossSumAddsInDoubleAndRoundsOnceToFp32) {
  const float t[4] = {1e8f, 1.0f, -1e8f, 0.5f};
  EXPECT_EQ(row_loss_sum(t, 4), 1.5);
  EXPECT_EQ(row_loss_sum(t, 0), 0.0);
  // 1 + 3e-8 is 1 in fp32, as the reference's kept values are.
  const float u[2] = {1.0f, 3e-8f};
  EXPECT_EQ(row_loss_sum(u, 2), 1.0);
}

// B rows of T per-token losses (some 0: ignored targets) and the rows' reference
// log-probabilities, drawn so that both signs of z occur.
struct Batch {
  int B, T;
  std::vector<float> losses, ref;
};

Batch draw(int B, int T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.5f, 4.0f);
  Batch b{B, T, std::vector<float>(size_t(B) * T), std::vector<float>(size_t(B))};
  for (int r = 0; r < B; ++r) {
    double sum = 0;
    for (int t = 0; t < T; ++t) {
      const float l = t < 3 || t >= T - 2 ? 0.0f : u(rng);  // prompt and padding: 0
      b.losses[size_t(r) * T + t] = l;
      sum += l;
    }
    // The reference a few nats from the policy, one way or the other by pair.
    const double shift = ((r / 2) % 2 == 0 ? 1.0 : -1.0) * (r % 2 == 0 ? 6.0 : -6.0);
    b.ref[size_t(r)] = float(-sum + shift);
  }
  return b;
}

double mean_loss(const Batch& b, double beta, double eps) {
  DpoSums s;
  s.add(b.losses.data(), b.ref.data(), b.B, b.T, beta, eps);
  return dpo_metrics(s).loss;
}

TEST(DpoRowWeights, AreTheMeanLossesDerivativeInEachRowsTokenLosses) {
  const int B = 6, T = 11;
  for (double eps : {0.0, 0.1}) {
    Batch b = draw(B, T, 7);
    const double beta = 0.1;
    // The mean over the batch's pairs: scale 1 / pairs.
    const DpoRowWeights w(beta, eps, 1.0 / (B / 2), b.ref.data());
    std::vector<float> weights(B, -99.0f);
    w.weigh(b.losses.data(), B, T, weights.data());
    int positive_z = 0;
    for (int r = 0; r < B; ++r) {
      SCOPED_TRACE("eps " + std::to_string(eps) + ", row " + std::to_string(r));
      // Raising any one of the row's counted tokens' loss moves the row's sum by as much.
      const size_t i = size_t(r) * T + 5;
      const float keep = b.losses[i];
      b.losses[i] = keep + 1.0f / 64;
      const double up = mean_loss(b, beta, eps), hi = b.losses[i];
      b.losses[i] = keep - 1.0f / 64;
      const double down = mean_loss(b, beta, eps), lo = b.losses[i];
      b.losses[i] = keep;
      const double fd = (up - down) / (hi - lo);
      EXPECT_NEAR(weights[size_t(r)], fd, 1e-6 * std::fabs(fd) + 1e-9);
      // A chosen row's (even) weight is positive (a step lowers its loss), its rejected
      // partner's the opposite, while sigma(z) is below 1 - eps.
      if (r % 2 == 0) {
        const DpoPair p = dpo_pair(row_loss_sum(&b.losses[size_t(r) * T], T),
                                   row_loss_sum(&b.losses[size_t(r + 1) * T], T), b.ref[size_t(r)],
                                   b.ref[size_t(r + 1)], beta, eps);
        positive_z += p.z > 0;
        EXPECT_GT(weights[size_t(r)], 0.0f);
        EXPECT_EQ(weights[size_t(r) + 1], -weights[size_t(r)]) << "a pair's weights are opposite";
      }
    }
    EXPECT_GT(positive_z, 0) << "the batch should have pairs on both sides of z = 0";
    EXPECT_LT(positive_z, B / 2);
    // The scale multiplies every weight.
    std::vector<float> doubled(B);
    DpoRowWeights(beta, eps, 2.0 / (B / 2), b.ref.data())
        .weigh(b.losses.data(), B, T, doubled.data());
    for (int r = 0; r < B; ++r) EXPECT_FLOAT_EQ(doubled[size_t(r)], 2.0f * weights[size_t(r)]);
  }
}

TEST(DpoRowWeights, PairsAreAdjacentRows) {
  // Each pair's weights come from its two rows alone: pair 0's are those of rows 0 and 1 as a
  // batch of their own.
  Batch b = draw(4, 9, 3);
  std::vector<float> w4(4), w2(2);
  DpoRowWeights(0.1, 0.1, 1.0, b.ref.data()).weigh(b.losses.data(), 4, 9, w4.data());
  DpoRowWeights(0.1, 0.1, 1.0, b.ref.data()).weigh(b.losses.data(), 2, 9, w2.data());
  EXPECT_EQ(w4[0], w2[0]);
  EXPECT_EQ(w4[1], w2[1]);
  // Pair 1's weights are its own: rows 2 and 3 alone, as a batch of one pair.
  std::vector<float> w1(2);
  DpoRowWeights(0.1, 0.1, 1.0, b.ref.data() + 2).weigh(b.losses.data() + 18, 2, 9, w1.data());
  EXPECT_EQ(w4[2], w1[0]);
  EXPECT_EQ(w4[3], w1[1]);
}

TEST(DpoSums, MeansAndAccuracy) {
  // Three pairs, as two calls (a batch of 4 rows, then one of 2): z > 0, z < 0, z > 0.
  const int T = 2;
  const float a[8] = {1, 1, 3, 2, /**/ 4, 0, 1, 1};  // sums 2, 5 | 4, 2
  const float ref_a[4] = {-3, -4, -2, -3};
  const float c[4] = {0.5f, 0.5f, 2, 2};  // sums 1, 4
  const float ref_c[2] = {-1, -1};
  const double beta = 0.5, eps = 0.1;
  DpoSums s;
  s.add(a, ref_a, 4, T, beta, eps);
  s.add(c, ref_c, 2, T, beta, eps);
  EXPECT_EQ(s.pairs, 3.0);
  EXPECT_EQ(s.correct, 2.0);
  // Rewards: beta (-nll - ref).
  const double rc[3] = {0.5 * (-2 + 3), 0.5 * (-4 + 2), 0.5 * (-1 + 1)};
  const double rr[3] = {0.5 * (-5 + 4), 0.5 * (-2 + 3), 0.5 * (-4 + 1)};
  double loss = 0;
  for (int j = 0; j < 3; ++j) {
    const double z = rc[j] - rr[j];
    loss += (1 - eps) * nls(z) + eps * nls(-z);
  }
  const DpoMetrics m = dpo_metrics(s);
  EXPECT_NEAR(m.loss, loss / 3, 1e-14);
  EXPECT_NEAR(m.reward_chosen, (rc[0] + rc[1] + rc[2]) / 3, 1e-14);
  EXPECT_NEAR(m.reward_rejected, (rr[0] + rr[1] + rr[2]) / 3, 1e-14);
  EXPECT_NEAR(m.margin(), m.reward_chosen - m.reward_rejected, 1e-15);
  EXPECT_DOUBLE_EQ(m.accuracy, 2.0 / 3.0);
  // No pairs: zeros, no division by zero.
  const DpoMetrics none = dpo_metrics(DpoSums{});
  EXPECT_EQ(none.loss, 0.0);
  EXPECT_EQ(none.accuracy, 0.0);
}

}  // namespace
}  // namespace strata
