// Evaluation (Run::eval_loss between steps, Run::evaluate for strata eval): forward passes
// over the eval batches, each rank its rows, the per-token losses reduced across ranks.
#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "src/tiers/tier_manager.h"
#include "src/train/data.h"
#include "src/train/run.h"
#include "strata/log.h"

namespace strata::run_detail {

Status Run::eval_batch(int i) {
  const MicroBatch eval_mb{0.0f, losses_.data(), nullptr, nullptr, 0, /*losses_out_pinned=*/true};
  tm_->begin_phase("eval");
  data_->eval_batch(i, B_, T_, tok_.data(), tgt_.data(), rank_, world_, pos_.data());
  model_->begin_batch(
      tok_.data(), tgt_.data(),
      data_->eval_positions() && !positions_are_plain(pos_.data(), B_, T_) ? pos_.data() : nullptr);
  const std::string what = fmt::format("eval batch {}", i);
  STRATA_RETURN_IF_ERROR(run_program(Pass::kEval, 0, true, false, &eval_mb), what);
  STRATA_RETURN_IF_ERROR(tm_->end_backward(), what);
  return tm_->end_phase().with_context("eval");
}

Result<std::optional<double>> Run::eval_loss() {
  STRATA_RETURN_IF_ERROR(tm_->finish_pending_step(), "before eval");
  if (preference()) return preference_eval_loss();
  double sum = 0;
  // eval_batch(i) takes B*world windows from i*B*world on, wrapping past the end: the batches
  // that hold every window once are enough (2147483647 of them ran for days, ignoring Ctrl-C).
  const size_t rows = size_t(B_) * size_t(world_), windows = data_->eval_windows(T_);
  const size_t whole = (windows + rows - 1) / rows;
  const int n = int(std::min<size_t>(size_t(std::max(1, cfg_.data.eval_batches)), whole));
  if (n < cfg_.data.eval_batches && !eval_cap_logged_) {
    eval_cap_logged_ = true;
    log_info(
        "eval: data.eval_batches {} is more than the {} batch(es) that hold the {} held-out "
        "windows: evaluating {}",
        cfg_.data.eval_batches, whole, windows, n);
  }
  // Every window, the last batch's rows past the end wrapping to the start: those are not
  // counted (they had counted the first windows twice), so the loss is strata eval's.
  if (size_t(n) * rows > windows) {
    int64_t tokens = 0;
    return whole_eval_loss(size_t(n), world_ == 1, &tokens);
  }
  for (int i = 0; i < n; ++i) {
    if (world_ == 1 && opts_.stop_signal && opts_.stop_signal->load() != 0) {
      return std::optional<double>();
    }
    STRATA_RETURN_IF_ERROR(eval_batch(i), "");
    for (size_t j = 0; j < size_t(B_) * T_; ++j) sum += losses_[j];
  }
  if (data_->eval_packed()) {
    // The mean over the targets that count in the n global batches.
    int64_t targets = 0;
    for (int i = 0; i < n; ++i) targets += data_->eval_batch_targets(i, B_, T_, world_);
    float total = static_cast<float>(sum);
    STRATA_RETURN_IF_ERROR(reduce(&total, 1, ReduceOp::kSum), "reducing the eval loss");
    return std::optional<double>((world_ > 1 ? double(total) : sum) / double(targets));
  }
  float total = static_cast<float>(sum / (double(n) * B_ * T_));
  STRATA_RETURN_IF_ERROR(reduce(&total, 1, ReduceOp::kSum), "reducing the eval loss");
  return std::optional<double>(world_ > 1 ? double(total) / world_ : sum / (double(n) * B_ * T_));
}

Result<std::optional<double>> Run::whole_eval_loss(size_t batches, bool stoppable,
                                                   int64_t* tokens) {
  const size_t windows = data_->eval_windows(T_), rows = size_t(B_) * size_t(world_);
  double sum = 0;
  for (size_t i = 0; i < batches; ++i) {
    if (stoppable && opts_.stop_signal && opts_.stop_signal->load() != 0) {
      return std::optional<double>();
    }
    STRATA_RETURN_IF_ERROR(eval_batch(int(i)), "");
    for (size_t b = 0; b < size_t(B_); ++b) {
      if (i * rows + size_t(rank_) * size_t(B_) + b >= windows) break;
      for (size_t t = 0; t < size_t(T_); ++t) sum += losses_[b * size_t(T_) + t];
    }
  }
  *tokens = 0;  // the targets that count (every one of each window's T without a loss mask)
  for (size_t w = 0; w < windows; ++w) *tokens += data_->eval_window_targets(w, T_);
  float total = static_cast<float>(sum);
  STRATA_RETURN_IF_ERROR(reduce(&total, 1, ReduceOp::kSum), "reducing the eval loss");
  return std::optional<double>((world_ > 1 ? double(total) : sum) / double(*tokens));
}

Result<EvalResult> Run::evaluate() {
  if (preference()) return preference_evaluate();
  EvalResult r;
  r.rank = rank_;
  r.world_size = world_;
  r.T = T_;
  r.corpus_tokens = int64_t(data_->eval_tokens());
  // eval_batch(i) gives rank r rows [r*B, (r+1)*B) of the i-th run of B*world windows; the
  // last run's rows past the end wrap around to the start and are computed but not counted.
  const size_t windows = data_->eval_windows(T_);
  const size_t rows = size_t(B_) * size_t(world_);
  const size_t batches = (windows + rows - 1) / rows;
  STRATA_CHECK(batches <= size_t(std::numeric_limits<int>::max()), "eval: too many batches");
  log_info("eval: {} windows of {} tokens, {} batch(es) of {} x {} rank(s)", windows, T_, batches,
           B_, world_);
  const auto t0 = Clock::now();
  Result<std::optional<double>> loss = whole_eval_loss(batches, false, &r.tokens);
  STRATA_RETURN_IF_ERROR(loss.status(), "");
  r.windows = int64_t(windows);
  r.loss = **loss;
  r.perplexity = std::exp(r.loss);
  log_info("eval: {} tokens in {:.2f} s", r.tokens, seconds_since(t0));
  return r;
}

}  // namespace strata::run_detail
