// A pre-scan that bounds how deeply a JSON text nests, before any parser sees it.
//
// nlohmann::json parses iteratively, but destroying, dumping and walking a value recurse, so a
// document like 100,000 '[' overflows the stack. Every JSON strata reads from a user or a file
// (configs, --set values, checkpoint metadata, shard manifests, machine profiles) is first
// checked here: strings and (optionally) comments are skipped, brackets counted.
#pragma once

#include <cstddef>
#include <string_view>

#include "strata/status.h"

namespace strata {

// The deepest a strata JSON document may nest. Configs nest 4 levels, checkpoint metadata 3.
inline constexpr size_t kMaxJsonDepth = 64;

// kInvalidArgument when `text` nests objects/arrays deeper than `max_depth`, naming the byte
// offset where it does ("nested deeper than 64 levels at byte 1234"). `comments`: skip // and
// /* */ comments as the config parser does. Malformed text is left for the parser to report.
Status check_json_depth(std::string_view text, size_t max_depth = kMaxJsonDepth,
                        bool comments = false);

}  // namespace strata
