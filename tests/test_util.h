// Small helpers shared by the test binaries (tests include from the repository root).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "strata/config.h"

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

// A GPT model shape (model.type gpt2) with these sizes, every other model key its default.
inline ModelConfig gpt_shape(int layers, int heads, int width, int vocab, int context) {
  ModelConfig mc;
  mc.n_layer = layers;
  mc.n_head = heads;
  mc.n_embd = width;
  mc.vocab_size = vocab;
  mc.context = context;
  return mc;
}

}  // namespace strata::test
