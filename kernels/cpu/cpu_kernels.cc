// The CPU backend's Kernels table: each call captures its arguments by value, enqueues one host
// task on the stream, and returns. The task runs the synchronous op from ops.h inside a TBB
// arena limited to the device's thread count (or TBB's default arena when threads == 0).
#include "kernels/cpu/cpu_kernels.h"

#include <tbb/task_arena.h>

#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <utility>

#include "kernels/cpu/ops.h"
#include "strata/cpu_optim.h"
#include "strata/device.h"

namespace strata {
namespace {

class CpuKernels final : public Kernels {
 public:
  CpuKernels(Device& device, int threads) : device_(device) {
    if (threads > 0) arena_.emplace(threads);
  }

  void encoder_forward(Stream& s, DType dt, void* out, const int32_t* tokens, const int32_t* pos,
                       const void* wte, const void* wpe, int B, int T, int C) override {
    run(s, [=] { cpu::encoder_forward(dt, out, tokens, pos, wte, wpe, B, T, C); });
  }
  void encoder_backward(Stream& s, DType dt, float* dwte, float* dwpe, const void* dout,
                        const int32_t* tokens, const int32_t* pos, int B, int T, int C) override {
    run(s, [=] { cpu::encoder_backward(dt, dwte, dwpe, dout, tokens, pos, B, T, C); });
  }

  void layernorm_forward(Stream& s, DType dt, void* out, float* mean, float* rstd, const void* inp,
                         const void* weight, const void* bias, int N, int C) override {
    run(s, [=] { cpu::layernorm_forward(dt, out, mean, rstd, inp, weight, bias, N, C); });
  }
  void layernorm_backward(Stream& s, DType dt, void* dinp, const void* dres, float* dweight,
                          float* dbias, const void* dout, const void* inp, const void* weight,
                          const float* mean, const float* rstd, int N, int C) override {
    run(s, [=] {
      cpu::layernorm_backward(dt, dinp, dres, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
    });
  }

  void matmul_forward(Stream& s, DType dt, void* out, const void* inp, const void* weight,
                      const void* bias, int N, int C, int OC) override {
    run(s, [=] { cpu::matmul_forward(dt, out, inp, weight, bias, N, C, OC); });
  }
  void matmul_gelu_forward(Stream& s, DType dt, void* out, void* pre, const void* inp,
                           const void* weight, const void* bias, int N, int C, int OC) override {
    run(s, [=] {
      cpu::matmul_forward(dt, pre, inp, weight, bias, N, C, OC);
      cpu::gelu_forward(dt, out, pre, size_t(N) * OC);
    });
  }
  void matmul_backward(Stream& s, DType dt, void* dinp, float* dweight, float* dbias,
                       const void* dout, const void* inp, const void* weight, int N, int C, int OC,
                       bool accumulate) override {
    run(s, [=] {
      cpu::matmul_backward(dt, dinp, dweight, dbias, dout, inp, weight, N, C, OC, accumulate);
    });
  }

  // The fused ops run the calls they replace, in one task: the same bits (the golden curves do
  // not move whichever a model takes).
  void matmul_backward_gelu(Stream& s, DType dt, void* dpre, float* dweight, float* dbias,
                            const void* dout, const void* inp, const void* weight, const void* pre,
                            int N, int C, int OC) override {
    run(s, [=] {
      const size_t n = size_t(N) * size_t(C);
      std::memset(dpre, 0, n * dtype_size(dt));
      cpu::matmul_backward(dt, dpre, dweight, dbias, dout, inp, weight, N, C, OC,
                           /*accumulate=*/true);
      cpu::gelu_backward_replace(dt, dpre, pre, n);
    });
  }
  void residual_layernorm_forward(Stream& s, DType dt, void* res, void* out, float* mean,
                                  float* rstd, const void* a, const void* b, const void* weight,
                                  const void* bias, int N, int C) override {
    run(s, [=] {
      cpu::residual_forward(dt, res, a, b, size_t(N) * size_t(C));
      cpu::layernorm_forward(dt, out, mean, rstd, res, weight, bias, N, C);
    });
  }
  void residual_rmsnorm_forward(Stream& s, DType dt, void* res, void* out, float* rstd,
                                const void* a, const void* b, const void* weight, float eps, int N,
                                int C) override {
    run(s, [=] {
      cpu::residual_forward(dt, res, a, b, size_t(N) * size_t(C));
      cpu::rmsnorm_forward(dt, out, rstd, res, weight, eps, N, C);
    });
  }

  KernelSupport supports(KernelOp op, const OpShape& shape) const override {
    switch (op) {
      case KernelOp::kFusedAttention:  // the twin of the CUDA kernels: every dtype and head size
        if (shape.hs < 0) return {false, "negative head size"};
        return {true, "cpu"};
      case KernelOp::kMatmulGelu:
        return {true, "cpu (matmul_forward, then gelu_forward)"};
      case KernelOp::kResidualNorm:
        return {true, "cpu (residual_forward, then the norm)"};
      case KernelOp::kMatmulBackwardGelu:
        return {true, "cpu (matmul_backward, then gelu_backward)"};
      case KernelOp::kDropout:
      case KernelOp::kAttentionDecode:
        return {true, "cpu"};
    }
    return {false, "unknown op"};
  }
  void fused_attention_forward(Stream& s, DType dt, void* out, float* lse, const void* qkv,
                               const int32_t* pos, int B, int T, int NH, int NKV, int hs) override {
    check_heads(NH, NKV, hs);
    run(s, [=] { cpu::fused_attention_forward(dt, out, lse, qkv, pos, B, T, NH, NKV, hs); });
  }
  void fused_attention_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                                const void* qkv, const void* out, const float* lse,
                                const int32_t* pos, int B, int T, int NH, int NKV, int hs,
                                bool accumulate) override {
    check_heads(NH, NKV, hs);
    run(s, [=] {
      // Written: zeroed first, so it has the bits of an accumulation into zeros.
      if (!accumulate) std::memset(dqkv, 0, size_t(B) * T * (NH + 2 * NKV) * hs * dtype_size(dt));
      cpu::fused_attention_backward(dt, dqkv, scratch, dout, qkv, out, lse, pos, B, T, NH, NKV, hs);
    });
  }

