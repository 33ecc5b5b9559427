// The config parser: one table of every accepted key drives parsing, unknown-key suggestions,
// overrides, the not-acted-on report and the reference docs.
//
// Flow: parse JSON -> apply overrides (paths checked against the table) -> walk the document,
// checking each leaf's type and range and writing it into the Config -> resolve "auto" and
// defaults that depend on other keys -> cross-key rules (batch triple, fp16/bf16, ...) -> list
// settings the engine does not act on yet.
#include "strata/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "src/base/json_depth.h"
#include "src/base/json_text.h"
#include "src/base/safe_file.h"
#include "src/config/config_ctx.h"
#include "src/config/key_table.h"
#include "src/config/leaf.h"
#include "src/config/model_shape.h"
#include "strata/log.h"

namespace strata {
namespace {

using json = nlohmann::json;
using namespace config_internal;

// Walks `obj`, the document's `section`, into ctx. On an error *at is the path of the key it is
// about (the parser names where that key came from: the file or an override).
Status walk(const json& obj, const std::string& section, Ctx* ctx, std::string* at) {
  const Schema& s = schema();
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string path = join(section, it.key());
    *at = path;
    const json& v = it.value();
    auto leaf = s.leaf.find(path);
    if (leaf != s.leaf.end()) {
      const Key& key = s.keys[leaf->second];
      if (v.is_null()) continue;  // DeepSpeed's None: the default
      const std::string& canon = canonical(key);
      if (ctx->given.count(canon) || ctx->autos.count(canon)) {
        return invalid_argument(
            fmt::format("{}: given twice (as {}); these keys are aliases, keep one", path,
                        fmt::join(s.alias_group.at(canon), " and ")));
      }
      if ((key.flags & kAuto) && v.is_string() && v.get<std::string>() == "auto") {
        ctx->autos.insert(canon);
        continue;
      }
      STRATA_ASSIGN_OR_RETURN(json norm, check_value(key.type, v, path), "");
      if (key.set) key.set(ctx->cfg, norm);
      ctx->given[canon] = std::move(norm);
      continue;
    }
    if (s.children.count(path)) {
      if (v.is_null()) continue;
      if (!v.is_object()) return type_error(path, "object", v);
      STRATA_RETURN_IF_ERROR(walk(v, path, ctx, at), "");
      continue;
    }
    return unknown_key(section, it.key());
  }
  return Status::ok();
}

// Writes the override `text` ("a.b.c=value") into doc. Its errors are about `text`, which the
// caller names.
Status apply_override(json* doc, const std::string& text) {
  size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    return invalid_argument("expected path=value, e.g. zero_optimization.stage=3");
  }
  std::string path = text.substr(0, eq);
  std::string value_text = text.substr(eq + 1);
  std::vector<std::string> segs = split(path, '.');
  const Schema& s = schema();
  std::string section;
  const Key* leaf = nullptr;
  for (size_t i = 0; i < segs.size(); ++i) {
    if (segs[i].empty()) {
      return invalid_argument(fmt::format("{}: empty name in path", path));
    }
    std::string full = join(section, segs[i]);
    auto it = s.leaf.find(full);
    if (it != s.leaf.end()) {
      leaf = &s.keys[it->second];
      if (leaf->type.kind == Kind::kAny) break;  // free-form below this key
      if (i + 1 != segs.size()) {
        return invalid_argument(fmt::format("{} is a value, not a section", full));
      }
      break;
    }
    if (!s.children.count(full)) {
      return unknown_key(section, segs[i]);
    }
    section = full;
  }
  Status depth = check_json_depth(value_text);
  if (!depth.is_ok()) return depth;
  json value = json::parse(value_text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = value_text;  // not JSON (or 1e400): a string

  json* cur = doc;
  for (size_t i = 0; i + 1 < segs.size(); ++i) {
    json& next = (*cur)[segs[i]];
    if (!next.is_object()) next = json::object();
    cur = &next;
  }
  // An override of one spelling of an aliased key replaces every spelling in the file.
  if (leaf && leaf->type.kind != Kind::kAny) {
    for (const std::string& spelling : s.alias_group.at(canonical(*leaf))) {
      cur->erase(split(spelling, '.').back());
    }
  }
  (*cur)[segs.back()] = std::move(value);
  return Status::ok();
}

// How messages name an override: the command line's spelling of it, a long value cut short.
std::string override_origin(const std::string& text) {
  constexpr size_t kMost = 80;
  if (text.size() <= kMost) return "--set " + text;
  return fmt::format("--set {}... ({} characters)", text.substr(0, kMost), text.size());
}

// True when `text` names the key `path` or a key below it (not another key that starts or ends
// with the same letters: train.steps is not train.steps_per_print).
bool names_key(const std::string& text, const std::string& path) {
  auto word = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
  };
  for (size_t at = text.find(path); at != std::string::npos; at = text.find(path, at + 1)) {
    const size_t end = at + path.size();
    if ((at == 0 || !word(text[at - 1])) &&
        (end == text.size() || !word(text[end]) || text[end] == '.')) {
      return true;
    }
  }
  return false;
}

