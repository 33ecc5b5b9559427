#include "src/train/monitors.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>

#include "strata/checksum.h"
#include "strata/log.h"

namespace strata {
namespace {

double wall_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Protocol buffer encoding: the few wire types an Event needs.
void varint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out->push_back(char(v));
}
void little_endian(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(char(uint8_t(v >> (8 * i))));
}
void field_bytes(std::string* out, int field, const std::string& bytes) {  // wire type 2
  varint(out, uint64_t(field) << 3 | 2);
  varint(out, bytes.size());
  out->append(bytes);
}

uint32_t masked_crc(const std::string& bytes) {
  const uint32_t c = crc32c(0, bytes.data(), bytes.size());
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// A file name for a metric: letters, digits, '.', '-', '_'; anything else becomes '_'.
std::string file_name_of(const std::string& metric) {
  std::string s = metric;
  for (char& ch : s) {
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '-') ch = '_';
  }
  return s.empty() || s[0] == '.' ? "_" + s : s;
}

}  // namespace

std::string tensorboard_record(double wall_time, int64_t step, const Scalars* scalars) {
  std::string event;
  uint64_t wt;
  static_assert(sizeof(wt) == sizeof(wall_time));
  std::memcpy(&wt, &wall_time, sizeof(wt));
  varint(&event, 1 << 3 | 1);  // wall_time: double
  little_endian(&event, wt, 8);
  varint(&event, 2 << 3 | 0);  // step: int64
  varint(&event, uint64_t(step));
  if (scalars == nullptr) {
    field_bytes(&event, 3, "brain.Event:2");  // file_version
  } else {
    std::string summary;
    for (const auto& [tag, value] : *scalars) {
      std::string v;
      field_bytes(&v, 1, tag);  // Summary.Value.tag
      const float f = float(value);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      varint(&v, 2 << 3 | 5);  // Summary.Value.simple_value: float
      little_endian(&v, bits, 4);
      field_bytes(&summary, 1, v);  // Summary.value
    }
    field_bytes(&event, 5, summary);  // Event.summary
  }
  std::string len;
  little_endian(&len, event.size(), 8);
  std::string rec = len;
  little_endian(&rec, masked_crc(len), 4);
  rec += event;
  little_endian(&rec, masked_crc(event), 4);
  return rec;
}

namespace {

// Creates `dir` with its parents; the error names `key`, the path and the errno text (a
// read-only file system says so, not "no such file").
Status create_monitor_dir(const std::string& dir, const char* key) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return io_error(fmt::format("{}: cannot create '{}': {}", key, dir, ec.message()));
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::open(const std::string& dir) {
  STRATA_RETURN_IF_ERROR(create_monitor_dir(dir, "tensorboard.output_path"), "");
  std::unique_ptr<TensorBoardWriter> w(new TensorBoardWriter());
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  const double now = wall_now();
  w->path_ =
      fmt::format("{}/events.out.tfevents.{}.{}.{}", dir, int64_t(now), host, int(::getpid()));
  STRATA_RETURN_IF_ERROR(w->file_.open(w->path_, /*append=*/false, "tensorboard.output_path"), "");
  STRATA_RETURN_IF_ERROR(w->file_.write_bytes(tensorboard_record(now, 0, nullptr)),
                         "tensorboard.output_path: the event file's first record");
  return w;
}

Status TensorBoardWriter::add(int64_t step, const Scalars& scalars) {
  return file_.write_bytes(tensorboard_record(wall_now(), step, &scalars));
}

Result<std::unique_ptr<CsvMonitor>> CsvMonitor::open(const std::string& dir) {
  std::unique_ptr<CsvMonitor> m(new CsvMonitor());
  m->dir_ = dir;
  STRATA_RETURN_IF_ERROR(create_monitor_dir(dir, "csv_monitor.output_path"), "");
  return m;
}

Status CsvMonitor::add(int64_t step, const Scalars& scalars) {
  for (const auto& [name, value] : scalars) {
    auto& f = files_[name];
    if (!f) {
      f = std::make_unique<MetricsLog>();
      const std::string path = dir_ + "/" + file_name_of(name) + ".csv";
      Status st = f->open(path, /*append=*/true, "csv_monitor.output_path");
      if (st.is_ok()) st = f->write_line("step," + name);
      if (!st.is_ok()) {
        if (error_.is_ok()) {
          error_ = st;
          log_warn("{}; training goes on, and strata train will exit 1", st.message());
        }
        continue;
      }
    }
    Status st = f->write_line(fmt::format("{},{}", step, value));
    if (!st.is_ok() && error_.is_ok()) error_ = st;
  }
  return error_;
}

const Status& CsvMonitor::error() const { return error_; }

Result<Monitors> Monitors::open(const Config& config) {
  Monitors m;
  // An empty job_name without an output_path would put the monitor's files straight into
  // train.checkpoint_dir, among the checkpoints.
  for (const auto& [mc, name] : {std::pair{&config.tensorboard, "tensorboard"},
                                 std::pair{&config.csv_monitor, "csv_monitor"}}) {
    if (mc->enabled && mc->job_name.empty() && mc->output_path.empty()) {
      return invalid_argument(fmt::format(
          "{0}.job_name is empty and {0}.output_path is not given: its files would go straight "
          "into train.checkpoint_dir '{1}', among the checkpoints; give {0}.job_name (default "
          "\"DeepSpeedJobName\") or {0}.output_path",
          name, config.train.checkpoint_dir));
    }
  }
  auto dir_of = [&](const MonitorConfig& mc) {
    return (mc.output_path.empty() ? config.train.checkpoint_dir : mc.output_path) + "/" +
           mc.job_name;
  };
  if (config.tensorboard.enabled) {
    STRATA_ASSIGN_OR_RETURN(m.tensorboard, TensorBoardWriter::open(dir_of(config.tensorboard)),
                            "tensorboard");
  }
  if (config.csv_monitor.enabled) {
    STRATA_ASSIGN_OR_RETURN(m.csv, CsvMonitor::open(dir_of(config.csv_monitor)), "csv_monitor");
  }
  return m;
}

void Monitors::add(int64_t step, const Scalars& scalars) {
  if (tensorboard) tensorboard->add(step, scalars).ignore();
  if (csv) csv->add(step, scalars).ignore();
}

Status Monitors::error() const {
  if (tensorboard && !tensorboard->error().is_ok()) return tensorboard->error();
  if (csv && !csv->error().is_ok()) return csv->error();
  return Status::ok();
}

}  // namespace strata
