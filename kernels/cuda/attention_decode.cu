// Generation's attention against a key/value cache (Kernels::attention_decode): one kernel
// copies the new positions' key and value heads into the caches, then one block per (sequence,
// new position, query head) walks the cached keys in chunks of kThreads: each thread scores one
// key of the chunk, the block takes the chunk's maximum and sum (shared-memory tree reductions,
// a fixed order: deterministic), rescales its running sums (online softmax) and adds the
// chunk's values, each thread owning output channels tid, tid + kThreads, ... The CPU twin is
// kernels/cpu/attention_decode.cc (the same numbers up to the order of the fp32 sums).
#include <string>

#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHead = 2 * kMaxRopePairs;  // hs <= 512: at most 2 channels per thread

template <typename T>
__global__ void append_kernel(T* kc, T* vc, const T* qkv, int B, int Tn, int pos0, int maxT, int NH,
                              int KVH, int hs) {
  const size_t Q = size_t(NH) * hs, KV = size_t(KVH) * hs, W = Q + 2 * KV;
  const size_t n = size_t(B) * Tn * KV;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t c = i % KV, bt = i / KV, b = bt / size_t(Tn), t = bt % size_t(Tn);
    const T* row = qkv + bt * W;
    const size_t at = (b * size_t(maxT) + size_t(pos0) + t) * KV + c;
    kc[at] = row[Q + c];
    vc[at] = row[Q + KV + c];
  }
}

// red[0..kThreads) holds one value per thread: the block's maximum (max) or sum, in a fixed tree.
__device__ float block_reduce(float* red, bool max) {
  for (int w = kThreads / 2; w > 0; w /= 2) {
    __syncthreads();
    if (int(threadIdx.x) < w) {
      const float a = red[threadIdx.x], b = red[threadIdx.x + w];
      red[threadIdx.x] = max ? fmaxf(a, b) : a + b;
    }
  }
  __syncthreads();
  const float r = red[0];
  __syncthreads();
  return r;
}

template <typename T>
__global__ void decode_kernel(T* out, const T* kc, const T* vc, const T* qkv, int Tn, int pos0,
                              int maxT, int NH, int KVH, int hs, float scale) {
  __shared__ float q[kMaxHead];
  __shared__ float p[kThreads];
  __shared__ float red[kThreads];
  const int h = blockIdx.x % NH, t = (blockIdx.x / NH) % Tn, b = blockIdx.x / NH / Tn;
  const int tid = threadIdx.x, len = pos0 + t + 1, kvh = h / (NH / KVH);
  const size_t Q = size_t(NH) * hs, KV = size_t(KVH) * hs, W = Q + 2 * KV;
  const T* qrow = qkv + (size_t(b) * Tn + t) * W + size_t(h) * hs;
  for (int i = tid; i < hs; i += kThreads) q[i] = to_f32(qrow[i]);
  const T* keys = kc + size_t(b) * maxT * KV + size_t(kvh) * hs;
  const T* vals = vc + size_t(b) * maxT * KV + size_t(kvh) * hs;
  float m = -INFINITY, l = 0.0f, acc[kMaxHead / kThreads] = {0.0f, 0.0f};
  __syncthreads();
  for (int c0 = 0; c0 < len; c0 += kThreads) {
    const int j = c0 + tid;
    float s = -INFINITY;
    if (j < len) {
      float d = 0.0f;
      for (int i = 0; i < hs; ++i) d += q[i] * to_f32(keys[size_t(j) * KV + i]);
      s = d * scale;
    }
    red[tid] = s;
    const float mx = fmaxf(m, block_reduce(red, true));  // finite: key c0 is in the chunk
    const float e = j < len ? expf(s - mx) : 0.0f;
    p[tid] = e;
    red[tid] = e;
    const float sum = block_reduce(red, false);
    const float corr = expf(m - mx);  // 0 on the first chunk (m = -inf)
    l = l * corr + sum;
    const int n = min(kThreads, len - c0);
    for (int r = 0, i = tid; i < hs; ++r, i += kThreads) {
      float a = acc[r] * corr;
      for (int jj = 0; jj < n; ++jj) a += p[jj] * to_f32(vals[size_t(c0 + jj) * KV + i]);
      acc[r] = a;
    }
    m = mx;
    __syncthreads();  // p is rewritten by the next chunk
  }
  T* o = out + (size_t(b) * Tn + t) * Q + size_t(h) * hs;
  for (int r = 0, i = tid; i < hs; ++r, i += kThreads) o[i] = from_f32<T>(acc[r] / l);
}

}  // namespace

bool cuda_attention_decode_supported(int hs) { return hs >= 1 && hs <= kMaxHead; }

Status cuda_attention_decode(cudaStream_t s, DType dt, void* out, void* kcache, void* vcache,
                             const void* qkv, int B, int T, int pos0, int maxT, int NH, int KVH,
                             int hs) {
  if (!cuda_attention_decode_supported(hs) || KVH < 1 || NH % KVH != 0 || pos0 < 0 ||
      pos0 + T > maxT) {
    return invalid_argument("attention_decode: NH=" + std::to_string(NH) +
                            " KVH=" + std::to_string(KVH) + " hs=" + std::to_string(hs) +
                            " positions " + std::to_string(pos0) + " + " + std::to_string(T) +
                            " of " + std::to_string(maxT) + " out of range");
  }
  if (B == 0 || T == 0) return Status::ok();
  const size_t n = size_t(B) * T * KVH * hs;
  const float scale = 1.0f / sqrtf(float(hs));
  STRATA_DISPATCH_DT(dt, append_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(kcache), static_cast<scalar_t*>(vcache),
                             static_cast<const scalar_t*>(qkv), B, T, pos0, maxT, NH, KVH, hs));
  STRATA_CUDA_LAUNCH_CHECK("launching attention_decode's cache append");
  STRATA_DISPATCH_DT(dt, decode_kernel<scalar_t><<<unsigned(size_t(B) * T * NH), kThreads, 0, s>>>(
                             static_cast<scalar_t*>(out), static_cast<const scalar_t*>(kcache),
                             static_cast<const scalar_t*>(vcache),
                             static_cast<const scalar_t*>(qkv), T, pos0, maxT, NH, KVH, hs, scale));
  STRATA_CUDA_LAUNCH_CHECK("launching attention_decode");
  return Status::ok();
}

}  // namespace strata
