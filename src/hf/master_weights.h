// The fp32 master weights of a model, from a strata checkpoint or from model.from_pretrained:
// what `strata generate` runs (src/model/generate.h).
#pragma once

#include <string>
#include <vector>

#include "src/model/architecture.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata {

// Every module's fp32 master weights: from a strata checkpoint (a file, or a sharded
// checkpoint's manifest: the shards' slices put together), or, when `checkpoint` is "", from
// model.from_pretrained. The checkpoint's model must be `arch`'s (checked, naming both shapes).
// A LoRA run's checkpoint (arch has adapters) holds only the adapters: its weights are the base
// with the adapters merged in (merged_lora_modules, what `strata export` writes), so generate
// gives the merged export's tokens.
Result<std::vector<std::vector<float>>> load_master_weights(const Architecture& arch,
                                                            const ModelConfig& model,
                                                            const std::string& checkpoint);

}  // namespace strata
