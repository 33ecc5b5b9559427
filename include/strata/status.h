// Status and Result<T>: how every fallible strata call reports failure.
//
// Anything the environment can make fail (I/O, allocation, configuration, peers) returns a
// [[nodiscard]] Status or Result<T>. A Status is one pointer wide and costs nothing when OK.
// A failed Status carries a code and a message; each level that passes a failure up adds a
// line of context with STRATA_RETURN_IF_ERROR(expr, "what I was doing"), so the final message
// reads like a trail: "loading checkpoint run/ckpt-100.bin: reading header: short read ...".
//
// Broken invariants (bugs, not inputs) use STRATA_CHECK, which is always on and aborts with
// the file, line and condition.
//
// Thread safety: Status and Result are values; distinct objects may be used from any thread.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace strata {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,  // bad input: config, flags, file contents
  kNotFound,         // a file, key or device that does not exist
  kOutOfMemory,      // a tier, arena or buffer pool has no room
  kIoError,          // read/write/fsync failed (errno in the message)
  kNoSpace,          // ENOSPC or a preflight found too little free space
  kCorrupt,          // checksum or magic mismatch: data that must not be trusted
  kUnavailable,      // a capability this machine/kernel/build lacks
  kInternal,         // a peer or library returned something unexpected
  kCancelled,        // stopped on request (SIGINT/SIGTERM)
};

// Short lower-case name of a code, e.g. "invalid argument".
const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status ok() { return Status(); }

  bool is_ok() const { return rep_ == nullptr; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  const std::string& message() const;

  // Returns a copy with `context` prepended: "context: message". OK stays OK.
  Status with_context(std::string_view context) const;

  // "invalid argument: <message>" or "OK".
  std::string to_string() const;

  // Marks a Status as deliberately ignored.
  void ignore() const {}

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::shared_ptr<const Rep> rep_;
};

inline Status invalid_argument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status out_of_memory(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
inline Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status no_space(std::string m) { return {StatusCode::kNoSpace, std::move(m)}; }
inline Status corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }

// Status from an errno value: "<what>: <strerror(err)> (errno N)". ENOSPC maps to kNoSpace,
// ENOENT to kNotFound, ENOMEM to kOutOfMemory, everything else to kIoError.
Status errno_status(int err, std::string_view what);

// A value or a failed Status. Access to value() on an error is a bug (STRATA_CHECK).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}          // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {    // NOLINT
    if (std::get<Status>(v_).is_ok()) std::abort();  // an OK Status carries no value
  }

  bool is_ok() const { return v_.index() == 0; }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return check(), std::get<T>(v_); }
  const T& value() const& { return check(), std::get<T>(v_); }
  T&& value() && { return check(), std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  void check() const {
    if (!is_ok()) {
      std::fprintf(stderr, "strata: Result::value() on error: %s\n",
                   std::get<Status>(v_).to_string().c_str());
      std::abort();
    }
  }
  std::variant<T, Status> v_;
};

[[noreturn]] void check_failed(const char* file, int line, const char* cond, std::string_view msg);

}  // namespace strata

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

// Always-on invariant check. Optional second argument: a message (std::string or const char*).
#define STRATA_CHECK(cond, ...)                                                           \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::strata::check_failed(__FILE__, __LINE__, #cond, ::std::string_view{__VA_ARGS__}); \
  } while (0)

// Returns the Status of `expr` from the enclosing function if it failed, with `context`
// (a string expression, evaluated only on failure) prepended.
#define STRATA_RETURN_IF_ERROR(expr, context)      \
  do {                                             \
    ::strata::Status strata_status_ = (expr);      \
    if (!strata_status_.is_ok()) [[unlikely]]      \
      return strata_status_.with_context(context); \
  } while (0)

// `lhs = value of expr` or return its Status with context.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr, context) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_result_, __LINE__), lhs, expr, context)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr, context) \
  auto tmp = (expr);                                           \
  if (!tmp.is_ok()) [[unlikely]]                               \
    return tmp.status().with_context(context);                 \
  lhs = std::move(tmp).value()
