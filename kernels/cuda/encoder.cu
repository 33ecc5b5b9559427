// Token + position embedding (wpe null: the token embedding alone), forward and backward. CPU twin:
// kernels/cpu/encoder.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// One thread per output element: out[b,t,c] = wte[tok,c] + wpe[p,c], p = pos[b,t] or t.
template <typename T>
__global__ void encoder_forward_kernel(T* out, const int32_t* tokens, const int32_t* positions,
                                       const T* wte, const T* wpe, int B, int T_, int C) {
  const size_t total = size_t(B) * T_ * C;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t bt = i / C;
    const int c = int(i % C), t = positions ? positions[bt] : int(bt % T_);
    const size_t tok = size_t(tokens[bt]);
    const float pos = wpe ? to_f32(wpe[size_t(t) * C + c]) : 0.0f;
    out[i] = from_f32<T>(to_f32(wte[tok * C + c]) + pos);
  }
}

// dwpe[t,c] += sum_b dout[b,t,c] (one thread per (t,c), deterministic); dwte[tok,c] += dout by
// atomics (two positions may hold the same token).
template <typename T>
__global__ void encoder_backward_kernel(float* dwte, float* dwpe, const T* dout,
                                        const int32_t* tokens, int B, int T_, int C) {
  const size_t total = size_t(T_) * C;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const int t = int(i / C), c = int(i % C);
    float pos = 0.0f;
    for (int b = 0; b < B; ++b) {
      const size_t bt = size_t(b) * T_ + t;
      const float g = to_f32(dout[bt * C + c]);
      pos += g;
      atomicAdd(&dwte[size_t(tokens[bt]) * C + c], g);
    }
    if (dwpe) dwpe[i] += pos;
  }
}

// With positions (packed sequences): one thread per (b,t,c), both gradients by atomics (rows of
// one window share positions), so the order of the sums, and their last bits, may vary.
template <typename T>
__global__ void encoder_backward_pos_kernel(float* dwte, float* dwpe, const T* dout,
                                            const int32_t* tokens, const int32_t* positions,
                                            size_t total, int C) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t bt = i / C;
    const int c = int(i % C);
    const float g = to_f32(dout[i]);
    atomicAdd(&dwte[size_t(tokens[bt]) * C + c], g);
    if (dwpe) atomicAdd(&dwpe[size_t(positions[bt]) * C + c], g);
  }
}

}  // namespace

Status cuda_encoder_forward(cudaStream_t s, DType dt, void* out, const int32_t* tokens,
                            const int32_t* pos, const void* wte, const void* wpe, int B, int T,
                            int C) {
  const size_t n = size_t(B) * T * C;
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, encoder_forward_kernel<scalar_t>
                     <<<grid_for(n, 256), 256, 0, s>>>(static_cast<scalar_t*>(out), tokens, pos,
                                                       static_cast<const scalar_t*>(wte),
                                                       static_cast<const scalar_t*>(wpe), B, T, C));
  STRATA_CUDA_LAUNCH_CHECK("launching encoder_forward");
  return Status::ok();
}

Status cuda_encoder_backward(cudaStream_t s, DType dt, float* dwte, float* dwpe, const void* dout,
                             const int32_t* tokens, const int32_t* pos, int B, int T, int C) {
  const size_t n = size_t(T) * C;
  if (n == 0 || B == 0) return Status::ok();
  if (pos != nullptr) {
    const size_t total = size_t(B) * n;
    STRATA_DISPATCH_DT(dt,
                       encoder_backward_pos_kernel<scalar_t><<<grid_for(total, 256), 256, 0, s>>>(
                           dwte, dwpe, static_cast<const scalar_t*>(dout), tokens, pos, total, C));
    STRATA_CUDA_LAUNCH_CHECK("launching encoder_backward");
    return Status::ok();
  }
  STRATA_DISPATCH_DT(dt, encoder_backward_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             dwte, dwpe, static_cast<const scalar_t*>(dout), tokens, B, T, C));
  STRATA_CUDA_LAUNCH_CHECK("launching encoder_backward");
  return Status::ok();
}

}  // namespace strata
