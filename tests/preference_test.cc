// DPO's losses (src/train/preference.h) on the host. The sigmoid loss at z = 0, far out
// (|z| = 1000, no overflow) and with label smoothing against the formula written here; every
// loss type, weighted sums of them and the f-divergences against TRL's own DPOTrainer code
// (tests/fixtures/dpo/losses.json, from tests/fixtures/dpo/make_losses.py): each micro-batch's
// loss and each row's derivative; DpoRowWeights' factors against a central difference of the
// batch's loss in each row's per-token losses (their signs, the pairing, the scale); DpoSums and
// dpo_metrics' means and accuracy.
#include "src/train/preference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace strata {
namespace {

// -log sigma(x) by the textbook formula, fine for the moderate x used against it.
double nls(double x) { return std::log1p(std::exp(-x)); }
double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

DpoLoss sigmoid_loss(double beta, double eps) {
  DpoConfig c;
  c.beta = beta;
  c.label_smoothing = eps;
  return dpo_loss_of(c);
}

// One pair's loss and the derivatives of its rows (chosen, rejected).
struct One {
  double loss, dc, dr;
};
One one_pair(const DpoLoss& l, double nll_c, double nll_r, float ref_c, float ref_r) {
  const double nll[2] = {nll_c, nll_r};
  const float ref[2] = {ref_c, ref_r}, count[2] = {1, 1};
  double drow[2];
  const double loss = dpo_micro_batch_loss(l, nll, ref, count, 2, drow, nullptr);
  return {loss, drow[0], drow[1]};
}

TEST(DpoLoss, SigmoidAtZeroIsLn2AndTheSlopeHalfBeta) {
  // Policy and reference agree on both sequences: z = 0.
  for (double eps : {0.0, 0.1, 0.3}) {
    const One p = one_pair(sigmoid_loss(0.1, eps), 3.5, 7.25, -3.5f, -7.25f);
    EXPECT_NEAR(p.loss, std::log(2.0), 1e-15) << eps;
    // dL/dz = -(1 - eps)/2 + eps/2; d nll(chosen) = -dz / beta.
    EXPECT_NEAR(p.dc, -0.1 * (-0.5 + eps), 1e-15) << eps;
    EXPECT_EQ(p.dr, -p.dc) << eps;
  }
}

TEST(DpoLoss, SigmoidFollowsTheFormula) {
  const double beta = 0.25, nll_c = 10.0, nll_r = 14.0;
  const float ref_c = -11.0f, ref_r = -12.0f;
  for (double eps : {0.0, 0.1}) {
    // log pi(c) = -10, log ref(c) = -11: reward 0.25; log pi(r) = -14, log ref(r) = -12: -0.5.
    const double z = 0.75;
    const One p = one_pair(sigmoid_loss(beta, eps), nll_c, nll_r, ref_c, ref_r);
    EXPECT_NEAR(p.loss, (1 - eps) * nls(z) + eps * nls(-z), 1e-14) << eps;
    EXPECT_NEAR(p.dc, -beta * (-(1 - eps) * sig(-z) + eps * sig(z)), 1e-14) << eps;
  }
}

TEST(DpoLoss, SigmoidFarOutNoOverflow) {
  // z = +1000: the pair is won, the loss ~0 (eps 0) or ~ eps * 1000 (the smoothed side);
  // z = -1000: loss ~ (1 - eps) * 1000, the chosen row's slope ~ beta (1 - eps).
  for (double eps : {0.0, 0.1}) {
    const One won = one_pair(sigmoid_loss(0.1, eps), 0.0, 10000.0, 0.0f, 0.0f);
    EXPECT_TRUE(std::isfinite(won.loss) && std::isfinite(won.dc));
    EXPECT_NEAR(won.loss, eps * 1000.0, 1e-9) << eps;
    EXPECT_NEAR(won.dc, -0.1 * eps, 1e-15) << eps;
    const One lost = one_pair(sigmoid_loss(0.1, eps), 10000.0, 0.0, 0.0f, 0.0f);
    EXPECT_TRUE(std::isfinite(lost.loss) && std::isfinite(lost.dc));
    EXPECT_NEAR(lost.loss, (1 - eps) * 1000.0, 1e-9) << eps;
    EXPECT_NEAR(lost.dc, 0.1 * (1 - eps), 1e-15) << eps;
  }
}

TEST(DpoLoss, EveryLossTypeStaysFiniteFarOut) {
  // Log-ratios of +-500 nats (z = +-100 at beta 0.1, discopop's e^-z far past fp64's range at
  // beta 2): every loss type's value and row derivatives are finite, each alone and summed.
  for (const std::string& t : dpo_loss_types()) {
    for (double beta : {0.1, 2.0}) {
      DpoConfig c;
      c.loss_type = {t};
      c.beta = beta;
      c.label_smoothing = t == "exo_pair" ? 1e-3 : 0.1;
      const DpoLoss l = dpo_loss_of(c);
      for (double d : {-500.0, 500.0}) {
        const double nll[4] = {100.0 - d, 100.0 + d, 50.0 + d, 50.0 - d};
        const float ref[4] = {-100, -100, -50, -50}, count[4] = {7, 9, 3, 5};
        double drow[4], pl[2];
        const double loss = dpo_micro_batch_loss(l, nll, ref, count, 4, drow, pl);
        SCOPED_TRACE(t + " beta " + std::to_string(beta) + " d " + std::to_string(d));
        EXPECT_TRUE(std::isfinite(loss)) << loss;
        for (double g : drow) EXPECT_TRUE(std::isfinite(g)) << g;
      }
    }
  }
}

TEST(DpoLoss, RowLossSumAddsInDoubleAndRoundsOnceToFp32) {
  const float t[4] = {1e8f, 1.0f, -1e8f, 0.5f};
  EXPECT_EQ(row_loss_sum(t, 4), 1.5);
  EXPECT_EQ(row_loss_sum(t, 0), 0.0);
  // 1 + 3e-8 is 1 in fp32, as the reference's kept values are.
  const float u[2] = {1.0f, 3e-8f};
  EXPECT_EQ(row_loss_sum(u, 2), 1.0);
}

// The dpo section of a fixture case (TRL's DPOConfig keys) as strata's.
DpoConfig config_of(const nlohmann::json& d) {
  DpoConfig c;
  c.loss_type = d.at("loss_type").get<std::vector<std::string>>();
  if (d.contains("loss_weights")) c.loss_weights = d["loss_weights"].get<std::vector<double>>();
  c.beta = d.value("beta", 0.1);
  c.label_smoothing = d.value("label_smoothing", 0.0);
  c.f_divergence_type = d.value("f_divergence_type", std::string("reverse_kl"));
  c.f_alpha_divergence_coef = d.value("f_alpha_divergence_coef", 0.5);
  c.discopop_tau = d.value("discopop_tau", 0.05);
  return c;
}

TEST(DpoLoss, EveryLossTypeMatchesTrl) {
  std::ifstream f(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/dpo/losses.json");
  ASSERT_TRUE(f) << "tests/fixtures/dpo/losses.json";
  const nlohmann::json fx = nlohmann::json::parse(f);
  std::set<std::string> seen;
  for (const nlohmann::json& c : fx["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const DpoConfig cfg = config_of(c["dpo"]);
    for (const std::string& t : cfg.loss_type) seen.insert(t);
    const DpoLoss loss = dpo_loss_of(cfg);
    // TRL's alpha divergence runs in fp32, and EXO takes the logs of epsilon in fp32 (a
    // torch.tensor of the float): their values are that close.
    const bool exo = std::count(cfg.loss_type.begin(), cfg.loss_type.end(), "exo_pair") > 0;
    const double tol = cfg.f_divergence_type == "alpha_divergence" ? 2e-5 : (exo ? 1e-7 : 1e-10);
    for (const nlohmann::json& b : c["batches"]) {
      const std::vector<double> nll = b["nll"];
      const std::vector<double> ref64 = b["ref"], count64 = b["count"], want = b["drow"];
      const int rows = int(nll.size()), pairs = rows / 2;
      // The reference's values are fp32 ones (as strata keeps them).
      const size_t n = nll.size();
      std::vector<float> ref(n), count(n);
      for (int r = 0; r < rows; ++r) {
        ref[size_t(r)] = float(ref64[size_t(r)]);
        ASSERT_EQ(double(ref[size_t(r)]), ref64[size_t(r)]);
        count[size_t(r)] = float(count64[size_t(r)]);
      }
      std::vector<double> drow(n);
      const double sum = dpo_micro_batch_loss(loss, nll.data(), ref.data(), count.data(), rows,
                                              drow.data(), nullptr);
      // TRL's loss is the mean over the micro-batch's pairs; strata's the sum.
      const double trl_loss = b["loss"];
      EXPECT_NEAR(sum / pairs, trl_loss, tol * std::max(1.0, std::fabs(trl_loss)));
      for (int r = 0; r < rows; ++r) {
        const double w = want[size_t(r)] * pairs;
        EXPECT_NEAR(drow[size_t(r)], w, tol * std::max(1.0, std::fabs(w))) << "row " << r;
      }
    }
  }
  // Every loss type strata names is checked against TRL.
  for (const std::string& t : dpo_loss_types()) EXPECT_TRUE(seen.count(t)) << t;
  EXPECT_EQ(seen.size(), dpo_loss_types().size());
}

// B rows of T per-token losses (some 0: ignored targets), the rows' reference
// log-probabilities, drawn so that both signs of z occur, and their completion targets.
struct Batch {
  int B, T;
  std::vector<float> losses, ref, count;
};

Batch draw(int B, int T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.5f, 4.0f);
  Batch b{B, T, std::vector<float>(size_t(B) * T), std::vector<float>(size_t(B)),
          std::vector<float>(size_t(B))};
  for (int r = 0; r < B; ++r) {
    double sum = 0;
    for (int t = 0; t < T; ++t) {
      const float l = t < 3 || t >= T - 2 ? 0.0f : u(rng);  // prompt and padding: 0
      b.losses[size_t(r) * T + t] = l;
      sum += l;
    }
    // The reference a few nats from the policy, one way or the other by pair, by another
    // amount for each row (no ties for aot's sorts).
    const double shift = ((r / 2) % 2 == 0 ? 1.0 : -1.0) * (r % 2 == 0 ? 6.0 : -6.0) + 0.7 * r;
    b.ref[size_t(r)] = float(-sum + shift);
    b.count[size_t(r)] = float(T - 5);
  }
  return b;
}

double mean_loss(const DpoLoss& l, const Batch& b) {
  DpoSums s;
  s.add(l, b.losses.data(), b.ref.data(), b.count.data(), b.B, b.T);
  return dpo_metrics(s).loss;
}

// Each loss type, and a weighted sum with a batch-wide one, through the row weights.
std::vector<DpoConfig> configs() {
  std::vector<DpoConfig> out;
  for (const std::string& t : dpo_loss_types()) {
    DpoConfig c;
    c.loss_type = {t};
    c.label_smoothing = t == "exo_pair" ? 1e-3 : (t == "sigmoid" || t == "robust" ? 0.1 : 0.0);
    c.beta = t == "discopop" ? 0.01 : 0.1;
    out.push_back(c);
  }
  DpoConfig mpo;
  mpo.loss_type = {"sigmoid", "bco_pair", "sft"};
  mpo.loss_weights = {0.8, 0.2, 1.0};
  out.push_back(mpo);
  DpoConfig js;
  js.loss_type = {"ipo"};
  js.f_divergence_type = "js_divergence";
  out.push_back(js);
  return out;
}

TEST(DpoRowWeights, AreTheMeanLossesDerivativeInEachRowsTokenLosses) {
  const int B = 6, T = 11;
  for (const DpoConfig& c : configs()) {
    std::string name;
    for (const std::string& t : c.loss_type) name += t + " ";
    SCOPED_TRACE(name + c.f_divergence_type);
    const DpoLoss l = dpo_loss_of(c);
    Batch b = draw(B, T, 7);
    // The mean over the batch's pairs: scale 1 / pairs.
    const DpoRowWeights w(&l, 1.0 / (B / 2), b.ref.data(), b.count.data());
    std::vector<float> weights(B, -99.0f);
    w.weigh(b.losses.data(), B, T, weights.data());
    for (int r = 0; r < B; ++r) {
      SCOPED_TRACE("row " + std::to_string(r));
      // Raising any one of the row's counted tokens' loss moves the row's sum by as much.
      const size_t i = size_t(r) * T + 5;
      const float keep = b.losses[i];
      b.losses[i] = keep + 1.0f / 64;
      const double up = mean_loss(l, b), hi = b.losses[i];
      b.losses[i] = keep - 1.0f / 64;
      const double down = mean_loss(l, b), lo = b.losses[i];
      b.losses[i] = keep;
      const double fd = (up - down) / (hi - lo);
      EXPECT_NEAR(weights[size_t(r)], fd, 1e-4 * std::fabs(fd) + 1e-7);
    }
    // The scale multiplies every weight.
    std::vector<float> doubled(B);
    DpoRowWeights(&l, 2.0 / (B / 2), b.ref.data(), b.count.data())
        .weigh(b.losses.data(), B, T, doubled.data());
    for (int r = 0; r < B; ++r) EXPECT_FLOAT_EQ(doubled[size_t(r)], 2.0f * weights[size_t(r)]);
  }
}

TEST(DpoRowWeights, SigmoidPairsAreOppositeAndTheirOwn) {
  Batch b = draw(6, 11, 7);
  const DpoLoss l = sigmoid_loss(0.1, 0.1);
  std::vector<float> w6(6);
  DpoRowWeights(&l, 1.0, b.ref.data(), b.count.data()).weigh(b.losses.data(), 6, 11, w6.data());
  for (int r = 0; r < 6; r += 2) {
    // A chosen row's weight is positive (a step lowers its loss) while sigma(z) is below
    // 1 - eps, its rejected partner's the opposite.
    EXPECT_GT(w6[size_t(r)], 0.0f) << r;
    EXPECT_EQ(w6[size_t(r) + 1], -w6[size_t(r)]) << "a pair's weights are opposite";
  }
  // Pair 1's weights come from its two rows alone: rows 2 and 3 as a batch of one pair.
  std::vector<float> w1(2);
  DpoRowWeights(&l, 1.0, b.ref.data() + 2, b.count.data() + 2)
      .weigh(b.losses.data() + 22, 2, 11, w1.data());
  EXPECT_EQ(w6[2], w1[0]);
  EXPECT_EQ(w6[3], w1[1]);
}

TEST(DpoRowWeights, AotSortsWithinTheMicroBatch) {
  // aot pairs the i-th smallest policy log-ratio difference with the i-th smallest reference
  // one. Pair 0: policy 1 (nll 1 and 2), reference 4; pair 1: policy 0, reference 5. Sorted:
  // (0, 4) and (1, 5), both delta -4, where the sigmoid loss takes -3 and -5 pair by pair.
  const float losses[4] = {1, 2, 3, 3}, ref[4] = {-1, -5, -1, -6}, count[4] = {1, 1, 1, 1};
  DpoConfig c;
  c.loss_type = {"aot"};
  const double beta = c.beta;
  const DpoLoss aot = dpo_loss_of(c), sigmoid = sigmoid_loss(beta, 0.0);
  DpoSums sa, ss;
  sa.add(aot, losses, ref, count, 4, 1);
  ss.add(sigmoid, losses, ref, count, 4, 1);
  EXPECT_NEAR(dpo_metrics(sa).loss, nls(-4 * beta), 1e-15);
  EXPECT_NEAR(dpo_metrics(ss).loss, (nls(-3 * beta) + nls(-5 * beta)) / 2, 1e-15);
  std::vector<float> w(4);
  DpoRowWeights(&aot, 1.0, ref, count).weigh(losses, 4, 1, w.data());
  for (int r = 0; r < 4; ++r) {
    EXPECT_FLOAT_EQ(w[size_t(r)], float((r % 2 ? -1 : 1) * beta * sig(4 * beta))) << r;
  }
  // A micro-batch of one pair has nothing to sort: the sigmoid loss.
  std::vector<float> wa(2), ws(2);
  DpoRowWeights(&aot, 1.0, ref + 2, count).weigh(losses + 2, 2, 1, wa.data());
  DpoRowWeights(&sigmoid, 1.0, ref + 2, count).weigh(losses + 2, 2, 1, ws.data());
  EXPECT_EQ(wa, ws);
}

TEST(DpoSums, MeansAndAccuracy) {
  // Three pairs, as two calls (a batch of 4 rows, then one of 2): z > 0, z < 0, z > 0.
  const int T = 2;
  const float a[8] = {1, 1, 3, 2, /**/ 4, 0, 1, 1};  // sums 2, 5 | 4, 2
  const float ref_a[4] = {-3, -4, -2, -3}, count_a[4] = {2, 2, 2, 2};
  const float c[4] = {0.5f, 0.5f, 2, 2};  // sums 1, 4
  const float ref_c[2] = {-1, -1}, count_c[2] = {2, 2};
  const double beta = 0.5, eps = 0.1;
  const DpoLoss l = sigmoid_loss(beta, eps);
  DpoSums s;
  s.add(l, a, ref_a, count_a, 4, T);
  s.add(l, c, ref_c, count_c, 2, T);
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
