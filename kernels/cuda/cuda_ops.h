// The CUDA backend's internals shared by its device (cuda_device.cc), its kernel table
// (cuda_kernels.cc) and its ops (one .cu file per op). Not a public header.
//
// Each cuda_<op> launcher mirrors the Kernels method of the same name (strata/kernels.h holds
// the contract: shapes, dtypes, accumulation) with two differences: it takes the raw
// cudaStream_t, and it returns the Status of the enqueue (a bad launch configuration, a
// cuBLASLt error). Failures while the kernel runs surface at the next synchronize.
//
// Every op computes in fp32 and rounds to the storage type on store with the CUDA _rn
// intrinsics (round to nearest even), as the CPU reference does. Gradient outputs accumulate.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"
#include "strata/optimizer.h"
#include "strata/status.h"

namespace strata {

// Partial sums per reduction launch: the norm reduction uses at most this many blocks.
constexpr int kCudaReduceBlocks = 1024;

// Device memory private to one stream for the reductions whose bits must not depend on the
// order the GPU runs blocks in (column_sums.cuh: the norms' weight and bias gradients and a
// linear layer's bias gradient; encoder.cu: the embedding's gradients). Work on one stream runs
// in order, so every launch on it reuses the same memory; `tile_counts` are zero between
// launches (a launch that counts puts them back). One allocation, `partials` first. The
// capacities are what the launchers plan with (a test may lower them): a column sum over more
// than `partial_floats` sums takes fewer row chunks (down to one), a shape with more column
// tiles than `tile_counts_size` one chunk; the embedding's gradient takes its rows
// `row_capacity` at a time, in order (the same bits).
struct CudaReduceScratch {
  static constexpr size_t kPartialFloats = size_t(1) << 20;
  static constexpr size_t kTileCounts = 4096;
  static constexpr size_t kRowInts = size_t(5) << 18;  // five ints a row, 262144 rows
  static constexpr size_t kBytes = kPartialFloats * 4 + kTileCounts * 4 + kRowInts * 4;

  float* partials = nullptr;
  unsigned* tile_counts = nullptr;
  int32_t* rows = nullptr;
  size_t partial_floats = kPartialFloats;
  size_t tile_counts_size = kTileCounts;
  size_t row_capacity = kRowInts / 5;
};

// Allocates `rs` (zeroed counters, enqueued on `s` and waited for); frees what it allocated if
// that fails. free_reduce_scratch takes a scratch that may be unallocated.
Status allocate_reduce_scratch(cudaStream_t s, CudaReduceScratch* rs);
void free_reduce_scratch(CudaReduceScratch* rs);

// A CUDA stream as the Device interface hands it out. Owned by the CudaDevice, with the
// device memory below (allocated outside the arena, before its capacity is measured).
class CudaStream final : public Stream {
 public:
  cudaStream_t handle = nullptr;
  // kCudaReduceBlocks doubles private to this stream: work on one stream runs in order, so
  // reductions enqueued on it can reuse the same partial-sum buffer.
  double* scratch = nullptr;
  // cuBLASLt workspace private to this stream (may be 0 bytes: cuBLASLt then picks algorithms
  // that need none).
  void* blas_workspace = nullptr;
  size_t blas_workspace_bytes = 0;
  CudaReduceScratch reduce;
};

// The CudaStream behind a Stream handed out by a CUDA device; aborts (a bug) on any other.
CudaStream& cuda_stream(Stream& s);

// The algorithm cuBLASLt's heuristic chose for each problem a kernel table has run (matmul.cu's
// key: the product's shapes, types, leading dimensions, epilogue, the alignments of the
// operands and of the epilogue's pointers, and the workspace), so that a step's repeated products
// ask the heuristic once each rather than at every call (microseconds of host time per call).
// Thread-safe.
class CublasLtAlgos {
 public:
  using Key = std::array<int64_t, 18>;
  bool find(const Key& key, cublasLtMatmulAlgo_t* algo) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = algos_.find(key);
    if (it == algos_.end()) return false;
    *algo = it->second;
    return true;
  }
  void put(const Key& key, const cublasLtMatmulAlgo_t& algo) {
    std::lock_guard<std::mutex> lock(mu_);
    algos_.emplace(key, algo);
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return algos_.size();
  }

