// GELU, tanh approximation (GPT-2), forward and backward. CPU twin: kernels/cpu/gelu.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

template <typename T>
__global__ void gelu_forward_kernel(T* out, const T* inp, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float x = to_f32(inp[i]);
    const float cube = 0.044715f * x * x * x;
    out[i] = from_f32<T>(0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube))));
  }
}

// dinp += gelu'(inp) * dout.
template <typename T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float x = to_f32(inp[i]);
    const float arg = kGeluScale * (x + 0.044715f * x * x * x);
    const float th = tanhf(arg), ch = coshf(arg);
    const float sech2 = 1.0f / (ch * ch);
    const float local =
        0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = from_f32<T>(to_f32(dinp[i]) + local * to_f32(dout[i]));
  }
}

}  // namespace

Status cuda_gelu_forward(cudaStream_t s, DType dt, void* out, const void* inp, size_t n) {
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, gelu_forward_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(out), static_cast<const scalar_t*>(inp), n));
  STRATA_CUDA_LAUNCH_CHECK("launching gelu_forward");
  return Status::ok();
}

Status cuda_gelu_backward(cudaStream_t s, DType dt, void* dinp, const void* inp, const void* dout,
                          size_t n) {
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, gelu_backward_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(inp),
                             static_cast<const scalar_t*>(dout), n));
  STRATA_CUDA_LAUNCH_CHECK("launching gelu_backward");
  return Status::ok();
}

}  // namespace strata
