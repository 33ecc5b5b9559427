// SwiGLU, forward and backward, over a packed [N, 2H] gate|up input. CPU twin:
// kernels/cpu/swiglu.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

template <typename T>
__global__ void swiglu_forward_kernel(T* out, const T* inp, size_t n, int H) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / H, c = i % H;
    const float g = to_f32(inp[r * 2 * H + c]), u = to_f32(inp[r * 2 * H + H + c]);
    out[i] = from_f32<T>(g / (1.0f + expf(-g)) * u);
  }
}

// d gate = dout * up * sig(g) * (1 + g * (1 - sig(g))); d up = dout * silu(g); written as
// 0 + the gradient (the bits of accumulating into zeros).
template <typename T>
__global__ void swiglu_backward_kernel(T* dinp, const T* inp, const T* dout, size_t n, int H) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / H, c = i % H;
    const size_t gi = r * 2 * H + c, ui = gi + H;
    const float g = to_f32(inp[gi]), u = to_f32(inp[ui]), d = to_f32(dout[i]);
    const float sig = 1.0f / (1.0f + expf(-g));
    dinp[gi] = from_f32<T>(0.0f + d * u * sig * (1.0f + g * (1.0f - sig)));
    dinp[ui] = from_f32<T>(0.0f + d * g * sig);
  }
}

}  // namespace

Status cuda_swiglu_forward(cudaStream_t s, DType dt, void* out, const void* inp, int N, int H) {
  const size_t n = size_t(N) * H;
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, swiglu_forward_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(out), static_cast<const scalar_t*>(inp), n, H));
  STRATA_CUDA_LAUNCH_CHECK("launching swiglu_forward");
  return Status::ok();
}

Status cuda_swiglu_backward(cudaStream_t s, DType dt, void* dinp, const void* inp, const void* dout,
                            int N, int H) {
  const size_t n = size_t(N) * H;
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, swiglu_backward_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(inp),
                             static_cast<const scalar_t*>(dout), n, H));
  STRATA_CUDA_LAUNCH_CHECK("launching swiglu_backward");
  return Status::ok();
}

}  // namespace strata
