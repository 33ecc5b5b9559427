// Does a file at one of `strata plan`'s output paths carry the mark strata plan leaves, so that
// plan may replace it without --force? --write-config's config holds strata.written_by
// (kPlanWrittenBy), --json's report the magic "strata-plan", --svg's chart kPlanSvgMark.
//
// `text` is whatever the file holds (a user's config with comments, a binary, a document nested
// 100,000 deep): anything that is not plan's own output is simply "no" (false), never a crash
// or an exception. Thread-safe.
#pragma once

#include <string>

namespace strata {

// `flag` is "--write-config", "--json" or "--svg"; `text` the existing file's contents.
bool written_by_plan(const std::string& flag, const std::string& text);

}  // namespace strata
