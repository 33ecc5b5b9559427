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

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/dtype.h"
#include "strata/optimizer.h"
#include "strata/status.h"

namespace strata {

class Stream;

// Rotary position embeddings: the frequencies of one head's hs/2 rotated pairs.
//   inv_freq[i] = theta^(-2i/hs), i < hs/2 (Hugging Face's LlamaRotaryEmbedding);
//   llama3 scaling (Llama 3.1 `rope_scaling.rope_type: llama3`) then divides the low
//   frequencies by `factor` and blends the band between them and the high ones:
//     wavelen = 2*pi / inv_freq;  lo = original_max_position / low_freq_factor;
//     hi = original_max_position / high_freq_factor;
//     wavelen > lo: inv_freq / factor; wavelen < hi: inv_freq; otherwise (1 - s) * inv_freq /
//     factor + s * inv_freq with s = (original_max_position / wavelen - low_freq_factor) /
//     (high_freq_factor - low_freq_factor).
// Position t's pair i turns by the angle t * inv_freq[i]. Computed in double on every backend.
struct RopeParams {
  double theta = 10000.0;
  bool llama3 = false;  // apply the llama3 frequency adjustment below
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192.0;
};

// inv_freq[0 .. hs/2) for `rope` (the formula above); hs even.
inline void rope_inv_freq(const RopeParams& rope, int hs, double* inv_freq) {
  const double kTwoPi = 6.283185307179586;
  for (int i = 0; i < hs / 2; ++i) {
    double f = 1.0 / std::pow(rope.theta, double(2 * i) / hs);
    if (rope.llama3) {
      const double wavelen = kTwoPi / f;
      const double lo = rope.original_max_position / rope.low_freq_factor;
      const double hi = rope.original_max_position / rope.high_freq_factor;
      if (wavelen > lo) {
        f = f / rope.factor;
      } else if (!(wavelen < hi)) {
        const double s = (rope.original_max_position / wavelen - rope.low_freq_factor) /
                         (rope.high_freq_factor - rope.low_freq_factor);
        f = (1.0 - s) * f / rope.factor + s * f;
      }
    }
    inv_freq[i] = f;
  }
}

// The most rotated pairs a head may have (head size <= 2 * kMaxRopePairs).
constexpr int kMaxRopePairs = 256;

// Sizes of quantize()'s outputs for n elements: bytes of q, and the number of scales.
inline size_t quantized_bytes(int bits, size_t n) { return bits == 8 ? n : (n + 1) / 2; }
inline size_t quantize_blocks(size_t n, int block) {
  return (n + size_t(block) - 1) / size_t(block);
}
// The largest quantized magnitude for `bits` (8 or 4).
inline int quantize_qmax(int bits) { return bits == 8 ? 127 : 7; }

// --- Capability query (ggml-backend's supports_op) ---------------------------------------------
// The ops a backend may lack, or may run on a faster path for some shapes only. Every other op
// of Kernels is required of every backend. A new optional op or fast path lands on one backend
// first: the others answer "unsupported" and the caller takes the fallback it names.
enum class KernelOp {
  // fused_attention_forward/backward. Fallback: attention_gqa_forward/backward.
  kFusedAttention,
  // matmul_gelu_forward. Fallback: matmul_forward, then gelu_forward.
  kMatmulGelu,
  // dropout. No fallback: a caller that needs it refuses to start without it (LoRA's
  // lora_dropout > 0). Reads no shape field.
  kDropout,
  // attention_decode (generation's key/value cache). Fallback: no cache — each token reruns the
  // whole window's forward (src/model/generate.h). Reads dt and hs.
  kAttentionDecode,
  // residual_layernorm_forward and residual_rmsnorm_forward. Fallback: residual_forward, then
  // layernorm_forward or rmsnorm_forward on its output. Reads dt, N and C.
  kResidualNorm,
  // matmul_backward_gelu. Fallback: matmul_backward into a zeroed buffer, then gelu_backward
  // from it into the zeroed dpre. Reads dt, N, C (the input channels: the GELU's width), OC.
  kMatmulBackwardGelu,
};

// The call a query is about; each KernelOp reads its own fields (attention: dt, hs, B, T, NH,
// KVH, positions; matmul: dt, N, C, OC). A field left 0 means "any value": an attention query with
// only dt and hs set asks whether every B, T, NH, KVH runs (the question a model asks once, before
// it plans its memory); a query with every field set asks about that one call (a library's
// per-shape limits).
struct OpShape {
  DType dt = DType::kF32;
  int hs = 0;  // head size (attention)
  int B = 0, T = 0, NH = 0, KVH = 0;
  int N = 0, C = 0, OC = 0;  // rows, input and output channels (matmul)
  // Attention: the call passes positions (attention masked per sequence).
  bool positions = false;
};

// The answer: whether the call runs on this backend, and which implementation runs it (for logs
// and benchmarks: "cpu", "cuda wmma", "cudnn 9.28.1"), or why not.
struct KernelSupport {
  bool supported = false;
  std::string path;  // the implementation when supported; the reason when not
  explicit operator bool() const { return supported; }
};

// Dropout's mask, the same on every backend: element i of a call with key `key` is kept when
// dropout_uniform(key, i) >= p, where dropout_uniform is the top 24 bits of a SplitMix64 hash of
// key + (i + 1) * golden ratio, over 2^24 (a counter-based stream: no state, any element
// computable alone, so the backward regenerates the forward's mask from the same key). Host and
// device code (kernels/cpu/dropout.cc, kernels/cuda/dropout.cu) call these same functions.
#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif
STRATA_HOST_DEVICE inline uint64_t dropout_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
STRATA_HOST_DEVICE inline float dropout_uniform(uint64_t key, size_t i) {
  const uint64_t h = dropout_mix(key + (uint64_t(i) + 1) * 0x9e3779b97f4a7c15ull);
  return float(h >> 40) * (1.0f / 16777216.0f);
}

class Kernels {
 public:
  virtual ~Kernels() = default;

