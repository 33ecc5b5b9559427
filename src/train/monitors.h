// Where the trainer's metrics records go besides train.log_file: DeepSpeed's "tensorboard" and
// "csv_monitor" sections (MonitorConfig).
//
// Each record is a list of named scalars at a step (the numbers of the JSONL record:
// metrics_record in src/train/step_report.h, so the three outputs never disagree).
//
// TensorBoardWriter writes the TFRecord event file format TensorBoard reads
// (<dir>/events.out.tfevents.<seconds>.<host>.<pid>): each record is
//   uint64 length | uint32 masked CRC32C of the length | data | uint32 masked CRC32C of data
// (little-endian; mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8), and each data an Event
// protocol buffer: the first {wall_time, file_version "brain.Event:2"}, then one per record
// {wall_time, step, summary {value {tag, simple_value}}...}. A new file per run (a resumed run
// adds one; TensorBoard reads every file in the directory).
//
// CsvMonitor writes one <dir>/<metric>.csv per scalar: each run (fresh or resumed) appends a
// "step,<metric>" header, then a "step,value" row per record, as DeepSpeed's csv_monitor does
// (its files are opened "a+"); a file is never truncated, so another run's rows are kept.
//
// Failures are never silent and never stop training: the first failed write of a file is a
// warning naming the config key and the path, kept in error() for the CLI's exit status
// (MetricsLog's rules). Files are never opened through a link.
//
// Thread safety: one thread (the trainer's rank 0).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "src/train/metrics_log.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata {

using Scalars = std::vector<std::pair<std::string, double>>;

// One TensorBoard Event record (length, CRCs, the Event's bytes) with these scalars; no
// summary and file_version "brain.Event:2" when `scalars` is null (a file's first record).
std::string tensorboard_record(double wall_time, int64_t step, const Scalars* scalars);

class TensorBoardWriter {
 public:
  // Creates `dir` if missing and a new event file in it.
  static Result<std::unique_ptr<TensorBoardWriter>> open(const std::string& dir);
  Status add(int64_t step, const Scalars& scalars);
  const Status& error() const { return file_.error(); }
  const std::string& path() const { return path_; }

 private:
  MetricsLog file_;
  std::string path_;
};

class CsvMonitor {
 public:
  static Result<std::unique_ptr<CsvMonitor>> open(const std::string& dir);
  Status add(int64_t step, const Scalars& scalars);
  const Status& error() const;

 private:
  std::string dir_;
  std::map<std::string, std::unique_ptr<MetricsLog>> files_;  // metric -> its file
  Status error_;
};

// The monitors a config asks for, opened under <output_path or checkpoint_dir>/<job_name>.
struct Monitors {
  std::unique_ptr<TensorBoardWriter> tensorboard;
  std::unique_ptr<CsvMonitor> csv;

  static Result<Monitors> open(const Config& config);
  // Writes the record to each; the first failure (also kept in error()).
  void add(int64_t step, const Scalars& scalars);
  // The first failure of any monitor, OK if none.
  Status error() const;
};

}  // namespace strata
