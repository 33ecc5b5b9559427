// KernelsWrapper: a Kernels that forwards every call to another one (LevelDB's EnvWrapper).
//
// A layer that changes a few ops derives from it and overrides only those: a faster path that
// handles some calls itself and hands the rest to the kernels it wraps (the CUDA backend's cuDNN
// attention, kernels/cuda/library_attention.h), a test double that counts or refuses calls
// (tests/wrapped_device.h). A new op is added here once, and every wrapper forwards it. Every
// forwarded op passes through run_op, so a wrapper that watches all of them (the op profile)
// overrides that one call.
//
// Ownership: the wrapped Kernels is not owned and must outlive the wrapper. Thread safety: that
// of the wrapped Kernels (the wrapper adds no state).
#pragma once

#include "strata/kernels.h"

namespace strata {

// One forwarded call, made again on any Kernels: `call(k)` runs the same op with the same
// arguments on `k`. A non-owning reference to the caller's lambda, valid during the forward.
class KernelCall {
 public:
  template <typename F>
  explicit KernelCall(F& f) : f_(&f), run_([](void* f, Kernels& k) { (*static_cast<F*>(f))(k); }) {}
  void operator()(Kernels& k) const { run_(f_, k); }

 private:
  void* f_;
  void (*run_)(void*, Kernels&);
};

class KernelsWrapper : public Kernels {
 public:
  explicit KernelsWrapper(Kernels* wrapped) : k_(wrapped) {}

  // The Kernels every call is forwarded to (a benchmark reaches a backend's own kernels under
  // a faster path through it).
  Kernels* wrapped() const { return k_; }