  // Whether `op` runs for `shape` on this backend, and on which path (see KernelOp). Cheap after
  // the first call for a shape (a library's per-shape check is cached); thread-safe.
  virtual KernelSupport supports(KernelOp op, const OpShape& shape) const = 0;

  // Positions: `pos`, where an op takes it, is a device array [B*T] of each token's position in
  // its sequence (0 <= pos < the model's context), or nullptr for position t of row b,t (one
  // sequence per row). Packed windows restart positions at each sequence they hold; a decode
  // step runs one token at its position in the cache.
  //
  // out[b,t,:] = wte[tokens[b,t],:] + wpe[p,:], p = pos[b,t] (t without pos).
  //                                                      out [B,T,C], wte [Vp,C], wpe [maxT,C]
  // wpe may be null (models with rotary positions): out = wte[tokens] (dwpe null likewise).
  virtual void encoder_forward(Stream& s, DType dt, void* out, const int32_t* tokens,
                               const int32_t* pos, const void* wte, const void* wpe, int B, int T,
                               int C) = 0;
  // dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[p,:] += dout[b,t,:] (p as in the forward).
  virtual void encoder_backward(Stream& s, DType dt, float* dwte, float* dwpe, const void* dout,
                                const int32_t* tokens, const int32_t* pos, int B, int T, int C) = 0;

  // out = (inp - mean) * rstd * weight + bias per row; saves mean[N], rstd[N]. eps = 1e-5.
  virtual void layernorm_forward(Stream& s, DType dt, void* out, float* mean, float* rstd,
                                 const void* inp, const void* weight, const void* bias, int N,
                                 int C) = 0;
  // The norm backwards (layernorm_backward, rmsnorm_backward) hand on the residual stream's
  // gradient with the norm's: dinp = dres + the gradient through the norm, rounded to dt once
  // (dres may be dinp: accumulated; nullptr: written, as into zeros); dweight, dbias += (fp32).
  // A block's residual gradient thus needs no copy or add of its own.
  virtual void layernorm_backward(Stream& s, DType dt, void* dinp, const void* dres, float* dweight,
                                  float* dbias, const void* dout, const void* inp,
                                  const void* weight, const float* mean, const float* rstd, int N,
                                  int C) = 0;

