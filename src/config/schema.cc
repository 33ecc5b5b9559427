// The key table's indexes (key_table.h): leaves by path, the child names of every section, and
// the spellings of each key.
#include <string>

#include "src/config/key_table.h"

namespace strata::config_internal {

const Schema& schema() {
  static const Schema* s = [] {
    auto* out = new Schema;
    out->keys = build_table();
    for (size_t i = 0; i < out->keys.size(); ++i) {
      const Key& k = out->keys[i];
      out->leaf[k.path] = i;
      std::string parent;
      size_t start = 0;
      for (;;) {
        size_t dot = k.path.find('.', start);
        std::string name = k.path.substr(start, dot == std::string::npos ? dot : dot - start);
        out->children[parent].insert(name);
        if (dot == std::string::npos) break;
        parent = k.path.substr(0, dot);
        start = dot + 1;
      }
      const std::string& canon = k.alias_of.empty() ? k.path : k.alias_of;
      out->alias_group[canon].push_back(k.path);
    }
    return out;
  }();
  return *s;
}

}  // namespace strata::config_internal
