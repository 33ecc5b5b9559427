// Fused softmax cross-entropy: loss per row, and the logits overwritten with their gradient.
// CPU twin: kernels/cpu/crossentropy.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr int kThreads = 512;

// One block per row of logits [N,Vp]; columns >= V are padding (gradient 0); a row whose
// target is negative is masked out (loss and gradient 0). `packed`: the row in 16-byte packs.
template <typename T>
__global__ void crossentropy_kernel(float* losses, T* logits, const int32_t* targets, float dloss,
                                    int V, int Vp, bool packed) {
  __shared__ float shared[32];
  T* x = logits + size_t(blockIdx.x) * Vp;
  const int target = targets[blockIdx.x], t = threadIdx.x, threads = blockDim.x;
  if (target < 0) {  // masked out (a loss mask): no loss, no gradient
    if (t == 0) losses[blockIdx.x] = 0.0f;
    for_row_elems<T>(Vp, packed, t, threads, [&](int c, auto w) {
      constexpr int K = decltype(w)::value;
      Elems<T, K> z;
      for (int j = 0; j < K; ++j) z.v[j] = from_f32<T>(0.0f);
      store_elems(x + c, z);
    });
    return;
  }
  // Every read of x[target] happens before the reductions' barriers, so before any write.
  const float xt = to_f32(x[target]);
  float mx = -INFINITY;
  for_row_elems<T>(Vp, packed, t, threads, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    if (c >= V) return;
    const Elems<T, K> xs = load_elems<K>(x + c);
    for (int j = 0; j < K; ++j) {
      if (c + j < V) mx = fmaxf(mx, to_f32(xs.v[j]));
    }
  });
  mx = block_max(mx, shared);
  float sum = 0.0f;
  for_row_elems<T>(Vp, packed, t, threads, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    if (c >= V) return;
    const Elems<T, K> xs = load_elems<K>(x + c);
    for (int j = 0; j < K; ++j) {
      if (c + j < V) sum += expf(to_f32(xs.v[j]) - mx);
    }
  });
  sum = block_sum(sum, shared);
  const float inv = 1.0f / sum;
  if (t == 0) losses[blockIdx.x] = logf(sum) + mx - xt;
  for_row_elems<T>(Vp, packed, t, threads, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    Elems<T, K> xs = load_elems<K>(x + c);
    for (int j = 0; j < K; ++j) {
      const int cj = c + j;
      float g = 0.0f;
      if (cj < V) g = (expf(to_f32(xs.v[j]) - mx) * inv - (cj == target ? 1.0f : 0.0f)) * dloss;
      xs.v[j] = from_f32<T>(g);
    }
    store_elems(x + c, xs);
  });
}

}  // namespace

Status cuda_crossentropy_forward_backward(cudaStream_t s, DType dt, float* losses,
                                          void* logits_inout, const int32_t* targets, float dloss,
                                          int N, int V, int Vp, bool packed) {
  if (N == 0) return Status::ok();
  if (V <= 0 || Vp < V) {
    return invalid_argument("crossentropy: need 0 < V <= Vp, got V=" + std::to_string(V) +
                            " Vp=" + std::to_string(Vp));
  }
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, Vp, {logits_inout});
    crossentropy_kernel<scalar_t><<<unsigned(N), kThreads, 0, s>>>(
        losses, static_cast<scalar_t*>(logits_inout), targets, dloss, V, Vp, p);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching crossentropy_forward_backward");
  return Status::ok();
}

}  // namespace strata
