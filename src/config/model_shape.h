// The model shape's own checks, one place for parse_config (src/config/config.cc) and the
// models (decoder_shape, src/model/decoder.cc), so that a shape the config parser accepts is
// one the architecture accepts, with the same message.
//
// Thread safety: a plain function of a value.
#pragma once

#include "strata/config.h"
#include "strata/status.h"

namespace strata {

// OK when `model` has at least one layer, head, width unit and position, a vocabulary of 2 or
// more, its width divisible by its heads, and padded_vocab_size not below vocab_size (0 is
// "auto": vocab_size rounded up to 64 by whoever resolves it, so not checked). Else
// kInvalidArgument naming the key and both values.
Status check_model_shape(const ModelConfig& model);

}  // namespace strata
