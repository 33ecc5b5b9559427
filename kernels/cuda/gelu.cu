// GELU, tanh approximation (GPT-2), forward and backward. CPU twin: kernels/cpu/gelu.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

__device__ __forceinline__ float gelu(float x) {
  const float cube = 0.044715f * x * x * x;
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
}

__device__ __forceinline__ float gelu_grad(float x) {
  const float arg = kGeluScale * (x + 0.044715f * x * x * x);
  const float th = tanhf(arg), ch = coshf(arg);
  const float sech2 = 1.0f / (ch * ch);
  return 0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}

template <typename T>
__global__ void gelu_forward_kernel(T* out, const T* inp, size_t n, bool packed) {
  for_each_elems<T>(n, packed, [&](size_t i, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> x = load_elems<K>(inp + i);
    Elems<T, K> o;
    for (int j = 0; j < K; ++j) o.v[j] = from_f32<T>(gelu(to_f32(x.v[j])));
    store_elems(out + i, o);
  });
}

// dinp += gelu'(inp) * dout.
template <typename T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, size_t n, bool packed) {
  for_each_elems<T>(n, packed, [&](size_t i, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> x = load_elems<K>(inp + i), d = load_elems<K>(dout + i);
    Elems<T, K> g = load_elems<K>(dinp + i);
    for (int j = 0; j < K; ++j) {
      g.v[j] = from_f32<T>(to_f32(g.v[j]) + gelu_grad(to_f32(x.v[j])) * to_f32(d.v[j]));
    }
    store_elems(dinp + i, g);
  });
}

}  // namespace

Status cuda_gelu_forward(cudaStream_t s, DType dt, void* out, const void* inp, size_t n,
                         bool packed) {
  if (n == 0) return Status::ok();
  packed = packed && packs_aligned({out, inp});
  STRATA_DISPATCH_DT(
      dt, gelu_forward_kernel<scalar_t><<<grid_for_elems<scalar_t>(n, packed, 256), 256, 0, s>>>(
              static_cast<scalar_t*>(out), static_cast<const scalar_t*>(inp), n, packed));
  STRATA_CUDA_LAUNCH_CHECK("launching gelu_forward");
  return Status::ok();
}

Status cuda_gelu_backward(cudaStream_t s, DType dt, void* dinp, const void* inp, const void* dout,
                          size_t n, bool packed) {
  if (n == 0) return Status::ok();
  packed = packed && packs_aligned({dinp, inp, dout});
  STRATA_DISPATCH_DT(
      dt, gelu_backward_kernel<scalar_t><<<grid_for_elems<scalar_t>(n, packed, 256), 256, 0, s>>>(
              static_cast<scalar_t*>(dinp), static_cast<const scalar_t*>(inp),
              static_cast<const scalar_t*>(dout), n, packed));
  STRATA_CUDA_LAUNCH_CHECK("launching gelu_backward");
  return Status::ok();
}

}  // namespace strata
