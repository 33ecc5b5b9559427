#include "src/base/json_depth.h"

#include <fmt/format.h>

namespace strata {

Status check_json_depth(std::string_view text, size_t max_depth, bool comments) {
  size_t depth = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '"') {  // skip the string, escapes included
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\') ++i;
      }
    } else if (comments && c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (comments && c == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      const size_t end = text.find("*/", i + 2);
      if (end == std::string_view::npos) return Status::ok();  // the parser reports it
      i = end + 1;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return invalid_argument(fmt::format(
            "JSON nested deeper than {} levels at byte {}; no strata document nests like this "
            "(is it the right file?)",
            max_depth, i));
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return Status::ok();
}

}  // namespace strata
