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

// What happens to a block's activations between its forward and its backward
// (strata.activations; DeepSpeed's activation_checkpointing.* maps onto it, see src/config/config.cc).
//   kKeep       every block's intermediate tensors stay on the device until its backward: the
//               most device memory, no extra work.
//   kRecompute  only each block's INPUT (the residual stream, [B,T,C] in dt) stays, plus ONE
//               block's set of intermediates (a scratch shared by all blocks); backward_block(l)
//               first re-runs block l's forward from its saved input into the scratch. One extra
//               block forward per block per micro-batch; the numbers do not change (the same
//               deterministic kernels run on the same inputs).
//   kOffload    like kRecompute, but block inputs leave the device (to host-tier buffers,
//               through an ActivationStore) and come back one block ahead of the backward that
//               needs them; two input buffers stay on the device. The last block's input never
//               leaves: its backward follows the head's directly.
enum class ActivationMode : uint8_t { kKeep = 0, kRecompute = 1, kOffload = 2 };
const char* activation_mode_name(ActivationMode mode);  // "keep", "recompute", "offload"
// Parses strata.activations; an unknown name is kInvalidArgument naming the key.
Result<ActivationMode> parse_activation_mode(const std::string& name);

// Memory a batch shape needs for activations under a mode. Device bytes are exact: they are
// what GptModel::create allocates (one arena), so the tier manager's preflight and the planner
// use this function. Host bytes (kOffload only) are the host-tier buffers the tier manager
// reserves for block inputs: stash_layers buffers of stash_bytes, each rounded to 4 KiB.
struct ActivationSizes {
  size_t bytes = 0;        // device: activations + activation gradients (+ block inputs)
  size_t host_bytes = 0;   // host tier: offloaded block inputs (kOffload), else 0
  int stash_layers = 0;    // kOffload: blocks whose input leaves the device (L - 1)
  size_t stash_bytes = 0;  // one block input: B*T*C elements of dt
};
ActivationSizes activation_bytes(const ModelLayout& layout, int B, int T, DType dt,
                                 ActivationMode mode = ActivationMode::kKeep);

// Where kOffload sends block inputs: the TierManager implements it with host-tier buffers
// reserved at its creation (TierOptions::stash_*). Every call only enqueues work and is made
// from the one host thread that drives the model.
class ActivationStore {
 public:
  virtual ~ActivationStore() = default;
  // Copies `bytes` at device pointer `dev` into layer `layer`'s host buffer on the
  // device-to-host stream, after all work enqueued so far on the compute stream. `dev` must not
  // be overwritten until compute_waits_activation(layer) has been enqueued. Fails (nothing
  // enqueued) on a layer or size outside the reservation.
  virtual Status stash_activation(int layer, const void* dev, size_t bytes) = 0;
  // Copies layer `layer`'s stashed bytes back to device pointer `dev` on the host-to-device
  // stream, after all work enqueued so far on the compute stream (the previous user of `dev`)
  // and after every stash enqueued so far. Fails if the layer was never stashed.
  virtual Status restore_activation(int layer, void* dev) = 0;
  // Makes the compute stream wait (in stream order) for the latest stash or restore of `layer`.
  virtual void compute_waits_activation(int layer) = 0;
};

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
  // Allocates activation buffers on `device` for micro-batches of B sequences of T tokens, as
  // activation_bytes(layout, B, T, dt, mode).bytes says. kOffload needs `store` (which must
  // outlive the model, and have room for activation_bytes(...).stash_layers block inputs);
  // backward_block must then be called in order L-1..0 after the micro-batch's forward. Under
  // kRecompute and kOffload, backward_block(l)'s `params` must hold the same values as
  // forward_block(l)'s (no optimizer step may land between them: the trainer's schedules,
  // delayed update included, only change parameters between steps).
  static Result<std::unique_ptr<GptModel>> create(Device& device, const ModelLayout& layout, int B,
                                                  int T, DType dt,
                                                  ActivationMode mode = ActivationMode::kKeep,
                                                  ActivationStore* store = nullptr);
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
  ActivationMode mode() const { return mode_; }
  // The first failure of an ActivationStore call (kOffload), OK otherwise. The store also keeps
  // it for its next sync point (TierManager::end_backward), so a step whose block inputs did
  // not come back fails before its optimizer step.
  Status status() const { return error_; }

 private:
  GptModel(Device& d, const ModelLayout& l, int B, int T, DType dt, ActivationMode mode,
           ActivationStore* store)
      : dev_(d), lay_(l), B_(B), T_(T), dt_(dt), mode_(mode), store_(store) {}
  struct Layer;
  // Block l's input, its output (the next block's input or the head's), its intermediates.
  void* input(int l) const;
  void* output(int l) const;
  Layer& acts(int l);
  // Enqueues block l's forward from `in` into `y`; writes the residual output to `out` unless
  // it is nullptr (a recompute, whose output is not needed). With kOffload, the compute stream
  // first waits for any stash still reading input slot `wait_slot_before_out` (-1: none).
  void block_forward(int l, const void* p, const void* in, Layer& y, void* out,
                     int wait_slot_before_out);
  // kOffload: the compute stream waits for the stash still reading input slot `slot`, if any.
  void wait_slot(int slot);
  void note(const Status& s);

  Device& dev_;
  ModelLayout lay_;
  int B_, T_;
  DType dt_;
  ActivationMode mode_;
  ActivationStore* store_;
  Status error_;
  void* arena_ = nullptr;  // one device allocation for everything below
  int32_t* tokens_ = nullptr;
  int32_t* targets_ = nullptr;
  float* losses_ = nullptr;
  // A block's intermediates (dt unless noted). kKeep: one per layer, and res3 is the next
  // block's input. kRecompute/kOffload: one scratch (res3 unused: outputs go to inputs_/out_).
  struct Layer {
    void *ln1, *qkv, *atty, *attproj, *res2, *ln2, *fch, *fch_gelu, *fcproj, *res3;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd, *att;
  };
  std::vector<Layer> layers_;
  // kRecompute: every block's input (inputs_[0] == encoded_); kOffload: two slots, block l's
  // input in inputs_[l % 2]. out_: the last block's output, the head's input (not kKeep).
  std::vector<void*> inputs_;
  void* out_ = nullptr;
  // kOffload: the layer whose stash last read each slot (-1: none pending), and whether a
  // layer's restore has been enqueued and not yet consumed by its backward.
  int slot_stash_[2] = {-1, -1};
  std::vector<bool> restored_;
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
