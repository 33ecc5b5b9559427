// Small helpers shared by the test binaries (tests include from the repository root).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace strata::test {

// A fresh, empty directory under the system temp dir, unique to this process:
// <prefix>_<name>_<pid>.
inline std::string temp_dir(const std::string& prefix, const std::string& name) {
  const std::filesystem::path p = std::filesystem::temp_directory_path() /
                                  (prefix + "_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

// The whole file as a string ("" when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace strata::test
