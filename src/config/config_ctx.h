// The config parser's state between its steps (src/config/config.cc parses and walks the
// document into it; src/config/resolve.cc resolves what it leaves to "auto" and checks the
// combinations no one key can). Internal to src/config.
#pragma once

#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "strata/config.h"
#include "strata/status.h"

namespace strata::config_internal {

// Parser state.
struct Ctx {
  Config cfg;
  std::map<std::string, nlohmann::json>
      given;                    // canonical path -> normalized value (absent: not set)
  std::set<std::string> autos;  // canonical paths set to "auto"
};

inline void note_auto(Ctx* ctx, const std::string& path, const std::string& value) {
  ctx->cfg.resolved_auto.push_back(fmt::format("{} = {} (auto)", path, value));
}
inline bool is_auto(const Ctx& ctx, const char* path) { return ctx.autos.count(path) != 0; }
inline bool is_given(const Ctx& ctx, const char* path) { return ctx.given.count(path) != 0; }

// Resolves ctx->cfg's "auto" values and defaults that depend on other keys, and checks the
// cross-key rules, a section at a time (resolve.cc). Errors name the key and the fix.
Status resolve(Ctx* ctx, int world_size);

}  // namespace strata::config_internal