  // out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC] (bias may be null).
  virtual void matmul_forward(Stream& s, DType dt, void* out, const void* inp, const void* weight,
                              const void* bias, int N, int C, int OC) = 0;
  // A linear layer and the GELU after it (GPT-2's MLP up-projection), an optional op
  // (KernelOp::kMatmulGelu): pre[N,OC] = inp @ weight^T + bias (bias may be null), saved for
  // gelu_backward; out[N,OC] = gelu(pre). The CPU backend computes exactly matmul_forward then
  // gelu_forward (the same bits); the CUDA backend fuses the GELU into the GEMM's epilogue
  // (cuBLASLt GELU_AUX_BIAS), which applies it to the fp32 sum before rounding, so out may
  // differ from gelu(rounded pre) by one rounding of dt.
  virtual void matmul_gelu_forward(Stream& s, DType dt, void* out, void* pre, const void* inp,
                                   const void* weight, const void* bias, int N, int C, int OC) = 0;
  // dinp += dout @ weight when `accumulate`, else dinp = dout @ weight (written: dinp needs no
  // zeroing, and its old contents are never read); dinp may be null (no input gradient).
  // dweight += dout^T @ inp (if non-null: nullptr for a frozen weight); dbias += column sums of
  // dout (if non-null). A written dinp has the bits of one accumulated into zeros, but for the
  // sign of a zero (a -0 product stays -0).
  virtual void matmul_backward(Stream& s, DType dt, void* dinp, float* dweight, float* dbias,
                               const void* dout, const void* inp, const void* weight, int N, int C,
                               int OC, bool accumulate) = 0;
  // A linear layer's backward whose input was a GELU's output (GPT-2's MLP down-projection,
  // inp = gelu(pre)), an optional op (KernelOp::kMatmulBackwardGelu): the gradient w.r.t. pre
  // in the same call,
  //   dpre[N,C] = gelu'(pre) * (dout @ weight)   WRITTEN, not accumulated (dpre needs no
  //                                              zeroing; it must not alias pre);
  //   dweight += dout^T @ inp, dbias += column sums of dout (each if non-null), as
  //   matmul_backward.
  // The CPU backend computes exactly the fallback's bits: matmul_backward into a zeroed buffer,
  // then gelu_backward from it into a zeroed dpre. The CUDA backend applies gelu' in the dinp
  // GEMM's epilogue (cuBLASLt DGELU, reading pre as the epilogue's aux input) to the fp32 sum
  // before rounding, so dpre may differ from the fallback's by one rounding of dt.
  virtual void matmul_backward_gelu(Stream& s, DType dt, void* dpre, float* dweight, float* dbias,
                                    const void* dout, const void* inp, const void* weight,
                                    const void* pre, int N, int C, int OC) = 0;

  // Causal self-attention with grouped-query heads (Llama, Mistral, Qwen2; GPT-2 is the case
  // KVH == NH, hs = C/NH): NH query heads share KVH key/value heads (KVH divides NH; query head h
  // reads key/value head h / (NH/KVH), as Hugging Face's repeat_kv). qkv [B,T,W],
  // W = (NH + 2*KVH)*hs, packs per position the query heads (channels [0, NH*hs)), then the key
  // heads ([NH*hs, (NH+KVH)*hs)), then the value heads; head j of each part uses channels
  // j*hs .. (j+1)*hs-1 of that part. This is the output of one matmul whose weight stacks
  // q_proj, k_proj and v_proj rows (GPT-2's c_attn with KVH == NH). out [B,T,NH*hs];
  // att [B,NH,T,T] saves the softmax probabilities (entries above the diagonal are 0);
  // scale 1/sqrt(hs). Every backend supports every dtype and head size.
  //   pos (positions, see encoder_forward) masks attention per sequence: the query at row t of
  //   batch b sees the keys t - pos[b,t] .. t (its own sequence of a packed window: a block-
  //   diagonal causal mask), with att 0 elsewhere. pos[b,t] is clamped to [0, t]. nullptr is
  //   plain causal attention, keys 0..t, the same bits as a call without positions.
  virtual void attention_gqa_forward(Stream& s, DType dt, void* out, float* att, const void* qkv,
                                     const int32_t* pos, int B, int T, int NH, int KVH, int hs) = 0;
  // dqkv [B,T,W] += gradient w.r.t. qkv. scratch [B,NH,T,T] fp32 working memory.
  virtual void attention_gqa_backward(Stream& s, DType dt, void* dqkv, float* scratch,
                                      const void* dout, const void* qkv, const float* att,
                                      const int32_t* pos, int B, int T, int NH, int KVH,
                                      int hs) = 0;

