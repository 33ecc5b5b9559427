// The CUDA backend's kernel table: each Kernels method binds the calling thread to the GPU,
// enqueues the op's launcher (one .cu file per op) on the caller's stream, and hands an enqueue
// failure to the device's error sink, from which the next synchronize() returns it. The table
// the device hands out wraps these in LibraryAttentionKernels (cuDNN's fused attention where it
// supports the shape; attention_library.h).
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "kernels/cuda/attention_library.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_optimizer.h"

namespace strata {

CudaStream& cuda_stream(Stream& s) {
  auto* cs = dynamic_cast<CudaStream*>(&s);
  STRATA_CHECK(cs != nullptr, "a CUDA kernel or copy was given a stream of another device");
  return *cs;
}

void CudaErrorSink::note(const Status& s) {
  if (s.is_ok()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (first_.is_ok()) first_ = s;
}

Status CudaErrorSink::take() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(first_, Status::ok());
}

namespace {

class CudaKernels final : public Kernels {
 public:
  CudaKernels(int ordinal, cublasLtHandle_t handle, CudaErrorSink* errors)
      : ordinal_(ordinal),
        handle_(handle),
        errors_(errors),
        fused_ops_(on_unless_zero(kFusedOpsEnv)),
        packed_(on_unless_zero(kPackedAccessEnv)) {}

