// Parsing the JSON text of a file strata reads (configs, a Hugging Face config.json or weight
// index), so that every malformed document is an error naming the file and the place.
//
// The text's nesting is bounded first (json_depth.h), then it is parsed; a syntax error names
// `origin`, the line and the column, and what was found; a number beyond a double is named as
// such. Thread-safe (no shared state).
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

// The document in `text`. `comments`: // and /* */ comments are skipped (configs). Errors are
// kInvalidArgument: "<origin>: invalid JSON at line L column C: <what>".
Result<nlohmann::json> parse_json_text(const std::string& text, const std::string& origin,
                                       bool comments = false);

// "line L column C" of byte offset `byte` in `text` (both from 1).
std::string line_col(std::string_view text, size_t byte);

}  // namespace strata
