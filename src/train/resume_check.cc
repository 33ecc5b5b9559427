#include "src/train/resume_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "strata/optimizer.h"

namespace strata {
namespace {

// The fields in which two shape strings (Architecture::shape_string: "L=12 NH=12 C=768 ...",
// then " lora r=8 scaling=2 <sites>" with adapters) differ, as "T 1024 in the checkpoint, 512
// in the config", or how to go from a full fine-tune to LoRA and back: the message, with what
// to do.
std::string shape_difference(const std::string& ckpt, const std::string& mine) {
  const size_t lc = ckpt.find(" lora "), lm = mine.find(" lora ");
  if ((lc == std::string::npos) != (lm == std::string::npos)) {
    return lc == std::string::npos
               ? "the checkpoint is a full fine-tune and the config adds LoRA adapters (a lora "
                 "section): a LoRA run cannot resume it; export it (strata export --out DIR) and "
                 "start the LoRA run from it (model.from_pretrained = DIR), or remove the lora "
                 "section to resume the full fine-tune"
               : "the checkpoint is a LoRA run's and the config has no lora section: resume "
                 "with the run's lora section, or export the merged model (strata export --out "
                 "DIR) and fine-tune it in full from model.from_pretrained = DIR";
  }
  auto fields = [](const std::string& s) {
    std::vector<std::pair<std::string, std::string>> out;
    size_t b = 0;
    while (b < s.size()) {
      size_t e = s.find(' ', b);
      if (e == std::string::npos) e = s.size();
      const std::string tok = s.substr(b, e - b);
      const size_t eq = tok.find('=');
      if (eq != std::string::npos) out.emplace_back(tok.substr(0, eq), tok.substr(eq + 1));
      b = e + 1;
    }
    return out;
  };
  const auto a = fields(ckpt.substr(0, lc)), b = fields(mine.substr(0, lm));
  std::string diff;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (a[i] != b[i]) {
      diff += fmt::format("{}{} {} in the checkpoint, {} in the config", diff.empty() ? "" : "; ",
                          a[i].first, a[i].second, b[i].second);
    }
  }
  if (lc != std::string::npos && ckpt.substr(lc) != mine.substr(lm)) {
    diff += fmt::format("{}LoRA{} in the checkpoint,{} in the config", diff.empty() ? "" : "; ",
                        ckpt.substr(lc + 5), mine.substr(lm + 5));
  }
  if (diff.empty() || a.size() != b.size()) {
    diff = fmt::format("the checkpoint's model ({}) differs from the config's ({})", ckpt, mine);
  } else {
    diff = "the checkpoint's model differs from the config's: " + diff;
  }
  return diff + "; give the config it was trained with";
}

}  // namespace

