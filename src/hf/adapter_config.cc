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

// target_parameters (PEFT's names of fused parameters, matched as their whole name or its end
// after a ".") select exactly want.target_parameters.
Status check_target_parameters(const json& cfg, const std::string& path,
                               const AdapterExpectation& want) {
  const json in = cfg.value("target_parameters", json());
  if (!in.is_null() && !in.is_array()) {
    return invalid_argument(
        fmt::format("{}: target_parameters is {}, not a list of names", path, shown(in)));
  }
  std::set<std::string> selected;
  for (const json& t : in.is_array() ? in : json::array()) {
    if (!t.is_string()) {
      return invalid_argument(
          fmt::format("{}: target_parameters holds {}, not a parameter name", path, shown(t)));
    }
    const std::string name = t.get<std::string>();
    bool any = false;
    for (const std::string& p : want.target_parameters) {
      if (p == name || (p.size() > name.size() && p[p.size() - name.size() - 1] == '.' &&
                        p.compare(p.size() - name.size(), name.size(), name) == 0)) {
        selected.insert(p);
        any = true;
      }
    }
    if (!any) {
      return invalid_argument(
          fmt::format("{}: target_parameters names {}, which the model does not adapt: set "
                      "lora.target_parameters to the adapter's",
                      path, shown(t)));
    }
  }
  if (selected != want.target_parameters) {
    std::string names;
    for (const std::string& p : want.target_parameters) names += (names.empty() ? "" : ", ") + p;
    return invalid_argument(fmt::format(
        "{}: target_parameters differ from the model's adapted expert parameters ({}): set "
        "lora.target_parameters to the adapter's",
        path, names.empty() ? "none" : names));
  }
  return Status::ok();
}

}  // namespace

Status check_adapter_config(const std::string& text, const std::string& path,
                            const AdapterExpectation& want) {
  STRATA_ASSIGN_OR_RETURN(json cfg, parse_json_text(text, path), "");
  if (!cfg.is_object() || cfg.value("peft_type", json()) != "LORA") {
    return invalid_argument(
        fmt::format("{}: not a LoRA adapter (peft_type must be \"LORA\")", path));
  }
  const json dora = cfg.value("use_dora", json());
  if (!dora.is_null() && dora != false) {
    return invalid_argument(
        fmt::format("{}: use_dora is {}: DoRA adapters are not supported (only LoRA and rsLoRA)",
                    path, shown(dora)));
  }
  const json rslora_in = cfg.value("use_rslora", json());
  if (!rslora_in.is_null() && !rslora_in.is_boolean()) {
    return invalid_argument(
        fmt::format("{}: use_rslora is {}, not true or false", path, shown(rslora_in)));
  }
  const bool rslora = rslora_in == true;
  // lora_dropout shapes training only (the config's lora.lora_dropout decides a run's): read
  // and checked, not compared.
  const json dropout_in = cfg.value("lora_dropout", json());
  if (!dropout_in.is_null() &&
      !(dropout_in.is_number() && dropout_in.get<double>() >= 0 && dropout_in.get<double>() < 1)) {
    return invalid_argument(
        fmt::format("{}: lora_dropout is {}, not a number in [0, 1)", path, shown(dropout_in)));
  }
  const json bias = cfg.value("bias", json());
  if (!bias.is_null() && bias != "none") {
    return invalid_argument(fmt::format(
        "{}: bias is {}: the adapter carries trained biases of the base, which strata's frozen "
        "LoRA base cannot take (only bias \"none\" adapters load)",
        path, shown(bias)));
  }
  // What would give some layers other ranks, scalings or no adapter, or lora_B a bias: each
  // absent, false or empty in an adapter strata reads.
  for (const char* k : {"lora_bias", "layers_to_transform", "rank_pattern", "alpha_pattern"}) {
    const json v = cfg.value(k, json());
    if (!v.is_null() && v != false && !(v.is_object() && v.empty()) &&
        !(v.is_array() && v.empty())) {
      return invalid_argument(fmt::format(
          "{}: {} is {}: strata's adapters are one rank and scaling on every block, lora_B "
          "without a bias; such an adapter does not load",
          path, k, shown(v)));
    }
  }
  const json to_save = cfg.value("modules_to_save", json());
  if (!to_save.is_null() && !(to_save.is_array() && to_save.empty())) {
    return invalid_argument(fmt::format(
        "{}: modules_to_save is {}: the adapter carries whole trained modules beside its LoRA "
        "weights, which strata's frozen LoRA base cannot take",
        path, shown(to_save)));
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
  // The scaling is compared as the float LoraLayout holds, converted only when a float holds
  // it (a double beyond a float's range converts with undefined behaviour in C++).
  const double scale = rslora ? alpha / std::sqrt(double(r)) : alpha / r;
  if (r != want.r || !std::isfinite(scale) || std::fabs(scale) > 3.4e38 ||
      float(scale) != want.scaling) {
    return invalid_argument(fmt::format(
        "{}: r {}, lora_alpha {} and use_rslora {} (scaling {}) differ from the config's lora.r "
        "{} and scaling {} (set lora.r, lora.lora_alpha and lora.use_rslora to the adapter's)",
        path, r, alpha, rslora, scale, want.r, want.scaling));
  }
  const json targets_in = cfg.value("target_modules", json());
  if (targets_in.is_string()) {
    // A string: "all-linear", or a pattern the config must give too (the same selection).
    const std::string t = targets_in.get<std::string>();
    const bool same = t == "all-linear" ? want.all_sites : t == want.target_pattern;
    if (!same) {
      return invalid_argument(fmt::format(
          "{}: target_modules \"{}\" selects other layers than the config's lora.target_modules: "
          "set lora.target_modules to the adapter's",
          path, t.substr(0, 40)));
    }
  }
  std::set<std::string> targets;
  if (targets_in.is_string()) {
    targets = want.target_modules;
  } else if (targets_in.is_array()) {
    for (const json& t : targets_in) {
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
  return check_target_parameters(cfg, path, want);
}

}  // namespace strata
