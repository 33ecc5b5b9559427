// The CPU kernels as plain synchronous functions (internal to kernels/cpu).
//
// Each function here is one op of the Kernels table (strata/kernels.h has the shapes, the
// dtype rules and the accumulate (+=) semantics of the backward ops); the table in
// cpu_kernels.cc enqueues a call to it on the stream and runs it inside a TBB arena limited to
// the device's thread count. One op per file, named as its CUDA twin: encoder.cc, layernorm.cc,
// matmul.cc, attention.cc, flash_attention.cc, rmsnorm.cc, swiglu.cc, rope.cc, gelu.cc,
// residual.cc, crossentropy.cc, cast.cc, norm.cc, quantize.cc, nf4.cc, dropout.cc,
// attention_decode.cc.
//
// Threading: the functions use tbb::parallel_for and run on whatever arena they are called
// from. They may be called from any thread; concurrent calls must not write the same memory.
//
// Determinism: every result is bit-identical run to run for the same inputs, and does not
// depend on the thread count either. Work is split into chunks whose bounds depend only on the
// shapes; a reduction over rows sums fixed chunks into per-chunk partials, then adds the
// partials in chunk order. No atomics, no order that depends on scheduling.
#pragma once

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "strata/dtype.h"
#include "strata/kernels.h"

namespace strata::cpu {

// Calls f(begin, end) over [0, n) split into pieces of at most `grain` (>= 1), in parallel.
// The pieces' bounds depend only on n and grain.
template <typename F>
void parallel_ranges(size_t n, size_t grain, F&& f) {
  if (n == 0) return;
  if (grain == 0) grain = 1;
  if (n <= grain) {
    f(size_t{0}, n);
    return;
  }
  size_t chunks = (n + grain - 1) / grain;
  tbb::parallel_for(
      tbb::blocked_range<size_t>(0, chunks, 1),
      [&](const tbb::blocked_range<size_t>& r) {
        for (size_t c = r.begin(); c != r.end(); ++c) {
          size_t b = c * grain, e = b + grain < n ? b + grain : n;
          f(b, e);
        }
      },
      tbb::simple_partitioner());
}

// A thread's reusable float scratch, uninitialised: for a task body's buffers that it writes
// before it reads them, so a call neither allocates nor zero-fills them (a zeroed std::vector
// per tile or per attention task cost a memset -- and past glibc's mmap threshold, page faults
// -- per call). Declare one per call site as a function-local `thread_local`; the buffer stays
// valid until the same thread calls get() on it again, so a task body must not call into TBB
// (which could run another task of the same call site on this thread) while it uses it.
class ThreadScratch {
 public:
  float* get(size_t n) {
    if (n > n_) {
      buf_ = std::make_unique_for_overwrite<float[]>(n);
      n_ = n;
    }
    return buf_.get();
  }

