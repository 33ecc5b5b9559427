#include "src/train/metrics_log.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "src/base/safe_file.h"
#include "strata/log.h"

namespace strata {

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

Status MetricsLog::open(const std::string& path, bool append, const std::string& key) {
  path_ = path;
  key_ = key;
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  auto fd = open_for_writing(path, append, 0644);
  if (!fd.is_ok()) {
    return fd.status().with_context(
        fmt::format("{}: cannot open the metrics file '{}'", key, path));
  }
  fd_ = *fd;
  struct stat st {};
  if (::fstat(fd_, &st) == 0) offset_ = uint64_t(st.st_size);
  return Status::ok();
}

Status MetricsLog::write_bytes(const std::string& text) {
  if (fd_ < 0 || !error_.is_ok()) return Status::ok();
  Status st = write_fully(fd_, text.data(), text.size(), path_, &offset_);
  if (!st.is_ok()) {
    error_ = st.with_context(key_ + ": the metrics file could not be written");
    log_warn("{}; training goes on, no more metrics are written, and strata train will exit 1",
             error_.message());
    return error_;
  }
  return Status::ok();
}

}  // namespace strata
