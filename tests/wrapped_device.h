// A test double of the Device interface: forwards everything to a real device, but can claim
// that the host cannot address its memory (as a CUDA device), so that the code paths a GPU
// takes — copies instead of host pointers, the device's optimizer, gradient statistics on the
// device — run on the CPU backend in CI; and counts the optimizer steps its kernels enqueue.
//
// Memory is still host memory underneath: a host access to device memory on such a path is not
// caught here (only on a GPU), but any missing copy or ordering shows up as different numbers.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "strata/device.h"
#include "strata/kernels.h"

namespace strata::test {

// What CountingKernels counts; shared, so that it outlives the device.
struct KernelCounts {
  std::atomic<long> optimizer_steps{0};
  std::atomic<long> optimizer_elements{0};
};

// Forwards every op to `inner`, counting optimizer_step calls and their elements. With
// fused_attention false it reports the fused attention unsupported, so that models take the
// plain attention (the reference the fused one is compared with).
class CountingKernels final : public Kernels {
 public:
  bool fused_attention = true;

  CountingKernels(Kernels& inner, std::shared_ptr<KernelCounts> counts)
      : inner_(inner), counts_(std::move(counts)) {}

  void encoder_forward(Stream& s, DType dt, void* out, const int32_t* tokens, const void* wte,
                       const void* wpe, int B, int T, int C) override {
    inner_.encoder_forward(s, dt, out, tokens, wte, wpe, B, T, C);
  }
  void encoder_backward(Stream& s, DType dt, float* dwte, float* dwpe, const void* dout,
                        const int32_t* tokens, int B, int T, int C) override {
    inner_.encoder_backward(s, dt, dwte, dwpe, dout, tokens, B, T, C);
  }
  void layernorm_forward(Stream& s, DType dt, void* out, float* mean, float* rstd, const void* inp,
                         const void* weight, const void* bias, int N, int C) override {
    inner_.layernorm_forward(s, dt, out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(Stream& s, DType dt, void* dinp, float* dweight, float* dbias,
                          const void* dout, const void* inp, const void* weight, const float* mean,
                          const float* rstd, int N, int C) override {
    inner_.layernorm_backward(s, dt, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void matmul_forward(Stream& s, DType dt, void* out, const void* inp, const void* weight,
                      const void* bias, int N, int C, int OC) override {
    inner_.matmul_forward(s, dt, out, inp, weight, bias, N, C, OC);
  }
  void matmul_backward(Stream& s, DType dt, void* dinp, float* dweight, float* dbias,
                       const void* dout, const void* inp, const void* weight, int N, int C,
                       int OC) override {
    inner_.matmul_backward(s, dt, dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  }
  void attention_forward(Stream& s, DType dt, void* out, float* att, const void* qkv, int B, int T,
                         int C, int NH) override {
    inner_.attention_forward(s, dt, out, att, qkv, B, T, C, NH);
  }
  void attention_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                          const void* qkv, const float* att, int B, int T, int C, int NH) override {
    inner_.attention_backward(s, dt, dqkv, scratch, dout, qkv, att, B, T, C, NH);
  }
  bool fused_attention_supported(DType dt, int hs) const override {
    return fused_attention && inner_.fused_attention_supported(dt, hs);
  }
  void fused_attention_forward(Stream& s, DType dt, void* out, float* lse, const void* qkv, int B,
                               int T, int NH, int NKV, int hs) override {
    inner_.fused_attention_forward(s, dt, out, lse, qkv, B, T, NH, NKV, hs);
  }
  void fused_attention_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                                const void* qkv, const void* out, const float* lse, int B, int T,
                                int NH, int NKV, int hs) override {
    inner_.fused_attention_backward(s, dt, dqkv, scratch, dout, qkv, out, lse, B, T, NH, NKV, hs);
  }
  void attention_gqa_forward(Stream& s, DType dt, void* out, float* att, const void* qkv, int B,
                             int T, int NH, int KVH, int hs) override {
    inner_.attention_gqa_forward(s, dt, out, att, qkv, B, T, NH, KVH, hs);
  }
  void attention_gqa_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                              const void* qkv, const float* att, int B, int T, int NH, int KVH,
                              int hs) override {
    inner_.attention_gqa_backward(s, dt, dqkv, scratch, dout, qkv, att, B, T, NH, KVH, hs);
  }
  void rmsnorm_forward(Stream& s, DType dt, void* out, float* rstd, const void* inp,
                       const void* weight, float eps, int N, int C) override {
    inner_.rmsnorm_forward(s, dt, out, rstd, inp, weight, eps, N, C);
  }
  void rmsnorm_backward(Stream& s, DType dt, void* dinp, float* dweight, const void* dout,
                        const void* inp, const void* weight, const float* rstd, int N,
                        int C) override {
    inner_.rmsnorm_backward(s, dt, dinp, dweight, dout, inp, weight, rstd, N, C);
  }
  void swiglu_forward(Stream& s, DType dt, void* out, const void* inp, int N, int H) override {
    inner_.swiglu_forward(s, dt, out, inp, N, H);
  }
  void swiglu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout, int N,
                       int H) override {
    inner_.swiglu_backward(s, dt, dinp, inp, dout, N, H);
  }
  void rope_forward(Stream& s, DType dt, void* qkv, const RopeParams& rope, int B, int T, int NH,
                    int KVH, int hs) override {
    inner_.rope_forward(s, dt, qkv, rope, B, T, NH, KVH, hs);
  }
  void rope_backward(Stream& s, DType dt, void* dqkv, const RopeParams& rope, int B, int T, int NH,
                     int KVH, int hs) override {
    inner_.rope_backward(s, dt, dqkv, rope, B, T, NH, KVH, hs);
  }
  void gelu_forward(Stream& s, DType dt, void* out, const void* inp, size_t n) override {
    inner_.gelu_forward(s, dt, out, inp, n);
  }
  void gelu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout,
                     size_t n) override {
    inner_.gelu_backward(s, dt, dinp, inp, dout, n);
  }
  void residual_forward(Stream& s, DType dt, void* out, const void* a, const void* b,
                        size_t n) override {
    inner_.residual_forward(s, dt, out, a, b, n);
  }
  void add_inplace(Stream& s, DType dt, void* dst, const void* src, size_t n) override {
    inner_.add_inplace(s, dt, dst, src, n);
  }
  void gather_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                   const float* scale, int n, int C) override {
    inner_.gather_rows(s, dt, out, in, idx, scale, n, C);
  }
  void scatter_add_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                        const float* scale, int n, int C) override {
    inner_.scatter_add_rows(s, dt, out, in, idx, scale, n, C);
  }
  void row_dots(Stream& s, DType dt, float* out, const void* a, const int32_t* idx, const void* b,
                int n, int C) override {
    inner_.row_dots(s, dt, out, a, idx, b, n, C);
  }
  void crossentropy_forward_backward(Stream& s, DType dt, float* losses, void* logits_inout,
                                     const int32_t* targets, float dloss, int N, int V,
                                     int Vp) override {
    inner_.crossentropy_forward_backward(s, dt, losses, logits_inout, targets, dloss, N, V, Vp);
  }
  void cast(Stream& s, void* dst, DType dst_t, const void* src, DType src_t, size_t n) override {
    inner_.cast(s, dst, dst_t, src, src_t, n);
  }
  void norm_sq_and_nonfinite(Stream& s, float* acc, const float* x, size_t n) override {
    inner_.norm_sq_and_nonfinite(s, acc, x, n);
  }
  void scale(Stream& s, float* x, float factor, size_t n) override {
    inner_.scale(s, x, factor, n);
  }
  bool dropout_supported() const override { return inner_.dropout_supported(); }
  void dropout(Stream& s, DType dt, void* out, const void* in, size_t n, float p,
               uint64_t key) override {
    inner_.dropout(s, dt, out, in, n, p, key);
  }
  void quantize(Stream& s, int bits, DType dt, void* q, float* scales, const void* x, size_t n,
                int block) override {
    inner_.quantize(s, bits, dt, q, scales, x, n, block);
  }
  void dequantize(Stream& s, int bits, DType dt, void* x, const void* q, const float* scales,
                  size_t n, int block, bool accumulate) override {
    inner_.dequantize(s, bits, dt, x, q, scales, n, block, accumulate);
  }
  void dequantize_nf4(Stream& s, DType dt, void* x, const uint8_t* q, const float* absmax,
                      size_t n) override {
    inner_.dequantize_nf4(s, dt, x, q, absmax, n);
  }
  void optimizer_step(Stream& s, const OptimizerHyper& hyper, const ShardState& shard) override {
    counts_->optimizer_steps.fetch_add(1);
    counts_->optimizer_elements.fetch_add(long(shard.n));
    inner_.optimizer_step(s, hyper, shard);
  }

 private:
  Kernels& inner_;
  std::shared_ptr<KernelCounts> counts_;
};

