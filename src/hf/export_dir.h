// Who may write a Hugging Face export into a directory (train.export_dir, `strata export --out`,
// `strata export --adapter`).
//
// An export writes config.json and model*.safetensors over what a directory holds, so it first
// makes sure the directory is its to write: missing (created, and removed again when the export
// fails, so a failure leaves no empty directory), holding no model (no config.json,
// *.safetensors, *.bin, *.index.json, a PEFT adapter's adapter_config.json), or holding an
// earlier export of the same lineage (the run_id of the strata checkpoint it came from,
// recorded in kExportMarker beside the files).
// Anything else — a base model, another run's export — is refused with a message naming what is
// there, unless the caller forces it (`strata export --force`). The directory a run's
// model.from_pretrained reads is never written.
//
// Once an export has written its files, the files of the model that was there before and that
// the export did not replace (an old layout's shards, another model's generation_config.json or
// pytorch_model.bin) are removed, so the directory holds one model.
//
// Thread-compatible; rank 0 alone exports.
#pragma once

#include <functional>
#include <string>

#include "strata/status.h"

namespace strata {

// The lineage record an export leaves in its directory: {"run_id": "...", "step": N}.
inline constexpr const char* kExportMarker = ".strata-export.json";

// Who is writing, for the checks and their messages.
struct ExportTarget {
  std::string dir;
  std::string key;              // how the user named it: "train.export_dir" or "--out"
  std::string run_id;           // the lineage of the checkpoint exported ("" unknown)
  int64_t step = 0;             // its step (recorded in the marker)
  std::string from_pretrained;  // model.from_pretrained ("" none): never written
  bool force = false;           // replace whatever model is there
  std::string force_hint;       // appended to a refusal: how to force it ("" none)
  bool adapter = false;         // a PEFT adapter (export --adapter), not a merged model: the
                                // two never share a directory without `force`
};

// The checks that need no lineage, for a preflight before any training: the directory is not
// model.from_pretrained's, is a directory (or missing under a directory that is), and is
// writable. Errors name `t.key`, the path and what to do.
Status check_export_dir(const ExportTarget& t);

// check_export_dir, then that the directory holds no model an export of `t.run_id` may not
// replace (see above). The refusal (kInvalidArgument) names the files there and the lineage of
// an export, and says what to do.
Status check_export_owner(const ExportTarget& t);

// check_export_owner, then `write` (the export into t.dir). When it fails, the directories it
// created are removed again (when empty). When it succeeds, the earlier model's files it did not
// replace are removed and kExportMarker records t.run_id.
Status export_as_owner(const ExportTarget& t, const std::function<Status()>& write);

}  // namespace strata
