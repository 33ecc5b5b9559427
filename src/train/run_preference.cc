// Preference training (src/train/preference.h): the reference's log-probabilities of every pair
// before the first step, each step's row weights and DPO metrics, and the held-out DPO loss.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "src/tiers/tier_manager.h"
#include "src/train/data.h"
#include "src/train/preference.h"
#include "src/train/run.h"
#include "strata/log.h"

namespace strata::run_detail {

Status Run::check_preference_data() {
  if (!preference()) return Status::ok();
  if (B_ % 2 != 0) {
    return invalid_argument(fmt::format(
        "train_micro_batch_size_per_gpu is {}: preference pairs need an even micro-batch (each "
        "pair's chosen and rejected sequences are two rows of the same micro-batch)",
        B_));
  }
  dpo_loss_ = dpo_loss_of(cfg_.dpo);
  return Status::ok();
}

Status Run::pair_forward(bool eval_split, size_t first_pair) {
  const MicroBatch mb{0.0f, losses_.data(), nullptr, nullptr, 0, /*losses_out_pinned=*/true};
  tm_->begin_phase("eval");
  data_->pair_batch(eval_split, first_pair, B_, T_, tok_.data(), tgt_.data());
  model_->begin_batch(tok_.data(), tgt_.data(), nullptr);
  const std::string what = fmt::format("the pairs from {}", first_pair);
  STRATA_RETURN_IF_ERROR(run_program(Pass::kEval, 0, true, false, &mb), what);
  STRATA_RETURN_IF_ERROR(tm_->end_backward(), what);
  return tm_->end_phase().with_context("eval");
}

Status Run::reference_logps_of(bool eval_split, std::vector<float>* out,
                               std::vector<float>* counts) {
  const size_t pairs = eval_split ? data_->eval_pairs() : data_->train_pairs();
  out->assign(2 * pairs, 0.0f);
  counts->assign(2 * pairs, 0.0f);
  // Each rank takes B/2 pairs of each global batch; the sums of the others stay 0, so the
  // ranks' vectors add up to the whole.
  const size_t mine = size_t(B_) / 2, per_batch = mine * size_t(world_);
  const size_t batches = (pairs + per_batch - 1) / per_batch;
  auto last_note = Clock::now();
  const auto t0 = last_note;
  for (size_t i = 0; i < batches; ++i) {
    // One rank answers a stop at once (nothing is trained yet: no checkpoint to write); ranks
    // run the pass's collectives together, so with several it runs to its end.
    if (world_ == 1 && opts_.stop_signal && opts_.stop_signal->load() != 0) {
      return invalid_argument(
          "stopped during DPO's reference pass, before the first step: nothing was trained and "
          "no checkpoint was written; run again to train");
    }
    const size_t first = i * per_batch + size_t(rank_) * mine;
    STRATA_RETURN_IF_ERROR(pair_forward(eval_split, first), "");
    for (size_t j = 0; j < mine && first + j < pairs; ++j) {
      for (size_t k = 0; k < 2; ++k) {
        const float* row = losses_.data() + (2 * j + k) * size_t(T_);
        (*out)[2 * (first + j) + k] = static_cast<float>(-row_loss_sum(row, T_));
        const int32_t* tgt = tgt_.data() + (2 * j + k) * size_t(T_);
        (*counts)[2 * (first + j) + k] =
            float(std::count_if(tgt, tgt + T_, [](int32_t t) { return t >= 0; }));
      }
    }
    if (rank_ == 0 && seconds_since(last_note) > 10.0) {
      last_note = Clock::now();
      log_info("DPO: the reference's log-probabilities: {} of {} {} pairs ({:.0f} s)",
               std::min(pairs, (i + 1) * per_batch), pairs, eval_split ? "held-out" : "training",
               seconds_since(t0));
    }
  }
  STRATA_RETURN_IF_ERROR(reduce(out->data(), out->size(), ReduceOp::kSum), "");
  return reduce(counts->data(), counts->size(), ReduceOp::kSum);
}

Status Run::reference_logps() {
  if (rank_ == 0) {
    std::string loss;
    for (size_t i = 0; i < cfg_.dpo.loss_type.size(); ++i) {
      loss += (i ? " + " : "") +
              (cfg_.dpo.loss_weights.empty()
                   ? cfg_.dpo.loss_type[i]
                   : fmt::format("{} {}", cfg_.dpo.loss_weights[i], cfg_.dpo.loss_type[i]));
    }
    if (cfg_.dpo.f_divergence_type != "reverse_kl") {
      loss += fmt::format(", f-divergence {}", cfg_.dpo.f_divergence_type);
    }
    log_info(
        "DPO: {} preference pairs, {} held out; loss {}, beta {}, label_smoothing {}; the "
        "reference is the initial model",
        data_->train_pairs(), data_->eval_pairs(), loss, cfg_.dpo.beta, cfg_.dpo.label_smoothing);
  }
  const auto t0 = Clock::now();
  STRATA_RETURN_IF_ERROR(reference_logps_of(false, &ref_train_, &count_train_), "training pairs");
  STRATA_RETURN_IF_ERROR(reference_logps_of(true, &ref_eval_, &count_eval_), "held-out pairs");
  if (rank_ == 0) {
    log_info("DPO: the reference's log-probabilities of {} pairs in {:.2f} s",
             data_->train_pairs() + data_->eval_pairs(), seconds_since(t0));
  }
  return Status::ok();
}

void Run::weigh_preference_rows(double scale, std::vector<MicroBatch>* mbs) {
  const size_t mine = size_t(B_) / 2;
  const double pairs = double(mine) * double(accum_) * double(world_);
  ref_rows_.assign(size_t(accum_), std::vector<float>(size_t(B_)));
  count_rows_.assign(size_t(accum_), std::vector<float>(size_t(B_)));
  row_weights_.clear();
  row_weights_.reserve(size_t(accum_));
  for (int micro = 0; micro < accum_; ++micro) {
    std::vector<float>& ref = ref_rows_[size_t(micro)];
    std::vector<float>& count = count_rows_[size_t(micro)];
    for (size_t j = 0; j < mine; ++j) {
      const size_t p = data_->train_pair(cfg_.train.seed, step_, micro, size_t(rank_) * mine + j);
      for (size_t k = 0; k < 2; ++k) {
        ref[2 * j + k] = ref_train_[2 * p + k];
        count[2 * j + k] = count_train_[2 * p + k];
      }
    }
    row_weights_.emplace_back(&dpo_loss_, scale / pairs, ref.data(), count.data());
  }
  for (int micro = 0; micro < accum_; ++micro) {
    (*mbs)[size_t(micro)].row_weights = &row_weights_[size_t(micro)];
  }
}

Result<double> Run::preference_step_loss() {
  DpoSums s;
  for (int micro = 0; micro < accum_; ++micro) {
    s.add(dpo_loss_, losses_.data() + size_t(micro) * size_t(B_) * size_t(T_),
          ref_rows_[size_t(micro)].data(), count_rows_[size_t(micro)].data(), B_, T_);
  }
  STRATA_RETURN_IF_ERROR(reduce_dpo_sums(&s), "reducing the DPO metrics");
  last_dpo_ = dpo_metrics(s);
  return last_dpo_.loss;
}

Status Run::reduce_dpo_sums(DpoSums* s) {
  if (world_ == 1) return Status::ok();
  float v[7] = {float(s->loss),         float(s->reward_chosen), float(s->reward_rejected),
                float(s->correct),      float(s->pairs),         float(s->logp_chosen),
                float(s->logp_rejected)};
  STRATA_RETURN_IF_ERROR(reduce(v, 7, ReduceOp::kSum), "");
  *s = DpoSums{v[0], v[1], v[2], v[3], v[4], v[5], v[6]};
  return Status::ok();
}

Result<std::optional<double>> Run::preference_eval_loss(bool every_pair) {
  const size_t pairs = data_->eval_pairs(), mine = size_t(B_) / 2;
  const size_t per_batch = mine * size_t(world_);
  const size_t whole = (pairs + per_batch - 1) / per_batch;
  const size_t n =
      every_pair ? whole : std::min<size_t>(size_t(std::max(1, cfg_.data.eval_batches)), whole);
  if (!every_pair && n < size_t(cfg_.data.eval_batches) && !eval_cap_logged_) {
    eval_cap_logged_ = true;
    log_info(
        "eval: data.eval_batches {} is more than the {} batch(es) that hold the {} held-out "
        "pairs: evaluating {}",
        cfg_.data.eval_batches, whole, pairs, n);
  }
  DpoSums s;
  for (size_t i = 0; i < n; ++i) {
    if (world_ == 1 && opts_.stop_signal && opts_.stop_signal->load() != 0) {
      return std::optional<double>();
    }
    const size_t first = i * per_batch + size_t(rank_) * mine;
    STRATA_RETURN_IF_ERROR(pair_forward(true, first), "");
    // The rows past the last pair (wrapped to the first) are computed, not counted.
    std::vector<float> ref(size_t(B_), 0.0f), count(size_t(B_), 0.0f);
    size_t rows = 0;
    for (size_t j = 0; j < mine && first + j < pairs; ++j, rows += 2) {
      for (size_t k = 0; k < 2; ++k) {
        ref[2 * j + k] = ref_eval_[2 * (first + j) + k];
        count[2 * j + k] = count_eval_[2 * (first + j) + k];
      }
    }
    s.add(dpo_loss_, losses_.data(), ref.data(), count.data(), int(rows), T_);
  }
  STRATA_RETURN_IF_ERROR(reduce_dpo_sums(&s), "reducing the eval's DPO metrics");
  last_eval_dpo_ = dpo_metrics(s);
  return std::optional<double>(last_eval_dpo_.loss);
}

Result<EvalResult> Run::preference_evaluate() {
  EvalResult r;
  r.rank = rank_;
  r.world_size = world_;
  r.T = T_;
  r.corpus_tokens = int64_t(data_->eval_tokens());
  r.preference = true;
  r.pairs = int64_t(data_->eval_pairs());
  r.windows = 2 * r.pairs;
  for (size_t w = 0; w < size_t(r.windows); ++w) r.tokens += data_->eval_window_targets(w, T_);
  const auto t0 = Clock::now();
  Result<std::optional<double>> loss = preference_eval_loss(/*every_pair=*/true);
  STRATA_RETURN_IF_ERROR(loss.status(), "");
  r.loss = **loss;
  r.perplexity = std::exp(r.loss);
  r.reward_chosen = last_eval_dpo_.reward_chosen;
  r.reward_rejected = last_eval_dpo_.reward_rejected;
  r.reward_accuracy = last_eval_dpo_.accuracy;
  r.logp_chosen = last_eval_dpo_.logp_chosen;
  r.logp_rejected = last_eval_dpo_.logp_rejected;
  log_info("eval: the DPO loss of {} pairs in {:.2f} s", r.pairs, seconds_since(t0));
  return r;
}

}  // namespace strata::run_detail
