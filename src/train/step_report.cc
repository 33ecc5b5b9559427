#include "src/train/step_report.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace strata {

std::string hms(double s) {
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, (t / 60) % 60, t % 60);
  return fmt::format("{:02}:{:02}", t / 60, t % 60);
}

std::string progress_line(const StepReport& r, const StepWindow& w) {
  constexpr double kMiB = 1048576.0;
  // Comm time only means something with several ranks.
  const std::string comm =
      r.world_size > 1 ? fmt::format(", comm {:.0f} ({:.2f} MiB sent)", 1e3 * w.per_step(w.comm_s),
                                     w.per_step(double(w.sent_total())) / kMiB)
                       : std::string();
  const std::string aux =
      r.aux_loss >= 0 ? fmt::format("aux {:.4f} | ", r.aux_loss) : std::string();
  const std::string rewards = r.preference
                                  ? fmt::format("acc {:.2f} margin {:.3f} | ", r.reward_accuracy,
                                                r.reward_chosen - r.reward_rejected)
                                  : std::string();
  const std::string scale = r.fp16 ? fmt::format("scale {:g} | ", r.loss_scale) : std::string();
  const std::string optimizer_note = r.rollbacks > 0 ? fmt::format(", {} rollbacks", r.rollbacks)
                                     : r.approximate ? ", delayed: approximate"
                                                     : "";
  return fmt::format(
      "step {:5d}/{} | loss {:.4f} | {}{}lr {:.3e} | norm {:.3f} | {}{:.0f} tok/s | step {:.0f} "
      "ms: "
      "fwd/bwd {:.0f} (fetch wait {:.0f}) opt {:.0f} ({:.0f}% hidden{}), io wait {:.0f}{} | "
      "moved/step: device {:.1f} MiB, nvme {:.1f} MiB | {} elapsed, ETA {}{}\n",
      r.step, r.total, r.loss, aux, rewards, r.lr, r.grad_norm, scale, r.tokens_per_s,
      1e3 * w.per_step(r.window_s), 1e3 * w.per_step(w.fwd_bwd_s), 1e3 * w.per_step(w.fetch_wait_s),
      1e3 * w.per_step(w.optimizer_s),
      w.optimizer_s > 0 ? 100.0 * w.optimizer_hidden_s / w.optimizer_s : 0.0, optimizer_note,
      1e3 * w.per_step(w.io_wait_s), comm, w.per_step(double(w.device_bytes)) / kMiB,
      w.per_step(double(w.nvme_bytes)) / kMiB, hms(r.elapsed_s), hms(r.eta_s),
      r.skipped ? " | overflow: step skipped" : "");
}

std::string metrics_record(const StepReport& r, const StepWindow& w) {
  nlohmann::json j{
      {"step", r.step},
      {"loss", r.loss},
      {"lr", r.lr},
      {"grad_norm", r.grad_norm},
      {"loss_scale", r.loss_scale},
      {"skipped", r.skipped},
      {"tokens_per_s", r.tokens_per_s},
      {"elapsed_s", r.elapsed_s},
      {"step_s", w.per_step(r.window_s)},
      {"fwd_bwd_s", w.per_step(w.fwd_bwd_s)},
      {"fetch_wait_s", w.per_step(w.fetch_wait_s)},
      {"optimizer_s", w.per_step(w.optimizer_s)},
      {"optimizer_hidden_s", w.per_step(w.optimizer_hidden_s)},
      {"optimizer_hidden_share", w.optimizer_s > 0 ? w.optimizer_hidden_s / w.optimizer_s : 0.0},
      // The CPU optimizer's kernel: parameters per second of its own time (0: it stepped none).
      {"cpu_optimizer_params_per_s",
       w.cpu_optimizer_s > 0 ? double(w.cpu_optimizer_params) / w.cpu_optimizer_s : 0.0},
      {"rollbacks", r.rollbacks},
      {"delayed_update", r.approximate},
      {"io_wait_s", w.per_step(w.io_wait_s)},
      {"comm_s", w.per_step(w.comm_s)},
      {"comm_bytes", w.per_step(double(w.sent_total()))},
      {"comm_param_bytes", w.per_step(double(w.sent[0]))},
      {"comm_grad_bytes", w.per_step(double(w.sent[1]))},
      {"device_bytes_per_step", w.per_step(double(w.device_bytes))},
      {"nvme_bytes_per_step", w.per_step(double(w.nvme_bytes))},
      {"peak_rss_bytes", r.peak_rss},
      {"rss_bytes", r.rss}};
  if (r.aux_loss >= 0) j["aux_loss"] = r.aux_loss;
  if (r.preference) {
    j["rewards/chosen"] = r.reward_chosen;
    j["rewards/rejected"] = r.reward_rejected;
    j["rewards/accuracies"] = r.reward_accuracy;
    j["rewards/margins"] = r.reward_chosen - r.reward_rejected;
    j["logps/chosen"] = r.logp_chosen;
    j["logps/rejected"] = r.logp_rejected;
  }
  return j.dump();
}

}  // namespace strata
