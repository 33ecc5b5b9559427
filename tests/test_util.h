// Small helpers shared by the test binaries (tests include from the repository root).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "strata/config.h"

namespace strata::test {

// The directories a test process made under the system temp dir, removed when it exits with
// every test passed: kept where one failed (to look at), with STRATA_KEEP_TEST_DIRS set, or in
// a forked child that exits (its parent still uses them). A crash keeps them too.
class TempDirs {
 public:
  static TempDirs& get() {
    static TempDirs dirs;
    return dirs;
  }
  void add(const std::filesystem::path& p) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(p);
  }
  ~TempDirs() {
    if (::getpid() != pid_ || std::getenv("STRATA_KEEP_TEST_DIRS") != nullptr) return;
    if (!::testing::UnitTest::GetInstance()->Passed()) return;
    for (const auto& p : dirs_) {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  }

 private:
  // GoogleTest's instance made first, so that it outlives this one (statics end in reverse).
  TempDirs() : pid_(::getpid()) { ::testing::UnitTest::GetInstance(); }
  const pid_t pid_;
  std::mutex mu_;
  std::vector<std::filesystem::path> dirs_;
};

// A fresh, empty directory under the system temp dir, unique to this process, removed at its
// exit as TempDirs says.
inline std::string temp_dir_named(const std::string& leaf) {
  const std::filesystem::path p = std::filesystem::temp_directory_path() / leaf;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  TempDirs::get().add(p);
  return p.string();
}

// temp_dir_named's <prefix>_<name>_<pid>.
inline std::string temp_dir(const std::string& prefix, const std::string& name) {
  return temp_dir_named(prefix + "_" + name + "_" + std::to_string(::getpid()));
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
