// RMSNorm, forward and backward: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps); and over
// each query and key head of packed q|k|v rows (Qwen3's q_norm, k_norm).
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

// The query and key heads of qkv rows [N,W]: head `seg` = n H + h (H = NH + NKV) starts at
// n W + h hs; the query heads (h < NH) take qw, the key heads kw. One warp a head: its input to
// saved [seg], then rmsnorm_row from there back into qkv.
template <typename T>
__global__ void qk_norm_forward_kernel(T* qkv, T* saved, float* rstd, const T* qw, const T* kw,
                                       float eps, int N, int NH, int NKV, int hs, bool packed) {
  const int H = NH + NKV;
  const int seg = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (seg >= N * H) return;
  const int n = seg / H, h = seg % H;
  T* head = qkv + size_t(n) * (NH + 2 * NKV) * hs + size_t(h) * hs;
  T* sv = saved + size_t(seg) * hs;
  float ss = 0.0f;
  for_row_elems<T>(hs, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> xs = load_elems<K>(head + c);
    store_elems(sv + c, xs);
    for (int j = 0; j < K; ++j) {
      const float v = to_f32(xs.v[j]);
      ss += v * v;
    }
  });
  rmsnorm_row(head, rstd, sv, h < NH ? qw : kw, ss, eps, seg, hs, lane, packed);
}

// The input gradient of each query and key head in place, one warp a head (RmsNormGrad's terms,
// as rmsnorm_backward_dinp_kernel; each lane reads its elements before it writes them).
template <typename T>
__global__ void qk_norm_backward_dinp_kernel(T* dqkv, const T* saved, const T* qw, const T* kw,
                                             const float* rstd, int N, int NH, int NKV, int hs,
                                             bool packed) {
  const int H = NH + NKV;
  const int seg = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (seg >= N * H) return;
  const int n = seg / H, h = seg % H;
  T* g = dqkv + size_t(n) * (NH + 2 * NKV) * hs + size_t(h) * hs;
  const T* x = saved + size_t(seg) * hs;
  const T* weight = h < NH ? qw : kw;
  const RmsNormGrad norm{rstd};
  auto st = norm.row(seg);
  float d[2] = {0.0f, 0.0f};
  for_row_elems<T>(hs, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> ws = load_elems<K>(weight + c), ds = load_elems<K>(g + c);
    const Elems<T, K> xs = load_elems<K>(x + c);
    for (int j = 0; j < K; ++j)
      norm.dots(st, to_f32(xs.v[j]), to_f32(ws.v[j]) * to_f32(ds.v[j]), d);
  });
  st = norm_finish(norm, st, d, hs);
  norm_dinp_row(g, static_cast<const T*>(nullptr), g, x, weight, hs, lane, packed,
                [&](float xv, float dn) { return norm.grad(st, xv, dn); });
}

// dqw[c] += sum over rows n and query heads h of saved * rstd * dqkv at column c of the head (dkw
// over the key heads): column_sums.cuh over the N rows, each row's heads in order.
template <typename T>
__global__ void qk_norm_backward_weight_kernel(float* dqw, float* dkw, const T* dqkv,
                                               const T* saved, const float* rstd, int N, int NH,
                                               int NKV, int hs, int rows_per_chunk, int chunks,
                                               CudaReduceScratch rs) {
  __shared__ float sh[2][1][kColumnRowLanes][33];
  __shared__ int last;
  const int H = NH + NKV;
  const size_t W = size_t(NH + 2 * NKV) * hs;
  const int c = blockIdx.x * 32 + threadIdx.x;
  int r0, r1;
  column_sum_rows(N, rows_per_chunk, &r0, &r1);
  float v[2][1] = {{0.0f}, {0.0f}};
  if (c < hs) {
    for (int r = r0 + threadIdx.y; r < r1; r += kColumnRowLanes) {
      for (int h = 0; h < H; ++h) {
        const size_t seg = size_t(r) * H + h;
        const float t =
            to_f32(saved[seg * hs + c]) * rstd[seg] * to_f32(dqkv[r * W + size_t(h) * hs + c]);
        v[h < NH ? 0 : 1][0] += t;
      }
    }
  }
  float* const out[2] = {dqw, dkw};
  finish_column_sums<2>(v, out, hs, chunks, rs, sh, last);
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

Status cuda_qk_norm_forward(cudaStream_t s, DType dt, void* qkv, void* saved, float* rstd,
                            const void* qw, const void* kw, float eps, int N, int NH, int NKV,
                            int hs, bool packed) {
  const size_t heads = size_t(N) * size_t(NH + NKV);
  if (heads == 0) return Status::ok();
  const unsigned grid = unsigned((heads + kRowsPerBlock - 1) / kRowsPerBlock);
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, hs, {qkv, saved, qw, kw});
    qk_norm_forward_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
        static_cast<scalar_t*>(qkv), static_cast<scalar_t*>(saved), rstd,
        static_cast<const scalar_t*>(qw), static_cast<const scalar_t*>(kw), eps, N, NH, NKV, hs, p);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching qk_norm_forward");
  return Status::ok();
}

Status cuda_qk_norm_backward(cudaStream_t s, DType dt, void* dqkv, float* dqw, float* dkw,
                             const void* saved, const void* qw, const void* kw, const float* rstd,
                             int N, int NH, int NKV, int hs, const CudaReduceScratch& rs,
                             bool packed) {
  const size_t heads = size_t(N) * size_t(NH + NKV);
  if (heads == 0) return Status::ok();
  const unsigned grid = unsigned((heads + kRowsPerBlock - 1) / kRowsPerBlock);
  const ColumnSumPlan plan = plan_column_sums(rs, N, hs, 2);
  STRATA_DISPATCH_DT(dt, {
    auto* g = static_cast<scalar_t*>(dqkv);
    const auto* x = static_cast<const scalar_t*>(saved);
    const bool p = rows_packed<scalar_t>(packed, hs, {dqkv, saved, qw, kw});
    // The weights' sums read the gradient before the input-gradient pass replaces it.
    qk_norm_backward_weight_kernel<scalar_t><<<plan.grid, column_sum_block(), 0, s>>>(
        dqw, dkw, g, x, rstd, N, NH, NKV, hs, plan.rows_per_chunk, plan.chunks, rs);
    qk_norm_backward_dinp_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
        g, x, static_cast<const scalar_t*>(qw), static_cast<const scalar_t*>(kw), rstd, N, NH, NKV,
        hs, p);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching qk_norm_backward");
  return Status::ok();
}

}  // namespace strata
