// Rotary position embeddings, in place on the query and key heads of a packed qkv buffer.
// The frequencies are computed on the host (rope_inv_freq, in double) and passed by value; each
// thread computes its angle's cos and sin in double and rounds them to fp32, as the CPU twin
// (kernels/cpu/rope.cc) does. A token's position is t, or pos[b,t] where given.
#include <string>

#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

struct InvFreq {
  double v[kMaxRopePairs];
};

// One thread per (row, head, pair): heads 0..NH+KVH-1 of each row are the query then key heads.
template <typename T>
__global__ void rope_kernel(T* qkv, const InvFreq f, const int32_t* pos, int B, int T_, int NH,
                            int KVH, int hs, bool inverse) {
  const int half = hs / 2, heads = NH + KVH;
  const size_t total = size_t(B) * T_ * heads * half;
  const size_t W = size_t(NH + 2 * KVH) * hs;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int i = int(idx % half), h = int((idx / half) % heads);
    const size_t r = idx / (size_t(half) * heads);
    const int t = pos ? pos[r] : int(r % T_);
    double sd, cd;
    sincos(double(t) * f.v[i], &sd, &cd);
    const float c = float(cd), sn = inverse ? float(-sd) : float(sd);
    T* v = qkv + r * W + size_t(h) * hs;
    const float a = to_f32(v[i]), b = to_f32(v[i + half]);
    v[i] = from_f32<T>(a * c - b * sn);
    v[i + half] = from_f32<T>(b * c + a * sn);
  }
}

Status launch_rope(cudaStream_t s, DType dt, void* qkv, const RopeParams& rope, const int32_t* pos,
                   int B, int T, int NH, int KVH, int hs, bool inverse) {
  if (hs % 2 != 0 || hs / 2 > kMaxRopePairs) {
    return invalid_argument("rope: head size " + std::to_string(hs) +
                            " must be even and <= " + std::to_string(2 * kMaxRopePairs));
  }
  const size_t n = size_t(B) * T * (NH + KVH) * (hs / 2);
  if (n == 0) return Status::ok();
  InvFreq f{};
  rope_inv_freq(rope, hs, f.v);
  STRATA_DISPATCH_DT(dt, rope_kernel<scalar_t><<<grid_for(n, 256), 256, 0, s>>>(
                             static_cast<scalar_t*>(qkv), f, pos, B, T, NH, KVH, hs, inverse));
  STRATA_CUDA_LAUNCH_CHECK(inverse ? "launching rope_backward" : "launching rope_forward");
  return Status::ok();
}

}  // namespace

Status cuda_rope_forward(cudaStream_t s, DType dt, void* qkv, const RopeParams& rope,
                         const int32_t* pos, int B, int T, int NH, int KVH, int hs) {
  return launch_rope(s, dt, qkv, rope, pos, B, T, NH, KVH, hs, false);
}

Status cuda_rope_backward(cudaStream_t s, DType dt, void* dqkv, const RopeParams& rope,
                          const int32_t* pos, int B, int T, int NH, int KVH, int hs) {
  return launch_rope(s, dt, dqkv, rope, pos, B, T, NH, KVH, hs, true);
}

}  // namespace strata
