#include "src/model/family.h"

#include <fmt/format.h>

#include <climits>
#include <cstdint>

namespace strata {

const std::vector<const ModelFamily*>& model_families() {
  static const std::vector<const ModelFamily*> kFamilies = {
      &gpt2_family(), &llama_family(), &phi3_family(), &mixtral_family(), &qwen2_moe_family(),
  };
  return kFamilies;
}

const ModelFamily* family_for_type(const std::string& type) {
  for (const ModelFamily* f : model_families()) {
    for (const std::string& t : f->types) {
      if (t == type) return f;
    }
  }
  return nullptr;
}

const ModelFamily* family_for_hf_architecture(const std::string& arch) {
  for (const ModelFamily* f : model_families()) {
    for (const std::string& a : f->hf_architectures) {
      if (a == arch) return f;
    }
  }
  return nullptr;
}

std::string family_type_names() {
  std::string out;
  for (const ModelFamily* f : model_families()) out += (out.empty() ? "" : ", ") + f->types[0];
  return out;
}

std::string family_hf_architecture_names() {
  std::string out;
  for (const ModelFamily* f : model_families()) {
    for (const std::string& a : f->hf_architectures) out += (out.empty() ? "" : ", ") + a;
  }
  return out;
}

Status HfConfigIn::bad(const std::string& key, const std::string& why) const {
  return invalid_argument(fmt::format("{}: {}: {}", path_, key, why));
}

Status HfConfigIn::get_int(const char* key, int dflt, int* out) const {
  if (!has(key)) {
    if (dflt < 0) return bad(key, "missing");
    *out = dflt;
    return Status::ok();
  }
  const nlohmann::json& v = c_[key];
  if (!v.is_number_integer()) return bad(key, "not an integer");
  // (nlohmann parses a non-negative literal as unsigned, a negative one as signed.)
  const bool in_range = v.is_number_unsigned()
                            ? v.get<uint64_t>() >= 1 && v.get<uint64_t>() <= uint64_t(INT_MAX)
                            : v.get<int64_t>() >= 1 && v.get<int64_t>() <= INT_MAX;
  if (!in_range) {
    return bad(key, fmt::format("{} is not a size strata takes (1 to {})", v.dump(), INT_MAX));
  }
  *out = v.get<int>();
  return Status::ok();
}

Status HfConfigIn::get_real(const nlohmann::json& obj, const std::string& where, const char* key,
                            double dflt, double* out) const {
  if (!obj.contains(key) || obj[key].is_null()) {
    *out = dflt;
    return Status::ok();
  }
  if (!obj[key].is_number()) return bad(where + key, "not a number");
  *out = obj[key].get<double>();
  if (!(*out > 0)) return bad(where + key, fmt::format("{} is not positive", obj[key].dump()));
  return Status::ok();
}

Status HfConfigIn::get_string(const nlohmann::json& obj, const std::string& where, const char* key,
                              const std::string& dflt, std::string* out) const {
  if (!obj.contains(key) || obj[key].is_null()) {
    *out = dflt;
    return Status::ok();
  }
  if (!obj[key].is_string()) {
    return bad(where + key, fmt::format("{} is not a string", obj[key].dump()));
  }
  *out = obj[key].get<std::string>();
  return Status::ok();
}

Status HfConfigIn::get_bool(const char* key, bool dflt, bool* out) const {
  if (!has(key)) {
    *out = dflt;
    return Status::ok();
  }
  if (!c_[key].is_boolean()) return bad(key, "not true/false");
  *out = c_[key].get<bool>();
  return Status::ok();
}

}  // namespace strata
