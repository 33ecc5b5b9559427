// NF4 dequantization (Kernels::dequantize_nf4): a quantized LoRA base's weights back to the
// model dtype, one thread per byte (two elements). CPU twin: kernels/cpu/nf4.cc, whose bits
// this kernel reproduces (one _rn multiply, then the dtype's rounding).
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr int kThreads = 256;

// bitsandbytes' NF4 code book (src/base/nf4.cc's kNf4Code, the same fp32 values).
__device__ inline float nf4_code(int c) {
  const float code[16] = {-1.0f,
                          -0.6961928009986877f,
                          -0.5250730514526367f,
                          -0.39491748809814453f,
                          -0.28444138169288635f,
                          -0.18477343022823334f,
                          -0.09105003625154495f,
                          0.0f,
                          0.07958029955625534f,
                          0.16093020141124725f,
                          0.24611230194568634f,
                          0.33791524171829224f,
                          0.44070982933044434f,
                          0.5626170039176941f,
                          0.7229568362236023f,
                          1.0f};
  return code[c];
}

template <typename T>
__global__ void dequantize_nf4_kernel(T* x, const uint8_t* q, const float* absmax, size_t n) {
  const size_t bytes = (n + 1) / 2;
  for (size_t b = blockIdx.x * size_t(blockDim.x) + threadIdx.x; b < bytes;
       b += size_t(gridDim.x) * blockDim.x) {
    const size_t i = 2 * b;
    const float s = absmax[i / 64];
    const uint8_t byte = q[b];
    x[i] = from_f32<T>(__fmul_rn(nf4_code(byte >> 4), s));
    if (i + 1 < n) x[i + 1] = from_f32<T>(__fmul_rn(nf4_code(byte & 0xf), s));
  }
}

}  // namespace

Status cuda_dequantize_nf4(cudaStream_t s, DType dt, void* x, const uint8_t* q, const float* absmax,
                           size_t n) {
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(
      dt, dequantize_nf4_kernel<scalar_t><<<grid_for((n + 1) / 2, kThreads), kThreads, 0, s>>>(
              static_cast<scalar_t*>(x), q, absmax, n));
  STRATA_CUDA_LAUNCH_CHECK("launching dequantize_nf4");
  return Status::ok();
}

}  // namespace strata
