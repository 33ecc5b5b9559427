// Fused softmax cross-entropy: loss per row, and the logits overwritten with their gradient.
// CPU twin: kernels/cpu/crossentropy.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr int kThreads = 1024;  // two blocks fill an SM's threads (and, cached, its shared memory)
// The largest row (Vp elements) a block keeps in shared memory: GPT-2's padded vocabulary in
// bf16 (100.6 KB: two blocks of kThreads fill an H100/H200 SM), a Llama's 32000 (64 KB).
constexpr size_t kCachedRowBytes = 112 * 1024;

// One block per row of logits [N,Vp]; columns >= V are padding (gradient 0); a row whose
// target is negative is masked out (loss and gradient 0). `packed`: the row in 16-byte packs.
// Three passes over the row: its max, the sum of exp, the gradient written over it. With
// kCached the first pass also keeps the row in shared memory and the other two read it there,
// so the row crosses the device memory's bus once each way; every thread reads back only the
// elements it stored (the same for_row_elems split), in the same order, so the sums, and the
// bits, are those of the uncached kernel.
template <typename T, bool kCached>
__global__ void __launch_bounds__(kThreads, 2)
    crossentropy_kernel(float* losses, T* logits, const int32_t* targets, float dloss, int V,
                        int Vp, bool packed) {
  __shared__ float shared[32];
  STRATA_DYNAMIC_SMEM(cache);
  T* x = logits + size_t(blockIdx.x) * Vp;
  T* row = kCached ? reinterpret_cast<T*>(cache) : x;
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
    if constexpr (kCached) store_elems(row + c, xs);
    for (int j = 0; j < K; ++j) {
      if (c + j < V) mx = fmaxf(mx, to_f32(xs.v[j]));
    }
  });
  mx = block_max(mx, shared);
  float sum = 0.0f;
  for_row_elems<T>(Vp, packed, t, threads, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    if (c >= V) return;
    const Elems<T, K> xs = load_elems<K>(row + c);
    for (int j = 0; j < K; ++j) {
      if (c + j < V) sum += expf(to_f32(xs.v[j]) - mx);
    }
  });
  sum = block_sum(sum, shared);
  const float inv = 1.0f / sum;
  if (t == 0) losses[blockIdx.x] = logf(sum) + mx - xt;
  for_row_elems<T>(Vp, packed, t, threads, [&](int c, auto w) {
    constexpr int K = decltype(w)::value;
    Elems<T, K> xs;
    if (c < V) xs = load_elems<K>(row + c);  // a pack wholly in the padding is not read
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
                                          int N, int V, int Vp, bool packed, bool cache_rows) {
  if (N == 0) return Status::ok();
  if (V <= 0 || Vp < V) {
    return invalid_argument("crossentropy: need 0 < V <= Vp, got V=" + std::to_string(V) +
                            " Vp=" + std::to_string(Vp));
  }
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, Vp, {logits_inout});
    auto* x = static_cast<scalar_t*>(logits_inout);
    const size_t row_bytes = (size_t(Vp) * sizeof(scalar_t) + 15) / 16 * 16;
    // A device that cannot give a block the row's shared memory (the attribute refused) streams.
    auto* cached = crossentropy_kernel<scalar_t, true>;
    bool cache = cache_rows && row_bytes <= kCachedRowBytes;
    if (cache && cudaFuncSetAttribute(cached, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(row_bytes)) != cudaSuccess) {
      (void)cudaGetLastError();  // the refusal is not the launch's error
      cache = false;
    }
    if (cache) {
      cached<<<unsigned(N), kThreads, row_bytes, s>>>(losses, x, targets, dloss, V, Vp, p);
    } else {
      crossentropy_kernel<scalar_t, false>
          <<<unsigned(N), kThreads, 0, s>>>(losses, x, targets, dloss, V, Vp, p);
    }
  });
  STRATA_CUDA_LAUNCH_CHECK("launching crossentropy_forward_backward");
  return Status::ok();
}

}  // namespace strata
