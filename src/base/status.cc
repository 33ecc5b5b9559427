#include "strata/status.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace strata {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kNotFound:
      return "not found";
    case StatusCode::kOutOfMemory:
      return "out of memory";
    case StatusCode::kIoError:
      return "I/O error";
    case StatusCode::kNoSpace:
      return "no space";
    case StatusCode::kCorrupt:
      return "corrupt data";
    case StatusCode::kUnavailable:
      return "unavailable";
    case StatusCode::kInternal:
      return "internal error";
    case StatusCode::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) rep_ = std::make_shared<const Rep>(Rep{code, std::move(message)});
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

Status Status::with_context(std::string_view context) const {
  if (is_ok() || context.empty()) return *this;
  return Status(rep_->code, fmt::format("{}: {}", context, rep_->message));
}

std::string Status::to_string() const {
  if (is_ok()) return "OK";
  return fmt::format("{}: {}", status_code_name(rep_->code), rep_->message);
}

Status errno_status(int err, std::string_view what) {
  StatusCode code = StatusCode::kIoError;
  if (err == ENOSPC || err == EDQUOT) code = StatusCode::kNoSpace;
  if (err == ENOENT) code = StatusCode::kNotFound;
  if (err == ENOMEM) code = StatusCode::kOutOfMemory;
  return Status(code, fmt::format("{}: {} (errno {})", what, std::strerror(err), err));
}

void check_failed(const char* file, int line, const char* cond, std::string_view msg) {
  std::fprintf(stderr, "strata: CHECK failed at %s:%d: %s%s%.*s\n", file, line, cond,
               msg.empty() ? "" : ": ", static_cast<int>(msg.size()), msg.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata
