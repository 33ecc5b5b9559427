// Layer normalization, forward and backward (eps = 1e-5). CPU twin: kernels/cpu/layernorm.cc.
#include "kernels/cuda/cuda_common.cuh"
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

// dinp = dres + (w*dout - mean(w*dout) - norm * mean(w*dout*norm)) * rstd (dres null: 0 +),
// one warp per row.
template <typename T>
__global__ void layernorm_backward_dinp_kernel(T* dinp, const T* dres, const T* dout, const T* inp,
                                               const T* weight, const float* mean,
                                               const float* rstd, int N, int C, bool packed) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const size_t off = size_t(row) * C;
  const float m = mean[row], s = rstd[row];
  float a = 0.0f, b = 0.0f;
  for_row_elems<T>(C, packed, lane, 32, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> ws = load_elems<K>(weight + c), ds = load_elems<K>(dout + off + c);
    const Elems<T, K> xs = load_elems<K>(inp + off + c);
    for (int j = 0; j < K; ++j) {
      const float dn = to_f32(ws.v[j]) * to_f32(ds.v[j]);
      a += dn;
      b += dn * (to_f32(xs.v[j]) - m) * s;
    }
  });
  const float dnorm_mean = warp_sum(a) / C, dnorm_norm_mean = warp_sum(b) / C;
  norm_dinp_row(dinp + off, dres ? dres + off : nullptr, dout + off, inp + off, weight, C, lane,
                packed, [&](float x, float dn) {
                  const float n = (x - m) * s;
                  return (dn - dnorm_mean - n * dnorm_norm_mean) * s;
                });
}

// dweight[c] += sum_n norm[n,c]*dout[n,c]; dbias[c] += sum_n dout[n,c]. Block (32 columns x 8
// row lanes) per column tile and row chunk; chunks combine with one atomicAdd per column.
constexpr int kColRowChunk = 256;
template <typename T>
__global__ void layernorm_backward_params_kernel(float* dweight, float* dbias, const T* dout,
                                                 const T* inp, const float* mean, const float* rstd,
                                                 int N, int C) {
  __shared__ float sw[8][33], sb[8][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  const int r0 = blockIdx.y * kColRowChunk, r1 = min(N, r0 + kColRowChunk);
  float w = 0.0f, b = 0.0f;
  if (c < C) {
    for (int r = r0 + threadIdx.y; r < r1; r += 8) {
      const size_t i = size_t(r) * C + c;
      const float g = to_f32(dout[i]);
      b += g;
      w += (to_f32(inp[i]) - mean[r]) * rstd[r] * g;
    }
  }
  sw[threadIdx.y][threadIdx.x] = w;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int y = 1; y < 8; ++y) {
      w += sw[y][threadIdx.x];
      b += sb[y][threadIdx.x];
    }
    if (dweight) atomicAdd(&dweight[c], w);
    if (dbias) atomicAdd(&dbias[c], b);
  }
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
                               int C, bool packed) {
  if (N == 0) return Status::ok();
  const unsigned grid = unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock);
  const dim3 pgrid(unsigned((C + 31) / 32), unsigned((N + kColRowChunk - 1) / kColRowChunk));
  STRATA_DISPATCH_DT(
      dt,
      if (dinp) {
        const bool p = rows_packed<scalar_t>(packed, C, {dinp, dres, dout, inp, weight});
        layernorm_backward_dinp_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(
            static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(dres),
            static_cast<const scalar_t*>(dout), static_cast<const scalar_t*>(inp),
            static_cast<const scalar_t*>(weight), mean, rstd, N, C, p);
      } if (dweight || dbias) {
        layernorm_backward_params_kernel<scalar_t>
            <<<pgrid, dim3(32, 8), 0, s>>>(dweight, dbias, static_cast<const scalar_t*>(dout),
                                           static_cast<const scalar_t*>(inp), mean, rstd, N, C);
      });
  STRATA_CUDA_LAUNCH_CHECK("launching layernorm_backward");
  return Status::ok();
}

}  // namespace strata