  // Fused (flash-attention style) causal self-attention, an optional op (supports() with
  // KernelOp::kFusedAttention says where it runs): the same numbers as attention_gqa_forward/
  // backward up to rounding, computed tile by tile with an online softmax, so memory is O(T):
  // instead of the [B,NH,T,T] probabilities only each row's log-sum-exp is kept for the
  // backward, which recomputes the probabilities.
  //   NH query heads, NKV key/value heads (NH % NKV == 0), head size hs; qkv [B,T,(NH+2*NKV)*hs]
  //   and out [B,T,NH*hs] as attention_gqa_forward's (with NKV == NH a GPT block switches
  //   between the two with no other change); lse [B,NH,T] fp32: log(sum_t2 exp(score[t,t2])) of
  //   each row, natural log, score = q.k / sqrt(hs) for t2 <= t (and t2 >= t - pos[b,t] with
  //   positions: pos masks per sequence as in attention_gqa_forward).
  // A caller asks supports(kFusedAttention, {dt, hs}) once and otherwise uses the plain op;
  // a call the backend does not support is an error returned by the next synchronize. A call
  // with positions is OpShape::positions: a backend whose faster path does not mask per
  // sequence runs its own kernels for it (the backward likewise: the path is chosen per call).
  virtual void fused_attention_forward(Stream& s, DType dt, void* out, float* lse, const void* qkv,
                                       const int32_t* pos, int B, int T, int NH, int NKV,
                                       int hs) = 0;
  // dqkv += gradient w.r.t. qkv when `accumulate`, else dqkv = it (written: dqkv's old contents
  // are never read, and need no zeroing), given dout [B,T,NH*hs] and the forward's out and lse
  // (lse from any implementation of this backend: every one keeps the same log-sum-exp). A
  // written dqkv has the bits of one accumulated into zeros on the own kernels (which zero it
  // first); a library path writes its own result there (no scratch buffer and no add).
  // scratch [B,NH,T] fp32 is caller-provided working memory (each row's dot(dout, out)).
  // The own kernels are deterministic (no atomics); a library path may not be (its path name
  // in supports() says which runs).
  virtual void fused_attention_backward(Stream& s, DType dt, void* dqkv, float* scratch,
                                        const void* dout, const void* qkv, const void* out,
                                        const float* lse, const int32_t* pos, int B, int T, int NH,
                                        int NKV, int hs, bool accumulate) = 0;

  // RMSNorm (Llama): out = inp * rstd * weight per row, rstd = 1/sqrt(mean(inp^2) + eps);
  // saves rstd[N]. inp, out [N,C]; weight [C].
  virtual void rmsnorm_forward(Stream& s, DType dt, void* out, float* rstd, const void* inp,
                               const void* weight, float eps, int N, int C) = 0;
  virtual void rmsnorm_backward(Stream& s, DType dt, void* dinp, const void* dres, float* dweight,
                                const void* dout, const void* inp, const void* weight,
                                const float* rstd, int N, int C) = 0;

  // A residual add and the norm after it (a transformer block's res2 = x + attention, then its
  // second norm), an optional op (KernelOp::kResidualNorm):
  //   res[N,C] = a + b, rounded to dt (residual_forward's bits);
  //   out = the norm of the rounded res, with its statistics, as layernorm_forward (mean, rstd)
  //   or rmsnorm_forward (rstd) of res writes them.
  // Every backend gives the bits of the two calls it replaces: the norm reads res as stored.
  // res may alias a or b (as residual_forward's out); out must not alias a, b or res. The
  // backward is the two ops' backwards (layernorm_backward / rmsnorm_backward, add_inplace).
  virtual void residual_layernorm_forward(Stream& s, DType dt, void* res, void* out, float* mean,
                                          float* rstd, const void* a, const void* b,
                                          const void* weight, const void* bias, int N, int C) = 0;
  virtual void residual_rmsnorm_forward(Stream& s, DType dt, void* res, void* out, float* rstd,
                                        const void* a, const void* b, const void* weight, float eps,
                                        int N, int C) = 0;

