// NF4 dequantization (Kernels::dequantize_nf4): a quantized LoRA base's weights back to the
// model dtype, one thread per byte (two elements). CPU twin: kernels/cpu/nf4.cc, whose bits
// this kernel reproduces (one _rn multiply, then the dtype's rounding).
#include "kernels/cuda/cuda_common.cuh"
#include "src/base/nf4.h"

namespace strata {
namespace {

constexpr int kThreads = 256;

// bitsandbytes' NF4 code book (src/base/nf4.h's STRATA_NF4_CODE_VALUES, as kNf4Code).
__device__ inline float nf4_code(int c) {
  const float code[16] = {STRATA_NF4_CODE_VALUES};
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
