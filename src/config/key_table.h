// The table of every config key (key_table.cc): its path, type and range, the Config member it
// writes, its doc line, and why the engine does not act on it when it does not. The parser
// (config.cc) walks documents against it; the reference docs are generated from it. Internal to
// src/config/.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "strata/config.h"

namespace strata::config_internal {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Value types.
enum class Kind {
  kBool,
  kInt,
  kReal,
  kSize,
  kString,
  kEnum,
  kStringList,
  kStringOrList,
  kBetas,
  kEnumList,  // a string or a list of strings, each one of values ("a|b|c"); kept as a list
  kRealList,  // a list of numbers, each in [lo, hi]
  kDType,
  kAny
};

struct Type {
  Kind kind;
  double lo = 0, hi = 0;
  bool lo_open = false, hi_open = false;
  const char* values = nullptr;  // kEnum: "a|b|c"
  uint64_t multiple = 0;         // kSize: must be a multiple of this
};

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kMaxInt = kInf;          // no upper bound (values beyond 2^62 are refused)
constexpr double kMaxI32 = 2147483647.0;  // keys stored in an int
// Keys the optimizer takes as a float (the learning rate, weight decay): the largest finite one.
constexpr double kMaxF32 = 3.4028234663852886e38;
constexpr double kIntLimit = 4.611686018427387904e18;  // 2^62

using Setter = void (*)(Config&, const json&);
using Getter = json (*)(const Config&);

constexpr unsigned kAuto = 1;  // "auto" accepted, resolved after the walk

// One accepted key. Bound keys write a Config member; unbound keys (DeepSpeed features strata
// does not have) are validated, compared with `dflt` (JSON text) and reported.
struct Key {
  std::string path;
  Type type;
  Setter set = nullptr;
  Getter get = nullptr;
  const char* doc = "";
  const char* not_acted = nullptr;  // nullptr: the engine acts on it
  unsigned flags = 0;
  const char* dflt = nullptr;  // unbound: default as JSON; bound: default's description if dynamic
  std::string alias_of;        // "" or the canonical key's path
  const char* group = "";      // heading in the reference docs
};

struct Schema {
  std::vector<Key> keys;
  std::map<std::string, size_t> leaf;                           // path -> index
  std::map<std::string, std::set<std::string>> children;        // section ("" = root) -> names
  std::map<std::string, std::vector<std::string>> alias_group;  // canonical -> all spellings
};

// Every key, in the order docs/CONFIG.md lists them (key_table.cc).
std::vector<Key> build_table();
// The table and its indexes, built once (schema.cc).
const Schema& schema();

}  // namespace strata::config_internal
