// Rotary position embeddings, in place on the query and key heads of a packed qkv buffer.
// The frequencies are computed on the host (rope_inv_freq, in double) and passed by value. A
// block takes kRopeRows rows: its threads first compute those rows' angles' cos and sin, one
// (row, pair) a thread, in double rounded to fp32 as the CPU twin's table (kernels/cpu/rope.cc)
// is, into shared memory; then they rotate every query and key head of the rows, K pairs at a
// time: K consecutive elements of a head's first half with the K of its second half they pair
// with, each K a 16-byte pack where `packed` (a thread a pair otherwise). A token's position is
// t, or pos[b,t] where given. The angles are shared by a row's heads (36 of them in TinyLlama's
// qkv), so the kernel moves the rows' bytes and little else.
#include <string>

#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

struct InvFreq {
  double v[kMaxRopePairs];
};

constexpr int kRopeRows = 4;       // rows a block
constexpr int kRopeThreads = 256;  // threads a block
constexpr int kRopeTable = kRopeRows * kMaxRopePairs;

template <typename T, int K>
__global__ void rope_kernel(T* qkv, const InvFreq f, const int32_t* pos, size_t rows, int T_,
                            int NH, int KVH, int hs, bool inverse) {
  __shared__ float cs[kRopeTable];
  __shared__ float sn[kRopeTable];
  const int half = hs / 2, heads = NH + KVH, packs = half / K;
  const size_t W = size_t(NH + 2 * KVH) * hs;
  const size_t groups = (rows + kRopeRows - 1) / kRopeRows;
  for (size_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const size_t r0 = g * kRopeRows;
    const int n = int(rows - r0 < size_t(kRopeRows) ? rows - r0 : size_t(kRopeRows));
    for (int e = threadIdx.x; e < n * half; e += blockDim.x) {
      const int lr = e / half, i = e % half;
      const size_t r = r0 + size_t(lr);
      const int t = pos ? pos[r] : int(r % size_t(T_));
      double sd, cd;
      sincos(double(t) * f.v[i], &sd, &cd);
      cs[e] = float(cd);
      sn[e] = inverse ? float(-sd) : float(sd);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n * heads * packs; e += blockDim.x) {
      const int i = (e % packs) * K, h = (e / packs) % heads, lr = e / (packs * heads);
      T* v = qkv + (r0 + size_t(lr)) * W + size_t(h) * hs;
      const float* c = cs + lr * half + i;
      const float* s = sn + lr * half + i;
      const Elems<T, K> a = load_elems<K>(v + i), b = load_elems<K>(v + i + half);
      Elems<T, K> x, y;
      for (int j = 0; j < K; ++j) {
        const float aj = to_f32(a.v[j]), bj = to_f32(b.v[j]);
        x.v[j] = from_f32<T>(aj * c[j] - bj * s[j]);
        y.v[j] = from_f32<T>(bj * c[j] + aj * s[j]);
      }
      store_elems(v + i, x);
      store_elems(v + i + half, y);
    }
    __syncthreads();  // the next group's table overwrites this one's
  }
}

Status launch_rope(cudaStream_t s, DType dt, void* qkv, const RopeParams& rope, const int32_t* pos,
                   int B, int T, int NH, int KVH, int hs, bool inverse, bool packed) {
  if (hs % 2 != 0 || hs / 2 > kMaxRopePairs) {
    return invalid_argument("rope: head size " + std::to_string(hs) +
                            " must be even and <= " + std::to_string(2 * kMaxRopePairs));
  }
  const size_t rows = size_t(B) * T;
  if (rows == 0 || NH + KVH == 0 || hs == 0) return Status::ok();
  InvFreq f{};
  rope_inv_freq(rope, hs, f.v);
  const unsigned grid = grid_for((rows + kRopeRows - 1) / kRopeRows, 1);
  STRATA_DISPATCH_DT(dt, {
    // A head's halves fill whole packs, so every pack of every row is 16-byte aligned.
    if (packed && (hs / 2) % kPack<scalar_t> == 0 && packs_aligned({qkv})) {
      rope_kernel<scalar_t, kPack<scalar_t>><<<grid, kRopeThreads, 0, s>>>(
          static_cast<scalar_t*>(qkv), f, pos, rows, T, NH, KVH, hs, inverse);
    } else {
      rope_kernel<scalar_t, 1><<<grid, kRopeThreads, 0, s>>>(static_cast<scalar_t*>(qkv), f, pos,
                                                             rows, T, NH, KVH, hs, inverse);
    }
  });
  STRATA_CUDA_LAUNCH_CHECK(inverse ? "launching rope_backward" : "launching rope_forward");
  return Status::ok();
}

}  // namespace

Status cuda_rope_forward(cudaStream_t s, DType dt, void* qkv, const RopeParams& rope,
                         const int32_t* pos, int B, int T, int NH, int KVH, int hs, bool packed) {
  return launch_rope(s, dt, qkv, rope, pos, B, T, NH, KVH, hs, false, packed);
}

Status cuda_rope_backward(cudaStream_t s, DType dt, void* dqkv, const RopeParams& rope,
                          const int32_t* pos, int B, int T, int NH, int KVH, int hs, bool packed) {
  return launch_rope(s, dt, dqkv, rope, pos, B, T, NH, KVH, hs, true, packed);
}

}  // namespace strata