Result<ResumePlan> check_resume(const std::string& path, const CheckpointMeta& mine,
                                int64_t train_steps) {
  STRATA_ASSIGN_OR_RETURN(ShardManifest man, read_shard_manifest(path), "resume check");
  ResumePlan plan;
  plan.files = man.files;
  plan.whole = man.step < 0;
  const size_t M = mine.modules.size();
  // Per module, the (offset, numel) ranges the files hold, to check they tile it.
  std::vector<std::vector<std::pair<size_t, size_t>>> ranges(M);
  for (size_t f = 0; f < man.files.size(); ++f) {
    const std::string& file = man.files[f];
    STRATA_ASSIGN_OR_RETURN(CheckpointMeta meta, read_checkpoint_meta(file), "resume check");
    auto bad = [&](const std::string& what) {
      return invalid_argument(fmt::format("{}: {}", file, what));
    };
    if (meta.model_shape != mine.model_shape) {
      return bad(shape_difference(meta.model_shape, mine.model_shape));
    }
    if (meta.moment_dtype != mine.moment_dtype) {
      return bad(
          fmt::format("moments are {} in the checkpoint but strata.optimizer.moment_dtype "
                      "is {}; resume with moment_dtype {}",
                      meta.moment_dtype, mine.moment_dtype, meta.moment_dtype));
    }
    // A file written before the state was recorded, or a caller that steps no optimizer (""):
    // not checked.
    if (!meta.optimizer_state.empty() && !mine.optimizer_state.empty() &&
        meta.optimizer_state != mine.optimizer_state) {
      const OptimizerState* theirs = find_optimizer_state(meta.optimizer_state);
      const OptimizerState* ours = find_optimizer_state(mine.optimizer_state);
      STRATA_CHECK(theirs != nullptr && ours != nullptr, "an optimizer state no optimizer keeps");
      return bad(fmt::format(
          "the checkpoint holds the optimizer state of {} ({}) but optimizer.type is {}, whose "
          "state is {}; resume with optimizer.type {}, or start a new run without --resume",
          theirs->optimizers, theirs->holds, ours->optimizers, ours->holds, theirs->optimizers));
    }
    if (meta.modules.size() != M) {
      return bad(fmt::format("{} modules, the model has {}", meta.modules.size(), M));
    }
    if (plan.whole) {
      if (meta.world_size != 1 || meta.rank != 0) {
        return bad(fmt::format(
            "a shard file (rank {} of {}) given as a checkpoint; resume from its manifest "
            "(the file without the .rank suffix)",
            meta.rank, meta.world_size));
      }
    } else if (meta.world_size != man.world_size || meta.rank != int(f)) {
      return bad(fmt::format("says rank {} of {}, but the manifest {} lists it as rank {} of {}",
                             meta.rank, meta.world_size, path, f, man.world_size));
    }
    for (size_t i = 0; i < M; ++i) {
      const CheckpointModule& got = meta.modules[i];
      const CheckpointModule& want = mine.modules[i];
      if (got.name != want.name) {
        return bad(fmt::format("module {} is '{}', the model's is '{}'", i, got.name, want.name));
      }
      if (plan.whole && (got.numel != want.numel || got.offset != 0)) {
        return bad(fmt::format("module '{}' has {} elements at offset {}, the model's has {}",
                               got.name, got.numel, got.offset, want.numel));
      }
      // A shard that is all padding holds 0 elements (its offset may lie past the end).
      if (got.numel > 0 && (got.numel > want.numel || got.offset > want.numel - got.numel)) {
        return bad(fmt::format("module '{}' elements [{}, {}) lie outside its {} elements",
                               got.name, got.offset, got.offset + got.numel, want.numel));
      }
      if (got.numel > 0) ranges[i].emplace_back(got.offset, got.numel);
    }
    if (f == 0) {
      plan.meta = meta;
    } else {
      const CheckpointMeta& a = plan.meta;
      if (meta.step != a.step || meta.opt_steps != a.opt_steps || meta.seed != a.seed ||
          meta.run_id != a.run_id || meta.loss_scale != a.loss_scale ||
          meta.scaler_cur_iter != a.scaler_cur_iter ||
          meta.scaler_last_overflow_iter != a.scaler_last_overflow_iter ||
          meta.scaler_cur_hysteresis != a.scaler_cur_hysteresis) {
        return bad(fmt::format(
            "its step counters or lineage (step {}, opt_steps {}, run {}) differ from {}'s (step "
            "{}, opt_steps {}, run {}): the shard files come from different saves",
            meta.step, meta.opt_steps, meta.run_id, man.files[0], a.step, a.opt_steps, a.run_id));
      }
    }
  }
  if (!plan.whole && man.step != plan.meta.step) {
    return invalid_argument(fmt::format("{}: the manifest says step {}, its shard files step {}",
                                        path, man.step, plan.meta.step));
  }
  for (size_t i = 0; i < M; ++i) {
    auto& r = ranges[i];
    std::sort(r.begin(), r.end());
    size_t next = 0;
    for (const auto& [off, n] : r) {
      if (off != next) {
        return invalid_argument(fmt::format(
            "{}: module '{}' elements [{}, {}) are {} by its files; a shard file is missing, "
            "duplicated or from another save",
            path, mine.modules[i].name, std::min(off, next), std::max(off, next),
            off > next ? "not covered" : "covered twice"));
      }
      next = off + n;
    }
    if (next != mine.modules[i].numel) {
      return invalid_argument(fmt::format(
          "{}: module '{}' elements [{}, {}) are not covered by its files; a shard file is "
          "missing or from another save",
          path, mine.modules[i].name, next, mine.modules[i].numel));
    }
  }
  const CheckpointMeta& m = plan.meta;
  if (m.seed != mine.seed) {
    return invalid_argument(fmt::format(
        "{}: the checkpoint was trained with train.seed {}, the config says {}; the seed picks "
        "the batches (and the synthetic corpus), so resume with --set train.seed={}",
        path, m.seed, mine.seed, m.seed));
  }
  if (m.step > train_steps) {
    return invalid_argument(
        fmt::format("{}: the checkpoint is at step {}, past train.steps {}; to train further raise "
                    "train.steps above {} (--set train.steps=N)",
                    path, m.step, train_steps, m.step));
  }
  return plan;
}

