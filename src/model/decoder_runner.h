// What the decoder-only runners (src/model/gpt2.cc, src/model/llama.cc) share: one device arena
// carved for a batch shape's activations, the tokens' and targets' upload, the first error kept
// for status(), where each block's input and output live under each activation mode, and the
// activation-offload slots. The models keep their own buffers, carve and compute steps.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "src/model/architecture.h"
#include "strata/device.h"

namespace strata {

// Bump allocator over one arena: 256-byte aligned slices. With base == nullptr it only measures.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  void* take(size_t bytes) {
    void* p = base_ ? base_ + off_ : nullptr;
    off_ += (bytes + 255) / 256 * 256;
    return p;
  }
  size_t used() const { return off_; }

 private:
  char* base_;
  size_t off_ = 0;
};

// Shape: the model's shape (L: layers). Buffers: its activation buffers, with tokens, targets
// (int32 [B*T]), layers (a Layer per block under kKeep, else one scratch Layer with res3),
// inputs (kRecompute: every block's input; kOffload: two slots), encoded and out (the last
// block's output, not under kKeep).
template <class Shape, class Buffers>
class DecoderRunner : public ModelRunner {
 public:
  // The one carve of the activation arena: activation_plan() measures it, allocate() allocates
  // what it measured and carves again for real.
  using CarveFn = void (*)(Carver&, const Shape&, int B, int T, DType, ActivationMode, bool fused,
                           Buffers*);

  DecoderRunner(Device& d, const ModelLayout& layout, const Shape& sh, int B, int T, DType dt,
                ActivationMode mode, bool fused, ActivationStore* store)
      : dev_(d),
        layout_(layout),
        sh_(sh),
        B_(B),
        T_(T),
        dt_(dt),
        mode_(mode),
        fused_(fused),
        store_(store) {}
  ~DecoderRunner() override {
    dev_.synchronize(dev_.compute_stream()).ignore();
    if (arena_) dev_.release(arena_);
    if (host_io_) dev_.release_host(host_io_);
  }

  Status allocate(CarveFn carve) {
    Carver measure(nullptr);
    carve(measure, sh_, B_, T_, dt_, mode_, fused_, &buf_);
    STRATA_ASSIGN_OR_RETURN(arena_, dev_.allocate(measure.used(), "activations"), "device");
    Carver real(static_cast<char*>(arena_));
    carve(real, sh_, B_, T_, dt_, mode_, fused_, &buf_);
    restored_.assign(size_t(sh_.L), false);
    const size_t N = size_t(B_) * T_;
    STRATA_ASSIGN_OR_RETURN(void* h, dev_.allocate_host(N * 8 + N * 4), "host staging");
    host_io_ = static_cast<int32_t*>(h);
    host_losses_ = reinterpret_cast<float*>(host_io_ + 2 * N);
    return Status::ok();
  }

  void begin_batch(const int32_t* tokens, const int32_t* targets) override {
    const size_t N = size_t(B_) * T_;
    Stream& s = dev_.compute_stream();
    // The staging buffer is reused per micro-batch: wait until the last upload consumed it.
    dev_.synchronize(s).ignore();
    std::memcpy(host_io_, tokens, N * 4);
    std::memcpy(host_io_ + N, targets, N * 4);
    dev_.copy_h2d(s, buf_.tokens, host_io_, N * 4);
    dev_.copy_h2d(s, buf_.targets, host_io_ + N, N * 4);
  }

  Status status() const override { return error_; }

 protected:
  // Block l's input, its output (the next block's input or the head's), its intermediates.
  void* input(int l) const {
    switch (mode_) {
      case ActivationMode::kKeep:
        return l == 0 ? buf_.encoded : buf_.layers[size_t(l) - 1].res3;
      case ActivationMode::kRecompute:
        return buf_.inputs[size_t(l)];
      case ActivationMode::kOffload:
        return buf_.inputs[size_t(l % 2)];
    }
    return nullptr;
  }
  void* output(int l) const {
    if (mode_ == ActivationMode::kKeep) return buf_.layers[size_t(l)].res3;
    return l + 1 < sh_.L ? input(l + 1) : buf_.out;
  }
  auto& acts(int l) {
    return mode_ == ActivationMode::kKeep ? buf_.layers[size_t(l)] : buf_.layers[0];
  }
  // kOffload: the compute stream waits for the stash still reading input slot `slot`, if any.
  void wait_slot(int slot) {
    if (mode_ != ActivationMode::kOffload || slot < 0 || slot_stash_[slot] < 0) return;
    store_->compute_waits_activation(slot_stash_[slot]);
    slot_stash_[slot] = -1;
  }
  void note(const Status& s) {
    if (!s.is_ok() && error_.is_ok()) error_ = s;
  }

  Device& dev_;
  const ModelLayout& layout_;
  Shape sh_;
  int B_, T_;
  DType dt_;
  ActivationMode mode_;
  bool fused_;  // fused attention (Kernels::fused_attention_*): att holds the log-sum-exp
  ActivationStore* store_;
  Status error_;
  void* arena_ = nullptr;  // one device allocation for everything in buf_
  Buffers buf_;
  // kOffload: the layer whose stash last read each slot (-1: none pending), and whether a
  // layer's restore has been enqueued and not yet consumed by its backward.
  int slot_stash_[2] = {-1, -1};
  std::vector<bool> restored_;
  // host staging for tokens/targets/losses (the copy engines need stable host memory)
  int32_t* host_io_ = nullptr;
  float* host_losses_ = nullptr;
};

}  // namespace strata
