// Inverted dropout (Kernels::dropout): each element's mask from dropout_uniform (strata/
// kernels.h, the same function the CPU twin kernels/cpu/dropout.cc calls), then one fp32
// multiply by 1 / (1 - p) computed on the host: the CPU's bits. And Kernels::scale_rows, the
// same one multiply as kernels/cpu/dropout.cc's.
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

// x[r * row_elems + i] *= scale[r]: blockIdx.y walks the rows.
template <typename T>
__global__ void scale_rows_kernel(T* x, const float* scale, int rows, size_t row_elems) {
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    T* row = x + size_t(r) * row_elems;
    const float f = scale[r];
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < row_elems;
         i += size_t(gridDim.x) * blockDim.x) {
      row[i] = from_f32<T>(__fmul_rn(to_f32(row[i]), f));
    }
  }
}

}  // namespace

Status cuda_scale_rows(cudaStream_t s, DType dt, void* x, const float* scale, int rows,
                       size_t row_elems) {
  if (rows <= 0 || row_elems == 0) return Status::ok();
  const dim3 grid(grid_for(row_elems, 256), unsigned(rows < 65535 ? rows : 65535));
  STRATA_DISPATCH_DT(dt, scale_rows_kernel<scalar_t>
                     <<<grid, 256, 0, s>>>(static_cast<scalar_t*>(x), scale, rows, row_elems));
  STRATA_CUDA_LAUNCH_CHECK("launching scale_rows");
  return Status::ok();
}

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
