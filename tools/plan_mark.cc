#include "tools/plan_mark.h"

#include <nlohmann/json.hpp>

#include "src/base/json_depth.h"
#include "src/plan/plan.h"

namespace strata {

bool written_by_plan(const std::string& flag, const std::string& text) {
  if (flag == "--svg") return text.find(kPlanSvgMark) != std::string::npos;
  // Plan's own files nest 4 levels; a deeper document is not one, refused before it is parsed
  // as every JSON strata reads is (json_depth.h).
  if (!check_json_depth(text, kMaxJsonDepth, /*comments=*/true).is_ok()) return false;
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false,
                                       /*ignore_comments=*/true);
  if (!j.is_object()) return false;
  if (flag == "--json") return j.value("magic", nlohmann::json()) == "strata-plan";
  return j.contains("strata") && j["strata"].is_object() &&
         j["strata"].value("written_by", nlohmann::json()) == kPlanWrittenBy;
}

}  // namespace strata