 private:
  mutable std::mutex mu_;
  std::map<Key, cublasLtMatmulAlgo_t> algos_;
};

// What one cuBLASLt call needs: the device's handle, the stream's workspace and the table's
// chosen algorithms (null: the heuristic is asked at every call).
struct CudaBlas {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  CublasLtAlgos* algos = nullptr;
};

// Errors from enqueue functions that return void (Kernels, copies, host_fn): the first one is
// kept and handed to the next synchronize() of any stream or event of the device, which
// returns it. Thread-safe.
class CudaErrorSink {
 public:
  void note(const Status& s);
  Status take();  // the first noted error since the last take(), or OK

 private:
  std::mutex mu_;
  Status first_;
};

// The kernel table of a CUDA device: enqueues the cuda_<op> launchers below on the stream
// each call names, after binding the calling thread to GPU `ordinal`. Errors go to `errors`.
// `handle` and `errors` must outlive the table. The fused attention runs on cuDNN where it
// supports the call's shape, unless STRATA_CUDNN=0 (kernels/cuda/attention_library.h), its
// backward deterministic unless `deterministic` is false (CudaDeviceOptions::deterministic).
std::unique_ptr<Kernels> create_cuda_kernels(int ordinal, cublasLtHandle_t handle,
                                             CudaErrorSink* errors, bool deterministic = true);

// The environment switch of the fused elementwise ops: STRATA_FUSED_OPS=0 makes the table's
// supports() answer no for kMatmulGelu, kMatmulBackwardGelu and kResidualNorm, so the models
// take the unfused calls, and the norms' backwards compute their parameter gradients in a
// kernel of their own (a fused against unfused comparison of a whole step). Read when the table
// is created; any other value, or unset, offers them.
inline constexpr const char* kFusedOpsEnv = "STRATA_FUSED_OPS";

// The environment switch of the 16-byte packs (cuda_common.cuh): STRATA_CUDA_PACKED=0 makes the
// table call the elementwise and row kernels below with `packed` false, one element a thread's
// access (the kernels they replace; a whole step's comparison). Read when the table is created;
// any other value, or unset, takes the packs wherever the arrays are aligned. The launchers'
// `packed` is that switch; each launcher also falls back where a pointer or a row is not
// 16-byte aligned.
inline constexpr const char* kPackedAccessEnv = "STRATA_CUDA_PACKED";

// encoder.cu
Status cuda_encoder_forward(cudaStream_t s, DType dt, void* out, const int32_t* tokens,
                            const int32_t* pos, const void* wte, const void* wpe, int B, int T,
                            int C);
// The CPU backend's bits (each row of dwte and dwpe gathers its rows in row order; `rs` the
// stream's scratch, rs.row_capacity rows at a time).
Status cuda_encoder_backward(cudaStream_t s, DType dt, float* dwte, float* dwpe, const void* dout,
                             const int32_t* tokens, const int32_t* pos, int B, int T, int C,
                             const CudaReduceScratch& rs);
// layernorm.cu
Status cuda_layernorm_forward(cudaStream_t s, DType dt, void* out, float* mean, float* rstd,
                              const void* inp, const void* weight, const void* bias, int N, int C,
                              bool packed = true);
// dinp = dres + the norm's gradient (dres may be dinp; null: written), as Kernels' doc says.
// `fused`: the parameter gradients from the input gradient's pass where the rows go in packs
// (norm_backward.cuh; the fused ops' switch), else a column-sum kernel of their own.
Status cuda_layernorm_backward(cudaStream_t s, DType dt, void* dinp, const void* dres,
                               float* dweight, float* dbias, const void* dout, const void* inp,
                               const void* weight, const float* mean, const float* rstd, int N,
                               int C, const CudaReduceScratch& rs, bool packed = true,
                               bool fused = true);
// matmul.cu (cuBLASLt; dbias by a column-sum kernel, column_sums.cuh)
Status cuda_matmul_forward(cudaStream_t s, const CudaBlas& blas, DType dt, void* out,
                           const void* inp, const void* weight, const void* bias, int N, int C,
                           int OC);
