// Inverted dropout (Kernels::dropout): each element's mask from dropout_uniform (strata/
// kernels.h, the same function the CPU twin kernels/cpu/dropout.cc calls), then one fp32
// multiply by 1 / (1 - p) computed on the host: the CPU's bits.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// out may alias in: each element is read before it is written, by the same thread.
template <typename T>
__global__ void dropout_kernel(T* out, const T* in, size_t n, float p, float keep_scale,
                               uint64_t key) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = dropout_uniform(key, i) >= p ? from_f32<T>(__fmul_rn(to_f32(in[i]), keep_scale))
                                          : from_f32<T>(0.0f);
  }
}

}  // namespace

Status cuda_dropout(cudaStream_t s, DType dt, void* out, const void* in, size_t n, float p,
                    uint64_t key) {
  if (n == 0) return Status::ok();
  const float keep_scale = 1.0f / (1.0f - p);
  STRATA_DISPATCH_DT(dt, dropout_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(out), static_cast<const scalar_t*>(in), n, p,
                             keep_scale, key));
  STRATA_CUDA_LAUNCH_CHECK("launching dropout");
  return Status::ok();
}

}  // namespace strata