// The origin of an error about the key at `at`: the last override that gave it (its own path or
// a section above it), else `origin`, the file.
std::string key_origin(const std::vector<std::pair<std::string, std::string>>& applied,
                       const std::string& at, const std::string& origin) {
  for (auto it = applied.rbegin(); it != applied.rend(); ++it) {
    const std::string& p = it->first;
    if (at == p || (at.size() > p.size() && at.compare(0, p.size(), p) == 0 && at[p.size()] == '.'))
      return override_origin(it->second);
  }
  return origin;
}

// The origin of an error across keys (the batch triple, precision, ...): the file, with the
// overrides of the keys the message names ("x.json with --set train_batch_size=7").
std::string rule_origin(const std::vector<std::pair<std::string, std::string>>& applied,
                        const std::string& message, const std::string& origin) {
  std::string out = origin;
  std::set<std::string> named;
  for (auto it = applied.rbegin(); it != applied.rend(); ++it) {
    if (!names_key(message, it->first) || !named.insert(it->first).second) continue;
    out += fmt::format("{} {}", named.size() == 1 ? " with" : ",", override_origin(it->second));
  }
  return out;
}

std::string value_text(const json& v) {
  return v.is_string() ? v.get<std::string>()
                       : v.dump(-1, ' ', false, json::error_handler_t::replace);
}

void list_not_acted_on(Ctx* ctx) {
  static const Config defaults;
  const Schema& s = schema();
  for (const Key& k : s.keys) {
    if (!k.not_acted || !k.alias_of.empty()) continue;
    auto it = ctx->given.find(k.path);
    if (it == ctx->given.end()) continue;
    json value = k.get ? k.get(ctx->cfg) : it->second;
    json dflt = k.get ? k.get(defaults) : json::parse(k.dflt);
    if (k.type.kind == Kind::kAny) {
      if (value.is_object() && value.value("enabled", true) == false) continue;
    } else if (value == dflt) {
      continue;
    }
    ctx->cfg.not_acted_on.push_back(
        fmt::format("{} = {}: accepted; {}", k.path, value_text(value), k.not_acted));
  }
}

// DeepSpeed refuses a key given twice in one object (its JSON loader raises); so does strata.
// nlohmann::json keeps the last silently, so a SAX pass looks for duplicates first.
class DuplicateKeyFinder : public json::json_sax_t {
 public:
  std::string duplicate;  // path of the first duplicate, "" if none

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override {
    frames_.push_back({true, {}, "", 0});
    return true;
  }
  bool key(string_t& k) override {
    Frame& f = frames_.back();
    f.key = k;
    if (!f.keys.insert(k).second) {
      duplicate = path();
      return false;  // stop: report the first one
    }
    return true;
  }
  bool end_object() override { return end(); }
  bool start_array(std::size_t) override {
    frames_.push_back({false, {}, "", 0});
    return true;
  }
  bool end_array() override { return end(); }
  bool parse_error(std::size_t, const std::string&, const json::exception&) override {
    return false;
  }

 private:
  struct Frame {
    bool object;
    std::set<std::string> keys;
    std::string key;
    size_t index;
  };
  bool value() {
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().index;
    return true;
  }
  bool end() {
    frames_.pop_back();
    return value();
  }
  std::string path() const {
    std::string p;
    for (const Frame& f : frames_) {
      p = f.object ? join(p, f.key) : fmt::format("{}[{}]", p, f.index);
    }
    return p;
  }
  std::vector<Frame> frames_;
};

}  // namespace

