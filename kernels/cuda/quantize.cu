// Block-wise symmetric quantization to 8 or 4 bits with one fp32 scale per block (ZeRO++'s qwZ
// parameter gathers and qgZ gradient reduce-scatters). CPU twin: kernels/cpu/quantize.cc, whose
// numbers these kernels reproduce bit for bit (IEEE division, _rn intrinsics, no contraction).
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr int kThreads = 256;

// One CUDA block per quantization block: a max-reduction of |x| (and a non-finite flag), then
// each thread quantizes its elements. 4-bit: each thread writes whole bytes (element pairs).
template <typename T>
__global__ void quantize_kernel(int bits, void* q, float* scales, const T* x, size_t n, int block) {
  __shared__ float shared[32];
  __shared__ int shared_bad;
  const size_t i0 = size_t(blockIdx.x) * block;
  const size_t m = (n - i0) < size_t(block) ? (n - i0) : size_t(block);
  const int qmax = bits == 8 ? 127 : 7;
  if (threadIdx.x == 0) shared_bad = 0;
  __syncthreads();
  float amax = 0.0f;
  bool bad = false;
  for (size_t i = threadIdx.x; i < m; i += blockDim.x) {
    const float v = to_f32(x[i0 + i]);
    bad |= !isfinite(v);
    amax = fmaxf(amax, fabsf(v));
  }
  if (bad) shared_bad = 1;
  amax = block_max(amax, shared);
  __syncthreads();
  const bool finite = shared_bad == 0;
  const float scale = finite ? __fdiv_rn(amax, float(qmax)) : __int_as_float(0x7fc00000);
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  auto quant = [&](size_t i) -> int {
    if (!finite || !(scale > 0.0f)) return 0;
    const float r = rintf(__fdiv_rn(to_f32(x[i]), scale));  // ties to even
    return int(fminf(fmaxf(r, float(-qmax)), float(qmax)));
  };
  if (bits == 8) {
    int8_t* q8 = static_cast<int8_t*>(q);
    for (size_t i = threadIdx.x; i < m; i += blockDim.x) q8[i0 + i] = int8_t(quant(i0 + i));
  } else {
    uint8_t* q4 = static_cast<uint8_t*>(q);
    for (size_t j = threadIdx.x; 2 * j < m; j += blockDim.x) {
      const size_t i = i0 + 2 * j;
      const uint8_t lo = uint8_t(quant(i)) & 0x0f;
      const uint8_t hi = (2 * j + 1 < m) ? (uint8_t(quant(i + 1)) & 0x0f) : 0;
      q4[i / 2] = uint8_t(lo | (hi << 4));
    }
  }
}

template <typename T>
__global__ void dequantize_kernel(int bits, T* x, const void* q, const float* scales, size_t n,
                                  int block, bool accumulate) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    int v;
    if (bits == 8) {
      v = static_cast<const int8_t*>(q)[i];
    } else {
      const uint8_t byte = static_cast<const uint8_t*>(q)[i / 2];
      const int nib = (i % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
      v = nib >= 8 ? nib - 16 : nib;
    }
    const float d = __fmul_rn(float(v), scales[i / size_t(block)]);
    x[i] = from_f32<T>(accumulate ? __fadd_rn(to_f32(x[i]), d) : d);
  }
}

}  // namespace

Status cuda_quantize(cudaStream_t s, int bits, DType dt, void* q, float* scales, const void* x,
                     size_t n, int block) {
  if (n == 0) return Status::ok();
  const size_t blocks = (n + size_t(block) - 1) / size_t(block);
  if (blocks > 0x7fffffffu) return invalid_argument("quantize: too many blocks for one launch");
  STRATA_DISPATCH_DT(dt, quantize_kernel<scalar_t><<<unsigned(blocks), kThreads, 0, s>>>(
                             bits, q, scales, static_cast<const scalar_t*>(x), n, block));
  STRATA_CUDA_LAUNCH_CHECK("launching quantize");
  return Status::ok();
}

Status cuda_dequantize(cudaStream_t s, int bits, DType dt, void* x, const void* q,
                       const float* scales, size_t n, int block, bool accumulate) {
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, dequantize_kernel<scalar_t><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                             bits, static_cast<scalar_t*>(x), q, scales, n, block, accumulate));
  STRATA_CUDA_LAUNCH_CHECK("launching dequantize");
  return Status::ok();
}

}  // namespace strata
