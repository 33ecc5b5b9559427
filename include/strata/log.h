// A small leveled logger: one line per message, "[time rank level] text", to stderr.
//
// The level and the rank shown come from the one Runtime object (set_log_level,
// set_log_rank); both are set once at start-up, before threads start, and read atomically.
// Messages are formatted with {fmt} format strings.
// Thread safety: log() may be called from any thread; each line is written whole.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace strata {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Rank shown in each line; -1 (the default) hides it.
void set_log_rank(int rank);
// Parses "debug" | "info" | "warn" | "error" | "off".
bool parse_log_level(std::string_view name, LogLevel* out);

void log_line(LogLevel level, std::string_view text);

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> f, Args&&... args) {
  if (level < log_level()) return;
  log_line(level, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  log(LogLevel::kDebug, f, std::forward<Args>(args)...);
}
template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  log(LogLevel::kInfo, f, std::forward<Args>(args)...);
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  log(LogLevel::kWarn, f, std::forward<Args>(args)...);
}
template <typename... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  log(LogLevel::kError, f, std::forward<Args>(args)...);
}

// "1.50 GiB", "512 B", "3.2 MiB".
std::string format_bytes(double bytes);

}  // namespace strata
