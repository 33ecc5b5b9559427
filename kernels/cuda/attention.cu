// Causal self-attention with grouped-query heads (masked per sequence with positions: the softmax
// and its backward see only a row's own sequence, every other probability is 0), forward and
// backward, correct first: plain
// kernels with fp32 math and the probabilities materialized in `att` (as the contract asks), no
// fused or tensor-core path (that is flash_attention.cu). Multi-head attention (GPT-2) is the case
// KVH == NH, hs = C/NH. CPU twin: kernels/cpu/attention.cc.
//
// Layout: qkv [B,T,W], W = (NH+2*KVH)*hs; query head h of position (b,t) reads
// qkv[b,t,h*hs+i], its key/value head g = h/(NH/KVH) reads k at qkv[b,t,NH*hs+g*hs+i] and v at
// qkv[b,t,(NH+KVH)*hs+g*hs+i]; att [B,NH,T,T]; out [B,T,NH*hs].
#include <string>

#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr int kRowsPerBlock = 8;  // warp-per-row kernels: 256 threads

// The shape of one call: NH query heads, KVH key/value heads of hs channels.
struct Heads {
  int NH, KVH, hs;
  __device__ size_t width() const { return size_t(NH + 2 * KVH) * hs; }
  __device__ size_t k_off(int h) const { return size_t(NH) * hs + size_t(h / (NH / KVH)) * hs; }
  __device__ size_t v_off(int h) const {
    return size_t(NH + KVH) * hs + size_t(h / (NH / KVH)) * hs;
  }
};

// The first key row t of batch row b sees: t - pos[b,t] clamped to [0, t], 0 without positions
// (the twin of kernels/cpu/ops.h attention_key_start).
__device__ __forceinline__ int key_start(const int32_t* pos, int b, int t, int T_) {
  if (pos == nullptr) return 0;
  const int p = pos[size_t(b) * T_ + t];
  return p <= 0 ? t : (p >= t ? 0 : t - p);
}

// One warp per (b,h,t) row of att: scores q.k*scale for lo <= t2 <= t (lo = key_start), softmax,
// zeros elsewhere.
template <typename T>
__global__ void attention_softmax_kernel(float* att, const T* qkv, const int32_t* pos, int B,
                                         int T_, Heads hd) {
  const size_t row = blockIdx.x * size_t(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= size_t(B) * hd.NH * T_) return;
  const int t = int(row % T_), h = int((row / T_) % hd.NH), b = int(row / (size_t(T_) * hd.NH));
  const int hs = hd.hs;
  const size_t W = hd.width();
  const float scale = 1.0f / sqrtf(float(hs));
  const T* q = qkv + (size_t(b) * T_ + t) * W + size_t(h) * hs;
  float* a = att + row * T_;
  const int lo = key_start(pos, b, t, T_);
  float mx = -INFINITY;
  for (int t2 = lo + lane; t2 <= t; t2 += 32) {
    const T* k = qkv + (size_t(b) * T_ + t2) * W + hd.k_off(h);
    float dot = 0.0f;
    for (int i = 0; i < hs; ++i) dot += to_f32(q[i]) * to_f32(k[i]);
    dot *= scale;
    a[t2] = dot;
    mx = fmaxf(mx, dot);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int t2 = lo + lane; t2 <= t; t2 += 32) {
    const float e = expf(a[t2] - mx);
    a[t2] = e;
    sum += e;
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int t2 = lane; t2 < T_; t2 += 32) a[t2] = (t2 >= lo && t2 <= t) ? a[t2] * inv : 0.0f;
}

