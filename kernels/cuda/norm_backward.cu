// The fused backward of LayerNorm and RMSNorm (norm_backward.cuh): one pass over the rows for
// the input gradient and the parameter gradients' chunk sums, then the chunks' column sums.
// The row terms are those of layernorm.cu's and rmsnorm.cu's input-gradient kernels
// (norm_rows.cuh).
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/norm_backward.cuh"
#include "kernels/cuda/norm_rows.cuh"

namespace strata {
namespace {

// Norm: the norm's row terms (norm_rows.cuh: LayerNormGrad, RmsNormGrad), S parameter
// gradients.
template <typename T, int S, int P, typename Norm>
__global__ void __launch_bounds__(32 * kFusedWarps)
    norm_backward_fused_kernel(T* dinp, const T* dres, float* partials, const T* dout, const T* inp,
                               const T* weight, Norm norm, int N, int C, int rows_per_chunk) {
  constexpr int K = kPack<T>, kCols = P * 32 * K;  // the columns a block's lanes reach
  __shared__ float sh[S][kCols];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int r0 = int(blockIdx.x) * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
  float acc[S][P][K];
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < P; ++j)
      for (int k = 0; k < K; ++k) acc[s][j][k] = 0.0f;
  for (int row = r0 + warp; row < r1; row += kFusedWarps) {
    const size_t off = size_t(row) * C;
    auto st = norm.row(row);
    float d[2] = {0.0f, 0.0f};
    for (int j = 0; j < P; ++j) {
      const int c = (lane + 32 * j) * K;
      if (c >= C) continue;
      const Elems<T, K> ws = load_elems<K>(weight + c), ds = load_elems<K>(dout + off + c);
      const Elems<T, K> xs = load_elems<K>(inp + off + c);
      for (int k = 0; k < K; ++k) {
        const float x = to_f32(xs.v[k]), g = to_f32(ds.v[k]);
        norm.dots(st, x, to_f32(ws.v[k]) * g, d);
        float t[S];
        norm.params(st, x, g, t);
        for (int s = 0; s < S; ++s) acc[s][j][k] += t[s];
      }
    }
    st = norm_finish(norm, st, d, C);
    for (int j = 0; j < P; ++j) {
      const int c = (lane + 32 * j) * K;
      if (c >= C) continue;
      const Elems<T, K> ws = load_elems<K>(weight + c), ds = load_elems<K>(dout + off + c);
      const Elems<T, K> xs = load_elems<K>(inp + off + c);
      Elems<T, K> rs{};
      if (dres) rs = load_elems<K>(dres + off + c);
      Elems<T, K> gs;
      for (int k = 0; k < K; ++k) {
        const float g = norm.grad(st, to_f32(xs.v[k]), to_f32(ws.v[k]) * to_f32(ds.v[k]));
        gs.v[k] = from_f32<T>((dres ? to_f32(rs.v[k]) : 0.0f) + g);
      }
      store_elems(dinp + off + c, gs);
    }
  }
  // The chunk's sums: the warps in warp order.
  for (int w = 0; w < kFusedWarps; ++w) {
    if (warp == w) {
      for (int j = 0; j < P; ++j) {
        const int c = (lane + 32 * j) * K;
        if (c >= C) continue;
        for (int s = 0; s < S; ++s)
          for (int k = 0; k < K; ++k) sh[s][c + k] = (w == 0 ? 0.0f : sh[s][c + k]) + acc[s][j][k];
      }
    }
    __syncthreads();
  }
  for (int c = int(threadIdx.x); c < C; c += 32 * kFusedWarps) {
    for (int s = 0; s < S; ++s) partials[(size_t(s) * gridDim.x + blockIdx.x) * C + c] = sh[s][c];
  }
}

// out[s][c] += the chunks' sums of column c (out[s] null: not wanted).
template <int S>
__global__ void fused_norm_chunk_sums_kernel(float* out0, float* out1, const float* partials,
                                             int chunks, int C, CudaReduceScratch rs) {
  __shared__ float sh[S][1][kColumnRowLanes][33];
  __shared__ int last;
  const int c = int(blockIdx.x) * 32 + int(threadIdx.x);
  float v[S][1];
  for (int s = 0; s < S; ++s) v[s][0] = 0.0f;
  if (c < C) {
    for (int k = int(threadIdx.y); k < chunks; k += kColumnRowLanes) {
      for (int s = 0; s < S; ++s) v[s][0] += partials[(size_t(s) * chunks + k) * C + c];
    }
  }
  if constexpr (S == 1) {
    float* const out[1] = {out0};
    finish_column_sums<1>(v, out, C, /*chunks=*/1, rs, sh, last);
  } else {
    float* const out[2] = {out0, out1};
    finish_column_sums<2>(v, out, C, /*chunks=*/1, rs, sh, last);
  }
}

// Launches the fused backward as `plan` says (plan.packs > 0): the rows' input gradients, then
// the parameter gradients (out1 for S = 2) added to.
template <typename T, int S, typename Norm>
void launch_fused_norm_backward(cudaStream_t s, const FusedNormPlan& plan, T* dinp, const T* dres,
                                float* out0, float* out1, const T* dout, const T* inp,
                                const T* weight, const Norm& norm, int N, int C,
                                const CudaReduceScratch& rs) {
  const unsigned grid = unsigned(plan.chunks), block = 32 * kFusedWarps;
  switch (plan.packs) {
#define STRATA_FUSED_NORM_CASE(P)                                                     \
  case P:                                                                             \
    norm_backward_fused_kernel<T, S, P, Norm><<<grid, block, 0, s>>>(                 \
        dinp, dres, rs.partials, dout, inp, weight, norm, N, C, plan.rows_per_chunk); \
    break;
    STRATA_FUSED_NORM_CASE(1)
    STRATA_FUSED_NORM_CASE(2)
    STRATA_FUSED_NORM_CASE(4)
    STRATA_FUSED_NORM_CASE(8)
#undef STRATA_FUSED_NORM_CASE
    default:
      return;
  }
  fused_norm_chunk_sums_kernel<S><<<unsigned((C + 31) / 32), column_sum_block(), 0, s>>>(
      out0, out1, rs.partials, plan.chunks, C, rs);
}

}  // namespace

