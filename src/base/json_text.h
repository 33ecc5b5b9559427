// Parsing the JSON text of a file strata reads (configs, a Hugging Face config.json or weight
// index), so that every malformed document is an error naming the file and the place.
//
// The text's nesting is bounded first (json_depth.h), then it is parsed; a syntax error names
// `origin`, the line and the column, and what was found; a number beyond a double is named as
// such. Thread-safe (no shared state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

// The document in `text`. `comments`: // and /* */ comments are skipped (configs). Errors are
// kInvalidArgument: "<origin>: invalid JSON at line L column C: <what>".
Result<nlohmann::json> parse_json_text(const std::string& text, const std::string& origin,
                                       bool comments = false);

// `v` as an integer in [lo, hi], or nothing when it is not an integer (a float, a string, ...)
// or lies outside: converting such a value with get<int>() is undefined behaviour in nlohmann.
std::optional<int64_t> json_int_in(const nlohmann::json& v, int64_t lo, int64_t hi);

// "line L column C" of byte offset `byte` in `text` (both from 1).
std::string line_col(std::string_view text, size_t byte);

}  // namespace strata