  void encoder_forward(Stream& s, DType dt, void* out, const int32_t* tokens, const int32_t* pos,
                       const void* wte, const void* wpe, int B, int T, int C) override {
    run("encoder_forward", s, [&](CudaStream& cs) {
      return cuda_encoder_forward(cs.handle, dt, out, tokens, pos, wte, wpe, B, T, C);
    });
  }
  void encoder_backward(Stream& s, DType dt, float* dwte, float* dwpe, const void* dout,
                        const int32_t* tokens, const int32_t* pos, int B, int T, int C) override {
    run("encoder_backward", s, [&](CudaStream& cs) {
      return cuda_encoder_backward(cs.handle, dt, dwte, dwpe, dout, tokens, pos, B, T, C,
                                   cs.reduce);
    });
  }
  void layernorm_forward(Stream& s, DType dt, void* out, float* mean, float* rstd, const void* inp,
                         const void* weight, const void* bias, int N, int C) override {
    run("layernorm_forward", s, [&](CudaStream& cs) {
      return cuda_layernorm_forward(cs.handle, dt, out, mean, rstd, inp, weight, bias, N, C,
                                    packed_);
    });
  }
  void layernorm_backward(Stream& s, DType dt, void* dinp, const void* dres, float* dweight,
                          float* dbias, const void* dout, const void* inp, const void* weight,
                          const float* mean, const float* rstd, int N, int C) override {
    run("layernorm_backward", s, [&](CudaStream& cs) {
      return cuda_layernorm_backward(cs.handle, dt, dinp, dres, dweight, dbias, dout, inp, weight,
                                     mean, rstd, N, C, cs.reduce, packed_, fused_ops_);
    });
  }
  void matmul_forward(Stream& s, DType dt, void* out, const void* inp, const void* weight,
                      const void* bias, int N, int C, int OC) override {
    run("matmul_forward", s, [&](CudaStream& cs) {
      return cuda_matmul_forward(cs.handle, blas(cs), dt, out, inp, weight, bias, N, C, OC);
    });
  }
  void matmul_gelu_forward(Stream& s, DType dt, void* out, void* pre, const void* inp,
                           const void* weight, const void* bias, int N, int C, int OC) override {
    run("matmul_gelu_forward", s, [&](CudaStream& cs) {
      return cuda_matmul_gelu_forward(cs.handle, blas(cs), dt, out, pre, inp, weight, bias, N, C,
                                      OC);
    });
  }
  void matmul_backward(Stream& s, DType dt, void* dinp, float* dweight, float* dbias,
                       const void* dout, const void* inp, const void* weight, int N, int C, int OC,
                       bool accumulate) override {
    run("matmul_backward", s, [&](CudaStream& cs) {
      return cuda_matmul_backward(cs.handle, blas(cs), cs.reduce, dt, dinp, dweight, dbias, dout,
                                  inp, weight, N, C, OC, accumulate, packed_);
    });
  }
  void matmul_backward_gelu(Stream& s, DType dt, void* dpre, float* dweight, float* dbias,
                            const void* dout, const void* inp, const void* weight, const void* pre,
                            int N, int C, int OC) override {
    run("matmul_backward_gelu", s, [&](CudaStream& cs) {
      return cuda_matmul_backward_gelu(cs.handle, blas(cs), cs.reduce, dt, dpre, dweight, dbias,
                                       dout, inp, weight, pre, N, C, OC, packed_);
    });
  }
  void residual_layernorm_forward(Stream& s, DType dt, void* res, void* out, float* mean,
                                  float* rstd, const void* a, const void* b, const void* weight,
                                  const void* bias, int N, int C) override {
    run("residual_layernorm_forward", s, [&](CudaStream& cs) {
      return cuda_residual_layernorm_forward(cs.handle, dt, res, out, mean, rstd, a, b, weight,
                                             bias, N, C, packed_);
    });
  }
  void residual_rmsnorm_forward(Stream& s, DType dt, void* res, void* out, float* rstd,
                                const void* a, const void* b, const void* weight, float eps, int N,
                                int C) override {
    run("residual_rmsnorm_forward", s, [&](CudaStream& cs) {
      return cuda_residual_rmsnorm_forward(cs.handle, dt, res, out, rstd, a, b, weight, eps, N, C,
                                           packed_);
    });
  }
  KernelSupport supports(KernelOp op, const OpShape& shape) const override {
    const KernelSupport off{
        false, std::string("fused elementwise ops turned off by ") + kFusedOpsEnv + "=0"};
    switch (op) {
      case KernelOp::kFusedAttention:
        if (!cuda_fused_attention_supported(shape.dt, shape.hs)) {
          return {false, "the CUDA fused attention runs bf16 and fp16 with head size 64 or 128"};
        }
        return {true, "cuda wmma"};
      case KernelOp::kMatmulGelu:
        if (!fused_ops_) return off;
        if (!cuda_matmul_gelu_supported(shape.OC)) {
          return {false, "cuBLASLt's GELU epilogue needs the output channels a multiple of 8"};
        }
        return {true, "cublaslt gelu_aux_bias epilogue"};
      case KernelOp::kMatmulBackwardGelu:
        if (!fused_ops_) return off;
        if (!cuda_matmul_backward_gelu_supported(shape.C)) {
          return {false, "cuBLASLt's DGELU epilogue needs the input channels a multiple of 8"};
        }
        return {true, "cublaslt dgelu epilogue"};
      case KernelOp::kResidualNorm:
        if (!fused_ops_) return off;
        return {true, "cuda"};
      case KernelOp::kDropout:
        return {true, "cuda"};
      case KernelOp::kAttentionDecode:
        if (!cuda_attention_decode_supported(shape.hs)) {
          return {false, "the CUDA cached attention runs head sizes up to 512"};
        }
        return {true, "cuda"};
    }
    return {false, "unknown op"};
  }
  void fused_attention_forward(Stream& s, DType dt, void* out, float* lse, const void* qkv,
                               const int32_t* pos, int B, int T, int NH, int NKV, int hs) override {
    run("fused_attention_forward", s, [&](CudaStream& cs) {
      return cuda_fused_attention_forward(cs.handle, dt, out, lse, qkv, pos, B, T, NH, NKV, hs);
    });
  }
  void fused_attention_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                                const void* qkv, const void* out, const float* lse,
                                const int32_t* pos, int B, int T, int NH, int NKV, int hs,
                                bool accumulate) override {
    run("fused_attention_backward", s, [&](CudaStream& cs) -> Status {
      // Written: zeroed first (the kernels accumulate), the bits of an accumulation into zeros.
      if (!accumulate) {
        STRATA_CUDA_CHECK(
            cudaMemsetAsync(dqkv, 0, size_t(B) * T * (NH + 2 * NKV) * hs * dtype_size(dt),
                            cs.handle),
            "fused_attention_backward: zeroing the written dqkv");
      }
      return cuda_fused_attention_backward(cs.handle, dt, dqkv, scratch, dout, qkv, out, lse, pos,
                                           B, T, NH, NKV, hs);
    });
  }
  void attention_gqa_forward(Stream& s, DType dt, void* out, float* att, const void* qkv,
                             const int32_t* pos, int B, int T, int NH, int KVH, int hs) override {
    run("attention_gqa_forward", s, [&](CudaStream& cs) {
      return cuda_attention_gqa_forward(cs.handle, dt, out, att, qkv, pos, B, T, NH, KVH, hs);
    });
  }
  void attention_gqa_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                              const void* qkv, const float* att, const int32_t* pos, int B, int T,
                              int NH, int KVH, int hs) override {
    run("attention_gqa_backward", s, [&](CudaStream& cs) {
      return cuda_attention_gqa_backward(cs.handle, dt, dqkv, scratch, dout, qkv, att, pos, B, T,
                                         NH, KVH, hs);
    });
  }
  void rmsnorm_forward(Stream& s, DType dt, void* out, float* rstd, const void* inp,
                       const void* weight, float eps, int N, int C) override {
    run("rmsnorm_forward", s, [&](CudaStream& cs) {
      return cuda_rmsnorm_forward(cs.handle, dt, out, rstd, inp, weight, eps, N, C, packed_);
    });
  }
  void rmsnorm_backward(Stream& s, DType dt, void* dinp, const void* dres, float* dweight,
                        const void* dout, const void* inp, const void* weight, const float* rstd,
                        int N, int C) override {
    run("rmsnorm_backward", s, [&](CudaStream& cs) {
      return cuda_rmsnorm_backward(cs.handle, dt, dinp, dres, dweight, dout, inp, weight, rstd, N,
                                   C, cs.reduce, packed_, fused_ops_);
    });
  }
  void qk_norm_forward(Stream& s, DType dt, void* qkv, void* saved, float* rstd, const void* qw,
                       const void* kw, float eps, int N, int NH, int NKV, int hs) override {
    run("qk_norm_forward", s, [&](CudaStream& cs) {
      return cuda_qk_norm_forward(cs.handle, dt, qkv, saved, rstd, qw, kw, eps, N, NH, NKV, hs,
                                  packed_);
    });
  }
  void qk_norm_backward(Stream& s, DType dt, void* dqkv, float* dqw, float* dkw, const void* saved,
                        const void* qw, const void* kw, const float* rstd, int N, int NH, int NKV,
                        int hs) override {
    run("qk_norm_backward", s, [&](CudaStream& cs) {
      return cuda_qk_norm_backward(cs.handle, dt, dqkv, dqw, dkw, saved, qw, kw, rstd, N, NH, NKV,
                                   hs, cs.reduce, packed_);
    });
  }
  void swiglu_forward(Stream& s, DType dt, void* out, const void* inp, int N, int H) override {
    run("swiglu_forward", s, [&](CudaStream& cs) {
      return cuda_swiglu_forward(cs.handle, dt, out, inp, N, H, packed_);
    });
  }
  void swiglu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout, int N,
                       int H) override {
    run("swiglu_backward", s, [&](CudaStream& cs) {
      return cuda_swiglu_backward(cs.handle, dt, dinp, inp, dout, N, H, packed_);
    });
  }
  void rope_forward(Stream& s, DType dt, void* qkv, const RopeParams& rope, const int32_t* pos,
                    int B, int T, int NH, int KVH, int hs) override {
    run("rope_forward", s, [&](CudaStream& cs) {
      return cuda_rope_forward(cs.handle, dt, qkv, rope, pos, B, T, NH, KVH, hs, packed_);
    });
  }
  void rope_backward(Stream& s, DType dt, void* dqkv, const RopeParams& rope, const int32_t* pos,
                     int B, int T, int NH, int KVH, int hs) override {
    run("rope_backward", s, [&](CudaStream& cs) {
      return cuda_rope_backward(cs.handle, dt, dqkv, rope, pos, B, T, NH, KVH, hs, packed_);
    });
  }
  void gelu_forward(Stream& s, DType dt, void* out, const void* inp, size_t n) override {
    run("gelu_forward", s,
        [&](CudaStream& cs) { return cuda_gelu_forward(cs.handle, dt, out, inp, n, packed_); });
  }
  void gelu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout,
                     size_t n) override {
    run("gelu_backward", s, [&](CudaStream& cs) {
      return cuda_gelu_backward(cs.handle, dt, dinp, inp, dout, n, packed_);
    });
  }
  void residual_forward(Stream& s, DType dt, void* out, const void* a, const void* b,
                        size_t n) override {
    run("residual_forward", s, [&](CudaStream& cs) {
      return cuda_residual_forward(cs.handle, dt, out, a, b, n, packed_);
    });
  }
  void add_inplace(Stream& s, DType dt, void* dst, const void* src, size_t n) override {
    run("add_inplace", s,
        [&](CudaStream& cs) { return cuda_add_inplace(cs.handle, dt, dst, src, n, packed_); });
  }
  void gather_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                   const float* scale, int n, int C) override {
    run("gather_rows", s,
        [&](CudaStream& cs) { return cuda_gather_rows(cs.handle, dt, out, in, idx, scale, n, C); });
  }
  void scatter_add_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                        const float* scale, int n, int C) override {
    run("scatter_add_rows", s, [&](CudaStream& cs) {
      return cuda_scatter_add_rows(cs.handle, dt, out, in, idx, scale, n, C);
    });
  }
  void row_dots(Stream& s, DType dt, float* out, const void* a, const int32_t* idx, const void* b,
                int n, int C) override {
    run("row_dots", s,
        [&](CudaStream& cs) { return cuda_row_dots(cs.handle, dt, out, a, idx, b, n, C); });
  }
  void crossentropy_forward_backward(Stream& s, DType dt, float* losses, void* logits_inout,
                                     const int32_t* targets, float dloss, int N, int V,
                                     int Vp) override {
    run("crossentropy_forward_backward", s, [&](CudaStream& cs) {
      return cuda_crossentropy_forward_backward(cs.handle, dt, losses, logits_inout, targets, dloss,
                                                N, V, Vp, packed_);
    });
  }
  void cast(Stream& s, void* dst, DType dst_t, const void* src, DType src_t, size_t n) override {
    run("cast", s, [&](CudaStream& cs) { return cuda_cast(cs.handle, dst, dst_t, src, src_t, n); });
  }
  void norm_sq_and_nonfinite(Stream& s, double* norm_sq, const float* x, size_t n) override {
    run("norm_sq_and_nonfinite", s, [&](CudaStream& cs) {
      return cuda_norm_sq_and_nonfinite(cs.handle, cs.scratch, norm_sq, x, n);
    });
  }
  void scale(Stream& s, float* x, float factor, size_t n) override {
    run("scale", s, [&](CudaStream& cs) { return cuda_scale(cs.handle, x, factor, n); });
  }
  void scale_rows(Stream& s, DType dt, void* x, const float* scale, int rows,
                  size_t row_elems) override {
    run("scale_rows", s,
        [&](CudaStream& cs) { return cuda_scale_rows(cs.handle, dt, x, scale, rows, row_elems); });
  }
  void dropout(Stream& s, DType dt, void* out, const void* in, size_t n, float p,
               uint64_t key) override {
    run("dropout", s,
        [&](CudaStream& cs) { return cuda_dropout(cs.handle, dt, out, in, n, p, key); });
  }
  void attention_decode(Stream& s, DType dt, void* out, void* kcache, void* vcache, const void* qkv,
                        int B, int T, int pos0, int maxT, int NH, int KVH, int hs) override {
    run("attention_decode", s, [&](CudaStream& cs) {
      return cuda_attention_decode(cs.handle, dt, out, kcache, vcache, qkv, B, T, pos0, maxT, NH,
                                   KVH, hs);
    });
  }
  void quantize(Stream& s, int bits, DType dt, void* q, float* scales, const void* x, size_t n,
                int block) override {
    run("quantize", s,
        [&](CudaStream& cs) { return cuda_quantize(cs.handle, bits, dt, q, scales, x, n, block); });
  }
  void dequantize(Stream& s, int bits, DType dt, void* x, const void* q, const float* scales,
                  size_t n, int block, bool accumulate) override {
    run("dequantize", s, [&](CudaStream& cs) {
      return cuda_dequantize(cs.handle, bits, dt, x, q, scales, n, block, accumulate);
    });
  }
  void dequantize_nf4(Stream& s, DType dt, void* x, const uint8_t* q, const float* absmax,
                      size_t n) override {
    run("dequantize_nf4", s,
        [&](CudaStream& cs) { return cuda_dequantize_nf4(cs.handle, dt, x, q, absmax, n); });
  }
  void optimizer_step(Stream& s, const OptimizerHyper& hyper, const ShardState& shard) override {
    run("optimizer_step", s,
        [&](CudaStream& cs) { return cuda_optimizer_step(cs.handle, hyper, shard); });
  }

 private:
  CudaBlas blas(const CudaStream& cs) const {
    return {handle_, cs.blas_workspace, cs.blas_workspace_bytes, &algos_};
  }

  template <typename F>
  void run(const char* op, Stream& s, F&& launch) {
    CudaStream& cs = cuda_stream(s);
    Status st = STRATA_CUDA_STATUS(cudaSetDevice(ordinal_), "binding the thread to its GPU");
    if (st.is_ok()) st = launch(cs);
    if (!st.is_ok()) errors_->note(st.with_context(op));
  }

  // An environment switch that is on unless set to "0".
  static bool on_unless_zero(const char* name) {
    const char* env = std::getenv(name);
    return env == nullptr || std::strcmp(env, "0") != 0;
  }

  const int ordinal_;
  const cublasLtHandle_t handle_;
  CudaErrorSink* const errors_;
  const bool fused_ops_;         // the optional fused ops are offered (kFusedOpsEnv)
  const bool packed_;            // the kernels take 16-byte packs where aligned (kPackedAccessEnv)
  mutable CublasLtAlgos algos_;  // cuBLASLt's choice per product, shared by the streams
};

}  // namespace

std::unique_ptr<Kernels> create_cuda_kernels(int ordinal, cublasLtHandle_t handle,
                                             CudaErrorSink* errors, bool deterministic) {
  std::string why;
  std::unique_ptr<AttentionLibrary> library =
      attention_library_from_env(ordinal, deterministic, &why);
  return std::make_unique<LibraryAttentionKernels>(
      std::make_unique<CudaKernels>(ordinal, handle, errors), std::move(library), std::move(why),
      ordinal, errors);
}

}  // namespace strata
