// Token + position embedding (wpe null: the token embedding alone), forward and backward. CPU twin:
// kernels/cpu/encoder.cc.
#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// One thread per output element: out[b,t,c] = wte[tok,c] + wpe[p,c], p = pos[b,t] or t.
template <typename T>
__global__ void encoder_forward_kernel(T* out, const int32_t* tokens, const int32_t* positions,
                                       const T* wte, const T* wpe, int B, int T_, int C) {
  const size_t total = size_t(B) * T_ * C;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t bt = i / C;
    const int c = int(i % C), t = positions ? positions[bt] : int(bt % T_);
    const size_t tok = size_t(tokens[bt]);
    const float pos = wpe ? to_f32(wpe[size_t(t) * C + c]) : 0.0f;
    out[i] = from_f32<T>(to_f32(wte[tok * C + c]) + pos);
  }
}

// The gradients are the CPU backend's sums (kernels/cpu/encoder.cc) in its order: dwte[k] and
// dwpe[p] each gather their rows in ascending row order, one add after another, so the bits are
// the CPU backend's and do not depend on how the GPU schedules blocks. Rows are grouped by key
// (the token, or the position) without sorting, in four steps over the stream's scratch
// (CudaReduceScratch::rows, five ints a row):
//   rank_rows        each row's first row with its key, its rank among that key's rows and
//                    their count: every row compared with every key (N^2 compares: 67 M for
//                    8192 rows), a block per 128 rows and 1024 keys, the keys read 128 at a
//                    time into shared memory, the blocks' findings combined by integer atomics
//   offset_keys      an exclusive scan, in one block, of each key's count at its first row
//   place_rows       row r to slot offset[first] + rank
//   sum_rows_by_key  per (key's first row, 256 columns), from up to 2048 blocks striding over
//                    the rows: acc = dst[k][c], then each of the key's rows added in order, and
//                    stored.
constexpr int kRankTile = 128;    // rows of a block, and keys read into shared memory at once
constexpr int kRankChunk = 1024;  // keys one block compares its rows with

// Block (x, y) compares rows [128x, 128x + 128) with keys [1024y, 1024y + 1024) and adds what
// it found to each row's first, rank and count with integer atomics (their results do not
// depend on order). first starts at INT_MAX-ish (bytes 0x7F), rank and count at 0.
__global__ void rank_rows_kernel(const int32_t* keys, int N, int32_t* first, int32_t* rank,
                                 int32_t* count) {
  __shared__ int32_t tile[kRankTile];
  const int r = int(blockIdx.x) * kRankTile + int(threadIdx.x);
  const int32_t k = r < N ? keys[r] : 0;
  const int c0 = int(blockIdx.y) * kRankChunk, c1 = min(N, c0 + kRankChunk);
  int f = -1, rk = 0, n = 0;
  for (int j0 = c0; j0 < c1; j0 += kRankTile) {
    if (j0 + int(threadIdx.x) < c1) tile[threadIdx.x] = keys[j0 + threadIdx.x];
    __syncthreads();
    const int m = min(kRankTile, c1 - j0);
    if (r < N) {
      for (int j = 0; j < m; ++j) {
        if (tile[j] != k) continue;
        if (f < 0) f = j0 + j;
        rk += j0 + j < r ? 1 : 0;
        ++n;
      }
    }
    __syncthreads();
  }
  if (r < N && n > 0) {
    atomicMin(&first[r], f);
    atomicAdd(&rank[r], rk);
    atomicAdd(&count[r], n);
  }
}

// offset[r] for every first row r: the rows of the keys whose first rows come before it.
constexpr int kOffsetThreads = 1024;
__global__ void offset_keys_kernel(const int32_t* first, const int32_t* count, int N,
                                   int32_t* offset) {
  __shared__ int32_t sums[2][kOffsetThreads];
  const int t = int(threadIdx.x), per = (N + kOffsetThreads - 1) / kOffsetThreads;
  const int r0 = min(N, t * per), r1 = min(N, r0 + per);
  int32_t own = 0;
  for (int r = r0; r < r1; ++r) own += first[r] == r ? count[r] : 0;
  sums[0][t] = own;
  __syncthreads();
  int in = 0;
  for (int d = 1; d < kOffsetThreads; d *= 2) {  // inclusive scan, Hillis-Steele
    sums[1 - in][t] = sums[in][t] + (t >= d ? sums[in][t - d] : 0);
    __syncthreads();
    in = 1 - in;
  }
  int32_t at = sums[in][t] - own;
  for (int r = r0; r < r1; ++r) {
    if (first[r] != r) continue;
    offset[r] = at;
    at += count[r];
  }
}

__global__ void place_rows_kernel(const int32_t* first, const int32_t* rank, const int32_t* offset,
                                  int N, int32_t* slot) {
  const int r = int(blockIdx.x) * blockDim.x + int(threadIdx.x);
  if (r < N) slot[offset[first[r]] + rank[r]] = r;
}