  KernelSupport supports(KernelOp op, const OpShape& shape) const override {
    return k_->supports(op, shape);
  }
  void encoder_forward(Stream& s, DType dt, void* out, const int32_t* tokens, const int32_t* pos,
                       const void* wte, const void* wpe, int B, int T, int C) override {
    forward_op(s, "encoder_forward",
               [&](Kernels& k) { k.encoder_forward(s, dt, out, tokens, pos, wte, wpe, B, T, C); });
  }
  void encoder_backward(Stream& s, DType dt, float* dwte, float* dwpe, const void* dout,
                        const int32_t* tokens, const int32_t* pos, int B, int T, int C) override {
    forward_op(s, "encoder_backward", [&](Kernels& k) {
      k.encoder_backward(s, dt, dwte, dwpe, dout, tokens, pos, B, T, C);
    });
  }
  void layernorm_forward(Stream& s, DType dt, void* out, float* mean, float* rstd, const void* inp,
                         const void* weight, const void* bias, int N, int C) override {
    forward_op(s, "layernorm_forward", [&](Kernels& k) {
      k.layernorm_forward(s, dt, out, mean, rstd, inp, weight, bias, N, C);
    });
  }
  void layernorm_backward(Stream& s, DType dt, void* dinp, const void* dres, float* dweight,
                          float* dbias, const void* dout, const void* inp, const void* weight,
                          const float* mean, const float* rstd, int N, int C) override {
    forward_op(s, "layernorm_backward", [&](Kernels& k) {
      k.layernorm_backward(s, dt, dinp, dres, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
    });
  }
  void matmul_forward(Stream& s, DType dt, void* out, const void* inp, const void* weight,
                      const void* bias, int N, int C, int OC) override {
    forward_op(s, "matmul_forward",
               [&](Kernels& k) { k.matmul_forward(s, dt, out, inp, weight, bias, N, C, OC); });
  }
  void matmul_gelu_forward(Stream& s, DType dt, void* out, void* pre, const void* inp,
                           const void* weight, const void* bias, int N, int C, int OC) override {
    forward_op(s, "matmul_gelu_forward", [&](Kernels& k) {
      k.matmul_gelu_forward(s, dt, out, pre, inp, weight, bias, N, C, OC);
    });
  }
  void matmul_backward(Stream& s, DType dt, void* dinp, float* dweight, float* dbias,
                       const void* dout, const void* inp, const void* weight, int N, int C, int OC,
                       bool accumulate) override {
    forward_op(s, "matmul_backward", [&](Kernels& k) {
      k.matmul_backward(s, dt, dinp, dweight, dbias, dout, inp, weight, N, C, OC, accumulate);
    });
  }

  void matmul_backward_gelu(Stream& s, DType dt, void* dpre, float* dweight, float* dbias,
                            const void* dout, const void* inp, const void* weight, const void* pre,
                            int N, int C, int OC) override {
    forward_op(s, "matmul_backward_gelu", [&](Kernels& k) {
      k.matmul_backward_gelu(s, dt, dpre, dweight, dbias, dout, inp, weight, pre, N, C, OC);
    });
  }

  void fused_attention_forward(Stream& s, DType dt, void* out, float* lse, const void* qkv,
                               const int32_t* pos, int B, int T, int NH, int NKV, int hs) override {
    forward_op(s, "fused_attention_forward", [&](Kernels& k) {
      k.fused_attention_forward(s, dt, out, lse, qkv, pos, B, T, NH, NKV, hs);
    });
  }
  void fused_attention_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                                const void* qkv, const void* out, const float* lse,
                                const int32_t* pos, int B, int T, int NH, int NKV, int hs,
                                bool accumulate) override {
    forward_op(s, "fused_attention_backward", [&](Kernels& k) {
      k.fused_attention_backward(s, dt, dqkv, scratch, dout, qkv, out, lse, pos, B, T, NH, NKV, hs,
                                 accumulate);
    });
  }
  void attention_gqa_forward(Stream& s, DType dt, void* out, float* att, const void* qkv,
                             const int32_t* pos, int B, int T, int NH, int KVH, int hs) override {
    forward_op(s, "attention_gqa_forward", [&](Kernels& k) {
      k.attention_gqa_forward(s, dt, out, att, qkv, pos, B, T, NH, KVH, hs);
    });
  }
  void attention_gqa_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                              const void* qkv, const float* att, const int32_t* pos, int B, int T,
                              int NH, int KVH, int hs) override {
    forward_op(s, "attention_gqa_backward", [&](Kernels& k) {
      k.attention_gqa_backward(s, dt, dqkv, scratch, dout, qkv, att, pos, B, T, NH, KVH, hs);
    });
  }
  void rmsnorm_forward(Stream& s, DType dt, void* out, float* rstd, const void* inp,
                       const void* weight, float eps, int N, int C) override {
    forward_op(s, "rmsnorm_forward",
               [&](Kernels& k) { k.rmsnorm_forward(s, dt, out, rstd, inp, weight, eps, N, C); });
  }
  void rmsnorm_backward(Stream& s, DType dt, void* dinp, const void* dres, float* dweight,
                        const void* dout, const void* inp, const void* weight, const float* rstd,
                        int N, int C) override {
    forward_op(s, "rmsnorm_backward", [&](Kernels& k) {
      k.rmsnorm_backward(s, dt, dinp, dres, dweight, dout, inp, weight, rstd, N, C);
    });
  }
  void residual_layernorm_forward(Stream& s, DType dt, void* res, void* out, float* mean,
                                  float* rstd, const void* a, const void* b, const void* weight,
                                  const void* bias, int N, int C) override {
    forward_op(s, "residual_layernorm_forward", [&](Kernels& k) {
      k.residual_layernorm_forward(s, dt, res, out, mean, rstd, a, b, weight, bias, N, C);
    });
  }
  void residual_rmsnorm_forward(Stream& s, DType dt, void* res, void* out, float* rstd,
                                const void* a, const void* b, const void* weight, float eps, int N,
                                int C) override {
    forward_op(s, "residual_rmsnorm_forward", [&](Kernels& k) {
      k.residual_rmsnorm_forward(s, dt, res, out, rstd, a, b, weight, eps, N, C);
    });
  }
  void swiglu_forward(Stream& s, DType dt, void* out, const void* inp, int N, int H) override {
    forward_op(s, "swiglu_forward", [&](Kernels& k) { k.swiglu_forward(s, dt, out, inp, N, H); });
  }
  void swiglu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout, int N,
                       int H) override {
    forward_op(s, "swiglu_backward",
               [&](Kernels& k) { k.swiglu_backward(s, dt, dinp, inp, dout, N, H); });
  }
  void rope_forward(Stream& s, DType dt, void* qkv, const RopeParams& rope, const int32_t* pos,
                    int B, int T, int NH, int KVH, int hs) override {
    forward_op(s, "rope_forward",
               [&](Kernels& k) { k.rope_forward(s, dt, qkv, rope, pos, B, T, NH, KVH, hs); });
  }
  void rope_backward(Stream& s, DType dt, void* dqkv, const RopeParams& rope, const int32_t* pos,
                     int B, int T, int NH, int KVH, int hs) override {
    forward_op(s, "rope_backward",
               [&](Kernels& k) { k.rope_backward(s, dt, dqkv, rope, pos, B, T, NH, KVH, hs); });
  }
  void qk_norm_forward(Stream& s, DType dt, void* qkv, void* saved, float* rstd, const void* qw,
                       const void* kw, float eps, int N, int NH, int NKV, int hs) override {
    forward_op(s, "qk_norm_forward", [&](Kernels& k) {
      k.qk_norm_forward(s, dt, qkv, saved, rstd, qw, kw, eps, N, NH, NKV, hs);
    });
  }
  void qk_norm_backward(Stream& s, DType dt, void* dqkv, float* dqw, float* dkw, const void* saved,
                        const void* qw, const void* kw, const float* rstd, int N, int NH, int NKV,
                        int hs) override {
    forward_op(s, "qk_norm_backward", [&](Kernels& k) {
      k.qk_norm_backward(s, dt, dqkv, dqw, dkw, saved, qw, kw, rstd, N, NH, NKV, hs);
    });
  }
  void gelu_forward(Stream& s, DType dt, void* out, const void* inp, size_t n) override {
    forward_op(s, "gelu_forward", [&](Kernels& k) { k.gelu_forward(s, dt, out, inp, n); });
  }
  void gelu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout,
                     size_t n) override {
    forward_op(s, "gelu_backward", [&](Kernels& k) { k.gelu_backward(s, dt, dinp, inp, dout, n); });
  }
  void residual_forward(Stream& s, DType dt, void* out, const void* a, const void* b,
                        size_t n) override {
    forward_op(s, "residual_forward", [&](Kernels& k) { k.residual_forward(s, dt, out, a, b, n); });
  }
  void add_inplace(Stream& s, DType dt, void* dst, const void* src, size_t n) override {
    forward_op(s, "add_inplace", [&](Kernels& k) { k.add_inplace(s, dt, dst, src, n); });
  }
  void gather_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                   const float* scale, int n, int C) override {
    forward_op(s, "gather_rows",
               [&](Kernels& k) { k.gather_rows(s, dt, out, in, idx, scale, n, C); });
  }
  void scatter_add_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                        const float* scale, int n, int C) override {
    forward_op(s, "scatter_add_rows",
               [&](Kernels& k) { k.scatter_add_rows(s, dt, out, in, idx, scale, n, C); });
  }
  void row_dots(Stream& s, DType dt, float* out, const void* a, const int32_t* idx, const void* b,
                int n, int C) override {
    forward_op(s, "row_dots", [&](Kernels& k) { k.row_dots(s, dt, out, a, idx, b, n, C); });
  }
  void crossentropy_forward_backward(Stream& s, DType dt, float* losses, void* logits_inout,
                                     const int32_t* targets, float dloss, int N, int V,
                                     int Vp) override {
    forward_op(s, "crossentropy_forward_backward", [&](Kernels& k) {
      k.crossentropy_forward_backward(s, dt, losses, logits_inout, targets, dloss, N, V, Vp);
    });
  }
  void cast(Stream& s, void* dst, DType dst_t, const void* src, DType src_t, size_t n) override {
    forward_op(s, "cast", [&](Kernels& k) { k.cast(s, dst, dst_t, src, src_t, n); });
  }
  void norm_sq_and_nonfinite(Stream& s, double* norm_sq, const float* x, size_t n) override {
    forward_op(s, "norm_sq_and_nonfinite",
               [&](Kernels& k) { k.norm_sq_and_nonfinite(s, norm_sq, x, n); });
  }
  void scale(Stream& s, float* x, float factor, size_t n) override {
    forward_op(s, "scale", [&](Kernels& k) { k.scale(s, x, factor, n); });
  }
  void scale_rows(Stream& s, DType dt, void* x, const float* scale, int rows,
                  size_t row_elems) override {
    forward_op(s, "scale_rows",
               [&](Kernels& k) { k.scale_rows(s, dt, x, scale, rows, row_elems); });
  }
  void dropout(Stream& s, DType dt, void* out, const void* in, size_t n, float p,
               uint64_t key) override {
    forward_op(s, "dropout", [&](Kernels& k) { k.dropout(s, dt, out, in, n, p, key); });
  }
  void attention_decode(Stream& s, DType dt, void* out, void* kcache, void* vcache, const void* qkv,
                        int B, int T, int pos0, int maxT, int NH, int KVH, int hs) override {
    forward_op(s, "attention_decode", [&](Kernels& k) {
      k.attention_decode(s, dt, out, kcache, vcache, qkv, B, T, pos0, maxT, NH, KVH, hs);
    });
  }
  void quantize(Stream& s, int bits, DType dt, void* q, float* scales, const void* x, size_t n,
                int block) override {
    forward_op(s, "quantize", [&](Kernels& k) { k.quantize(s, bits, dt, q, scales, x, n, block); });
  }
  void dequantize(Stream& s, int bits, DType dt, void* x, const void* q, const float* scales,
                  size_t n, int block, bool accumulate) override {
    forward_op(s, "dequantize",
               [&](Kernels& k) { k.dequantize(s, bits, dt, x, q, scales, n, block, accumulate); });
  }
  void dequantize_nf4(Stream& s, DType dt, void* x, const uint8_t* q, const float* absmax,
                      size_t n) override {
    forward_op(s, "dequantize_nf4", [&](Kernels& k) { k.dequantize_nf4(s, dt, x, q, absmax, n); });
  }
  void optimizer_step(Stream& s, const OptimizerHyper& hyper, const ShardState& shard) override {
    forward_op(s, "optimizer_step", [&](Kernels& k) { k.optimizer_step(s, hyper, shard); });
  }

 protected:
  // Every op above goes through here (supports() does not): `op` is its name
  // ("matmul_forward"), `s` its stream, `call` the call itself. The default runs it on the
  // wrapped kernels; a wrapper that watches every op (the op profile, src/train/op_profile.h)
  // overrides this, and may also run the call on other kernels (a cost model's).
  virtual void run_op(Stream& s, const char* op, const KernelCall& call) {
    (void)s, (void)op;
    call(*k_);
  }

 private:
  template <typename F>
  void forward_op(Stream& s, const char* op, F&& f) {
    run_op(s, op, KernelCall(f));
  }

  Kernels* const k_;
};

}  // namespace strata