bool cuda_layernorm_backward_fused(cudaStream_t s, DType dt, void* dinp, const void* dres,
                                   float* dweight, float* dbias, const void* dout, const void* inp,
                                   const void* weight, const float* mean, const float* rstd, int N,
                                   int C, const CudaReduceScratch& rs, bool packed, bool fused) {
  bool launched = false;
  STRATA_DISPATCH_DT(dt, {
    const FusedNormPlan fp =
        plan_fused_norm<scalar_t>(fused, packed, dinp != nullptr, dweight || dbias, rs, N, C, 2);
    if (fp.packs > 0) {
      launch_fused_norm_backward<scalar_t, 2>(
          s, fp, static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(dres), dweight, dbias,
          static_cast<const scalar_t*>(dout), static_cast<const scalar_t*>(inp),
          static_cast<const scalar_t*>(weight), LayerNormGrad{mean, rstd}, N, C, rs);
      launched = true;
    }
  });
  return launched;
}

bool cuda_rmsnorm_backward_fused(cudaStream_t s, DType dt, void* dinp, const void* dres,
                                 float* dweight, const void* dout, const void* inp,
                                 const void* weight, const float* rstd, int N, int C,
                                 const CudaReduceScratch& rs, bool packed, bool fused) {
  bool launched = false;
  STRATA_DISPATCH_DT(dt, {
    const FusedNormPlan fp =
        plan_fused_norm<scalar_t>(fused, packed, dinp != nullptr, dweight != nullptr, rs, N, C, 1);
    if (fp.packs > 0) {
      launch_fused_norm_backward<scalar_t, 1>(
          s, fp, static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(dres), dweight, nullptr,
          static_cast<const scalar_t*>(dout), static_cast<const scalar_t*>(inp),
          static_cast<const scalar_t*>(weight), RmsNormGrad{rstd}, N, C, rs);
      launched = true;
    }
  });
  return launched;
}

}  // namespace strata
