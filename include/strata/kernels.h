// Kernels: the device compute table, the same on every backend.
//
// Conventions (every backend, every op):
//   - Each call is enqueued on `stream` and returns at once (see device.h for ordering).
//   - Pointers are device memory. A buffer typed `void*` holds elements of the call's `dt`
//     (bf16, fp16 or fp32: parameters, activations and activation gradients); a `float*` buffer
//     is always fp32 (weight gradients, layernorm statistics, attention probabilities, losses).
//   - Arithmetic is fp32 (fp32 accumulation in GEMMs and reductions); results are rounded to
//     `dt` on store, round-to-nearest-even.
//   - Backward ops ACCUMULATE (+=) into every gradient output, as in llm.c: the caller zeroes
//     gradients before the first micro-batch. This makes gradient accumulation and residual
//     branches free.
//   - Shapes follow llm.c: B batch, T sequence, C channels, NH heads, OC output channels,
//     N = B*T rows, V vocabulary, Vp padded vocabulary (>= V; rows V..Vp-1 of wte are padding).
//   - Matrices are row-major. A linear layer's weight is [OC, C]: out = inp @ weight^T + bias.
// The CPU backend (kernels/cpu/) is the reference; tests run each backend's ops against it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/dtype.h"

namespace strata {

class Stream;

class Kernels {
 public:
  virtual ~Kernels() = default;

  // out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].          out [B,T,C], wte [Vp,C], wpe [maxT,C]
  virtual void encoder_forward(Stream& s, DType dt, void* out, const int32_t* tokens,
                               const void* wte, const void* wpe, int B, int T, int C) = 0;
  // dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:].
  virtual void encoder_backward(Stream& s, DType dt, float* dwte, float* dwpe, const void* dout,
                                const int32_t* tokens, int B, int T, int C) = 0;

  // out = (inp - mean) * rstd * weight + bias per row; saves mean[N], rstd[N]. eps = 1e-5.
  virtual void layernorm_forward(Stream& s, DType dt, void* out, float* mean, float* rstd,
                                 const void* inp, const void* weight, const void* bias, int N,
                                 int C) = 0;
  virtual void layernorm_backward(Stream& s, DType dt, void* dinp, float* dweight, float* dbias,
                                  const void* dout, const void* inp, const void* weight,
                                  const float* mean, const float* rstd, int N, int C) = 0;

  // out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC] (bias may be null).
  virtual void matmul_forward(Stream& s, DType dt, void* out, const void* inp, const void* weight,
                              const void* bias, int N, int C, int OC) = 0;
  // dinp += dout @ weight; dweight += dout^T @ inp; dbias += column sums of dout (if non-null).
  virtual void matmul_backward(Stream& s, DType dt, void* dinp, float* dweight, float* dbias,
                               const void* dout, const void* inp, const void* weight, int N, int C,
                               int OC) = 0;

  // Causal multi-head self-attention. qkv [B,T,3C] holds q, k, v for every head (head h uses
  // channels h*C/NH .. (h+1)*C/NH-1 of each of the three C-wide parts); out [B,T,C];
  // att [B,NH,T,T] saves the softmax probabilities (entries above the diagonal are 0).
  virtual void attention_forward(Stream& s, DType dt, void* out, float* att, const void* qkv, int B,
                                 int T, int C, int NH) = 0;
  // dqkv += gradient w.r.t. qkv. scratch [B,NH,T,T] fp32 is caller-provided working memory.
  virtual void attention_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                                  const void* qkv, const float* att, int B, int T, int C,
                                  int NH) = 0;

  // Fused (flash-attention style) causal self-attention with grouped-query heads: the same
  // numbers as attention_forward/attention_backward, computed tile by tile with an online
  // softmax, so memory is O(T): instead of the [B,NH,T,T] probabilities only each row's
  // log-sum-exp is kept for the backward, which recomputes the probabilities.
  //   NH query heads, NKV key/value heads (NH % NKV == 0), head size hs. Query head h attends
  //   with key/value head h / (NH / NKV) (consecutive query heads share one, as in Llama).
  //   qkv [B,T,(NH + 2*NKV)*hs]: the NH query heads, then the NKV key heads, then the NKV value
  //   heads, each hs channels. With NKV == NH this is attention_forward's [B,T,3C], C = NH*hs,
  //   so a GPT block can switch between the two with no other change.
  //   out [B,T,NH*hs]; lse [B,NH,T] fp32: log(sum_t2 exp(score[t,t2])) of each row, where
  //   score = q.k / sqrt(hs) for t2 <= t.
  // fused_attention_supported(dt, hs): whether this backend runs the fused op for that dtype
  // and head size (the CPU backend: always; CUDA: bf16 and fp16 with hs 64 or 128, on tensor
  // cores). A caller checks it once and otherwise uses attention_forward/attention_backward;
  // an unsupported call is an error returned by the next synchronize of the device.
  virtual bool fused_attention_supported(DType dt, int hs) const = 0;
  virtual void fused_attention_forward(Stream& s, DType dt, void* out, float* lse, const void* qkv,
                                       int B, int T, int NH, int NKV, int hs) = 0;
  // dqkv += gradient w.r.t. qkv, given dout [B,T,NH*hs] and the forward's out and lse.
  // scratch [B,NH,T] fp32 is caller-provided working memory (each row's dot(dout, out)).
  // Deterministic: the result does not depend on scheduling (no atomics).
  virtual void fused_attention_backward(Stream& s, DType dt, void* dqkv, float* scratch,
                                        const void* dout, const void* qkv, const void* out,
                                        const float* lse, int B, int T, int NH, int NKV,
                                        int hs) = 0;

  // GELU, tanh approximation (GPT-2).
  virtual void gelu_forward(Stream& s, DType dt, void* out, const void* inp, size_t n) = 0;
  virtual void gelu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout,
                             size_t n) = 0;

  // out = a + b.
  virtual void residual_forward(Stream& s, DType dt, void* out, const void* a, const void* b,
                                size_t n) = 0;
  // dst += src.
  virtual void add_inplace(Stream& s, DType dt, void* dst, const void* src, size_t n) = 0;

  // Fused softmax cross-entropy over logits [N,Vp] (columns >= V are padding and ignored):
  // losses[i] = -log softmax(logits[i,:V])[targets[i]]; then logits is overwritten with
  // dlogits = (softmax - onehot(target)) * dloss (padding columns set to 0).
  virtual void crossentropy_forward_backward(Stream& s, DType dt, float* losses, void* logits_inout,
                                             const int32_t* targets, float dloss, int N, int V,
                                             int Vp) = 0;

  // dst[i] = convert(src[i]) between any dtypes.
  virtual void cast(Stream& s, void* dst, DType dst_t, const void* src, DType src_t, size_t n) = 0;
  // acc[0] += sum(x[i]^2) (summed in fp64 within the call, added to acc[0] in fp32);
  // acc[1] = 1 if any x[i] is inf or nan, else unchanged. acc: 2 floats of device memory.
  virtual void norm_sq_and_nonfinite(Stream& s, float* acc, const float* x, size_t n) = 0;
  // x[i] *= factor.
  virtual void scale(Stream& s, float* x, float factor, size_t n) = 0;
};

}  // namespace strata
