// Gradient statistics for clipping and overflow detection (the squared norm in fp64, in the
// host's order: inf or nan make it non-finite) and the in-place scale that applies the clip.
// CPU twin: kernels/cpu/norm.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// The host's order (strata::grad_stats, cpu_optim.h): tiles of kTile elements, in each kLanes
// lanes, element i into lane i % kLanes in element order, folded pairwise; the tiles' sums in
// tile order. A half-warp per tile, a thread per lane: the lane's loads coalesce across the
// half-warp, its fp64 adds run in element order.
constexpr size_t kTile = 65536;  // strata::kStatsTileElems
constexpr int kLanes = 16;
constexpr int kTilesPerBlock = 8;
constexpr int kBlockThreads = kTilesPerBlock * kLanes;
constexpr int kBatch = 64;  // loads a lane has in flight (its adds: a chain of 4096 per tile)

// Pass 1: partial[t] = tile first + t's folded lanes, for the tiles [first, first + tiles).
__global__ void norm_tiles_kernel(double* partial, const float* x, size_t n, size_t first,
                                  size_t tiles) {
  __shared__ double lanes[kBlockThreads];
  const size_t t = blockIdx.x * size_t(kTilesPerBlock) + threadIdx.x / kLanes;
  const int lane = int(threadIdx.x % kLanes);
  double sum = 0.0;
  if (t < tiles) {
    const size_t begin = (first + t) * kTile, end = begin + kTile < n ? begin + kTile : n;
    size_t i = begin + size_t(lane);
    // kBatch loads in flight before their adds (a lane's adds are a chain; its loads need not
    // wait on each other). The square of an fp32 value is exact in fp64: one rounding per add,
    // as on the host.
    for (; i + (kBatch - 1) * kLanes < end; i += kBatch * kLanes) {
      float v[kBatch];
      for (int k = 0; k < kBatch; ++k) v[k] = x[i + size_t(k) * kLanes];
      for (int k = 0; k < kBatch; ++k) sum += double(v[k]) * double(v[k]);
    }
    for (; i < end; i += kLanes) sum += double(x[i]) * double(x[i]);
  }
  lanes[threadIdx.x] = sum;
  __syncthreads();
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    if (lane < w) lanes[threadIdx.x] += lanes[threadIdx.x + w];
    __syncthreads();
  }
  if (lane == 0 && t < tiles) partial[t] = lanes[threadIdx.x];
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
      const unsigned blocks = unsigned((batch + kTilesPerBlock - 1) / kTilesPerBlock);
      norm_tiles_kernel<<<blocks, kBlockThreads, 0, s>>>(scratch, x, n, done, batch);
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
