// The trainer's progress reports: every steps_per_print steps (and the first and last) one
// progress line on stdout, and every train.log_interval steps (and the first and last) one
// metrics record (train.log_file's JSONL, and the monitors': src/train/monitors.h), each with
// the per-step means of the steps since the last one. The Run's loop adds each step's times and
// bytes to a StepWindow; this file only formats.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace strata {

// What the steps since the last report add up to.
struct StepWindow {
  int64_t steps = 0;
  double fwd_bwd_s = 0, fetch_wait_s = 0, optimizer_s = 0, optimizer_hidden_s = 0, io_wait_s = 0;
  // Time in collectives, summed over the communicators (with overlap it can exceed the share
  // of the step it costs), and the bytes this rank sent: [0] parameter gathers (hpZ's
  // included), [1] gradient reductions (qgZ's included), [2] the main thread's reductions.
  double comm_s = 0;
  std::array<uint64_t, 3> sent{0, 0, 0};
  uint64_t device_bytes = 0, nvme_bytes = 0;  // moved to and from the device, and NVMe
  // The CPU optimizer's kernel: its seconds and the parameters it stepped (ScheduleCounts').
  double cpu_optimizer_s = 0;
  uint64_t cpu_optimizer_params = 0;

  StepWindow& operator+=(const StepWindow& o) {
    steps += o.steps;
    fwd_bwd_s += o.fwd_bwd_s;
    fetch_wait_s += o.fetch_wait_s;
    optimizer_s += o.optimizer_s;
    optimizer_hidden_s += o.optimizer_hidden_s;
    io_wait_s += o.io_wait_s;
    comm_s += o.comm_s;
    for (size_t i = 0; i < sent.size(); ++i) sent[i] += o.sent[i];
    device_bytes += o.device_bytes;
    nvme_bytes += o.nvme_bytes;
    cpu_optimizer_s += o.cpu_optimizer_s;
    cpu_optimizer_params += o.cpu_optimizer_params;
    return *this;
  }

  // Per-step means (steps counted as at least 1).
  double per_step(double total) const { return total / double(steps > 0 ? steps : 1); }
  uint64_t sent_total() const { return sent[0] + sent[1] + sent[2]; }
};

// The state of the run at the report.
struct StepReport {
  int64_t step = 0, total = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double aux_loss = -1;  // a mixture of experts' load-balancing loss (-1: the model has none)
  // Preference data (DPO): the step's mean rewards of the chosen and rejected sequences, the
  // share of pairs whose chosen one's is higher (TRL's rewards/*) and the policy's mean
  // log-probabilities of each (TRL's logps/*).
  bool preference = false;
  double reward_chosen = 0, reward_rejected = 0, reward_accuracy = 0;
  double logp_chosen = 0, logp_rejected = 0;
  bool fp16 = false;  // show the loss scale
  double loss_scale = 1;
  bool skipped = false;      // fp16 overflow: the step was skipped
  int64_t rollbacks = 0;     // over the run so far
  bool approximate = false;  // the delayed update is on
  int world_size = 1;
  double window_s = 0;  // wall time of the window
  double elapsed_s = 0, eta_s = 0, tokens_per_s = 0;
  size_t peak_rss = 0;
  size_t rss = 0;  // VmRSS at the report
};

// "1:02:03" or "02:03".
std::string hms(double seconds);

// The progress line, with its newline.
std::string progress_line(const StepReport& r, const StepWindow& w);

// The JSONL record (no newline).
std::string metrics_record(const StepReport& r, const StepWindow& w);

}  // namespace strata