class WrappedDevice final : public Device {
 public:
  // host_addressable: what this device claims (the inner device's memory is host memory).
  WrappedDevice(std::unique_ptr<Device> inner, bool host_addressable,
                std::shared_ptr<KernelCounts> counts = std::make_shared<KernelCounts>())
      : inner_(std::move(inner)),
        addressable_(host_addressable),
        kernels_(inner_->kernels(), std::move(counts)) {}

  DeviceKind kind() const override { return inner_->kind(); }
  bool host_addressable() const override { return addressable_; }
  // Models on this device use the plain attention (see CountingKernels::fused_attention).
  void disable_fused_attention() { kernels_.fused_attention = false; }
  std::string name() const override {
    return inner_->name() + (addressable_ ? "" : " [not host-addressable]");
  }
  Result<void*> allocate(size_t bytes, std::string_view tag) override {
    return inner_->allocate(bytes, tag);
  }
  void release(void* ptr) override { inner_->release(ptr); }
  DeviceMemoryStats memory_stats() const override { return inner_->memory_stats(); }
  void reset_peak() override { inner_->reset_peak(); }
  Result<void*> allocate_host(size_t bytes) override { return inner_->allocate_host(bytes); }
  void release_host(void* ptr) override { inner_->release_host(ptr); }
  Status register_host(void* ptr, size_t bytes) override {
    return inner_->register_host(ptr, bytes);
  }
  void unregister_host(void* ptr) override { inner_->unregister_host(ptr); }
  Stream& compute_stream() override { return inner_->compute_stream(); }
  Stream& h2d_stream() override { return inner_->h2d_stream(); }
  Stream& d2h_stream() override { return inner_->d2h_stream(); }
  std::unique_ptr<Event> create_event() override { return inner_->create_event(); }
  void record(Event& event, Stream& stream) override { inner_->record(event, stream); }
  void wait(Stream& stream, const Event& event) override { inner_->wait(stream, event); }
  Status synchronize(Event& event) override { return inner_->synchronize(event); }
  Status synchronize(Stream& stream) override { return inner_->synchronize(stream); }
  bool query(Event& event) override { return inner_->query(event); }
  void copy_h2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    inner_->copy_h2d(s, dst, src, bytes);
  }
  void copy_d2h(Stream& s, void* dst, const void* src, size_t bytes) override {
    inner_->copy_d2h(s, dst, src, bytes);
  }
  void copy_d2d(Stream& s, void* dst, const void* src, size_t bytes) override {
    inner_->copy_d2d(s, dst, src, bytes);
  }
  void memset_zero(Stream& s, void* dst, size_t bytes) override {
    inner_->memset_zero(s, dst, bytes);
  }
  void host_fn(Stream& s, std::function<void()> fn) override { inner_->host_fn(s, std::move(fn)); }
  Kernels& kernels() override { return kernels_; }

 private:
  std::unique_ptr<Device> inner_;
  bool addressable_;
  CountingKernels kernels_;
};

}  // namespace strata::test
