// What the subcommands share on their command lines: an option table that parses argv and
// prints the usage on -h/--help or an error, the config and log level read the same way by
// every command that trains or evaluates (number values: parse_int_in and parse_number_in,
// strata/config.h; "a run directory means its latest checkpoint": resolve_checkpoint,
// src/checkpoint/checkpoint.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strata/config.h"

namespace strata::tools {

// The options of one subcommand; each writes into a variable of the caller's.
class CliOptions {
 public:
  // `command` names the subcommand in messages ("strata <command>: ..."); `usage` is printed
  // on stdout for -h/--help and after each usage error on stderr.
  CliOptions(std::string command, const char* usage);

  CliOptions& value(std::string flag, std::string* dst);                  // --flag VALUE
  CliOptions& repeated(std::string flag, std::vector<std::string>* dst);  // repeatable
  // --flag [VALUE]: `bare` when no value follows (the next argument starts with "--").
  CliOptions& optional_value(std::string flag, std::string* dst, std::string bare);
  CliOptions& flag(std::string flag, bool* dst, bool set_to = true);  // --flag

  // Parses argv[1..]. nullopt: the command goes on; else the exit code to return now (0 after
  // --help, 2 after a usage error, both printed).
  std::optional<int> parse(int argc, char** argv) const;

  // Prints "strata <command>: <message>" and the usage on stderr; returns 2.
  int usage_error(const std::string& message) const;
  // Prints "strata <command>: <message>" on stderr; returns 1.
  int fail(const std::string& message) const;

 private:
  enum class Kind { kValue, kRepeated, kOptional, kFlag };
  struct Option {
    std::string flag;
    Kind kind;
    void* dst;
    std::string bare;
    bool set_to = true;
  };
  std::string command_;
  const char* usage_;
  std::vector<Option> options_;
};

// Loads the config at `path` with --set `overrides` for `world_size` ranks, then sets the log
// level from `log_level` (--log-level; empty: strata.log_level). nullopt on success (`*out`
// holds the config), else the exit code after printing why (1: the config; 2: the level).
std::optional<int> load_cli_config(const CliOptions& cli, const std::string& path,
                                   const std::vector<std::string>& overrides, int world_size,
                                   const std::string& log_level, Config* out);

}  // namespace strata::tools
