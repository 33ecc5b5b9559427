// Column sums whose bits do not depend on the order the GPU runs blocks in (.cu only): out[s][c]
// += sum over rows of a per-element value, for S sums at once (a LayerNorm's weight and bias
// gradients, an RMSNorm's weight gradient, a linear layer's bias gradient).
//
// A launch is a grid of blocks of 32 threads (one column each, or a 16-byte pack of K columns)
// x 8 row lanes, one per column tile (x) and chunk of rows (y). A block sums its rows in a
// fixed order (each row lane every 8th row, then the 8 lanes in lane order). With one chunk the
// block adds its sums to out. With several, each block writes its sums to the stream's scratch
// (CudaReduceScratch::partials) and counts itself done on its tile's counter; the tile's last block
// adds the chunks' sums to out in chunk order and puts the counter back to 0 (the threadfence
// reduction of CUDA's samples, with the sums kept apart so their order is fixed). The float adds
// happen in the same order whichever block finishes last; only the integer counter is atomic.
#pragma once

#include "kernels/cuda/cuda_common.cuh"

namespace strata {

constexpr int kColumnRowLanes = 8;
constexpr int kColumnChunkRows = 256;  // rows of a chunk, while the scratch holds the sums

// One column-sum launch: its grid and how rows split into chunks.
struct ColumnSumPlan {
  dim3 grid;
  int chunks = 1;
  int rows_per_chunk = 0;
};

// Chunks of kColumnChunkRows rows while the scratch holds S sums of C columns for each, and
// while its counters hold one per 32-column tile; else fewer, down to one chunk. The chunks do
// not depend on K (columns a thread: the grid's tiles are 32 * K columns wide), so neither do
// the sums' bits.
inline ColumnSumPlan plan_column_sums(const CudaReduceScratch& rs, int N, int C, int S, int K = 1) {
  const int tiles = (C + 31) / 32;
  int chunks = (N + kColumnChunkRows - 1) / kColumnChunkRows;
  const size_t fit = rs.partial_floats / (size_t(S) * size_t(C));
  if (size_t(tiles) > rs.tile_counts_size) chunks = 1;
  if (size_t(chunks) > fit) chunks = int(fit);
  if (chunks < 1) chunks = 1;
  const int rows = (N + chunks - 1) / chunks;
  ColumnSumPlan p;
  p.rows_per_chunk = rows > 0 ? rows : 1;
  p.chunks = (N + p.rows_per_chunk - 1) / p.rows_per_chunk;
  if (p.chunks < 1) p.chunks = 1;
  p.grid = dim3(unsigned((C + 32 * K - 1) / (32 * K)), unsigned(p.chunks));
  return p;
}
inline dim3 column_sum_block() { return dim3(32, kColumnRowLanes); }

// The rows of this block's chunk, [r0, r1).
__device__ __forceinline__ void column_sum_rows(int N, int rows_per_chunk, int* r0, int* r1) {
  *r0 = int(blockIdx.y) * rows_per_chunk;
  *r1 = min(N, *r0 + rows_per_chunk);
}

// Called by every thread of the block once its K columns' sums over its rows (every 8th row of
// the chunk, from its row lane) are in v: thread x of a block over 32 * K columns has columns
// blockIdx.x * 32 * K + x * K + k, k < K (K = 1: one column a thread; more: a 16-byte pack of
// them, the same sums column by column). `sh` and `last` are the kernel's __shared__ memory
// (declared there, one [S][K][8][33] float array and one int). out[s] may be null (that sum is
// not wanted).
template <int S, int K = 1>
__device__ void finish_column_sums(float (&v)[S][K], float* const (&out)[S], int C, int chunks,
                                   const CudaReduceScratch& rs,
                                   float (&sh)[S][K][kColumnRowLanes][33], int& last) {
  const int tx = int(threadIdx.x), ty = int(threadIdx.y), c0 = (int(blockIdx.x) * 32 + tx) * K;
  for (int s = 0; s < S; ++s)
    for (int k = 0; k < K; ++k) sh[s][k][ty][tx] = v[s][k];
  __syncthreads();
  if (ty == 0) {
    for (int s = 0; s < S; ++s)
      for (int k = 0; k < K; ++k)
        for (int y = 1; y < kColumnRowLanes; ++y) v[s][k] += sh[s][k][y][tx];
  }
  if (chunks == 1) {
    if (ty == 0) {
      for (int s = 0; s < S; ++s)
        for (int k = 0; k < K; ++k)
          if (out[s] && c0 + k < C) out[s][c0 + k] += v[s][k];
    }
    return;
  }
  if (ty == 0) {
    for (int s = 0; s < S; ++s)
      for (int k = 0; k < K; ++k)
        if (c0 + k < C) rs.partials[(size_t(s) * chunks + blockIdx.y) * C + c0 + k] = v[s][k];
  }
  __threadfence();  // the sums are visible before the count says so
  __syncthreads();
  if (tx == 0 && ty == 0) {
    last = atomicAdd(&rs.tile_counts[blockIdx.x], 1u) == unsigned(chunks - 1) ? 1 : 0;
  }
  __syncthreads();
  if (last == 0) return;
  __threadfence();
  if (ty == 0) {
    // volatile: the other blocks' sums, read past this SM's L1
    const volatile float* partials = rs.partials;
    for (int s = 0; s < S; ++s) {
      if (!out[s]) continue;
      for (int k = 0; k < K; ++k) {
        const int c = c0 + k;
        if (c >= C) continue;
        float acc = out[s][c];
        for (int j = 0; j < chunks; ++j) acc += partials[(size_t(s) * chunks + j) * C + c];
        out[s][c] = acc;
      }
    }
  }
  if (tx == 0 && ty == 0) rs.tile_counts[blockIdx.x] = 0;
}

}  // namespace strata
