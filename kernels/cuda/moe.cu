// A mixture of experts' row dispatch: gather_rows, scatter_add_rows, row_dots (Kernels). CPU
// twin: kernels/cpu/moe.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// out row o(r) = in row i(r) * scale[r] (gather: o = r, i = idx[r]), or += (scatter: o = idx[r],
// i = r; idx's entries are distinct: no two threads write one element).
template <typename T, bool kScatter>
__global__ void move_rows_kernel(T* out, const T* in, const int32_t* idx, const float* scale,
                                 size_t n, int C) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / C, c = i % C;
    const float f = scale ? scale[r] : 1.0f;
    const float v = to_f32(in[(kScatter ? r : size_t(idx[r])) * C + c]) * f;
    T* dst = out + (kScatter ? size_t(idx[r]) : r) * C + c;
    *dst = from_f32<T>(kScatter ? to_f32(*dst) + v : v);
  }
}

// One thread per row, the columns in order (the CPU twin's sum, term for term).
template <typename T>
__global__ void row_dots_kernel(float* out, const T* a, const int32_t* idx, const T* b, int n,
                                int C) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x) {
    const T* ra = a + size_t(idx[r]) * C;
    const T* rb = b + size_t(r) * C;
    float acc = 0.0f;
    for (int c = 0; c < C; ++c) acc += to_f32(ra[c]) * to_f32(rb[c]);
    out[r] = acc;
  }
}

}  // namespace

Status cuda_gather_rows(cudaStream_t s, DType dt, void* out, const void* in, const int32_t* idx,
                        const float* scale, int n, int C) {
  const size_t total = size_t(n) * C;
  if (total == 0) return Status::ok();
  STRATA_DISPATCH_DT(
      dt, move_rows_kernel<scalar_t, false><<<grid_for(total, 256), 256, 0, s>>>(
              static_cast<scalar_t*>(out), static_cast<const scalar_t*>(in), idx, scale, total, C));
  STRATA_CUDA_LAUNCH_CHECK("launching gather_rows");
  return Status::ok();
}

Status cuda_scatter_add_rows(cudaStream_t s, DType dt, void* out, const void* in,
                             const int32_t* idx, const float* scale, int n, int C) {
  const size_t total = size_t(n) * C;
  if (total == 0) return Status::ok();
  STRATA_DISPATCH_DT(
      dt, move_rows_kernel<scalar_t, true><<<grid_for(total, 256), 256, 0, s>>>(
              static_cast<scalar_t*>(out), static_cast<const scalar_t*>(in), idx, scale, total, C));
  STRATA_CUDA_LAUNCH_CHECK("launching scatter_add_rows");
  return Status::ok();
}

Status cuda_row_dots(cudaStream_t s, DType dt, float* out, const void* a, const int32_t* idx,
                     const void* b, int n, int C) {
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(
      dt, row_dots_kernel<scalar_t><<<grid_for(size_t(n), 128), 128, 0, s>>>(
              out, static_cast<const scalar_t*>(a), idx, static_cast<const scalar_t*>(b), n, C));
  STRATA_CUDA_LAUNCH_CHECK("launching row_dots");
  return Status::ok();
}

}  // namespace strata
