// Helpers for the tests that compare with reference tensors written by Python tools and for
// the tests over the Hugging Face fixtures (tests include from the repository root).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/hf/safetensors.h"
#include "strata/config.h"
#include "tests/test_util.h"

namespace strata::test {

// The Hugging Face fixture `name` (tests/fixtures/hf/, tools/make_hf_fixtures.py).
inline std::string fixture(const std::string& name) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/" + name;
}

// configs/tiny-cpu.json without its model section, with `model` and overrides.
inline Result<Config> config_for(const nlohmann::json& model, std::vector<std::string> extra = {}) {
  nlohmann::json doc =
      nlohmann::json::parse(read_file(std::string(STRATA_SOURCE_DIR) + "/configs/tiny-cpu.json"));
  doc.erase("model");
  doc["scheduler"]["params"]["warmup_num_steps"] = 1;
  if (!model.is_null()) doc["model"] = model;
  return parse_config(doc.dump(), "<hf test>", extra);
}

// Every tensor of safetensors file `path`, as fp32, by name (a failure is a test failure and an
// empty map).
inline std::map<std::string, std::vector<float>> read_safetensors_f32(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f.is_ok()) << f.status().to_string();
  if (!f.is_ok()) return out;
  for (const SafetensorsTensor& t : (*f)->tensors()) {
    std::vector<float> v(t.numel());
    EXPECT_TRUE((*f)->read_as(t, DType::kF32, v.data()).is_ok());
    out[t.name] = std::move(v);
  }
  return out;
}

// |a - ref| / |ref| over the whole vectors (ref's size).
inline double rel_norm_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  double d = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    n += double(ref[i]) * ref[i];
  }
  return std::sqrt(d) / std::max(std::sqrt(n), 1e-30);
}

}  // namespace strata::test
