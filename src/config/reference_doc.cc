// The reference docs of every config key (docs/CONFIG.md), generated from the key table.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>

#include "src/config/key_table.h"
#include "src/config/leaf.h"
#include "strata/config.h"

namespace strata {

using namespace config_internal;

std::string config_reference_markdown() {
  static const Config defaults;
  const Schema& s = schema();
  std::string out;
  std::string section;
  for (const Key& k : s.keys) {
    if (k.group != section) {
      section = k.group;
      out += fmt::format(
          "\n### {}\n\n| key | type | default | allowed | acted on | meaning |\n"
          "|---|---|---|---|---|---|\n",
          section);
    }
    std::string type, allowed;
    switch (k.type.kind) {
      case Kind::kBool:
        type = "bool";
        break;
      case Kind::kInt:
        type = "integer";
        allowed = fmt_range(k.type);
        break;
      case Kind::kReal:
        type = "number";
        allowed = fmt_range(k.type);
        break;
      case Kind::kSize:
        type = "size";
        allowed = fmt_range(k.type);
        if (k.type.multiple) allowed += fmt::format(", multiple of {}", k.type.multiple);
        break;
      case Kind::kString:
        type = "string";
        break;
      case Kind::kEnum:
      case Kind::kDType:
        type = "enum";
        allowed = fmt::format("{}", fmt::join(split(k.type.values, '|'), " \\| "));
        break;
      case Kind::kStringList:
      case Kind::kStringOrList:
        type = "string or list";
        break;
      case Kind::kEnumList:
        type = "enum or list";
        allowed = fmt::format("{}", fmt::join(split(k.type.values, '|'), " \\| "));
        break;
      case Kind::kRealList:
        type = "list of numbers";
        allowed = "each in " + fmt_range(k.type);
        break;
      case Kind::kBetas:
        type = "[number, number]";
        allowed = "each in " + fmt_range(k.type);
        break;
      case Kind::kAny:
        type = "object";
        break;
    }
    if (k.flags & kAuto) type += " or \"auto\"";
    std::string dflt;
    if (!k.alias_of.empty()) {
      dflt = "";
    } else if (k.get && k.dflt) {
      dflt = k.dflt;
    } else if (k.get) {
      dflt = k.get(defaults).dump();
    } else {
      dflt = k.dflt;
    }
    std::string acted = k.not_acted ? fmt::format("no: {}", k.not_acted) : "yes";
    std::string doc =
        k.alias_of.empty() ? std::string(k.doc) : fmt::format("alias of `{}`", k.alias_of);
    if (!k.alias_of.empty()) acted = "as its key";
    out += fmt::format("| `{}` | {} | {} | {} | {} | {} |\n", k.path, type,
                       dflt.empty() ? "" : "`" + dflt + "`", allowed, acted, doc);
  }
  return out;
}

}  // namespace strata