constexpr int kSumColumns = 256;
constexpr unsigned kSumRowBlocks = 2048;  // blocks along the rows; each strides over them
template <typename T>
__global__ void sum_rows_by_key_kernel(float* dst, const T* src, const int32_t* keys,
                                       const int32_t* first, const int32_t* count,
                                       const int32_t* offset, const int32_t* slot, int N, int C) {
  const int c = int(blockIdx.y) * kSumColumns + int(threadIdx.x);
  if (c >= C) return;
  for (int r = int(blockIdx.x); r < N; r += int(gridDim.x)) {
    if (first[r] != r) continue;  // not its key's first row
    float* d = dst + size_t(keys[r]) * C + c;
    const int32_t* rows = slot + offset[r];
    const int n = count[r];
    float acc = *d;
    int i = 0;
    for (; i + 4 <= n; i += 4) {  // four loads in flight, added in order
      const float g0 = to_f32(src[size_t(rows[i]) * C + c]);
      const float g1 = to_f32(src[size_t(rows[i + 1]) * C + c]);
      const float g2 = to_f32(src[size_t(rows[i + 2]) * C + c]);
      const float g3 = to_f32(src[size_t(rows[i + 3]) * C + c]);
      acc += g0;
      acc += g1;
      acc += g2;
      acc += g3;
    }
    for (; i < n; ++i) acc += to_f32(src[size_t(rows[i]) * C + c]);
    *d = acc;
  }
}

// dst[key(r)] += src[r] for every row, in row order per key (see above).
template <typename T>
Status sum_rows_by_key(cudaStream_t s, float* dst, const T* src, const int32_t* keys, int N, int C,
                       const CudaReduceScratch& rs) {
  int32_t* first = rs.rows;
  int32_t *rank = first + N, *count = rank + N, *offset = count + N, *slot = offset + N;
  STRATA_CUDA_CHECK(cudaMemsetAsync(first, 0x7F, size_t(N) * sizeof(int32_t), s),
                    "encoder_backward: first rows");
  STRATA_CUDA_CHECK(cudaMemsetAsync(rank, 0, 2 * size_t(N) * sizeof(int32_t), s),
                    "encoder_backward: ranks and counts");
  const dim3 rank_grid(unsigned((N + kRankTile - 1) / kRankTile),
                       unsigned((N + kRankChunk - 1) / kRankChunk));
  rank_rows_kernel<<<rank_grid, kRankTile, 0, s>>>(keys, N, first, rank, count);
  offset_keys_kernel<<<1, kOffsetThreads, 0, s>>>(first, count, N, offset);
  place_rows_kernel<<<grid_for(size_t(N), 256), 256, 0, s>>>(first, rank, offset, N, slot);
  const dim3 grid(std::min(unsigned(N), kSumRowBlocks),
                  unsigned((C + kSumColumns - 1) / kSumColumns));
  sum_rows_by_key_kernel<T>
      <<<grid, kSumColumns, 0, s>>>(dst, src, keys, first, count, offset, slot, N, C);
  STRATA_CUDA_LAUNCH_CHECK("launching encoder_backward's sums by key");
  return Status::ok();
}

// dwpe[t,c] += dout[b,t,c] for b = 0, 1, ... in order (positions t): one thread per (t,c).
template <typename T>
__global__ void position_sums_kernel(float* dwpe, const T* dout, int B, int T_, int C) {
  const size_t total = size_t(T_) * C;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    float acc = dwpe[i];
    for (int b = 0; b < B; ++b) acc += to_f32(dout[size_t(b) * total + i]);
    dwpe[i] = acc;
  }
}

}  // namespace

Status cuda_encoder_forward(cudaStream_t s, DType dt, void* out, const int32_t* tokens,
                            const int32_t* pos, const void* wte, const void* wpe, int B, int T,
                            int C) {
  const size_t n = size_t(B) * T * C;
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, encoder_forward_kernel<scalar_t>
                     <<<grid_for(n, 256), 256, 0, s>>>(static_cast<scalar_t*>(out), tokens, pos,
                                                       static_cast<const scalar_t*>(wte),
                                                       static_cast<const scalar_t*>(wpe), B, T, C));
  STRATA_CUDA_LAUNCH_CHECK("launching encoder_forward");
  return Status::ok();
}

Status cuda_encoder_backward(cudaStream_t s, DType dt, float* dwte, float* dwpe, const void* dout,
                             const int32_t* tokens, const int32_t* pos, int B, int T, int C,
                             const CudaReduceScratch& rs) {
  const size_t rows = size_t(B) * T;
  if (rows == 0 || C == 0) return Status::ok();
  // Rows a scratch's worth at a time, in order: each key's rows still added in row order.
  const size_t step = std::max<size_t>(1, rs.row_capacity);
  STRATA_DISPATCH_DT(dt, {
    const auto* g = static_cast<const scalar_t*>(dout);
    for (size_t r0 = 0; r0 < rows; r0 += step) {
      const int n = int(std::min(step, rows - r0));
      const scalar_t* gr = g + r0 * size_t(C);
      STRATA_RETURN_IF_ERROR(sum_rows_by_key(s, dwte, gr, tokens + r0, n, C, rs), "dwte");
      if (dwpe && pos) {
        STRATA_RETURN_IF_ERROR(sum_rows_by_key(s, dwpe, gr, pos + r0, n, C, rs), "dwpe");
      }
    }
    if (dwpe && !pos) {
      position_sums_kernel<scalar_t><<<grid_for(size_t(T) * C, 256), 256, 0, s>>>(dwpe, g, B, T, C);
    }
  });
  STRATA_CUDA_LAUNCH_CHECK("launching encoder_backward");
  return Status::ok();
}

}  // namespace strata
