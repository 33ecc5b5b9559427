// Causal multi-head self-attention, forward and backward, correct first: plain kernels with
// fp32 math and the probabilities materialized in `att` (as the contract asks), no fused or
// tensor-core path yet. CPU twin: kernels/cpu/attention.cc.
//
// Layout (llm.c): qkv [B,T,3C]; head h of position (b,t) reads q at qkv[b,t,h*hs+i], k at
// qkv[b,t,C+h*hs+i], v at qkv[b,t,2C+h*hs+i], hs = C/NH; att [B,NH,T,T]; out [B,T,C].
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr int kRowsPerBlock = 8;  // warp-per-row kernels: 256 threads

// One warp per (b,h,t) row of att: scores q.k*scale for t2 <= t, softmax, zeros above.
template <typename T>
__global__ void attention_softmax_kernel(float* att, const T* qkv, int B, int T_, int C, int NH) {
  const size_t row = blockIdx.x * size_t(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= size_t(B) * NH * T_) return;
  const int t = int(row % T_), h = int((row / T_) % NH), b = int(row / (size_t(T_) * NH));
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  const T* q = qkv + (size_t(b) * T_ + t) * 3 * C + size_t(h) * hs;
  float* a = att + row * T_;
  float mx = -INFINITY;
  for (int t2 = lane; t2 <= t; t2 += 32) {
    const T* k = qkv + (size_t(b) * T_ + t2) * 3 * C + C + size_t(h) * hs;
    float dot = 0.0f;
    for (int i = 0; i < hs; ++i) dot += to_f32(q[i]) * to_f32(k[i]);
    dot *= scale;
    a[t2] = dot;
    mx = fmaxf(mx, dot);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int t2 = lane; t2 <= t; t2 += 32) {
    const float e = expf(a[t2] - mx);
    a[t2] = e;
    sum += e;
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int t2 = lane; t2 < T_; t2 += 32) a[t2] = t2 <= t ? a[t2] * inv : 0.0f;
}

// out[b,t,h*hs+i] = sum_{t2<=t} att[b,h,t,t2] * v[b,t2,h*hs+i], one thread per output element.
template <typename T>
__global__ void attention_value_kernel(T* out, const float* att, const T* qkv, int B, int T_, int C,
                                       int NH) {
  const size_t total = size_t(B) * T_ * C;
  const int hs = C / NH;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % C), h = c / hs;
    const size_t bt = idx / C;
    const int t = int(bt % T_), b = int(bt / T_);
    const float* a = att + ((size_t(b) * NH + h) * T_ + t) * T_;
    const T* v = qkv + size_t(b) * T_ * 3 * C + 2 * C + c;
    float acc = 0.0f;
    for (int t2 = 0; t2 <= t; ++t2) acc += a[t2] * to_f32(v[size_t(t2) * 3 * C]);
    out[idx] = from_f32<T>(acc);
  }
}

// One warp per (b,h,t) row: datt[t2] = v[t2].dout[t]; through the softmax,
// dpre[t2] = att[t2] * (datt[t2] - sum_j att[j]*datt[j]), stored times `scale` in `dpre`.
template <typename T>
__global__ void attention_dscores_kernel(float* dpre, const float* att, const T* dout, const T* qkv,
                                         int B, int T_, int C, int NH) {
  const size_t row = blockIdx.x * size_t(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= size_t(B) * NH * T_) return;
  const int t = int(row % T_), h = int((row / T_) % NH), b = int(row / (size_t(T_) * NH));
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  const T* g = dout + (size_t(b) * T_ + t) * C + size_t(h) * hs;
  const float* a = att + row * T_;
  float* d = dpre + row * T_;
  float s = 0.0f;
  for (int t2 = lane; t2 <= t; t2 += 32) {
    const T* v = qkv + (size_t(b) * T_ + t2) * 3 * C + 2 * C + size_t(h) * hs;
    float dot = 0.0f;
    for (int i = 0; i < hs; ++i) dot += to_f32(v[i]) * to_f32(g[i]);
    d[t2] = dot;
    s += a[t2] * dot;
  }
  s = warp_sum(s);
  for (int t2 = lane; t2 < T_; t2 += 32) d[t2] = t2 <= t ? a[t2] * (d[t2] - s) * scale : 0.0f;
}

