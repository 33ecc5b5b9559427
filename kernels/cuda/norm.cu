// Gradient statistics for clipping and overflow detection (squared norm in fp64, inf/nan flag)
// and the in-place scale that applies the clip. CPU twin: kernels/cpu/norm.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr int kThreads = 256;

// Pass 1: each block sums x^2 over its grid-stride share in fp64 into partial[blockIdx.x];
// any inf/nan sets acc[1] = 1 (every writer writes the same value).
__global__ void norm_partial_kernel(double* partial, float* acc, const float* x, size_t n) {
  __shared__ double shared[32];
  double sum = 0.0;
  bool bad = false;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    bad |= !isfinite(v);
    sum += double(v) * double(v);
  }
  if (bad) acc[1] = 1.0f;
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Pass 2, one block: acc[0] += float(sum of the partials). Fixed order: deterministic.
__global__ void norm_final_kernel(float* acc, const double* partial, int blocks) {
  __shared__ double shared[32];
  double sum = 0.0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) sum += partial[i];
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) acc[0] += float(sum);
}

__global__ void scale_kernel(float* x, float factor, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    x[i] *= factor;
  }
}

}  // namespace

Status cuda_norm_sq_and_nonfinite(cudaStream_t s, double* scratch, float* acc, const float* x,
                                  size_t n) {
  if (n == 0) return Status::ok();
  const size_t want = (n + kThreads * 4 - 1) / (kThreads * 4);
  const int blocks = int(want < size_t(kCudaReduceBlocks) ? want : kCudaReduceBlocks);
  norm_partial_kernel<<<blocks, kThreads, 0, s>>>(scratch, acc, x, n);
  STRATA_CUDA_LAUNCH_CHECK("launching norm_sq_and_nonfinite (partial sums)");
  norm_final_kernel<<<1, kThreads, 0, s>>>(acc, scratch, blocks);
  STRATA_CUDA_LAUNCH_CHECK("launching norm_sq_and_nonfinite (final sum)");
  return Status::ok();
}

Status cuda_scale(cudaStream_t s, float* x, float factor, size_t n) {
  if (n == 0) return Status::ok();
  scale_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, factor, n);
  STRATA_CUDA_LAUNCH_CHECK("launching scale");
  return Status::ok();
}

}  // namespace strata