  // SwiGLU: inp [N,2H] packs per row the gate (columns 0..H-1) and the up projection
  // (H..2H-1), the output of one matmul whose weight stacks gate_proj and up_proj rows;
  // out [N,H] = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
  virtual void swiglu_forward(Stream& s, DType dt, void* out, const void* inp, int N, int H) = 0;
  // dinp [N,2H] = gradient w.r.t. gate and up, written (the bits of accumulating into zeros):
  // what dinp held is never read, so the MLP's backward needs no zeroing pass first.
  virtual void swiglu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout,
                               int N, int H) = 0;

  // Rotary position embeddings, IN PLACE on the query and key heads of a packed qkv [B,T,W]
  // (layout of attention_gqa_forward; the value heads are untouched). The token at position p
  // (pos[b,t], or t without pos: see encoder_forward) rotates, in every query and key head, the
  // pairs (x[i], x[i + hs/2]) for i < hs/2 (Hugging Face's rotate_half convention) by the angle
  // p * inv_freq[i] (RopeParams):
  //   x[i] <- x[i] cos - x[i + hs/2] sin;  x[i + hs/2] <- x[i + hs/2] cos + x[i] sin.
  // cos and sin are computed in double and rounded to fp32. hs even, hs/2 <= kMaxRopePairs.
  virtual void rope_forward(Stream& s, DType dt, void* qkv, const RopeParams& rope,
                            const int32_t* pos, int B, int T, int NH, int KVH, int hs) = 0;
  // The gradient of rope_forward, also IN PLACE: rotates the query and key heads of dqkv back
  // by the same angles (the transpose of the rotation). Unlike the other backward ops this
  // replaces its buffer rather than accumulating: the rotation is linear and its input is not
  // needed, so the gradient w.r.t. the rotated qkv becomes the gradient w.r.t. the unrotated.
  virtual void rope_backward(Stream& s, DType dt, void* dqkv, const RopeParams& rope,
                             const int32_t* pos, int B, int T, int NH, int KVH, int hs) = 0;

  // Query/key norms (Qwen3's q_norm, k_norm), IN PLACE on the query and key heads of packed qkv
  // rows [N,W], W = (NH + 2 NKV) hs, before the rotary embedding: each query head becomes
  // rmsnorm_forward of it with weight qw [hs], each key head the same with kw [hs]; the value
  // heads are untouched. saved [N,(NH + NKV) hs] receives the heads as they were (row n: its
  // query heads, then its key heads) and rstd [N (NH + NKV)] their 1/sqrt(mean(x^2) + eps).
  virtual void qk_norm_forward(Stream& s, DType dt, void* qkv, void* saved, float* rstd,
                               const void* qw, const void* kw, float eps, int N, int NH, int NKV,
                               int hs) = 0;
  // Its gradient, IN PLACE as rope_backward: dqkv's query and key heads hold the gradient w.r.t.
  // the normalized heads and get the gradient w.r.t. the heads' inputs (rmsnorm_backward's
  // arithmetic per head; the value heads are untouched). dqw, dkw [hs] fp32 += the weights'
  // gradients, summed over the heads in an order that does not depend on threads or blocks.
  virtual void qk_norm_backward(Stream& s, DType dt, void* dqkv, float* dqw, float* dkw,
                                const void* saved, const void* qw, const void* kw,
                                const float* rstd, int N, int NH, int NKV, int hs) = 0;

  // GELU, tanh approximation (GPT-2).
  virtual void gelu_forward(Stream& s, DType dt, void* out, const void* inp, size_t n) = 0;
  virtual void gelu_backward(Stream& s, DType dt, void* dinp, const void* inp, const void* dout,
                             size_t n) = 0;

