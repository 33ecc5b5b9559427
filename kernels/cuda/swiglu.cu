// SwiGLU, forward and backward, over a packed [N, 2H] gate|up input. CPU twin:
// kernels/cpu/swiglu.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// Packs of output elements stay within a row when H fills whole packs (`packed` only then:
// rows_packed over rows of H).
template <typename T>
__global__ void swiglu_forward_kernel(T* out, const T* inp, size_t n, int H, bool packed) {
  for_each_elems<T>(n, packed, [&](size_t i, auto w) {
    constexpr int K = decltype(w)::value;
    const size_t r = i / H, c = i % H;
    const Elems<T, K> g = load_elems<K>(inp + r * 2 * H + c);
    const Elems<T, K> u = load_elems<K>(inp + r * 2 * H + H + c);
    Elems<T, K> o;
    for (int j = 0; j < K; ++j) {
      const float gj = to_f32(g.v[j]);
      o.v[j] = from_f32<T>(gj / (1.0f + expf(-gj)) * to_f32(u.v[j]));
    }
    store_elems(out + i, o);
  });
}

// d gate = dout * up * sig(g) * (1 + g * (1 - sig(g))); d up = dout * silu(g); written as
// 0 + the gradient (the bits of accumulating into zeros).
template <typename T>
__global__ void swiglu_backward_kernel(T* dinp, const T* inp, const T* dout, size_t n, int H,
                                       bool packed) {
  for_each_elems<T>(n, packed, [&](size_t i, auto w) {
    constexpr int K = decltype(w)::value;
    const size_t r = i / H, c = i % H;
    const size_t gi = r * 2 * H + c, ui = gi + H;
    const Elems<T, K> g = load_elems<K>(inp + gi), u = load_elems<K>(inp + ui);
    const Elems<T, K> d = load_elems<K>(dout + i);
    Elems<T, K> dg, du;
    for (int j = 0; j < K; ++j) {
      const float gj = to_f32(g.v[j]), uj = to_f32(u.v[j]), dj = to_f32(d.v[j]);
      const float sig = 1.0f / (1.0f + expf(-gj));
      dg.v[j] = from_f32<T>(0.0f + dj * uj * sig * (1.0f + gj * (1.0f - sig)));
      du.v[j] = from_f32<T>(0.0f + dj * gj * sig);
    }
    store_elems(dinp + gi, dg);
    store_elems(dinp + ui, du);
  });
}

}  // namespace

Status cuda_swiglu_forward(cudaStream_t s, DType dt, void* out, const void* inp, int N, int H,
                           bool packed) {
  const size_t n = size_t(N) * H;
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, H, {out, inp});
    swiglu_forward_kernel<scalar_t><<<grid_for_elems<scalar_t>(n, p, 256), 256, 0, s>>>(
        static_cast<scalar_t*>(out), static_cast<const scalar_t*>(inp), n, H, p);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching swiglu_forward");
  return Status::ok();
}

Status cuda_swiglu_backward(cudaStream_t s, DType dt, void* dinp, const void* inp, const void* dout,
                            int N, int H, bool packed) {
  const size_t n = size_t(N) * H;
  if (n == 0) return Status::ok();
  STRATA_DISPATCH_DT(dt, {
    const bool p = rows_packed<scalar_t>(packed, H, {dinp, inp, dout});
    swiglu_backward_kernel<scalar_t><<<grid_for_elems<scalar_t>(n, p, 256), 256, 0, s>>>(
        static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(inp),
        static_cast<const scalar_t*>(dout), n, H, p);
  });
  STRATA_CUDA_LAUNCH_CHECK("launching swiglu_backward");
  return Status::ok();
}

}  // namespace strata