// out = gelu(pre), pre = inp @ weight^T + bias, in one cuBLASLt call (GELU_AUX_BIAS epilogue;
// GELU_AUX without a bias): the epilogue's aux output is pre. OC must be a multiple of 8 (the
// aux matrix's leading dimension): cuda_matmul_gelu_supported.
bool cuda_matmul_gelu_supported(int OC);
Status cuda_matmul_gelu_forward(cudaStream_t s, const CudaBlas& blas, DType dt, void* out,
                                void* pre, const void* inp, const void* weight, const void* bias,
                                int N, int C, int OC);
// Kernels::matmul_backward: dinp by the product with beta 1 (accumulate) or 0 (written).
// `packed`: dbias's column sums read dout's rows in 16-byte packs where they are aligned (the
// same bits).
Status cuda_matmul_backward(cudaStream_t s, const CudaBlas& blas, const CudaReduceScratch& rs,
                            DType dt, void* dinp, float* dweight, float* dbias, const void* dout,
                            const void* inp, const void* weight, int N, int C, int OC,
                            bool accumulate, bool packed = true);
// dpre = gelu'(pre) * (dout @ weight) (written), in one cuBLASLt call with the DGELU epilogue
// (pre the epilogue's aux input); dweight and dbias as cuda_matmul_backward. C must be a
// multiple of 8 (the aux matrix's leading dimension): cuda_matmul_backward_gelu_supported.
bool cuda_matmul_backward_gelu_supported(int C);
Status cuda_matmul_backward_gelu(cudaStream_t s, const CudaBlas& blas, const CudaReduceScratch& rs,
                                 DType dt, void* dpre, float* dweight, float* dbias,
                                 const void* dout, const void* inp, const void* weight,
                                 const void* pre, int N, int C, int OC, bool packed = true);
// attention_decode.cu (any dtype, head size up to 2 * kMaxRopePairs)
bool cuda_attention_decode_supported(int hs);
Status cuda_attention_decode(cudaStream_t s, DType dt, void* out, void* kcache, void* vcache,
                             const void* qkv, int B, int T, int pos0, int maxT, int NH, int KVH,
                             int hs);
// attention.cu
// flash_attention.cu (tensor cores: bf16/fp16, hs 64 or 128; other arguments are rejected)
bool cuda_fused_attention_supported(DType dt, int hs);
Status cuda_fused_attention_forward(cudaStream_t s, DType dt, void* out, float* lse,
                                    const void* qkv, const int32_t* pos, int B, int T, int NH,
                                    int NKV, int hs);
Status cuda_fused_attention_backward(cudaStream_t s, DType dt, void* dqkv, float* scratch,
                                     const void* dout, const void* qkv, const void* out,
                                     const float* lse, const int32_t* pos, int B, int T, int NH,
                                     int NKV, int hs);
Status cuda_attention_gqa_forward(cudaStream_t s, DType dt, void* out, float* att, const void* qkv,
                                  const int32_t* pos, int B, int T, int NH, int KVH, int hs);
Status cuda_attention_gqa_backward(cudaStream_t s, DType dt, void* dqkv, float* scratch,
                                   const void* dout, const void* qkv, const float* att,
                                   const int32_t* pos, int B, int T, int NH, int KVH, int hs);
// rmsnorm.cu
Status cuda_rmsnorm_forward(cudaStream_t s, DType dt, void* out, float* rstd, const void* inp,
                            const void* weight, float eps, int N, int C, bool packed = true);
Status cuda_rmsnorm_backward(cudaStream_t s, DType dt, void* dinp, const void* dres, float* dweight,
                             const void* dout, const void* inp, const void* weight,
                             const float* rstd, int N, int C, const CudaReduceScratch& rs,
                             bool packed = true, bool fused = true);
// swiglu.cu
Status cuda_swiglu_forward(cudaStream_t s, DType dt, void* out, const void* inp, int N, int H,
                           bool packed = true);
Status cuda_swiglu_backward(cudaStream_t s, DType dt, void* dinp, const void* inp, const void* dout,
                            int N, int H, bool packed = true);
// rope.cu
Status cuda_rope_forward(cudaStream_t s, DType dt, void* qkv, const RopeParams& rope,
                         const int32_t* pos, int B, int T, int NH, int KVH, int hs,
                         bool packed = true);