  void attention_gqa_forward(Stream& s, DType dt, void* out, float* att, const void* qkv,
                             const int32_t* pos, int B, int T, int NH, int KVH, int hs) override {
    run(s, [=] { cpu::attention_gqa_forward(dt, out, att, qkv, pos, B, T, NH, KVH, hs); });
  }
  void attention_gqa_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                              const void* qkv, const float* att, const int32_t* pos, int B, int T,
                              int NH, int KVH, int hs) override {
    run(s, [=] {
      cpu::attention_gqa_backward(dt, dqkv, scratch, dout, qkv, att, pos, B, T, NH, KVH, hs);
    });
  }

  void rmsnorm_forward(Stream& s, DType dt, void* out, float* rstd, const void* inp,
                       const void* weight, float eps, int N, int C) override {
    run(s, [=] { cpu::rmsnorm_forward(dt, out, rstd, inp, weight, eps, N, C); });
  }
  void rmsnorm_backward(Stream& s, DType dt, void* dinp, const void* dres, float* dweight,
                        const void* dout, const void* inp, const void* weight, const float* rstd,
                        int N, int C) override {
    run(s, [=] { cpu::rmsnorm_backward(dt, dinp, dres, dweight, dout, inp, weight, rstd, N, C); });
  }

  void swiglu_forward(Stream& s, DType dt, void* out, const void* inp, int N, int H) override {
    run(s, [=] { cpu::swiglu_forward(dt, out, inp, N, H); });
  }
  void swiglu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout, int N,
                       int H) override {
    run(s, [=] { cpu::swiglu_backward(dt, dinp, inp, dout, N, H); });
  }

  void rope_forward(Stream& s, DType dt, void* qkv, const RopeParams& rope, const int32_t* pos,
                    int B, int T, int NH, int KVH, int hs) override {
    run(s, [=] { cpu::rope(dt, qkv, rope, pos, B, T, NH, KVH, hs, /*inverse=*/false); });
  }
  void rope_backward(Stream& s, DType dt, void* dqkv, const RopeParams& rope, const int32_t* pos,
                     int B, int T, int NH, int KVH, int hs) override {
    run(s, [=] { cpu::rope(dt, dqkv, rope, pos, B, T, NH, KVH, hs, /*inverse=*/true); });
  }

  void qk_norm_forward(Stream& s, DType dt, void* qkv, void* saved, float* rstd, const void* qw,
                       const void* kw, float eps, int N, int NH, int NKV, int hs) override {
    run(s, [=] { cpu::qk_norm_forward(dt, qkv, saved, rstd, qw, kw, eps, N, NH, NKV, hs); });
  }
  void qk_norm_backward(Stream& s, DType dt, void* dqkv, float* dqw, float* dkw, const void* saved,
                        const void* qw, const void* kw, const float* rstd, int N, int NH, int NKV,
                        int hs) override {
    run(s, [=] { cpu::qk_norm_backward(dt, dqkv, dqw, dkw, saved, qw, kw, rstd, N, NH, NKV, hs); });
  }

