#include "src/hf/adapter_config.h"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "src/base/json_text.h"

namespace strata {
namespace {

using json = nlohmann::json;

// A value as a message shows it: at most 40 characters.
std::string shown(const json& v) {
  return v.dump(-1, ' ', false, json::error_handler_t::replace).substr(0, 40);
}

}  // namespace

Status check_adapter_config(const std::string& text, const std::string& path,
                            const AdapterExpectation& want) {
  STRATA_ASSIGN_OR_RETURN(json cfg, parse_json_text(text, path), "");
  if (!cfg.is_object() || cfg.value("peft_type", json()) != "LORA") {
    return invalid_argument(
        fmt::format("{}: not a LoRA adapter (peft_type must be \"LORA\")", path));
  }
  for (const char* k : {"use_dora", "use_rslora"}) {
    const json v = cfg.value(k, json());
    if (!v.is_null() && v != false) {
      return invalid_argument(
          fmt::format("{}: {} is {}: only plain LoRA is supported", path, k, shown(v)));
    }
  }
  const auto r_in = json_int_in(cfg.value("r", json()), 1, 1 << 20);
  const json alpha_in = cfg.value("lora_alpha", json());
  if (!r_in || !alpha_in.is_number()) {
    return invalid_argument(
        fmt::format("{}: r must be a positive integer and lora_alpha a number (they are {} and {})",
                    path, shown(cfg.value("r", json())), shown(alpha_in)));
  }
  const int r = int(*r_in);
  const double alpha = alpha_in.get<double>();
  // alpha / r is compared as the float LoraLayout holds, converted only when a float holds it
  // (a double beyond a float's range converts with undefined behaviour in C++).
  const double scale = alpha / r;
  if (r != want.r || !std::isfinite(scale) || std::fabs(scale) > 3.4e38 ||
      float(scale) != want.scaling) {
    return invalid_argument(fmt::format(
        "{}: r {} and lora_alpha {} differ from the config's lora.r {} and scaling {} (set "
        "lora.r and lora.lora_alpha to the adapter's)",
        path, r, alpha, want.r, want.scaling));
  }
  std::set<std::string> targets;
  if (cfg.contains("target_modules") && cfg["target_modules"].is_array()) {
    for (const json& t : cfg["target_modules"]) {
      if (!t.is_string()) {
        return invalid_argument(
            fmt::format("{}: target_modules holds {}, not a module name", path, shown(t)));
      }
      targets.insert(t.get<std::string>());
    }
  }
  if (targets != want.target_modules) {
    std::string names;
    for (const std::string& t : want.target_modules) names += (names.empty() ? "" : ", ") + t;
    return invalid_argument(
        fmt::format("{}: target_modules differ from the model's adapted layers ({}): set "
                    "lora.target_modules to the adapter's",
                    path, names));
  }
  return Status::ok();
}

}  // namespace strata
