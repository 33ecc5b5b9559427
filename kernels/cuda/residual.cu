// Residual connections: out = a + b, and dst += src (gradient accumulation on a residual
// branch). CPU twin: kernels/cpu/residual.cc.
#include "kernels/cuda/cuda_common.cuh"

namespace strata {
namespace {

// out may alias a or b: each element is read before it is written, by the same thread.
template <typename T>
__global__ void add_kernel(T* out, const T* a, const T* b, size_t n, bool packed) {
  for_each_elems<T>(n, packed, [&](size_t i, auto w) {
    constexpr int K = decltype(w)::value;
    const Elems<T, K> x = load_elems<K>(a + i), y = load_elems<K>(b + i);
    Elems<T, K> o;
    for (int j = 0; j < K; ++j) o.v[j] = from_f32<T>(to_f32(x.v[j]) + to_f32(y.v[j]));
    store_elems(out + i, o);
  });
}

void launch_add(cudaStream_t s, DType dt, void* out, const void* a, const void* b, size_t n,
                bool packed) {
  packed = packed && packs_aligned({out, a, b});
  STRATA_DISPATCH_DT(dt,
                     add_kernel<scalar_t><<<grid_for_elems<scalar_t>(n, packed, 256), 256, 0, s>>>(
                         static_cast<scalar_t*>(out), static_cast<const scalar_t*>(a),
                         static_cast<const scalar_t*>(b), n, packed));
}

}  // namespace

Status cuda_residual_forward(cudaStream_t s, DType dt, void* out, const void* a, const void* b,
                             size_t n, bool packed) {
  if (n == 0) return Status::ok();
  launch_add(s, dt, out, a, b, n, packed);
  STRATA_CUDA_LAUNCH_CHECK("launching residual_forward");
  return Status::ok();
}

Status cuda_add_inplace(cudaStream_t s, DType dt, void* dst, const void* src, size_t n,
                        bool packed) {
  if (n == 0) return Status::ok();
  launch_add(s, dt, dst, dst, src, n, packed);
  STRATA_CUDA_LAUNCH_CHECK("launching add_inplace");
  return Status::ok();
}

}  // namespace strata
