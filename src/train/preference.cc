#include "src/train/preference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace strata {
namespace {

// log(1 + e^x) without overflow.
double softplus(double x) { return std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))); }

double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

// sigma'(x) = sigma(x) sigma(-x).
double dsigmoid(double x) { return sigmoid(x) * sigmoid(-x); }

// TRL's clamp of the alpha divergence's exponent (fp32's and bf16's; the fp16 bound is lower).
constexpr double kAlphaClamp = 80.0;

// A log-ratio's score f(x) and its slope f'(x) (DPOTrainer's f_divergence_type).
struct Score {
  double f, df;
};
Score score(const DpoLoss& l, double x) {
  switch (l.f) {
    case FDivergence::kReverseKl:
      return {x, 1.0};
    case FDivergence::kForwardKl:  // f'(t) = 1 - 1/t, t = e^x
      return {1.0 - std::exp(-x), std::exp(-x)};
    case FDivergence::kJsDivergence:  // log 2t/(t + 1) = log 2 + log sigma(x)
      return {std::log(2.0) - softplus(-x), sigmoid(-x)};
    case FDivergence::kAlphaDivergence: {
      if (std::fabs(l.alpha - 1.0) < 1e-6) return {x, 1.0};  // the limit: reverse KL
      const double t = (l.alpha - 1.0) * x, c = 1.0 / (l.alpha - 1.0);
      return {(std::exp(std::min(t, kAlphaClamp)) - 1.0) * c, t <= kAlphaClamp ? std::exp(t) : 0.0};
    }
  }
  return {x, 1.0};
}

// One pair's loss under one pair-local loss type and its derivatives in the log-ratios a
// (chosen) and b (rejected). nc, nr: the rows' completion targets (at least 1).
struct PairTerm {
  double loss, da, db;
};

// Loss types whose value is a function g(z) of z = beta (f(a) - f(b)): g and dg/dz.
struct OfZ {
  double loss, dz;
};
OfZ of_z(DpoLossType t, const DpoLoss& l, double z) {
  const double eps = l.label_smoothing;
  switch (t) {
    case DpoLossType::kSigmoid:  // cDPO with eps > 0 (TRL's sigmoid before 1.0)
    case DpoLossType::kAot:
    case DpoLossType::kAotUnpaired:
      return {(1.0 - eps) * softplus(-z) + eps * softplus(z),
              -(1.0 - eps) * sigmoid(-z) + eps * sigmoid(z)};
    case DpoLossType::kHinge:
      return {std::max(0.0, 1.0 - z), 1.0 - z > 0.0 ? -1.0 : 0.0};
    case DpoLossType::kExoPair: {
      const double log_pw = std::log1p(-eps), log_pl = std::log(eps);
      return {sigmoid(z) * (-softplus(-z) - log_pw) + sigmoid(-z) * (-softplus(z) - log_pl),
              dsigmoid(z) * (z - log_pw + log_pl)};
    }
    case DpoLossType::kRobust:
      return {((1.0 - eps) * softplus(-z) - eps * softplus(z)) / (1.0 - 2.0 * eps),
              (-(1.0 - eps) * sigmoid(-z) - eps * sigmoid(z)) / (1.0 - 2.0 * eps)};
    case DpoLossType::kDiscopop: {
      // e^-z m and e^-z m' through their logs: far below z = 0, e^-z overflows where m and m'
      // (sigmoids of z / tau) have long since underflowed; the products are finite (and 0).
      const double tau = l.discopop_tau, m = sigmoid(z / tau), s = softplus(-z);
      const double log_m = -softplus(-z / tau), log_dm = log_m - softplus(z / tau) - std::log(tau);
      const double em = std::exp(-z + log_m), edm = std::exp(-z + log_dm);
      const double sdm = s * std::exp(log_dm);
      return {s * (1.0 - m) + em, -sigmoid(-z) * (1.0 - m) + edm - sdm - em};
    }
    default:
      return {0.0, 0.0};
  }
}