bool parse_int_in(const std::string& text, long long lo, long long hi, long long* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0' || x < lo || x > hi) return false;
  *out = x;
  return true;
}

bool parse_number_in(const std::string& text, double lo, double hi, double* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(text.c_str(), &end);
  if (errno != 0 || end == text.c_str() || *end != '\0' || !std::isfinite(x) || x < lo || x > hi) {
    return false;
  }
  *out = x;
  return true;
}

Result<size_t> parse_size(const std::string& text) {
  auto bad = [&](std::string_view why) -> Status {
    return invalid_argument(fmt::format(
        "\"{}\": {}; use a byte count or a number with a unit: k, M, G, T (x1000) or KiB, MiB, "
        "GiB, TiB (x1024), e.g. \"16GiB\"",
        text, why));
  };
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i < text.size() && text[i] == '-') return bad("negative size");
  if (i == text.size() || !(std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    return bad("not a size");
  }
  const char* begin = text.c_str() + i;
  char* end = nullptr;
  errno = 0;
  double mant = std::strtod(begin, &end);
  if (end == begin || errno == ERANGE) return bad("not a size");
  std::string unit(end);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();
  std::string u;
  for (char ch : unit) u.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
  static const std::pair<const char*, double> kUnits[] = {{"", 1},
                                                          {"b", 1},
                                                          {"k", 1e3},
                                                          {"kb", 1e3},
                                                          {"m", 1e6},
                                                          {"mb", 1e6},
                                                          {"g", 1e9},
                                                          {"gb", 1e9},
                                                          {"t", 1e12},
                                                          {"tb", 1e12},
                                                          {"p", 1e15},
                                                          {"pb", 1e15},
                                                          {"ki", 1024.0},
                                                          {"kib", 1024.0},
                                                          {"mi", 1048576.0},
                                                          {"mib", 1048576.0},
                                                          {"gi", 1073741824.0},
                                                          {"gib", 1073741824.0},
                                                          {"ti", 1099511627776.0},
                                                          {"tib", 1099511627776.0},
                                                          {"pi", 1125899906842624.0},
                                                          {"pib", 1125899906842624.0}};
  double scale = 0;
  for (const auto& [name, mult] : kUnits) {
    if (u == name) scale = mult;
  }
  if (scale == 0) return bad(fmt::format("unknown unit \"{}\"", unit));
  double bytes = mant * scale;
  if (!std::isfinite(bytes) || bytes >= 1.8446744073709552e19) return bad("too large");
  double whole = std::round(bytes);
  if (std::fabs(bytes - whole) > 1e-6 * std::max(1.0, whole)) {
    return bad("not a whole number of bytes");
  }
  return static_cast<size_t>(whole);
}

Result<Config> parse_config(const std::string& json_text, const std::string& origin,
                            const std::vector<std::string>& overrides, int world_size) {
  STRATA_ASSIGN_OR_RETURN(json doc, parse_json_text(json_text, origin, /*comments=*/true), "");
  DuplicateKeyFinder dups;
  (void)json::sax_parse(json_text, &dups, json::input_format_t::json, /*strict=*/true,
                        /*ignore_comments=*/true);
  if (!dups.duplicate.empty()) {
    return invalid_argument(
        fmt::format("{}: {}: key given twice in one object; keep one (DeepSpeed refuses this too)",
                    origin, dups.duplicate));
  }
  if (!doc.is_object()) {
    return invalid_argument(fmt::format("{}: expected a JSON object at the top level, got {}",
                                        origin, short_dump(doc)));
  }
  if (world_size < 1) {
    return invalid_argument(
        fmt::format("{}: world_size {} must be at least 1", origin, world_size));
  }
  // (path, override) of each override applied, in order: an error names the one that gave its
  // key rather than the file.
  std::vector<std::pair<std::string, std::string>> applied;
  for (const std::string& ov : overrides) {
    Status st = apply_override(&doc, ov);
    if (!st.is_ok()) return st.with_context(override_origin(ov));
    applied.emplace_back(ov.substr(0, ov.find('=')), ov);
  }
  Ctx ctx;
  std::string at;
  Status st = walk(doc, "", &ctx, &at);
  if (!st.is_ok()) return st.with_context(key_origin(applied, at, origin));
  st = resolve(&ctx, world_size);
  if (!st.is_ok()) return st.with_context(rule_origin(applied, st.message(), origin));
  list_not_acted_on(&ctx);
  // strata.optimizer.defer says where an overlapped step that clipping holds back runs: without
  // the overlap there is no such step, and the key does nothing.
  if (ctx.given.count("strata.optimizer.defer") && !ctx.cfg.strata.optimizer_overlap &&
      ctx.cfg.strata.optimizer_defer != "auto") {
    log_warn(
        "{}: strata.optimizer.defer = {} has no effect with strata.optimizer.overlap = false "
        "(every step runs after backward); set strata.optimizer.overlap = true to use it, or "
        "remove it",
        origin, ctx.cfg.strata.optimizer_defer);
  }
  return std::move(ctx.cfg);
}