std::string resume_batch_note(const CheckpointMeta& then, const CheckpointMeta& now) {
  if (then.micro_batch <= 0 || then.accumulation <= 0) return "";
  if (then.accumulation == now.accumulation &&
      then.micro_batch * then.world_size == now.micro_batch * now.world_size) {
    return "";
  }
  return fmt::format(
      "the checkpoint was trained with {} sequence(s) a micro-batch on {} rank(s) and "
      "gradient_accumulation_steps {}; this run takes {} on {} and {}: from here on its steps go "
      "through other samples than an uninterrupted run's (a step's samples are picked by "
      "micro-batch index and by position across the ranks' micro-batches). To keep them, keep "
      "gradient_accumulation_steps and train_micro_batch_size_per_gpu x ranks",
      then.micro_batch, then.world_size, then.accumulation, now.micro_batch, now.world_size,
      now.accumulation);
}

std::string resume_schedule_note(const CheckpointMeta& then, const CheckpointMeta& now) {
  if (then.schedule_steps <= 0 || now.schedule_steps <= 0 ||
      then.schedule_steps == now.schedule_steps) {
    return "";
  }
  return fmt::format(
      "the checkpoint's learning-rate schedule decays over {} steps, this run's over {} "
      "(scheduler.params.total_num_steps; \"auto\" or unset: train.steps): from here on the "
      "learning rate is not the one the checkpoint's run would have taken. To keep it, --set "
      "scheduler.params.total_num_steps={}",
      then.schedule_steps, now.schedule_steps, then.schedule_steps);
}

std::vector<std::string> resume_notes(const CheckpointMeta& then, const CheckpointMeta& now) {
  std::vector<std::string> notes;
  for (std::string n : {resume_batch_note(then, now), resume_schedule_note(then, now),
                        resume_pad_note(then, now)}) {
    if (!n.empty()) notes.push_back(std::move(n));
  }
  return notes;
}

std::string resume_pad_note(const CheckpointMeta& then, const CheckpointMeta& now) {
  if (then.pad_token_id < -1 || now.pad_token_id < -1 || then.pad_token_id == now.pad_token_id) {
    return "";
  }
  auto name = [](int64_t pad) { return pad < 0 ? std::string("none") : std::to_string(pad); };
  return fmt::format(
      "the checkpoint's run kept the embedding row of pad token {} from training, this run keeps "
      "{}'s (model.pad_token_id, from config.json's pad_token_id): from here on the embedding "
      "trains otherwise than the checkpoint's run would have. To keep it, --set "
      "model.pad_token_id={}",
      name(then.pad_token_id), name(now.pad_token_id), then.pad_token_id);
}

}  // namespace strata