PairTerm pair_term(DpoLossType t, const DpoLoss& l, double a, double b, double nc, double nr) {
  const double beta = l.beta;
  switch (t) {
    case DpoLossType::kSigmoid:
    case DpoLossType::kHinge:
    case DpoLossType::kExoPair:
    case DpoLossType::kRobust:
    case DpoLossType::kDiscopop: {
      const Score sa = score(l, a), sb = score(l, b);
      // beta f(a) - beta f(b): the rewards' difference as written before any f-divergence.
      const OfZ g = of_z(t, l, beta * sa.f - beta * sb.f);
      return {g.loss, beta * g.dz * sa.df, -beta * g.dz * sb.df};
    }
    case DpoLossType::kIpo:
    case DpoLossType::kSigmoidNorm: {
      const Score sa = score(l, a), sb = score(l, b);
      const double u = sa.f / nc - sb.f / nr;
      double loss, du;
      if (t == DpoLossType::kIpo) {
        const double e = u - 1.0 / (2.0 * beta);
        loss = e * e;
        du = 2.0 * e;
      } else {
        loss = softplus(-beta * u);
        du = -beta * sigmoid(-beta * u);
      }
      return {loss, du * sa.df / nc, -du * sb.df / nr};
    }
    case DpoLossType::kNcaPair: {
      const double cr = beta * a, rr = beta * b;
      return {softplus(-cr) + 0.5 * softplus(cr) + 0.5 * softplus(rr),
              beta * (-sigmoid(-cr) + 0.5 * sigmoid(cr)), 0.5 * beta * sigmoid(rr)};
    }
    case DpoLossType::kBcoPair:
      return {softplus(-beta * a) + softplus(beta * b), -beta * sigmoid(-beta * a),
              beta * sigmoid(beta * b)};
    case DpoLossType::kSppoHard: {
      const double ea = a - 0.5 / beta, eb = b + 0.5 / beta;
      return {ea * ea + eb * eb, 2.0 * ea, 2.0 * eb};
    }
    case DpoLossType::kApoZero:
      return {1.0 - sigmoid(beta * a) + sigmoid(beta * b), -beta * dsigmoid(beta * a),
              beta * dsigmoid(beta * b)};
    case DpoLossType::kApoDown: {
      const double d = beta * (a - b);
      return {sigmoid(beta * a) + 1.0 - sigmoid(d), beta * dsigmoid(beta * a) - beta * dsigmoid(d),
              beta * dsigmoid(d)};
    }
    default:
      return {0.0, 0.0, 0.0};
  }
}

// The order of v's indices that sorts it (ties kept in index order).
std::vector<int> sorted_order(const std::vector<double>& v) {
  std::vector<int> o(v.size());
  std::iota(o.begin(), o.end(), 0);
  std::stable_sort(o.begin(), o.end(), [&](int i, int j) { return v[size_t(i)] < v[size_t(j)]; });
  return o;
}

int index_of(const std::vector<std::string>& names, const std::string& s) {
  const auto it = std::find(names.begin(), names.end(), s);
  return it == names.end() ? -1 : int(it - names.begin());
}

std::vector<std::string> names_of(const char* values) {
  std::vector<std::string> out(1);
  for (const char* c = values; *c; ++c) {
    if (*c == '|') {
      out.emplace_back();
    } else {
      out.back() += *c;
    }
  }
  return out;
}

}  // namespace

const std::vector<std::string>& dpo_loss_types() {
  static const std::vector<std::string> kNames = names_of(kDpoLossTypes);
  return kNames;
}

const std::vector<std::string>& f_divergence_types() {
  static const std::vector<std::string> kNames = names_of(kFDivergenceTypes);
  return kNames;
}

DpoLoss dpo_loss_of(const DpoConfig& c) {
  DpoLoss l;
  for (size_t i = 0; i < c.loss_type.size(); ++i) {
    const int t = std::max(0, index_of(dpo_loss_types(), c.loss_type[i]));
    l.terms.emplace_back(DpoLossType(t), c.loss_weights.empty() ? 1.0 : c.loss_weights[i]);
  }
  l.beta = c.beta;
  l.label_smoothing = c.label_smoothing;
  l.discopop_tau = c.discopop_tau;
  l.f = FDivergence(std::max(0, index_of(f_divergence_types(), c.f_divergence_type)));
  l.alpha = c.f_alpha_divergence_coef;
  return l;
}

