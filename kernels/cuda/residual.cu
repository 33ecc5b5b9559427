// Residual connections: out = a + b, and dst += src (gradient accumulation on a residual
// branch). CPU twin: kernels/cpu/residual.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// out may alias a or b: each element is read before it is written, by the same thread.
template <typename T>
__global__ void add_kernel(T* out, const T* a, const T* b, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
  }
}

}  // namespace

Status cuda_residual_forward(cudaStream_t s, DType dt, void* out, const void* a, const void* b,
                             size_t n) {
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, add_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(out), static_cast<const scalar_t*>(a),
                             static_cast<const scalar_t*>(b), n));
  STRATA_CUDA_LAUNCH_CHECK("launching residual_forward");
  return Status::ok();
}

Status cuda_add_inplace(cudaStream_t s, DType dt, void* dst, const void* src, size_t n) {
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, add_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(dst), static_cast<const scalar_t*>(dst),
                             static_cast<const scalar_t*>(src), n));
  STRATA_CUDA_LAUNCH_CHECK("launching add_inplace");
  return Status::ok();
}

}  // namespace strata
