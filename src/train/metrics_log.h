// An append-only metrics file: the JSONL metrics log (train.log_file), one line per metrics
// record or eval, and the monitors' files (src/train/monitors.h). Each line or record is written
// with one write(2), so it is either all there or, on a failure, reported.
// The JSONL log is opened appending whatever the run (a resumed run and a fresh one alike), and
// each run starts its lines with one naming its lineage and first step ({"run_id": "...",
// "start_step": N}), so the runs a log holds can be told apart.
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

  // Opens `path` (creating its parent directory), appending when `append`, else truncating
  // (the trainer's JSONL log always appends: a fresh run in another run's checkpoint directory,
  // or with its train.log_file, keeps that run's lines). Never follows a link at `path`. Errors
  // name `key` (the config key) and errno.
  Status open(const std::string& path, bool append, const std::string& key = "train.log_file");
  // Appends `line` and a newline. Returns the failure (also kept in error()) on the first
  // failed write; OK (and nothing written) once a write has failed.
  Status write_line(const std::string& line) { return write_bytes(line + "\n"); }
  // Appends `bytes` (a binary record) with one write, as write_line.
  Status write_bytes(const std::string& bytes);
  // The first write failure, OK if none.
  const Status& error() const { return error_; }
  bool is_open() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
  std::string path_;
  std::string key_;
  uint64_t offset_ = 0;
  Status error_;
};

}  // namespace strata