Status check_model_given(const Config& config) {
  if (config.model.given) return Status::ok();
  return invalid_argument(
      "the config has no model: add a \"model\" section, either {\"from_pretrained\": "
      "\"<Hugging Face model directory>\", \"context\": <tokens>} to fine-tune a checkpoint, "
      "or model.type and its shape keys (n_layer, n_head, n_embd, vocab_size, context; see "
      "docs/CONFIG.md) for a fresh one, or --set model.from_pretrained=DIR. A DeepSpeed config "
      "(e.g. the Hugging Face Trainer's ZeRO-3 one) describes the engine, not the model");
}

Status check_model_shape(const ModelConfig& m) {
  if (m.n_layer < 1 || m.n_head < 1 || m.n_embd < 1 || m.vocab_size < 2 || m.context < 1) {
    return invalid_argument("model: n_layer, n_head, n_embd, context must be >= 1, vocab >= 2");
  }
  if (m.head_dim == 0 && m.n_embd % m.n_head != 0) {
    return invalid_argument(
        fmt::format("model.n_embd: {} is not divisible by model.n_head ({})", m.n_embd, m.n_head));
  }
  if (m.pad_token_id >= m.vocab_size) {
    return invalid_argument(
        fmt::format("model.pad_token_id: {} is not a token of the vocabulary "
                    "(model.vocab_size {}); -1 for none",
                    m.pad_token_id, m.vocab_size));
  }
  if (m.padded_vocab_size != 0 && m.padded_vocab_size < m.vocab_size) {
    return invalid_argument(
        fmt::format("model.padded_vocab_size: {} is smaller than model.vocab_size ({})",
                    m.padded_vocab_size, m.vocab_size));
  }
  return Status::ok();
}

std::string model_section_json(const ModelConfig& model) {
  static const std::set<std::string> kAlways = {"model.type",       "model.n_layer",
                                                "model.n_head",     "model.n_embd",
                                                "model.vocab_size", "model.context"};
  Config given, defaults;
  given.model = model;
  json section = json::object();
  for (const Key& k : schema().keys) {
    if (k.path.rfind("model.", 0) != 0 || k.get == nullptr || !k.alias_of.empty()) continue;
    const json v = k.get(given);
    if (kAlways.count(k.path) == 0 && v == k.get(defaults)) continue;
    std::string pointer = k.path.substr(5);  // "/..." (not "/" + substr: GCC 12 -Wrestrict)
    pointer[0] = '/';
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    section[json::json_pointer(pointer)] = v;
  }
  return section.dump();
}

Result<Config> load_config(const std::string& path, const std::vector<std::string>& overrides,
                           int world_size) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return invalid_argument(fmt::format("{}: is a directory; give the config file's path", path));
  }
  STRATA_RETURN_IF_ERROR(expect_regular_file(path, "the config"), "");
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return errno_status(errno ? errno : ENOENT,
                        fmt::format("{}: cannot open config file (check the path)", path));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return errno_status(errno ? errno : EIO, fmt::format("{}: reading", path));
  return parse_config(ss.str(), path, overrides, world_size);
}

void log_config_notes(const Config& config) {
  for (const std::string& line : config.resolved_auto) log_info("config: {}", line);
  for (const std::string& line : config.not_acted_on) log_info("config: {}", line);
}

}  // namespace strata