Status cuda_rope_backward(cudaStream_t s, DType dt, void* dqkv, const RopeParams& rope,
                          const int32_t* pos, int B, int T, int NH, int KVH, int hs,
                          bool packed = true);
// gelu.cu
Status cuda_gelu_forward(cudaStream_t s, DType dt, void* out, const void* inp, size_t n,
                         bool packed = true);
Status cuda_gelu_backward(cudaStream_t s, DType dt, void* dinp, const void* inp, const void* dout,
                          size_t n, bool packed = true);
// residual.cu
Status cuda_residual_forward(cudaStream_t s, DType dt, void* out, const void* a, const void* b,
                             size_t n, bool packed = true);
Status cuda_add_inplace(cudaStream_t s, DType dt, void* dst, const void* src, size_t n,
                        bool packed = true);
// residual_norm.cu: res = a + b, then LayerNorm / RMSNorm of the stored res (the bits of
// cuda_residual_forward followed by cuda_layernorm_forward / cuda_rmsnorm_forward).
Status cuda_residual_layernorm_forward(cudaStream_t s, DType dt, void* res, void* out, float* mean,
                                       float* rstd, const void* a, const void* b,
                                       const void* weight, const void* bias, int N, int C,
                                       bool packed = true);
Status cuda_residual_rmsnorm_forward(cudaStream_t s, DType dt, void* res, void* out, float* rstd,
                                     const void* a, const void* b, const void* weight, float eps,
                                     int N, int C, bool packed = true);
// dropout.cu
Status cuda_dropout(cudaStream_t s, DType dt, void* out, const void* in, size_t n, float p,
                    uint64_t key);
// moe.cu
Status cuda_gather_rows(cudaStream_t s, DType dt, void* out, const void* in, const int32_t* idx,
                        const float* scale, int n, int C);
Status cuda_scatter_add_rows(cudaStream_t s, DType dt, void* out, const void* in,
                             const int32_t* idx, const float* scale, int n, int C);
Status cuda_row_dots(cudaStream_t s, DType dt, float* out, const void* a, const int32_t* idx,
                     const void* b, int n, int C);
// crossentropy.cu
Status cuda_crossentropy_forward_backward(cudaStream_t s, DType dt, float* losses,
                                          void* logits_inout, const int32_t* targets, float dloss,
                                          int N, int V, int Vp, bool packed = true,
                                          bool cache_rows = true);
// cast.cu
Status cuda_cast(cudaStream_t s, void* dst, DType dst_t, const void* src, DType src_t, size_t n);
// norm.cu (`scratch`: kCudaReduceBlocks doubles private to stream s)
Status cuda_norm_sq_and_nonfinite(cudaStream_t s, double* scratch, double* norm_sq, const float* x,
                                  size_t n);
Status cuda_scale(cudaStream_t s, float* x, float factor, size_t n);
Status cuda_scale_rows(cudaStream_t s, DType dt, void* x, const float* scale, int rows,
                       size_t row_elems);
// quantize.cu
Status cuda_quantize(cudaStream_t s, int bits, DType dt, void* q, float* scales, const void* x,
                     size_t n, int block);
Status cuda_dequantize(cudaStream_t s, int bits, DType dt, void* x, const void* q,
                       const float* scales, size_t n, int block, bool accumulate);
// nf4.cu
Status cuda_dequantize_nf4(cudaStream_t s, DType dt, void* x, const uint8_t* q, const float* absmax,
                           size_t n);
// adamw.cu: optimizer_step_reference's numbers on a shard whose pointers are device memory.
Status cuda_optimizer_step(cudaStream_t s, const OptimizerHyper& h, const ShardState& st);
// Query/key norms over the heads of packed qkv rows (Kernels::qk_norm_forward / _backward).
Status cuda_qk_norm_forward(cudaStream_t s, DType dt, void* qkv, void* saved, float* rstd,
                            const void* qw, const void* kw, float eps, int N, int NH, int NKV,
                            int hs, bool packed = true);
Status cuda_qk_norm_backward(cudaStream_t s, DType dt, void* dqkv, float* dqw, float* dkw,
                             const void* saved, const void* qw, const void* kw, const float* rstd,
                             int N, int NH, int NKV, int hs, const CudaReduceScratch& rs,
                             bool packed = true);

}  // namespace strata