  // out = a + b.
  virtual void residual_forward(Stream& s, DType dt, void* out, const void* a, const void* b,
                                size_t n) = 0;
  // dst += src.
  virtual void add_inplace(Stream& s, DType dt, void* dst, const void* src, size_t n) = 0;

  // Rows of [*, C] matrices picked by index, for a mixture of experts' dispatch and combine
  // (src/model/moe.h). idx and scale are device arrays of n entries; scale == nullptr means 1.
  // Accumulation is in fp32, one rounding to dt per element written.
  //   gather_rows:      out[i,:] = in[idx[i],:] * scale[i]
  //   scatter_add_rows: out[idx[i],:] += in[i,:] * scale[i]; idx's entries are distinct (one
  //                     call writes each row of out at most once, so no two threads race)
  //   row_dots:         out[i] = sum_c a[idx[i],c] * b[i,c]  (fp32 out)
  virtual void gather_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                           const float* scale, int n, int C) = 0;
  virtual void scatter_add_rows(Stream& s, DType dt, void* out, const void* in, const int32_t* idx,
                                const float* scale, int n, int C) = 0;
  virtual void row_dots(Stream& s, DType dt, float* out, const void* a, const int32_t* idx,
                        const void* b, int n, int C) = 0;

  // Fused softmax cross-entropy over logits [N,Vp] (columns >= V are padding and ignored):
  // losses[i] = -log softmax(logits[i,:V])[targets[i]]; then logits is overwritten with
  // dlogits = (softmax - onehot(target)) * dloss (padding columns set to 0). A negative target
  // (-1: the data's loss mask, as transformers' labels = -100) is ignored: loss 0, gradient 0.
  virtual void crossentropy_forward_backward(Stream& s, DType dt, float* losses, void* logits_inout,
                                             const int32_t* targets, float dloss, int N, int V,
                                             int Vp) = 0;

  // dst[i] = convert(src[i]) between any dtypes.
  virtual void cast(Stream& s, void* dst, DType dst_t, const void* src, DType src_t, size_t n) = 0;
  // *norm_sq = sum(x[i]^2) in fp64, in the order of the host's strata::grad_stats
  // (strata/cpu_optim.h): tiles of kStatsTileElems elements; in each, 16 lanes (element i into
  // lane i % 16, in element order), folded pairwise (lane j += lane j + w for w = 8, 4, 2, 1);
  // the tiles' sums added in tile order. So every backend gives the host's bits, and a gradient
  // norm taken on the device clips as one taken on the host does. Non-finite iff some x[i] is
  // inf or nan (squares cannot overflow fp64). norm_sq: one double of device memory.
  virtual void norm_sq_and_nonfinite(Stream& s, double* norm_sq, const float* x, size_t n) = 0;
  // x[i] *= factor.
  virtual void scale(Stream& s, float* x, float factor, size_t n) = 0;
  // x[r * row_elems + i] *= scale[r] (r < rows, i < row_elems; scale a device array of rows
  // entries): one fp32 multiply, one rounding to dt. A preference batch's per-sequence loss
  // weights on its logits' gradients.
  virtual void scale_rows(Stream& s, DType dt, void* x, const float* scale, int rows,
                          size_t row_elems) = 0;

  // Inverted dropout (torch.nn.Dropout in training): out[i] = in[i] * (1 / (1 - p)) (an fp32
  // multiply, one rounding to dt) where dropout_uniform(key, i) >= p, else 0; 0 <= p < 1. out may
  // be in. Its backward is the same call on the output's gradient with the same key.
  // An optional op (KernelOp::kDropout; the CPU, CUDA and simulated backends have it). A caller
  // checks supports() once when it is built (a LoRA runner with lora.lora_dropout > 0 refuses to
  // be created without it); calling dropout() where it is unsupported is a bug.
  virtual void dropout(Stream&, DType, void*, const void*, size_t, float, uint64_t) {
    STRATA_CHECK(false, "Kernels::dropout on a backend without it (check supports(kDropout))");
  }

  // Generation's attention against a key/value cache, an optional op (KernelOp::
  // kAttentionDecode): T new positions of each of B sequences, at positions pos0 .. pos0+T-1
  // (pos0 + T <= maxT). qkv [B,T,W] packs them as attention_gqa_forward's (query and key heads
  // already rotated); kcache and vcache [B,maxT,KVH*hs] hold the keys and values of positions
  // [0, pos0). The op first copies the new positions' key and value heads into rows pos0.. of
  // each cache (the same bits), then position pos0+t's query heads attend causally over rows
  // [0, pos0+t] (query head h reads key/value head h / (NH/KVH)): out [B,T,NH*hs], scale
  // 1/sqrt(hs), the softmax and the sums in fp32, one rounding to dt. With pos0 = 0 this is
  // attention_gqa_forward's attention up to rounding (a prompt filling the cache); with T = 1,
  // one token's step. Calling it where supports() says no is a bug.
  virtual void attention_decode(Stream&, DType, void* /*out*/, void* /*kcache*/, void* /*vcache*/,
                                const void* /*qkv*/, int /*B*/, int /*T*/, int /*pos0*/,
                                int /*maxT*/, int /*NH*/, int /*KVH*/, int /*hs*/) {
    STRATA_CHECK(false,
                 "Kernels::attention_decode on a backend without it (check "
                 "supports(kAttentionDecode))");
  }
  // Block-wise symmetric quantization (ZeRO++: parameters gathered as 8 bits, gradients
  // reduce-scattered as 4 bits). x has n elements of `dt` in blocks of `block` elements (the last
  // may be shorter; block > 0, even for 4 bits). Block b gets one fp32 scale
  //   scales[b] = max |x| over the block / qmax,   qmax = 127 (8 bits) or 7 (4 bits),
  // and element i the integer q[i] = round-to-nearest-even(x[i] / scales[b]) in [-qmax, qmax]
  // (0 where the scale is 0). A block holding an inf or nan gets a nan scale and q = 0, so it
  // dequantizes to nan: an overflow is never quantized away. Layout of q: 8 bits, one int8_t per
  // element; 4 bits, two's-complement nibbles, element i in byte i/2, the low nibble for even i
  // (quantized_bytes below). So |dequantize(quantize(x)) - x| <= scales[b] / 2 per element, up
  // to one fp32 rounding; the same bits on every backend.
  virtual void quantize(Stream& s, int bits, DType dt, void* q, float* scales, const void* x,
                        size_t n, int block) = 0;
  // x[i] = q[i] * scales[i / block], rounded to `dt`; with `accumulate`, x[i] = x[i] +
  // q[i] * scales[i / block] (fp32 multiply, then fp32 add, then one rounding to `dt`).
  virtual void dequantize(Stream& s, int bits, DType dt, void* x, const void* q,
                          const float* scales, size_t n, int block, bool accumulate) = 0;
  // QLoRA's 4-bit NormalFloat (a quantized LoRA base, src/model/base_quant.h): x[i] =
  // code[c_i] * absmax[i / 64] (one fp32 multiply), rounded to `dt`, where c_i is element i's
  // 4-bit index (byte i/2's high nibble for even i, its low nibble for odd i: bitsandbytes'
  // layout) and code the 16 NF4 values (src/base/nf4.h's kNf4Code, bitsandbytes' fp32 bits).
  // The same bits on every backend, and src/base/nf4.h's nf4_dequantize's before the rounding.
  virtual void dequantize_nf4(Stream& s, DType dt, void* x, const uint8_t* q, const float* absmax,
                              size_t n) = 0;
  // The optimizer step on a shard whose state lives in this device's memory: every pointer in
  // `shard` (grad, master, m, v, lp_out) is device memory; the numbers are
  // optimizer_step_reference()'s (strata/optimizer.h), element for element, on every backend
  // (CPU: the fused CPU optimizer, the same code the tier manager runs on host-resident state;
  // CUDA: kernels/cuda/adamw.cu, compiled without contraction). Moments fp32 or bf16 (fp16 is
  // an error returned by the next synchronize, as is any enqueue failure). The structs are
  // copied; the buffers must stay alive until the stream has run the step.
  virtual void optimizer_step(Stream& s, const OptimizerHyper& hyper, const ShardState& shard) = 0;
};

}  // namespace strata
