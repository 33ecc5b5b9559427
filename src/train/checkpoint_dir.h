// What `strata train` does with train.checkpoint_dir besides writing checkpoint files into it:
// the preflight, lineages and pruning, removing a killed run's temporaries, and choosing the
// checkpoint `--resume` starts from (with fallbacks when `latest` is missing or damaged).
//
// Names: checkpoints are "ckpt-<step, 8 digits>.bin" (a whole-model file, or a shard manifest
// with its shard files "<name>.rank<R>-of-<N>" beside it), `latest` holds the newest one's name,
// temporaries end in ".tmp".
//
// Lineage: every checkpoint carries the run_id of the lineage that wrote it (a fresh run draws
// a new one; a resumed run keeps its checkpoint's). A run prunes only its own lineage, never
// the checkpoint it just wrote, never one of a later step (a fork's future), and refuses at
// start to run when it would overwrite a checkpoint of another lineage.
//
// Thread-compatible; rank 0 alone prunes and removes temporaries.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata {

// One checkpoint found in a directory.
struct CheckpointEntry {
  std::string name;       // "ckpt-00000010.bin"
  int64_t step = 0;       // from the name
  std::string run_id;     // its lineage; "" when unknown (older files, or unreadable)
  bool readable = false;  // its metadata (or manifest) could be read
};

// Every "ckpt-<digits>.bin" in `dir`, by step ascending, with its lineage. Unreadable files are
// listed with readable = false. A missing directory is an empty list.
std::vector<CheckpointEntry> list_checkpoints(const std::string& dir);

// How many checkpoints a run keeps of its lineage (prune_checkpoints' `keep`).
inline constexpr int kKeepCheckpoints = 2;

// The preflight for train.checkpoint_dir, before any training: `dir` exists or can be created,
// is a directory, is writable (a probe file is created and removed, without following links),
// and its file system has room for `count` more checkpoints of `checkpoint_bytes` each (see
// checkpoints_to_come). Errors name train.checkpoint_dir, the path, the bytes needed and free,
// and the errno text.
Status check_checkpoint_dir(const std::string& dir, uint64_t checkpoint_bytes, int count = 1);

// How many checkpoints beyond those already in `dir` a run needs room for at its peak: it keeps
// `keep` of its lineage and writes the next one before pruning the oldest, so keep + 1, less
// those of its lineage already there (at most keep). `resume`: "" for a fresh run, "latest",
// or the checkpoint path it continues (its lineage's files are counted).
int checkpoints_to_come(const std::string& dir, const std::string& resume,
                        int keep = kKeepCheckpoints);

// check_checkpoint_dir, then (when `remove_temporaries`: rank 0) remove_stale_temporaries with
// a log line per file removed. What the trainer runs before it allocates anything.
Status prepare_checkpoint_dir(const std::string& dir, uint64_t checkpoint_bytes, int count,
                              bool remove_temporaries);

// Removes the temporaries a killed run left in `dir` ("ckpt-*.tmp", "latest.tmp"; a link is
// removed, never followed). Returns the names removed.
std::vector<std::string> remove_stale_temporaries(const std::string& dir);

// A run of lineage `run_id` that writes checkpoints for steps in (first_step, last_step] would
// replace a checkpoint of another lineage with the same name: kInvalidArgument naming it and
// the ways out (--resume it, another train.checkpoint_dir, or move it away). `passed_over`:
// the damaged checkpoints (paths) --resume fell back past, which the run may replace when their
// metadata cannot be read (a truncated, zeroed or empty file: no lineage left to protect).
Status check_no_foreign_overwrite(const std::string& dir, const std::string& run_id,
                                  int64_t first_step, int64_t last_step,
                                  const std::vector<std::string>& passed_over = {});

// Keeps, of lineage `run_id`, `just_written` and the keep-1 newest checkpoints of lower steps;
// removes the other lower-step ones of that lineage (a manifest with its shard files). Never
// touches other lineages, unknown ones, or steps above `just_written`'s. Returns the names
// removed; a removal that fails is skipped (logged), never an error.
std::vector<std::string> prune_checkpoints(const std::string& dir, const std::string& run_id,
                                           const std::string& just_written,
                                           int keep = kKeepCheckpoints);

// What `--resume` (no path) tries, in order: the checkpoint `latest` names, then the older
// checkpoints of its lineage, newest first. When `latest` is missing but checkpoints exist,
// the newest ones (with a warning naming them). kNotFound when the directory has none.
Result<std::vector<std::string>> resume_candidates(const std::string& dir);

// Outcome of one resume attempt on this rank, for `agree`.
enum class ResumeOutcome : int { kLoaded = 0, kDamaged = 1, kFailed = 2 };

// Tries `load` on each candidate until one loads. A candidate that fails as damaged (kCorrupt:
// checksum, truncation, bad metadata; or kNotFound: a missing shard file) is named in a
// warning and the next one tried; any other error is returned. `agree` (several ranks) turns
// this rank's outcome into the worst over all ranks, so every rank loads the same checkpoint;
// null on one rank. Returns the path loaded.
Result<std::string> resume_first_intact(
    const std::vector<std::string>& candidates,
    const std::function<Status(const std::string& path)>& load,
    const std::function<Result<ResumeOutcome>(ResumeOutcome mine)>& agree);

// A new lineage id: 16 hex digits from /dev/urandom (clock and pid when it cannot be read).
std::string new_run_id();

}  // namespace strata
