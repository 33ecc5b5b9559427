// Checking one config value against its key in the table: type, range, enum spelling, size
// suffixes; and the "unknown key; did you mean" suggestion. Used by the parser (config.cc) and
// the reference docs (reference_doc.cc).
#include "src/config/leaf.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace strata::config_internal {

const std::string& canonical(const Key& k) { return k.alias_of.empty() ? k.path : k.alias_of; }

std::string join(std::string_view a, std::string_view b) {
  return a.empty() ? std::string(b) : fmt::format("{}.{}", a, b);
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (std::tolower(a[i - 1]) == std::tolower(b[j - 1]) ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// "path: unknown key; did you mean X?" where X is the closest sibling by edit distance, or the
// full path of a key of exactly this name in another section when no sibling is close (a key
// put at the wrong level).
Status unknown_key(const std::string& section, const std::string& name) {
  const Schema& s = schema();
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const std::string& k : s.children.at(section)) {
    size_t d = edit_distance(name, k);
    if (d < best_d) best_d = d, best = k;
  }
  if (best_d > 1) {
    std::string elsewhere;
    for (const auto& [parent, names] : s.children) {
      if (!names.count(name)) continue;
      std::string full = join(parent, name);
      if (elsewhere.empty() || full.size() < elsewhere.size()) elsewhere = full;
    }
    if (!elsewhere.empty()) best = elsewhere;
  }
  return invalid_argument(
      fmt::format("{}: unknown key; did you mean {}?", join(section, name), best));
}

std::string short_dump(const json& v) {
  // An override value that is not JSON is taken as a string, which may not be valid UTF-8.
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

Status type_error(const std::string& path, std::string_view expected, const json& v) {
  std::string hint;
  if (v.is_string() && v.get<std::string>() == "auto") hint = "; \"auto\" is not accepted here";
  return invalid_argument(
      fmt::format("{}: expected {}, got {}{}", path, expected, short_dump(v), hint));
}

static std::string fmt_bound(double x, Kind kind) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (kind != Kind::kReal) return fmt::format("{}", static_cast<int64_t>(x));
  return fmt::format("{}", x);
}
std::string fmt_range(const Type& t) {
  return fmt::format("{}{}, {}{}", t.lo_open ? "(" : "[", fmt_bound(t.lo, t.kind),
                     fmt_bound(t.hi, t.kind), t.hi_open || std::isinf(t.hi) ? ")" : "]");
}
bool in_range(double x, const Type& t) {
  if (t.lo_open ? !(x > t.lo) : !(x >= t.lo)) return false;
  if (t.hi_open ? !(x < t.hi) : !(x <= t.hi)) return false;
  return true;
}
Status range_error(const std::string& path, const std::string& value, const Type& t) {
  return invalid_argument(fmt::format("{}: {} out of range {}", path, value, fmt_range(t)));
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t p = s.find(sep, start);
    out.emplace_back(s.substr(start, p == std::string_view::npos ? p : p - start));
    if (p == std::string_view::npos) return out;
    start = p + 1;
  }
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(a[i]) != std::tolower(b[i])) return false;
  }
  return true;
}

