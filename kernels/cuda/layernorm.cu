// Layer normalization, forward and backward (eps = 1e-5). CPU twin: kernels/cpu/layernorm.cc.
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/norm_backward.cuh"
#include "kernels/cuda/norm_rows.cuh"

namespace strata {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per row, 256 threads

// Two passes over the row like the reference: mean, then the variance around it.
template <typename T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp,
                                         const T* weight, const T* bias, int N, int C,
                                         bool packed) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + size_t(row) * C;
  float sum = 0.0f;
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> xs = load_elems<K>(x + c);
    for (int j = 0; j < K; ++j) sum += to_f32(xs.v[j]);
  });
  layernorm_row(out + size_t(row) * C, mean, rstd, x, weight, bias, warp_sum(sum) / C, row, C, lane,
                packed);
}

// dinp = dres + the norm's gradient (LayerNormGrad; dres null: 0 +), one warp per row.
template <typename T>
__global__ void layernorm_backward_dinp_kernel(T* dinp, const T* dres, const T* dout, const T* inp,
                                               const T* weight, const float* mean,
                                               const float* rstd, int N, int C, bool packed) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  norm_backward_dinp_row(LayerNormGrad{mean, rstd}, dinp, dres, dout, inp, weight, row, C, lane,
                         packed);
}

// dweight[c] += sum_n norm[n,c]*dout[n,c]; dbias[c] += sum_n dout[n,c], by column_sums.cuh
// (the same bits whichever order the blocks run in).
template <typename T>
__global__ void layernorm_backward_params_kernel(float* dweight, float* dbias, const T* dout,
                                                 const T* inp, const float* mean, const float* rstd,
                                                 int N, int C, int rows_per_chunk, int chunks,
                                                 CudaReduceScratch rs) {
  __shared__ float sh[2][1][kColumnRowLanes][33];
  __shared__ int last;
  const int c = blockIdx.x * 32 + threadIdx.x;
  int r0, r1;
  column_sum_rows(N, rows_per_chunk, &r0, &r1);
  float v[2][1] = {{0.0f}, {0.0f}};  // weight, bias
  if (c < C) {
    for (int r = r0 + threadIdx.y; r < r1; r += kColumnRowLanes) {
      const size_t i = size_t(r) * C + c;
      const float g = to_f32(dout[i]);
      v[1][0] += g;
      v[0][0] += (to_f32(inp[i]) - mean[r]) * rstd[r] * g;
    }
  }
  float* const out[2] = {dweight, dbias};
  finish_column_sums<2>(v, out, C, chunks, rs, sh, last);
}

}  // namespace

Status cuda_layernorm_forward(cudaStream_t s, DType dt, void* out, float* mean, float* rstd,
                              const void* inp, const void* weight, const void* bias, int N, int C,
                              bool packed) {
  if (N == 0) return Status::ok();
  const unsigned grid = unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock);
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, C, {out, inp, weight, bias});
    layernorm_forward_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
        static_cast<scalar_t*>(out), mean, rstd, static_cast<const scalar_t*>(inp),
        static_cast<const scalar_t*>(weight), static_cast<const scalar_t*>(bias), N, C, p);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching layernorm_forward");
  return Status::ok();
}

Status cuda_layernorm_backward(cudaStream_t s, DType dt, void* dinp, const void* dres,
                               float* dweight, float* dbias, const void* dout, const void* inp,
                               const void* weight, const float* mean, const float* rstd, int N,
                               int C, const CudaReduceScratch& rs, bool packed, bool fused) {
  if (N == 0) return Status::ok();
  const unsigned grid = unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock);
  const ColumnSumPlan plan = plan_column_sums(rs, N, C, 2);
  STRATA_DISPATCH_DT(dt, {
    const auto* g = static_cast<const scalar_t*>(dout);
    const auto* x = static_cast<const scalar_t*>(inp);
    const bool p = rows_packed<scalar_t>(packed, C, {dinp, dres, dout, inp, weight});
    if (!cuda_layernorm_backward_fused(s, dt, dinp, dres, dweight, dbias, dout, inp, weight, mean,
                                       rstd, N, C, rs, p, fused)) {
      if (dinp) {
        layernorm_backward_dinp_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
            static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(dres), g, x,
            static_cast<const scalar_t*>(weight), mean, rstd, N, C, p);
      }
      if (dweight || dbias) {
        layernorm_backward_params_kernel<scalar_t><<<plan.grid, column_sum_block(), 0, s>>>(
            dweight, dbias, g, x, mean, rstd, N, C, plan.rows_per_chunk, plan.chunks, rs);
      }
    }
  });
  STRATA_CUDA_LAUNCH_CHECK("launching layernorm_backward");
  return Status::ok();
}

}  // namespace strata
