// A norm's backward in one pass over its rows (.cu only): the input gradient of each row, as the
// row kernels compute it (a warp a row), and the parameter gradients' column sums from the same
// loads, so that dout and the input cross device memory once for both (the two-kernel form reads
// them again for the column sums: a third of the backward's bytes). layernorm.cu and rmsnorm.cu
// take it where their rows go in 16-byte packs and a lane's share of the columns fits its
// registers; elsewhere, or with `fused` false, their two kernels. The kernels live in
// norm_backward.cu (a header declares no __shared__ memory and launches nothing: the CUDA
// emulation translates .cu files only).
//
// The order of a column's sum is fixed by the shapes alone, whichever order the GPU runs blocks
// in: a block takes a chunk of rows (rows_per_chunk, at least kFusedRows, more where the scratch
// would not hold a sum per chunk and column), its warp w rows w, w + 8, ... of the chunk in row
// order; the block's 8 warps in warp order into the chunk's sum (the stream's scratch, no
// atomics); then a second kernel adds the chunks' sums into the gradient by columns: row lane y
// of its 32 x 8 blocks chunks y, y + 8, ..., the 8 lanes in lane order (column_sums.cuh).
#pragma once

#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"

namespace strata {

constexpr int kFusedWarps = 8;  // rows in flight a block (256 threads)
constexpr int kFusedRows = 16;  // rows of a chunk at the least: two a warp
constexpr int kFusedAccs = 64;  // a lane's accumulators at the most (its registers)

// The launch of a fused backward: lanes' packs a row (a power of two), rows a chunk, chunks.
struct FusedNormPlan {
  int packs = 0;  // 0: not fused (the two kernels run)
  int rows_per_chunk = 0;
  int chunks = 0;
};

// Fused where the rows go in packs (`packed`: rows_packed's answer for every array), dinp and a
// parameter gradient are wanted, S sums of a lane's packs fit kFusedAccs and the scratch holds a
// chunk's sums at kFusedRows rows or more.
template <typename T>
inline FusedNormPlan plan_fused_norm(bool fused, bool packed, bool dinp, bool params,
                                     const CudaReduceScratch& rs, int N, int C, int S) {
  FusedNormPlan p;
  if (!fused || !packed || !dinp || !params || N <= 0 || C <= 0) return p;
  const int need = (C / kPack<T> + 31) / 32;
  int packs = 1;
  while (packs < need) packs *= 2;
  const int accs = S * packs * kPack<T>;
  if (packs > 8 || accs > kFusedAccs) return p;
  const size_t per_chunk = size_t(S) * size_t(C);
  const size_t fit = rs.partial_floats / per_chunk;  // chunks the scratch holds
  if (fit == 0) return p;
  size_t rows = std::max<size_t>(kFusedRows, (size_t(N) + fit - 1) / fit);
  rows = (rows + kFusedWarps - 1) / kFusedWarps * kFusedWarps;
  p.packs = packs;
  p.rows_per_chunk = int(rows);
  p.chunks = int((size_t(N) + rows - 1) / rows);
  return p;
}

// The fused backwards (norm_backward.cu), as cuda_layernorm_backward and cuda_rmsnorm_backward
// take them (cuda_ops.h): launched where plan_fused_norm says so, returning true; false where it
// does not (the caller runs its two kernels). `packed`: rows_packed's answer.
bool cuda_layernorm_backward_fused(cudaStream_t s, DType dt, void* dinp, const void* dres,
                                   float* dweight, float* dbias, const void* dout, const void* inp,
                                   const void* weight, const float* mean, const float* rstd, int N,
                                   int C, const CudaReduceScratch& rs, bool packed, bool fused);
bool cuda_rmsnorm_backward_fused(cudaStream_t s, DType dt, void* dinp, const void* dres,
                                 float* dweight, const void* dout, const void* inp,
                                 const void* weight, const float* rstd, int N, int C,
                                 const CudaReduceScratch& rs, bool packed, bool fused);

}  // namespace strata