// out[b,t,h*hs+i] = sum_{t2<=t} att[b,h,t,t2] * v[b,t2,g(h)*hs+i], one thread per output.
template <typename T>
__global__ void attention_value_kernel(T* out, const float* att, const T* qkv, int B, int T_,
                                       Heads hd) {
  const int C = hd.NH * hd.hs;
  const size_t total = size_t(B) * T_ * C, W = hd.width();
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % C), h = c / hd.hs, i = c % hd.hs;
    const size_t bt = idx / C;
    const int t = int(bt % T_), b = int(bt / T_);
    const float* a = att + ((size_t(b) * hd.NH + h) * T_ + t) * T_;
    const T* v = qkv + size_t(b) * T_ * W + hd.v_off(h) + i;
    float acc = 0.0f;
    for (int t2 = 0; t2 <= t; ++t2) acc += a[t2] * to_f32(v[size_t(t2) * W]);
    out[idx] = from_f32<T>(acc);
  }
}

// One warp per (b,h,t) row: datt[t2] = v[t2].dout[t]; through the softmax,
// dpre[t2] = att[t2] * (datt[t2] - sum_j att[j]*datt[j]), stored times `scale` in `dpre`.
template <typename T>
__global__ void attention_dscores_kernel(float* dpre, const float* att, const T* dout, const T* qkv,
                                         const int32_t* pos, int B, int T_, Heads hd) {
  const size_t row = blockIdx.x * size_t(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= size_t(B) * hd.NH * T_) return;
  const int t = int(row % T_), h = int((row / T_) % hd.NH), b = int(row / (size_t(T_) * hd.NH));
  const int hs = hd.hs;
  const size_t W = hd.width(), C = size_t(hd.NH) * hs;
  const float scale = 1.0f / sqrtf(float(hs));
  const T* g = dout + (size_t(b) * T_ + t) * C + size_t(h) * hs;
  const float* a = att + row * T_;
  float* d = dpre + row * T_;
  const int lo = key_start(pos, b, t, T_);
  float s = 0.0f;
  for (int t2 = lo + lane; t2 <= t; t2 += 32) {
    const T* v = qkv + (size_t(b) * T_ + t2) * W + hd.v_off(h);
    float dot = 0.0f;
    for (int i = 0; i < hs; ++i) dot += to_f32(v[i]) * to_f32(g[i]);
    d[t2] = dot;
    s += a[t2] * dot;
  }
  s = warp_sum(s);
  for (int t2 = lane; t2 < T_; t2 += 32) {
    d[t2] = (t2 >= lo && t2 <= t) ? a[t2] * (d[t2] - s) * scale : 0.0f;
  }
}

// dq[b,t,h,i] += sum_{t2<=t} dpre[b,h,t,t2] * k[b,t2,g(h),i].
template <typename T>
__global__ void attention_dq_kernel(T* dqkv, const float* dpre, const T* qkv, int B, int T_,
                                    Heads hd) {
  const int C = hd.NH * hd.hs;
  const size_t total = size_t(B) * T_ * C, W = hd.width();
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % C), h = c / hd.hs, i = c % hd.hs;
    const size_t bt = idx / C;
    const int t = int(bt % T_), b = int(bt / T_);
    const float* d = dpre + ((size_t(b) * hd.NH + h) * T_ + t) * T_;
    const T* k = qkv + size_t(b) * T_ * W + hd.k_off(h) + i;
    float acc = 0.0f;
    for (int t2 = 0; t2 <= t; ++t2) acc += d[t2] * to_f32(k[size_t(t2) * W]);
    T* dst = dqkv + bt * W + c;
    *dst = from_f32<T>(to_f32(*dst) + acc);
  }
}