// Checks one leaf value and returns it normalized (sizes in bytes, enums spelled canonically,
// integers as integers, a single path as a list).
Result<json> check_value(const Type& t, const json& v, const std::string& path) {
  switch (t.kind) {
    case Kind::kBool:
      if (!v.is_boolean()) return type_error(path, "boolean", v);
      return v;
    case Kind::kInt: {
      double d;
      if (v.is_number_integer()) {
        if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{1} << 62) {
          return invalid_argument(
              fmt::format("{}: {} is too large (integers are at most 2^62)", path, v.dump()));
        }
        d = static_cast<double>(v.get<int64_t>());
      } else if (v.is_number_float() && std::isfinite(v.get<double>()) &&
                 v.get<double>() == std::floor(v.get<double>())) {
        d = v.get<double>();
        if (std::fabs(d) > kIntLimit) {
          return invalid_argument(
              fmt::format("{}: {} is too large (integers are at most 2^62)", path, v.dump()));
        }
      } else {
        return type_error(path, "integer", v);
      }
      if (!in_range(d, t)) return range_error(path, v.dump(), t);
      return json(static_cast<int64_t>(d));
    }
    case Kind::kReal: {
      if (!v.is_number()) return type_error(path, "number", v);
      double d = v.get<double>();
      if (!in_range(d, t)) return range_error(path, v.dump(), t);
      return json(d);
    }
    case Kind::kSize: {
      size_t bytes;
      if (v.is_number()) {
        double d = v.get<double>();
        if (d < 0 || !std::isfinite(d)) return range_error(path, v.dump(), t);
        if (d != std::floor(d)) {
          return invalid_argument(fmt::format("{}: {} is not a whole number", path, v.dump()));
        }
        if (d >= 1.8446744073709552e19) {
          return invalid_argument(
              fmt::format("{}: {} is too large: a size is at most 2^64-1 bytes", path, v.dump()));
        }
        bytes = static_cast<size_t>(d);
      } else if (v.is_string()) {
        Result<size_t> r = parse_size(v.get<std::string>());
        if (!r.is_ok()) return r.status().with_context(path);
        bytes = *r;
      } else {
        return type_error(path, "size (a number or a string like \"16GiB\")", v);
      }
      if (!in_range(static_cast<double>(bytes), t)) {
        return range_error(path, std::to_string(bytes), t);
      }
      if (t.multiple != 0 && bytes % t.multiple != 0) {
        return invalid_argument(
            fmt::format("{}: {} is not a multiple of {}", path, bytes, t.multiple));
      }
      return json(static_cast<uint64_t>(bytes));
    }
    case Kind::kString:
      if (!v.is_string()) return type_error(path, "string", v);
      return v;
    case Kind::kEnum:
    case Kind::kDType: {
      std::vector<std::string> allowed = split(t.values, '|');
      if (!v.is_string()) {
        return type_error(path, fmt::format("one of {}", fmt::join(allowed, ", ")), v);
      }
      std::string s = v.get<std::string>();
      if (t.kind == Kind::kDType) {
        DType d;
        if (parse_dtype(s, &d) &&
            std::find(allowed.begin(), allowed.end(), dtype_name(d)) != allowed.end()) {
          return json(dtype_name(d));
        }
      } else {
        for (const std::string& a : allowed) {
          if (iequals(a, s)) return json(a);
        }
      }
      return invalid_argument(
          fmt::format("{}: \"{}\" is not one of {}", path, s, fmt::join(allowed, ", ")));
    }
    case Kind::kStringList:
    case Kind::kStringOrList:
      if (v.is_string()) return t.kind == Kind::kStringList ? json::array({v}) : v;
      if (v.is_array() &&
          std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); })) {
        return v;
      }
      return type_error(path, "string or list of strings", v);
    case Kind::kEnumList: {
      std::vector<std::string> allowed = split(t.values, '|');
      const std::string what =
          fmt::format("one of {}, or a list of them", fmt::join(allowed, ", "));
      if (!v.is_string() && !v.is_array()) return type_error(path, what, v);
      json out = json::array();
      for (const json& e : v.is_string() ? json::array({v}) : v) {
        if (!e.is_string()) return type_error(path, what, e);
        const std::string s = e.get<std::string>();
        const auto it = std::find_if(allowed.begin(), allowed.end(),
                                     [&](const std::string& a) { return iequals(a, s); });
        if (it == allowed.end()) {
          return invalid_argument(
              fmt::format("{}: \"{}\" is not one of {}", path, s, fmt::join(allowed, ", ")));
        }
        out.push_back(*it);
      }
      return out;
    }
    case Kind::kRealList: {
      if (!v.is_array()) return type_error(path, "list of numbers", v);
      json out = json::array();
      for (size_t i = 0; i < v.size(); ++i) {
        const std::string p = fmt::format("{}[{}]", path, i);
        if (!v[i].is_number()) return type_error(p, "number", v[i]);
        const double d = v[i].get<double>();
        if (!std::isfinite(d) || !in_range(d, t)) return range_error(p, v[i].dump(), t);
        out.push_back(d);
      }
      return out;
    }
    case Kind::kBetas: {
      if (!v.is_array() || v.size() != 2) return type_error(path, "[beta1, beta2]", v);
      for (size_t i = 0; i < 2; ++i) {
        std::string p = fmt::format("{}[{}]", path, i);
        if (!v[i].is_number()) return type_error(p, "number", v[i]);
        if (!in_range(v[i].get<double>(), t)) return range_error(p, v[i].dump(), t);
      }
      return json::array({v[0].get<double>(), v[1].get<double>()});
    }
    case Kind::kAny:
      return v;
  }
  return internal_error("unreachable");
}

}  // namespace strata::config_internal