double dpo_micro_batch_loss(const DpoLoss& l, const double* nll, const float* ref,
                            const float* count, int rows, double* drow, double* pair_loss) {
  const int P = rows / 2;
  // a, b: the pairs' log-ratios; da, db: d loss / d a, d b (loss: the sum over pairs).
  const size_t np = static_cast<size_t>(P);
  std::vector<double> a(np), b(np), da(np, 0.0), db(np, 0.0), losses(np, 0.0);
  for (int j = 0; j < P; ++j) {
    a[size_t(j)] = -nll[2 * j] - double(ref[2 * j]);
    b[size_t(j)] = -nll[2 * j + 1] - double(ref[2 * j + 1]);
  }
  double sft_rows = 0;  // the sft term's row weight: d(sum over pairs)/d nll of a chosen row
  for (const auto& [type, w] : l.terms) {
    if (type == DpoLossType::kAot || type == DpoLossType::kAotUnpaired) {
      // Sorted within the micro-batch: the i-th smallest policy value against the i-th
      // smallest reference value (aot: the pairs' log-ratio differences; aot_unpaired: the
      // chosen against the rejected log-ratios).
      const bool paired = type == DpoLossType::kAot;
      std::vector<double> x(np), y(np);
      for (int j = 0; j < P; ++j) {
        const double pc = -nll[2 * j], pr = -nll[2 * j + 1];
        x[size_t(j)] = paired ? pc - pr : a[size_t(j)];
        y[size_t(j)] = paired ? double(ref[2 * j]) - double(ref[2 * j + 1]) : b[size_t(j)];
      }
      const std::vector<int> ox = sorted_order(x), oy = sorted_order(y);
      for (int i = 0; i < P; ++i) {
        const int jx = ox[size_t(i)], jy = oy[size_t(i)];
        const OfZ g = of_z(type, l, l.beta * (x[size_t(jx)] - y[size_t(jy)]));
        losses[size_t(i)] += w * g.loss;
        // x = a - b (aot, both rows of pair jx) or a (aot_unpaired); y = b of pair jy there.
        da[size_t(jx)] += w * l.beta * g.dz;
        if (paired) {
          db[size_t(jx)] -= w * l.beta * g.dz;
        } else {
          db[size_t(jy)] -= w * l.beta * g.dz;
        }
      }
      continue;
    }
    if (type == DpoLossType::kSft) {
      // The mean next-token loss of the micro-batch's chosen completions, counted once per
      // pair (TRL expands it to every pair before its mean).
      double tokens = 0, sum = 0;
      for (int j = 0; j < P; ++j) {
        tokens += double(count[2 * j]);
        sum += nll[2 * j];
      }
      if (tokens <= 0) continue;
      for (int j = 0; j < P; ++j) losses[size_t(j)] += w * sum / tokens;
      sft_rows += w * double(P) / tokens;
      continue;
    }
    for (int j = 0; j < P; ++j) {
      const double nc = std::max(1.0, double(count[2 * j]));
      const double nr = std::max(1.0, double(count[2 * j + 1]));
      const PairTerm p = pair_term(type, l, a[size_t(j)], b[size_t(j)], nc, nr);
      losses[size_t(j)] += w * p.loss;
      da[size_t(j)] += w * p.da;
      db[size_t(j)] += w * p.db;
    }
  }
  double total = 0;
  for (int j = 0; j < P; ++j) {
    total += losses[size_t(j)];
    if (pair_loss) pair_loss[j] = losses[size_t(j)];
    if (drow) {
      // a = -nll(chosen) - ref: d/d nll = -d/d a.
      drow[2 * j] = -da[size_t(j)] + sft_rows;
      drow[2 * j + 1] = -db[size_t(j)];
    }
  }
  return total;
}

double row_loss_sum(const float* token_losses, int T) {
  double sum = 0;
  for (int t = 0; t < T; ++t) sum += double(token_losses[t]);
  return double(static_cast<float>(sum));
}

namespace {

std::vector<double> row_sums(const float* token_losses, int rows, int T) {
  std::vector<double> nll(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) nll[size_t(r)] = row_loss_sum(token_losses + size_t(r) * T, T);
  return nll;
}

}  // namespace

void DpoRowWeights::weigh(const float* token_losses, int B, int T, float* weights) const {
  const int rows = B - B % 2;
  const std::vector<double> nll = row_sums(token_losses, rows, T);
  std::vector<double> drow(static_cast<size_t>(rows));
  dpo_micro_batch_loss(*loss_, nll.data(), ref_, count_, rows, drow.data(), nullptr);
  for (int r = 0; r < rows; ++r) weights[r] = static_cast<float>(drow[size_t(r)] * scale_);
}

void DpoSums::add(const DpoLoss& l, const float* token_losses, const float* ref, const float* count,
                  int rows, int T) {
  rows -= rows % 2;
  const int P = rows / 2;
  const std::vector<double> nll = row_sums(token_losses, rows, T);
  std::vector<double> pl(static_cast<size_t>(P));
  dpo_micro_batch_loss(l, nll.data(), ref, count, rows, nullptr, pl.data());
  for (int j = 0; j < P; ++j) {
    // TRL's rewards: beta times each sequence's log-ratio, whatever the loss.
    const double rc = l.beta * (-nll[size_t(2 * j)] - double(ref[2 * j]));
    const double rr = l.beta * (-nll[size_t(2 * j + 1)] - double(ref[2 * j + 1]));
    loss += pl[size_t(j)];
    reward_chosen += rc;
    reward_rejected += rr;
    correct += rc > rr ? 1.0 : 0.0;
    pairs += 1.0;
    logp_chosen -= nll[size_t(2 * j)];
    logp_rejected -= nll[size_t(2 * j + 1)];
  }
}

DpoMetrics dpo_metrics(const DpoSums& s) {
  DpoMetrics m;
  if (s.pairs <= 0) return m;
  m.loss = s.loss / s.pairs;
  m.reward_chosen = s.reward_chosen / s.pairs;
  m.reward_rejected = s.reward_rejected / s.pairs;
  m.accuracy = s.correct / s.pairs;
  m.logp_chosen = s.logp_chosen / s.pairs;
  m.logp_rejected = s.logp_rejected / s.pairs;
  return m;
}

}  // namespace strata
