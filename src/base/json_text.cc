#include "src/base/json_text.h"

#include <fmt/format.h>

#include "src/base/json_depth.h"

namespace strata {

std::string line_col(std::string_view text, size_t byte) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return fmt::format("line {} column {}", line, col);
}

Result<nlohmann::json> parse_json_text(const std::string& text, const std::string& origin,
                                       bool comments) {
  // Deep nesting would overflow the stack in the value's destructor and dump().
  Status depth = check_json_depth(text, kMaxJsonDepth, comments);
  if (!depth.is_ok()) return depth.with_context(origin);
  try {
    return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/true, comments);
  } catch (const nlohmann::json::out_of_range& e) {
    // 406: a number that does not fit a double (1e400).
    std::string what = e.what();
    const size_t at = what.find("] ");
    return invalid_argument(
        fmt::format("{}: invalid JSON: {}; numbers must fit a double (about 1.8e308)", origin,
                    at == std::string::npos ? what : what.substr(at + 2)));
  } catch (const nlohmann::json::parse_error& e) {
    // e.what(): "[json.exception.parse_error.101] parse error at line 3, column 1: <detail>".
    std::string what = e.what();
    size_t at = what.find("column");
    at = at == std::string::npos ? std::string::npos : what.find(": ", at);
    std::string detail = at == std::string::npos ? what : what.substr(at + 2);
    return invalid_argument(fmt::format("{}: invalid JSON at {}: {}", origin,
                                        line_col(text, e.byte == 0 ? 0 : e.byte - 1), detail));
  }
}

std::optional<int64_t> json_int_in(const nlohmann::json& v, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) return std::nullopt;
  // (nlohmann parses a non-negative literal as unsigned, a negative one as signed.)
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (hi < 0 || u > uint64_t(hi) || (lo > 0 && u < uint64_t(lo))) return std::nullopt;
    return int64_t(u);
  }
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) return std::nullopt;
  return x;
}

}  // namespace strata
