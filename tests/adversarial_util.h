// What the adversarial tests of the trainer share (docs/RELIABILITY.md: each case found by trying
// to break strata has a test that failed before its fix; the tests live with the unit they
// break): a scratch directory, checkpoint metadata rewritten with a valid checksum, copies of the
// Hugging Face fixtures to damage, and the quiet fixtures the tests name (Hardening, Hardening2).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "src/base/safe_file.h"
#include "src/checkpoint/checkpoint.h"
#include "src/hf/export_dir.h"
#include "src/hf/hf_checkpoint.h"
#include "src/hf/safetensors.h"
#include "src/model/architecture.h"
#include "src/plan/plan.h"
#include "src/train/checkpoint_dir.h"
#include "src/train/data.h"
#include "src/train/metrics_log.h"
#include "src/train/resume_check.h"
#include "src/train/stop_signals.h"
#include "src/train/trainer.h"
#include "strata/checksum.h"
#include "strata/config.h"
#include "strata/log.h"
#include "strata/swap_space.h"
#include "tests/test_util.h"
#include "tests/train_util.h"

namespace strata::adversarial {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::must_train;
using test::name_of;
using test::small_config;
using test::train_status;

inline std::string temp_dir(const std::string& name) {
  return test::temp_dir("strata_adversarial", name);
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Rewrites a checkpoint's metadata JSON with `edit` and recomputes its length and CRC, as a
// tool (or an attacker) would: the checksum then says nothing, the values must be checked.
inline void edit_meta(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  std::string bytes = test::read_file(path);
  ASSERT_GE(bytes.size(), 32u);
  uint32_t jlen;
  std::memcpy(&jlen, bytes.data() + 12, 4);
  nlohmann::json j = nlohmann::json::parse(bytes.substr(32, jlen));
  edit(j);
  const std::string js = j.dump();
  std::string out = bytes.substr(0, 32) + js + bytes.substr(32 + jlen);
  const uint32_t len = uint32_t(js.size()), crc = crc32c(0, js.data(), js.size());
  std::memcpy(out.data() + 12, &len, 4);
  std::memcpy(out.data() + 16, &crc, 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
}

inline std::string fixture_copy(const std::string& name, const std::string& dir) {
  const std::string to = dir + "/" + name;
  fs::create_directories(to);
  for (const auto& e :
       fs::directory_iterator(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/" + name)) {
    if (e.path().filename() != "reference.safetensors") fs::copy(e.path(), to);
  }
  return to;
}

// small_config's run with model.from_pretrained `dir` (its context 16).
inline Config pretrained_config(const std::string& run_dir, const std::string& dir,
                                std::vector<std::string> extra = {}) {
  const std::string doc =
      test::read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json");
  json j = json::parse(doc);
  j["model"] = {{"from_pretrained", dir}, {"context", 16}};
  j["scheduler"]["params"]["warmup_num_steps"] = 1;
  std::vector<std::string> ov = {
      "train.checkpoint_dir=\"" + run_dir + "/ckpt\"",
      "zero_optimization.offload_optimizer.nvme_path=\"" + run_dir + "/swap\"",
      "train.eval_interval=0", "train.steps=2", "device.memory_limit=\"64MiB\""};
  ov.insert(ov.end(), extra.begin(), extra.end());
  fs::create_directories(run_dir + "/swap");
  auto cfg = parse_config(j.dump(), "<test>", ov);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  return cfg.is_ok() ? *cfg : Config{};
}

// parse_config's status for the llama fixture's config.json with `edit` applied.
inline Status llama_config_with(const std::string& name, const std::function<void(json&)>& edit,
                                std::vector<std::string> extra = {}) {
  const std::string dir = temp_dir(name);
  json c = json::parse(
      test::read_file(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/llama/config.json"));
  edit(c);
  std::ofstream(dir + "/config.json") << c.dump();
  json doc = {{"model", {{"from_pretrained", dir}}}, {"train_micro_batch_size_per_gpu", 1}};
  return parse_config(doc.dump(), "<test>", extra).status();
}

class Hardening : public ::testing::Test {
 protected:
  void SetUp() override { set_log_level(LogLevel::kError); }
};
class Hardening2 : public Hardening {};

}  // namespace strata::adversarial
