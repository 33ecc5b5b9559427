// Conversions between fp32, bf16 and fp16 (round to nearest even). CPU twin: kernels/cpu/cast.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

template <typename S, typename D>
__global__ void cast_kernel(D* dst, const S* src, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = from_f32<D>(to_f32(src[i]));
  }
}

template <typename S>
Status cast_from(cudaStream_t s, void* dst, DType dst_t, const S* src, size_t n) {
  STRATA_DISPATCH_DT(dst_t, cast_kernel<S, scalar_t>
                     <<<grid_for(n, 256), 256, 0, s>>>(static_cast<scalar_t*>(dst), src, n));
  STRATA_CUDA_LAUNCH_CHECK("launching cast");
  return Status::ok();
}

}  // namespace

Status cuda_cast(cudaStream_t s, void* dst, DType dst_t, const void* src, DType src_t, size_t n) {
  if (n == 0) return Status::ok();
  if (dst_t == src_t) {
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * dtype_size(src_t), cudaMemcpyDeviceToDevice, s),
                      "cast between equal dtypes (a device copy)");
    return Status::ok();
  }
  STRATA_DISPATCH_DT(src_t, return cast_from(s, dst, dst_t, static_cast<const scalar_t*>(src), n));
  return invalid_argument("cast: unknown source dtype");
}

}  // namespace strata
