#include "strata/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace strata {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_rank{-1};
std::mutex g_write_mu;
const char* level_tag(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kError:
      return "E";
    default:
      return "?";
  }
}
}  // namespace

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }
void set_log_rank(int rank) { g_rank.store(rank); }

bool parse_log_level(std::string_view name, LogLevel* out) {
  static constexpr std::pair<std::string_view, LogLevel> kNames[] = {{"debug", LogLevel::kDebug},
                                                                     {"info", LogLevel::kInfo},
                                                                     {"warn", LogLevel::kWarn},
                                                                     {"error", LogLevel::kError},
                                                                     {"off", LogLevel::kOff}};
  for (auto& [n, l] : kNames) {
    if (n == name) {
      *out = l;
      return true;
    }
  }
  return false;
}

void log_line(LogLevel level, std::string_view text) {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t t = system_clock::to_time_t(now);
  int ms = static_cast<int>(duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm;
  localtime_r(&t, &tm);
  int rank = g_rank.load();
  std::string prefix = rank >= 0 ? fmt::format("[{:02}:{:02}:{:02}.{:03} r{} {}] ", tm.tm_hour,
                                               tm.tm_min, tm.tm_sec, ms, rank, level_tag(level))
                                 : fmt::format("[{:02}:{:02}:{:02}.{:03} {}] ", tm.tm_hour,
                                               tm.tm_min, tm.tm_sec, ms, level_tag(level));
  std::lock_guard<std::mutex> lock(g_write_mu);
  std::fwrite(prefix.data(), 1, prefix.size(), stderr);
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fputc('\n', stderr);
}

std::string format_bytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, kUnits[u]);
}

}  // namespace strata
