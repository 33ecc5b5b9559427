// A residual add and the norm after it in one kernel: res = a + b (rounded to the storage type
// and stored), then LayerNorm (eps = 1e-5) or RMSNorm of the stored res. CPU twin: the CPU table
// runs residual_forward then layernorm_forward / rmsnorm_forward (kernels/cpu/cpu_kernels.cc).
//
// One warp per row, as layernorm.cu and rmsnorm.cu: each lane adds, rounds and stores its
// strided elements, sums the rounded values, and reads them back from res for the second pass
// (the same lane wrote them, so no synchronization is needed), which is the norm kernels' own
// (norm_rows.cuh). The sums run in the unfused kernels' lane order, so the fused call gives the
// unfused calls' bits: one launch, and res is
// read once instead of written, then read by a second kernel.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/norm_rows.cuh"

namespace strata {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per row, 256 threads

// res[c] = a[c] + b[c] for the lane's columns of the row; returns the lane's sum of the rounded
// values (kSquares: of their squares, written as rmsnorm.cu's `ss += v * v`, so that nvcc
// contracts it the same way), the columns taken as the norm kernels' first pass takes them:
// in packs where res, out and the norm's parameters allow (what the unfused norm's call
// decides by), a and b read in packs only where they are aligned too.
template <bool kSquares, typename T>
__device__ __forceinline__ float add_row(T* res, const T* a, const T* b, int C, int lane,
                                         bool packed, bool ab_aligned) {
  float sum = 0.0f;
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> as = load_elems<K>(a + c, ab_aligned), bs = load_elems<K>(b + c, ab_aligned);
    Elems<T, K> rs;
    for (int j = 0; j < K; ++j) rs.v[j] = from_f32<T>(to_f32(as.v[j]) + to_f32(bs.v[j]));
    store_elems(res + c, rs);
    for (int j = 0; j < K; ++j) {
      const float v = to_f32(rs.v[j]);
      if constexpr (kSquares) {
        sum += v * v;
      } else {
        sum += v;
      }
    }
  });
  return sum;
}

template <typename T>
__global__ void residual_layernorm_kernel(T* res, T* out, float* mean, float* rstd, const T* a,
                                          const T* b, const T* weight, const T* bias, int N, int C,
                                          bool packed, bool ab_aligned) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const size_t off = size_t(row) * C;
  T* x = res + off;
  layernorm_row(out + off, mean, rstd, x, weight, bias,
                warp_sum(add_row<false>(x, a + off, b + off, C, lane, packed, ab_aligned)) / C, row,
                C, lane, packed);
}

template <typename T>
__global__ void residual_rmsnorm_kernel(T* res, T* out, float* rstd, const T* a, const T* b,
                                        const T* weight, float eps, int N, int C, bool packed,
                                        bool ab_aligned) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const size_t off = size_t(row) * C;
  T* x = res + off;
  rmsnorm_row(out + off, rstd, x, weight,
              add_row<true>(x, a + off, b + off, C, lane, packed, ab_aligned), eps, row, C, lane,
              packed);
}

}  // namespace

Status cuda_residual_layernorm_forward(cudaStream_t s, DType dt, void* res, void* out, float* mean,
                                       float* rstd, const void* a, const void* b,
                                       const void* weight, const void* bias, int N, int C,
                                       bool packed) {
  if (N == 0) return Status::ok();
  const unsigned grid = unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock);
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, C, {res, out, weight, bias});
    residual_layernorm_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
        static_cast<scalar_t*>(res), static_cast<scalar_t*>(out), mean, rstd,
        static_cast<const scalar_t*>(a), static_cast<const scalar_t*>(b),
        static_cast<const scalar_t*>(weight), static_cast<const scalar_t*>(bias), N, C, p,
        packs_aligned({a, b}));
  });
  STRATA_CUDA_LAUNCH_CHECK("launching residual_layernorm_forward");
  return Status::ok();
}

Status cuda_residual_rmsnorm_forward(cudaStream_t s, DType dt, void* res, void* out, float* rstd,
                                     const void* a, const void* b, const void* weight, float eps,
                                     int N, int C, bool packed) {
  if (N == 0) return Status::ok();
  const unsigned grid = unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock);
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, C, {res, out, weight});
    residual_rmsnorm_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
        static_cast<scalar_t*>(res), static_cast<scalar_t*>(out), rstd,
        static_cast<const scalar_t*>(a), static_cast<const scalar_t*>(b),
        static_cast<const scalar_t*>(weight), eps, N, C, p, packs_aligned({a, b}));
  });
  STRATA_CUDA_LAUNCH_CHECK("launching residual_rmsnorm_forward");
  return Status::ok();
}

}  // namespace strata
