#include "tools/cli.h"

#include <cstdio>
#include <cstring>
#include <utility>

#include "strata/log.h"

namespace strata::tools {

CliOptions::CliOptions(std::string command, const char* usage)
    : command_(std::move(command)), usage_(usage) {}

CliOptions& CliOptions::value(std::string flag, std::string* dst) {
  options_.push_back({std::move(flag), Kind::kValue, dst, {}});
  return *this;
}

CliOptions& CliOptions::repeated(std::string flag, std::vector<std::string>* dst) {
  options_.push_back({std::move(flag), Kind::kRepeated, dst, {}});
  return *this;
}

CliOptions& CliOptions::optional_value(std::string flag, std::string* dst, std::string bare) {
  options_.push_back({std::move(flag), Kind::kOptional, dst, std::move(bare)});
  return *this;
}

CliOptions& CliOptions::flag(std::string flag, bool* dst, bool set_to) {
  options_.push_back({std::move(flag), Kind::kFlag, dst, {}, set_to});
  return *this;
}

std::optional<int> CliOptions::parse(int argc, char** argv) const {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(usage_, stdout);
      return 0;
    }
    const Option* o = nullptr;
    for (const Option& c : options_) {
      if (c.flag == a) o = &c;
    }
    if (!o) return usage_error("unknown option '" + a + "'");
    const bool has_next = i + 1 < argc;
    switch (o->kind) {
      case Kind::kFlag:
        *static_cast<bool*>(o->dst) = o->set_to;
        break;
      case Kind::kOptional:
        *static_cast<std::string*>(o->dst) =
            has_next && std::strncmp(argv[i + 1], "--", 2) != 0 ? argv[++i] : o->bare;
        break;
      case Kind::kValue:
      case Kind::kRepeated:
        if (!has_next) return usage_error(a + " needs a value");
        if (o->kind == Kind::kValue) {
          *static_cast<std::string*>(o->dst) = argv[++i];
        } else {
          static_cast<std::vector<std::string>*>(o->dst)->push_back(argv[++i]);
        }
        break;
    }
  }
  return std::nullopt;
}

int CliOptions::usage_error(const std::string& message) const {
  std::fprintf(stderr, "strata %s: %s\n\n%s", command_.c_str(), message.c_str(), usage_);
  return 2;
}

int CliOptions::fail(const std::string& message) const {
  std::fprintf(stderr, "strata %s: %s\n", command_.c_str(), message.c_str());
  return 1;
}

std::optional<int> load_cli_config(const CliOptions& cli, const std::string& path,
                                   const std::vector<std::string>& overrides, int world_size,
                                   const std::string& log_level, Config* out) {
  Result<Config> cfg = load_config(path, overrides, world_size);
  if (!cfg.is_ok()) return cli.fail(cfg.status().message());
  LogLevel level;
  const std::string& lvl = log_level.empty() ? cfg->strata.log_level : log_level;
  if (!parse_log_level(lvl, &level)) {
    cli.fail("--log-level: '" + lvl + "' is not debug|info|warn|error|off");
    return 2;
  }
  set_log_level(level);
  *out = std::move(*cfg);
  return std::nullopt;
}

}  // namespace strata::tools
