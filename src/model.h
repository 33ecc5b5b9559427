// The GPT-2-style decoder: its parameter layout and its forward/backward on a Device.
//
// Parameters are grouped by module — "embedding" (wte [Vp,C], wpe [maxT,C]), "block.<i>"
// (12 tensors), "final_norm" (lnfw, lnfb), and "head" (lm_head [Vp,C]) when embeddings are not
// tied — and each module's parameters form ONE flat buffer. The module is the unit that later
// layers shard (ZeRO-3), offload and prefetch (tier manager): one transfer per module, never
// one per tensor. Gradients (fp32) use the same flat layout as the parameters.
//
// Block tensor order inside the flat buffer, with shapes (C channels, L layers):
//   ln1w [C], ln1b [C], qkvw [3C,C], qkvb [3C], attprojw [C,C], attprojb [C],
//   ln2w [C], ln2b [C], fcw [4C,C], fcb [4C], fcprojw [C,4C], fcprojb [C]
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata {

// One named tensor inside a module's flat buffer.
struct TensorSpec {
  std::string name;
  size_t offset = 0;  // elements from the module's start
  size_t numel = 0;
  // GPT-2 init: kind 0 = normal(0, std), 1 = zeros, 2 = ones.
  int init_kind = 0;
  float init_std = 0.02f;
};

struct ModuleSpec {
  std::string name;  // "embedding", "block.3", "final_norm", "head"
  std::vector<TensorSpec> tensors;
  size_t numel = 0;  // total elements in the flat buffer
};

// The static shape of the model: derived from ModelConfig alone.
struct ModelLayout {
  int L = 0, NH = 0, C = 0, V = 0, Vp = 0, maxT = 0;
  bool tied = true;
  std::vector<ModuleSpec> modules;  // in forward order
  size_t num_params() const;

  static Result<ModelLayout> from_config(const ModelConfig& m);
  int embedding() const { return 0; }
  int block(int l) const { return 1 + l; }
  int final_norm() const { return 1 + L; }
  int head() const { return tied ? 0 : 2 + L; }  // module holding the output projection
};

// Fills `master` (fp32, module.numel elements) with GPT-2's initialization, deterministically
// from (seed, module index). Projection weights feeding the residual stream (attprojw,
// fcprojw) use std 0.02/sqrt(2L).
void init_module_params(const ModelLayout& layout, int module, uint64_t seed, float* master);

// Device-side buffers for a batch shape: activations and their gradients. Sized once.
struct ActivationSizes {
  size_t bytes = 0;  // total device bytes needed for activations + activation gradients
};
ActivationSizes activation_bytes(const ModelLayout& layout, int B, int T, DType dt);

// Forward and backward of one micro-batch on `device`'s compute stream, one module at a time,
// so that the caller (the tier manager) can bring each module's parameters to the device just
// before its step and take its gradients away just after. Order for one micro-batch:
//   begin_batch; forward_embedding; forward_block(0..L-1); forward_head;
//   backward_head; backward_block(L-1..0); backward_embedding
// Every call only enqueues work; pointers must stay valid until the stream has run it.
// `params` point to a module's flat parameter buffer (dt) on the device; `grads` to a module's
// flat fp32 gradient buffer on the device, accumulated into (+=).
class GptModel {
 public:
  // Allocates activation buffers on `device` for micro-batches of B sequences of T tokens.
  static Result<std::unique_ptr<GptModel>> create(Device& device, const ModelLayout& layout, int B,
                                                  int T, DType dt);
  ~GptModel();

  // Uploads tokens/targets (host arrays [B*T]); blocks until the previous batch's upload has
  // been consumed (the host staging buffer is reused).
  void begin_batch(const int32_t* tokens, const int32_t* targets);
  void forward_embedding(const void* params);
  void forward_block(int l, const void* params);
  // Final norm + output projection + fused cross-entropy. Per-token losses land in losses_out
  // (host [B*T]) once the stream has run; the logits are replaced by their gradient times dloss
  // (dloss = loss scale / (B*T*accumulation); 0 for eval).
  void forward_head(const void* final_norm_params, const void* head_params, float dloss,
                    float* losses_out);
  void backward_head(const void* final_norm_params, float* final_norm_grads,
                     const void* head_params, float* head_grads);
  void backward_block(int l, const void* params, float* grads);
  void backward_embedding(float* grads);

  int B() const { return B_; }
  int T() const { return T_; }

 private:
  GptModel(Device& d, const ModelLayout& l, int B, int T, DType dt)
      : dev_(d), lay_(l), B_(B), T_(T), dt_(dt) {}

  Device& dev_;
  ModelLayout lay_;
  int B_, T_;
  DType dt_;
  void* arena_ = nullptr;  // one device allocation for everything below
  int32_t* tokens_ = nullptr;
  int32_t* targets_ = nullptr;
  float* losses_ = nullptr;
  // per layer activations (dt unless noted)
  struct Layer {
    void *ln1, *qkv, *atty, *attproj, *res2, *ln2, *fch, *fch_gelu, *fcproj, *res3;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd, *att;
  };
  std::vector<Layer> layers_;
  void *encoded_, *lnf_, *logits_;
  float *lnf_mean_, *lnf_rstd_;
  // activation-gradient scratch, reused by every layer. dA: gradient w.r.t. the residual
  // stream at the current layer boundary, carried from one backward call to the next.
  void *dA_, *dB_, *dln_, *dqkv_, *datty_, *dfch_, *dfch_gelu_;
  float* datt_scratch_;
  // host staging for tokens/targets/losses (the copy engines need stable host memory)
  int32_t* host_io_ = nullptr;
  float* host_losses_ = nullptr;
};

}  // namespace strata
