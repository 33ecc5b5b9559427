// Checking one config value against its key in the table (leaf.cc): its type and range, enum
// spellings, size suffixes, and the "unknown key; did you mean" suggestion. Internal to
// src/config/.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "src/config/key_table.h"
#include "strata/status.h"

namespace strata::config_internal {

// The key's canonical path (its own, or the one it is an alias of).
const std::string& canonical(const Key& k);
// "a.b" (or "b" when a is empty).
std::string join(std::string_view a, std::string_view b);
// Case-insensitive Levenshtein distance.
size_t edit_distance(std::string_view a, std::string_view b);
// "path: unknown key; did you mean X?" where X is the closest sibling by edit distance, or the
// full path of a key of exactly this name in another section when no sibling is close.
Status unknown_key(const std::string& section, const std::string& name);
// The value as JSON, cut to 60 characters.
std::string short_dump(const json& v);
// "path: expected E, got V" (with a hint when V is "auto").
Status type_error(const std::string& path, std::string_view expected, const json& v);
// "[lo, hi)" as the docs and the errors print it.
std::string fmt_range(const Type& t);
bool in_range(double x, const Type& t);
// "path: V out of range [lo, hi)".
Status range_error(const std::string& path, const std::string& value, const Type& t);
std::vector<std::string> split(std::string_view s, char sep);
bool iequals(std::string_view a, std::string_view b);
// Checks one leaf value and returns it normalized (sizes in bytes, enums spelled canonically,
// integers as integers, a single path as a list).
Result<json> check_value(const Type& t, const json& v, const std::string& path);

}  // namespace strata::config_internal