 private:
  std::unique_ptr<float[]> buf_;
  size_t n_ = 0;
};

// Elements per task of an elementwise op: large enough to amortise the scheduling.
constexpr size_t kElementGrain = 1 << 15;

// pos: each token's position (nullptr: t), as Kernels::encoder_forward.
void encoder_forward(DType dt, void* out, const int32_t* tokens, const int32_t* pos,
                     const void* wte, const void* wpe, int B, int T, int C);
void encoder_backward(DType dt, float* dwte, float* dwpe, const void* dout, const int32_t* tokens,
                      const int32_t* pos, int B, int T, int C);

void layernorm_forward(DType dt, void* out, float* mean, float* rstd, const void* inp,
                       const void* weight, const void* bias, int N, int C);
void layernorm_backward(DType dt, void* dinp, const void* dres, float* dweight, float* dbias,
                        const void* dout, const void* inp, const void* weight, const float* mean,
                        const float* rstd, int N, int C);

void matmul_forward(DType dt, void* out, const void* inp, const void* weight, const void* bias,
                    int N, int C, int OC);
// Kernels::matmul_backward (accumulate: dinp += dout @ weight, else dinp = dout @ weight).
void matmul_backward(DType dt, void* dinp, float* dweight, float* dbias, const void* dout,
                     const void* inp, const void* weight, int N, int C, int OC, bool accumulate);

// The first key the query at row t sees (attention masked per sequence, Kernels::
// attention_gqa_forward): t - pos[t], pos[t] clamped to [0, t]; 0 without positions. `pos` is
// the batch row's positions (pos + b*T) or nullptr.
inline int attention_key_start(const int32_t* pos, int t) {
  if (pos == nullptr) return 0;
  const int p = pos[t];
  return p <= 0 ? t : (p >= t ? 0 : t - p);
}

void fused_attention_forward(DType dt, void* out, float* lse, const void* qkv, const int32_t* pos,
                             int B, int T, int NH, int NKV, int hs);
void fused_attention_backward(DType dt, void* dqkv, float* scratch, const void* dout,
                              const void* qkv, const void* out, const float* lse,
                              const int32_t* pos, int B, int T, int NH, int NKV, int hs);

void attention_gqa_forward(DType dt, void* out, float* att, const void* qkv, const int32_t* pos,
                           int B, int T, int NH, int KVH, int hs);

void attention_gqa_backward(DType dt, void* dqkv, float* scratch, const void* dout, const void* qkv,
                            const float* att, const int32_t* pos, int B, int T, int NH, int KVH,
                            int hs);
void attention_decode(DType dt, void* out, void* kcache, void* vcache, const void* qkv, int B,
                      int T, int pos0, int maxT, int NH, int KVH, int hs);

void rmsnorm_forward(DType dt, void* out, float* rstd, const void* inp, const void* weight,
                     float eps, int N, int C);
void rmsnorm_backward(DType dt, void* dinp, const void* dres, float* dweight, const void* dout,
                      const void* inp, const void* weight, const float* rstd, int N, int C);

// Query/key norms over the heads of packed qkv rows (Kernels::qk_norm_forward / _backward).
void qk_norm_forward(DType dt, void* qkv, void* saved, float* rstd, const void* qw, const void* kw,
                     float eps, int N, int NH, int NKV, int hs);
void qk_norm_backward(DType dt, void* dqkv, float* dqw, float* dkw, const void* saved,
                      const void* qw, const void* kw, const float* rstd, int N, int NH, int NKV,
                      int hs);

void swiglu_forward(DType dt, void* out, const void* inp, int N, int H);
void swiglu_backward(DType dt, void* dinp, const void* inp, const void* dout, int N, int H);

// inverse: rotate back (rope_backward).
void rope(DType dt, void* qkv, const RopeParams& rope, const int32_t* pos, int B, int T, int NH,
          int KVH, int hs, bool inverse);

void gelu_forward(DType dt, void* out, const void* inp, size_t n);
void gelu_backward(DType dt, void* dinp, const void* inp, const void* dout, size_t n);
// g_io[i] = gelu'(inp[i]) * g_io[i], in place: the bits of gelu_backward from dout = g_io into a
// zeroed dinp (Kernels::matmul_backward_gelu on this backend).
void gelu_backward_replace(DType dt, void* g_io, const void* inp, size_t n);

void residual_forward(DType dt, void* out, const void* a, const void* b, size_t n);
void add_inplace(DType dt, void* dst, const void* src, size_t n);

// Kernels::gather_rows, scatter_add_rows, row_dots (moe.cc).
void gather_rows(DType dt, void* out, const void* in, const int32_t* idx, const float* scale, int n,
                 int C);
void scatter_add_rows(DType dt, void* out, const void* in, const int32_t* idx, const float* scale,
                      int n, int C);
void row_dots(DType dt, float* out, const void* a, const int32_t* idx, const void* b, int n, int C);

void crossentropy_forward_backward(DType dt, float* losses, void* logits_inout,
                                   const int32_t* targets, float dloss, int N, int V, int Vp);

void cast(void* dst, DType dst_t, const void* src, DType src_t, size_t n);
void norm_sq_and_nonfinite(double* norm_sq, const float* x, size_t n);
void scale(float* x, float factor, size_t n);
void scale_rows(DType dt, void* x, const float* scale, int rows, size_t row_elems);
void dropout(DType dt, void* out, const void* in, size_t n, float p, uint64_t key);

// Block-wise quantization (Kernels::quantize / dequantize): the AVX2 path when the CPU has it
// (quantize_isa(): "avx2" or "scalar"), bit for bit the scalar reference's results.
void quantize(int bits, DType dt, void* q, float* scales, const void* x, size_t n, int block);
void dequantize(int bits, DType dt, void* x, const void* q, const float* scales, size_t n,
                int block, bool accumulate);
const char* quantize_isa();
void quantize_reference(int bits, DType dt, void* q, float* scales, const void* x, size_t n,
                        int block);
void dequantize_reference(int bits, DType dt, void* x, const void* q, const float* scales, size_t n,
                          int block, bool accumulate);

// NF4 dequantization (Kernels::dequantize_nf4; nf4.cc).
void dequantize_nf4(DType dt, void* x, const uint8_t* q, const float* absmax, size_t n);

}  // namespace strata::cpu
