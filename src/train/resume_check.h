// Every value a checkpoint's metadata holds, checked against the run before any of it is used.
//
// The reader (src/checkpoint/checkpoint.h) already refuses values of the wrong type or range; this
// compares what is left with the run that resumes: the model (shape, module names and element
// counts), the moment dtype, the optimizer state (a config whose optimizer.type keeps another
// is refused; Adam and AdamW keep the same), train.seed, train.steps, and, for a sharded
// checkpoint, that the manifest, the shard files' world_size and rank, and their (offset, numel)
// ranges agree and tile every module exactly once. Every shard file's values are checked, each
// against the run. Errors name the file, the value, and the fix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/checkpoint/checkpoint.h"
#include "strata/status.h"

namespace strata {

// `path`: the checkpoint (a whole-model file or a shard manifest). `mine`: the run's own
// metadata (CheckpointMeta of a whole-model file for this config: modules with full numel;
// optimizer_state "" when the caller steps no optimizer, as evaluation, and the state is not
// checked; nor is it for a file that does not record one, written before it was recorded).
// `train_steps`: train.steps (a checkpoint past it is refused). Returns the metadata to resume
// with (of the first file; every file agrees on the counters) and the files to load.
struct ResumePlan {
  CheckpointMeta meta;
  std::vector<std::string> files;
  bool whole = true;  // one whole-model file (else shard files)
};
Result<ResumePlan> check_resume(const std::string& path, const CheckpointMeta& mine,
                                int64_t train_steps);

// Where a resume changes the batch `then` (the checkpoint's: micro_batch, accumulation,
// world_size) to `now`'s so that its steps go through other samples than an uninterrupted run
// (another gradient_accumulation_steps, or another micro-batch x ranks): a warning saying so and
// what keeps them; "" where they stay, or where the checkpoint does not record its batch.
std::string resume_batch_note(const CheckpointMeta& then, const CheckpointMeta& now);
// Where the learning-rate schedule decayed over other steps than it will now (then's and now's
// schedule_steps, both recorded): a warning that the rate from here on is not the checkpoint's
// run's, and the setting that keeps it; "" otherwise.
std::string resume_schedule_note(const CheckpointMeta& then, const CheckpointMeta& now);
// Where the run's model.pad_token_id (the embedding row that takes no gradient) differs from
// the checkpoint's (both recorded): a warning that the rows train otherwise from here on, and
// the setting that keeps the checkpoint's; "" otherwise.
std::string resume_pad_note(const CheckpointMeta& then, const CheckpointMeta& now);
// The notes above that apply to a resume from `then` to `now`, in that order.
std::vector<std::string> resume_notes(const CheckpointMeta& then, const CheckpointMeta& now);

}  // namespace strata
