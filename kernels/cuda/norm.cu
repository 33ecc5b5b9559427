// Gradient statistics for clipping and overflow detection (the squared norm in fp64, in the
// host's order: inf or nan make it non-finite) and the in-place scale that applies the clip.
// CPU twin: kernels/cpu/norm.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// The host's order (strata::grad_stats, cpu_optim.h): tiles of kTile elements, in each kLanes
// lanes, element i into lane i % kLanes in element order, folded pairwise; the tiles' sums in
// tile order. A block per tile: its first kLanes threads are the lanes, each a chain of fp64
// adds in element order (4096 a tile), fed from shared memory, into which the block's other
// four warps copy the tile kChunk elements at a time, one chunk ahead of the lanes (a lane
// that loaded its own elements waited for each batch of them: ~70 us a tile, where the chain
// of adds takes ~17).
constexpr size_t kTile = 65536;  // strata::kStatsTileElems
constexpr int kLanes = 16;
constexpr int kChunk = 4096;  // elements a stage (16 KB): 8 16-byte loads a copying thread
constexpr int kCopiers = 128;
constexpr int kBlockThreads = 32 + kCopiers;  // warp 0: the lanes (16 of its threads)

// Copying thread j of kCopiers: elements [base, base + m) into dst, 16 bytes at a time where
// the source is aligned, else one at a time.
__device__ __forceinline__ void copy_chunk(float* dst, const float* src, int m, int j) {
  constexpr int kPer = kChunk / 4 / kCopiers;  // 16-byte loads a thread, all in flight
  if ((reinterpret_cast<uintptr_t>(src) & 15u) == 0 && m == kChunk) {
    Elems<float, 4> v[kPer];
    for (int k = 0; k < kPer; ++k) v[k] = load_elems<4>(src + 4 * (j + k * kCopiers));
    for (int k = 0; k < kPer; ++k) store_elems(dst + 4 * (j + k * kCopiers), v[k]);
    return;
  }
  for (int i = j; i < m; i += kCopiers) dst[i] = src[i];
}

// Pass 1: partial[t] = tile first + t's folded lanes, for the grid's tiles from `first`.
__global__ void norm_tiles_kernel(double* partial, const float* x, size_t n, size_t first) {
  __shared__ float stage[2][kChunk];
  __shared__ double lanes[kLanes];
  const size_t t = blockIdx.x;
  const int tid = int(threadIdx.x);
  const size_t begin = (first + t) * kTile, end = begin + kTile < n ? begin + kTile : n;
  const int len = int(end - begin), chunks = (len + kChunk - 1) / kChunk;
  auto size_of = [&](int c) { return len - c * kChunk < kChunk ? len - c * kChunk : kChunk; };
  if (tid >= 32) copy_chunk(stage[0], x + begin, size_of(0), tid - 32);
  __syncthreads();
  double sum = 0.0;
  for (int c = 0; c < chunks; ++c) {
    if (tid >= 32 && c + 1 < chunks) {
      copy_chunk(stage[(c + 1) & 1], x + begin + size_t(c + 1) * kChunk, size_of(c + 1), tid - 32);
    } else if (tid < kLanes) {
      // The square of an fp32 value is exact in fp64: one rounding per add, as on the host.
      const float* v = stage[c & 1];
      const int m = size_of(c);
      for (int i = tid; i < m; i += kLanes) sum += double(v[i]) * double(v[i]);
    }
    __syncthreads();
  }
  if (tid < kLanes) lanes[tid] = sum;
  __syncthreads();
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    if (tid < w) lanes[tid] += lanes[tid + w];
    __syncthreads();
  }
  if (tid == 0) partial[t] = lanes[0];
}

// Pass 2, one thread: the tiles' sums in tile order, onto what the earlier batches of tiles
// left (`first` false) or from zero.
__global__ void norm_sum_kernel(double* norm_sq, const double* partial, size_t tiles, bool first) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double sum = first ? 0.0 : *norm_sq;
  for (size_t t = 0; t < tiles; ++t) sum += partial[t];
  *norm_sq = sum;
}

__global__ void scale_kernel(float* x, float factor, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    x[i] *= factor;
  }
}

}  // namespace

Status cuda_norm_sq_and_nonfinite(cudaStream_t s, double* scratch, double* norm_sq, const float* x,
                                  size_t n) {
  // The scratch holds kCudaReduceBlocks tiles' sums: larger inputs go in batches of tiles,
  // their sums added on in order.
  const size_t tiles = (n + kTile - 1) / kTile;
  size_t done = 0;
  do {
    const size_t batch =
        tiles - done < size_t(kCudaReduceBlocks) ? tiles - done : size_t(kCudaReduceBlocks);
    if (batch > 0) {
      norm_tiles_kernel<<<unsigned(batch), kBlockThreads, 0, s>>>(scratch, x, n, done);
      STRATA_CUDA_LAUNCH_CHECK("launching norm_sq_and_nonfinite (tiles)");
    }
    norm_sum_kernel<<<1, 32, 0, s>>>(norm_sq, scratch, batch, done == 0);
    STRATA_CUDA_LAUNCH_CHECK("launching norm_sq_and_nonfinite (sum)");
    done += batch;
  } while (done < tiles);
  return Status::ok();
}

Status cuda_scale(cudaStream_t s, float* x, float factor, size_t n) {
  if (n == 0) return Status::ok();
  scale_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, factor, n);
  STRATA_CUDA_LAUNCH_CHECK("launching scale");
  return Status::ok();
}

}  // namespace strata
