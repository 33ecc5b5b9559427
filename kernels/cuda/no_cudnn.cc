// create_cudnn_attention when strata was built without cuDNN (CMake found no cudnn.h and cuDNN
// frontend headers; see docs/GPU.md "Build"): the fused attention runs on the own kernels.
#include "kernels/cuda/attention_library.h"

namespace strata {

std::unique_ptr<AttentionLibrary> create_cudnn_attention(int /*ordinal*/, bool /*deterministic*/,
                                                         std::string* why) {
  *why = "strata was built without cuDNN (configure with STRATA_CUDNN_ROOT to use it)";
  return nullptr;
}

}  // namespace strata