// dq[b,t,h,i] += sum_{t2<=t} dpre[b,h,t,t2] * k[b,t2,h,i].
template <typename T>
__global__ void attention_dq_kernel(T* dqkv, const float* dpre, const T* qkv, int B, int T_, int C,
                                    int NH) {
  const size_t total = size_t(B) * T_ * C;
  const int hs = C / NH;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % C), h = c / hs;
    const size_t bt = idx / C;
    const int t = int(bt % T_), b = int(bt / T_);
    const float* d = dpre + ((size_t(b) * NH + h) * T_ + t) * T_;
    const T* k = qkv + size_t(b) * T_ * 3 * C + C + c;
    float acc = 0.0f;
    for (int t2 = 0; t2 <= t; ++t2) acc += d[t2] * to_f32(k[size_t(t2) * 3 * C]);
    T* dst = dqkv + bt * 3 * C + c;
    *dst = from_f32<T>(to_f32(*dst) + acc);
  }
}

// dk[b,t2,h,i] += sum_{t>=t2} dpre[b,h,t,t2] * q[b,t,h,i];
// dv[b,t2,h,i] += sum_{t>=t2} att[b,h,t,t2] * dout[b,t,h,i].
template <typename T>
__global__ void attention_dkv_kernel(T* dqkv, const float* dpre, const float* att, const T* dout,
                                     const T* qkv, int B, int T_, int C, int NH) {
  const size_t total = size_t(B) * T_ * C;
  const int hs = C / NH;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % C), h = c / hs;
    const size_t bt2 = idx / C;
    const int t2 = int(bt2 % T_), b = int(bt2 / T_);
    const size_t head = (size_t(b) * NH + h) * T_;
    float dk = 0.0f, dv = 0.0f;
    for (int t = t2; t < T_; ++t) {
      const size_t at = (head + t) * T_ + t2;
      const size_t bt = size_t(b) * T_ + t;
      dk += dpre[at] * to_f32(qkv[bt * 3 * C + c]);
      dv += att[at] * to_f32(dout[bt * C + c]);
    }
    T* k = dqkv + bt2 * 3 * C + C + c;
    T* v = k + C;
    *k = from_f32<T>(to_f32(*k) + dk);
    *v = from_f32<T>(to_f32(*v) + dv);
  }
}

}  // namespace

Status cuda_attention_forward(cudaStream_t s, DType dt, void* out, float* att, const void* qkv,
                              int B, int T, int C, int NH) {
  const size_t rows = size_t(B) * NH * T;
  if (rows == 0) return Status::ok();
  if (NH <= 0 || C % NH != 0) {
    return invalid_argument("attention_forward: C=" + std::to_string(C) +
                            " is not a multiple of NH=" + std::to_string(NH));
  }
  const unsigned grid = unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const size_t n = size_t(B) * T * C;
  STRATA_DISPATCH_DT(dt, {
    const auto* in = static_cast<const scalar_t*>(qkv);
    attention_softmax_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(att, in, B, T, C, NH);
    attention_value_kernel<scalar_t>
        <<<grid_for(n, 256), 256, 0, s>>>(static_cast<scalar_t*>(out), att, in, B, T, C, NH);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching attention_forward");
  return Status::ok();
}

Status cuda_attention_backward(cudaStream_t s, DType dt, void* dqkv, float* scratch,
                               const void* dout, const void* qkv, const float* att, int B, int T,
                               int C, int NH) {
  const size_t rows = size_t(B) * NH * T;
  if (rows == 0) return Status::ok();
  if (NH <= 0 || C % NH != 0) {
    return invalid_argument("attention_backward: C=" + std::to_string(C) +
                            " is not a multiple of NH=" + std::to_string(NH));
  }
  const unsigned grid = unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const size_t n = size_t(B) * T * C;
  STRATA_DISPATCH_DT(dt, {
    const auto* in = static_cast<const scalar_t*>(qkv);
    const auto* g = static_cast<const scalar_t*>(dout);
    auto* d = static_cast<scalar_t*>(dqkv);
    attention_dscores_kernel<scalar_t>
        <<<grid, 32 * kRowsPerBlock, 0, s>>>(scratch, att, g, in, B, T, C, NH);
    attention_dq_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(d, scratch, in, B, T, C, NH);
    attention_dkv_kernel<scalar_t>
        <<<grid_for(n, 256), 256, 0, s>>>(d, scratch, att, g, in, B, T, C, NH);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching attention_backward");
  return Status::ok();
}

}  // namespace strata
