// RMSNorm, forward and backward: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
// CPU twin: kernels/cpu/rmsnorm.cc.
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/norm_backward.cuh"
#include "kernels/cuda/norm_rows.cuh"

namespace strata {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per row, 256 threads

template <typename T>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* inp, const T* weight,
                                       float eps, int N, int C, bool packed) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + size_t(row) * C;
  float ss = 0.0f;
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> xs = load_elems<K>(x + c);
    for (int j = 0; j < K; ++j) {
      const float v = to_f32(xs.v[j]);
      ss += v * v;
    }
  });
  rmsnorm_row(out + size_t(row) * C, rstd, x, weight, ss, eps, row, C, lane, packed);
}

// dinp = dres + the norm's gradient (RmsNormGrad; dres null: 0 +), one warp per row.
template <typename T>
__global__ void rmsnorm_backward_dinp_kernel(T* dinp, const T* dres, const T* dout, const T* inp,
                                             const T* weight, const float* rstd, int N, int C,
                                             bool packed) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  norm_backward_dinp_row(RmsNormGrad{rstd}, dinp, dres, dout, inp, weight, row, C, lane, packed);
}

// dweight[c] += sum_n x[n,c] * rstd[n] * dout[n,c], by column_sums.cuh (the same bits whichever
// order the blocks run in).
template <typename T>
__global__ void rmsnorm_backward_weight_kernel(float* dweight, const T* dout, const T* inp,
                                               const float* rstd, int N, int C, int rows_per_chunk,
                                               int chunks, CudaReduceScratch rs) {
  __shared__ float sh[1][1][kColumnRowLanes][33];
  __shared__ int last;
  const int c = blockIdx.x * 32 + threadIdx.x;
  int r0, r1;
  column_sum_rows(N, rows_per_chunk, &r0, &r1);
  float v[1][1] = {{0.0f}};
  if (c < C) {
    for (int r = r0 + threadIdx.y; r < r1; r += kColumnRowLanes) {
      const size_t i = size_t(r) * C + c;
      v[0][0] += to_f32(inp[i]) * rstd[r] * to_f32(dout[i]);
    }
  }
  float* const out[1] = {dweight};
  finish_column_sums<1>(v, out, C, chunks, rs, sh, last);
}

}  // namespace

Status cuda_rmsnorm_forward(cudaStream_t s, DType dt, void* out, float* rstd, const void* inp,
                            const void* weight, float eps, int N, int C, bool packed) {
  if (N == 0) return Status::ok();
  const unsigned grid = unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock);
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, C, {out, inp, weight});
    rmsnorm_forward_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
        static_cast<scalar_t*>(out), rstd, static_cast<const scalar_t*>(inp),
        static_cast<const scalar_t*>(weight), eps, N, C, p);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching rmsnorm_forward");
  return Status::ok();
}

Status cuda_rmsnorm_backward(cudaStream_t s, DType dt, void* dinp, const void* dres, float* dweight,
                             const void* dout, const void* inp, const void* weight,
                             const float* rstd, int N, int C, const CudaReduceScratch& rs,
                             bool packed, bool fused) {
  if (N == 0) return Status::ok();
  const unsigned grid = unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock);
  const ColumnSumPlan plan = plan_column_sums(rs, N, C, 1);
  STRATA_DISPATCH_DT(dt, {
    const auto* g = static_cast<const scalar_t*>(dout);
    const auto* x = static_cast<const scalar_t*>(inp);
    const bool p = rows_packed<scalar_t>(packed, C, {dinp, dres, dout, inp, weight});
    if (!cuda_rmsnorm_backward_fused(s, dt, dinp, dres, dweight, dout, inp, weight, rstd, N, C, rs,
                                     p, fused)) {
      if (dinp) {
        rmsnorm_backward_dinp_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
            static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(dres), g, x,
            static_cast<const scalar_t*>(weight), rstd, N, C, p);
      }
      if (dweight) {
        rmsnorm_backward_weight_kernel<scalar_t><<<plan.grid, column_sum_block(), 0, s>>>(
            dweight, g, x, rstd, N, C, plan.rows_per_chunk, plan.chunks, rs);
      }
    }
  });
  STRATA_CUDA_LAUNCH_CHECK("launching rmsnorm_backward");
  return Status::ok();
}

}  // namespace strata