// For key/value head g and its query heads h (in order):
// dk[b,t2,g,i] += sum_h sum_{t>=t2} dpre[b,h,t,t2] * q[b,t,h,i];
// dv[b,t2,g,i] += sum_h sum_{t>=t2} att[b,h,t,t2] * dout[b,t,h,i].
template <typename T>
__global__ void attention_dkv_kernel(T* dqkv, const float* dpre, const float* att, const T* dout,
                                     const T* qkv, int B, int T_, Heads hd) {
  const int KC = hd.KVH * hd.hs, rep = hd.NH / hd.KVH, hs = hd.hs;
  const size_t total = size_t(B) * T_ * KC, W = hd.width(), C = size_t(hd.NH) * hs;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % KC), g = c / hs, i = c % hs;
    const size_t bt2 = idx / KC;
    const int t2 = int(bt2 % T_), b = int(bt2 / T_);
    float dk = 0.0f, dv = 0.0f;
    for (int h = g * rep; h < (g + 1) * rep; ++h) {
      const size_t head = (size_t(b) * hd.NH + h) * T_;
      for (int t = t2; t < T_; ++t) {
        const size_t at = (head + t) * T_ + t2;
        const size_t bt = size_t(b) * T_ + t;
        dk += dpre[at] * to_f32(qkv[bt * W + size_t(h) * hs + i]);
        dv += att[at] * to_f32(dout[bt * C + size_t(h) * hs + i]);
      }
    }
    T* k = dqkv + bt2 * W + size_t(hd.NH) * hs + c;
    T* v = k + KC;
    *k = from_f32<T>(to_f32(*k) + dk);
    *v = from_f32<T>(to_f32(*v) + dv);
  }
}

Status check_heads(const char* op, int NH, int KVH, int hs) {
  if (NH <= 0 || KVH <= 0 || hs <= 0 || NH % KVH != 0) {
    return invalid_argument(
        std::string(op) + ": NH=" + std::to_string(NH) +
        " query heads must be a positive multiple of KVH=" + std::to_string(KVH) +
        " key/value heads (head size " + std::to_string(hs) + ")");
  }
  return Status::ok();
}

}  // namespace

Status cuda_attention_gqa_forward(cudaStream_t s, DType dt, void* out, float* att, const void* qkv,
                                  const int32_t* pos, int B, int T, int NH, int KVH, int hs) {
  const size_t rows = size_t(B) * NH * T;
  if (rows == 0) return Status::ok();
  if (Status st = check_heads("attention_forward", NH, KVH, hs); !st.is_ok()) return st;
  const unsigned grid = unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const size_t n = size_t(B) * T * NH * hs;
  const Heads hd{NH, KVH, hs};
  STRATA_DISPATCH_DT(dt, {
    const auto* in = static_cast<const scalar_t*>(qkv);
    attention_softmax_kernel<scalar_t><<<grid, 32 * kRowsPerBlock, 0, s>>>(att, in, pos, B, T, hd);
    attention_value_kernel<scalar_t>
        <<<grid_for(n, 256), 256, 0, s>>>(static_cast<scalar_t*>(out), att, in, B, T, hd);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching attention_forward");
  return Status::ok();
}

Status cuda_attention_gqa_backward(cudaStream_t s, DType dt, void* dqkv, float* scratch,
                                   const void* dout, const void* qkv, const float* att,
                                   const int32_t* pos, int B, int T, int NH, int KVH, int hs) {
  const size_t rows = size_t(B) * NH * T;
  if (rows == 0) return Status::ok();
  if (Status st = check_heads("attention_backward", NH, KVH, hs); !st.is_ok()) return st;
  const unsigned grid = unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const size_t nq = size_t(B) * T * NH * hs, nkv = size_t(B) * T * KVH * hs;
  const Heads hd{NH, KVH, hs};
  STRATA_DISPATCH_DT(dt, {
    const auto* in = static_cast<const scalar_t*>(qkv);
    const auto* g = static_cast<const scalar_t*>(dout);
    auto* d = static_cast<scalar_t*>(dqkv);
    attention_dscores_kernel<scalar_t>
        <<<grid, 32 * kRowsPerBlock, 0, s>>>(scratch, att, g, in, pos, B, T, hd);
    attention_dq_kernel<scalar_t><<<grid_for(nq, 256), 256, 0, s>>>(d, scratch, in, B, T, hd);
    attention_dkv_kernel<scalar_t>
        <<<grid_for(nkv, 256), 256, 0, s>>>(d, scratch, att, g, in, B, T, hd);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching attention_backward");
  return Status::ok();
}

}  // namespace strata