  void gelu_forward(Stream& s, DType dt, void* out, const void* inp, size_t n) override {
    run(s, [=] { cpu::gelu_forward(dt, out, inp, n); });
  }
  void gelu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout,
                     size_t n) override {
    run(s, [=] { cpu::gelu_backward(dt, dinp, inp, dout, n); });
  }

  void residual_forward(Stream& s, DType dt, void* out, const void* a, const void* b,
                        size_t n) override {
    run(s, [=] { cpu::residual_forward(dt, out, a, b, n); });
  }
  void add_inplace(Stream& s, DType dt, void* dst, const void* src, size_t n) override {
    run(s, [=] { cpu::add_inplace(dt, dst, src, n); });
  }
  void gather_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                   const float* scale, int n, int C) override {
    run(s, [=] { cpu::gather_rows(dt, out, in, idx, scale, n, C); });
  }
  void scatter_add_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                        const float* scale, int n, int C) override {
    run(s, [=] { cpu::scatter_add_rows(dt, out, in, idx, scale, n, C); });
  }
  void row_dots(Stream& s, DType dt, float* out, const void* a, const int32_t* idx, const void* b,
                int n, int C) override {
    run(s, [=] { cpu::row_dots(dt, out, a, idx, b, n, C); });
  }

  void crossentropy_forward_backward(Stream& s, DType dt, float* losses, void* logits_inout,
                                     const int32_t* targets, float dloss, int N, int V,
                                     int Vp) override {
    run(s, [=] {
      cpu::crossentropy_forward_backward(dt, losses, logits_inout, targets, dloss, N, V, Vp);
    });
  }

  void cast(Stream& s, void* dst, DType dst_t, const void* src, DType src_t, size_t n) override {
    run(s, [=] { cpu::cast(dst, dst_t, src, src_t, n); });
  }
  void norm_sq_and_nonfinite(Stream& s, double* norm_sq, const float* x, size_t n) override {
    run(s, [=] { cpu::norm_sq_and_nonfinite(norm_sq, x, n); });
  }
  void scale(Stream& s, float* x, float factor, size_t n) override {
    run(s, [=] { cpu::scale(x, factor, n); });
  }
  void scale_rows(Stream& s, DType dt, void* x, const float* scale, int rows,
                  size_t row_elems) override {
    run(s, [=] { cpu::scale_rows(dt, x, scale, rows, row_elems); });
  }
  void dropout(Stream& s, DType dt, void* out, const void* in, size_t n, float p,
               uint64_t key) override {
    run(s, [=] { cpu::dropout(dt, out, in, n, p, key); });
  }
  void attention_decode(Stream& s, DType dt, void* out, void* kcache, void* vcache, const void* qkv,
                        int B, int T, int pos0, int maxT, int NH, int KVH, int hs) override {
    check_heads(NH, KVH, hs);
    run(s, [=] {
      cpu::attention_decode(dt, out, kcache, vcache, qkv, B, T, pos0, maxT, NH, KVH, hs);
    });
  }
  void quantize(Stream& s, int bits, DType dt, void* q, float* scales, const void* x, size_t n,
                int block) override {
    run(s, [=] { cpu::quantize(bits, dt, q, scales, x, n, block); });
  }
  void dequantize(Stream& s, int bits, DType dt, void* x, const void* q, const float* scales,
                  size_t n, int block, bool accumulate) override {
    run(s, [=] { cpu::dequantize(bits, dt, x, q, scales, n, block, accumulate); });
  }
  void dequantize_nf4(Stream& s, DType dt, void* x, const uint8_t* q, const float* absmax,
                      size_t n) override {
    run(s, [=] { cpu::dequantize_nf4(dt, x, q, absmax, n); });
  }
  void optimizer_step(Stream& s, const OptimizerHyper& hyper, const ShardState& shard) override {
    // threads 0: the fused optimizer runs in the arena this task runs in (the device's).
    run(s, [=] { strata::optimizer_step(hyper, shard, /*threads=*/0); });
  }

 private:
  // Head counts come from a validated model config: a mismatch here is a bug in the caller.
  static void check_heads(int NH, int NKV, int hs) {
    STRATA_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0 && hs > 0,
                 "fused attention: NH must be a positive multiple of NKV, and hs positive");
  }

  // Enqueues `op` on `s`; it runs in this table's arena once the stream reaches it.
  template <typename Op>
  void run(Stream& s, Op op) {
    device_.host_fn(s, [this, op = std::move(op)] {
      if (arena_) {
        arena_->execute(op);
      } else {
        op();
      }
    });
  }

  Device& device_;
  std::optional<tbb::task_arena> arena_;  // empty: TBB's default arena (all cores)
};

}  // namespace

std::unique_ptr<Kernels> create_cpu_kernels(Device& device, int threads) {
  return std::make_unique<CpuKernels>(device, threads);
}

}  // namespace strata
