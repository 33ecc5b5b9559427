// The JSONL metrics log (train.log_file): one line per progress report or eval, written with
// one write(2) each, so a line is either all there or, on a failure, reported. Each run appends
// (a resumed run and a fresh one alike) and starts its lines with one naming its lineage and
// first step ({"run_id": "...", "start_step": N}), so the runs a log holds can be told apart.
//
// A failure to write (a full file system, /dev/full, EIO) is never silent: the first one is
// logged as a warning naming train.log_file, the path and the errno text, and kept (error())
// so the run can finish its steps and checkpoints and the CLI then exits non-zero with it.
// Later lines are not attempted once a write failed (the log would have a hole).
#pragma once

#include <string>

#include "strata/status.h"

namespace strata {

class MetricsLog {
 public:
  MetricsLog() = default;
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // Opens `path` (creating its parent directory) for appending: a log is never truncated, so a
  // fresh run in another run's checkpoint directory (or with its train.log_file) keeps that
  // run's lines. Never follows a link at `path`. Errors name train.log_file and errno.
  Status open(const std::string& path);
  // Appends `line` and a newline. Returns the failure (also kept in error()) on the first
  // failed write; OK (and nothing written) once a write has failed.
  Status write_line(const std::string& line);
  // The first write failure, OK if none.
  const Status& error() const { return error_; }
  bool is_open() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
  std::string path_;
  uint64_t offset_ = 0;
  Status error_;
};

}  // namespace strata
