// GELU, tanh approximation (GPT-2; llm.c gelu_forward / gelu_backward), written through the
// logistic function so that it vectorizes: with u = sqrt(2/pi) (v + 0.044715 v^3),
//   0.5 (1 + tanh(u)) = s = 1 / (1 + exp(-2u)),   gelu(v) = v s,
//   gelu'(v) = s + v * 2 s (1 - s) * du/dv        (0.5 sech^2(u) = 2 s (1 - s)).
// exp is exp_fast below (about 1 ulp over fp32's range), not the C library's: plain
// arithmetic with no library call. Elements go through fp32 scratch in blocks of kBlock, so the
// typed loads/stores and the arithmetic are separate simple loops. GCC leaves the arithmetic
// scalar at baseline x86-64 (-O3), so on CPUs with AVX2 it runs eight lanes at a time in
// gelu_avx2.cc, computing the same bits; the scalar loop here is the reference and the fallback.
#include "kernels/cpu/gelu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

constexpr size_t kBlock = 512;

// exp(x): x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact product), a
// degree-6 polynomial for exp(r) (Cephes' expf), and 2^n put into the exponent bits. Inputs
// are clamped to [-87, 88] (results that underflow to the smallest normals or round up to
// 2^127-scale values; gelu only needs exp(-2u) saturating); NaN stays NaN.
inline float exp_fast(float x) {
  x = x > 88.0f ? 88.0f : x;
  x = x < -87.0f ? -87.0f : x;
  // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick (exact for |t| < 2^22).
  const float t = x * 1.44269504088896341f;
  float n = (t + 12582912.0f) - 12582912.0f;
  n = n == n ? n : 0.0f;  // NaN: any n; the polynomial carries the NaN
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

// s = 0.5 (1 + tanh(u)) for v.
inline float gelu_gate(float v) {
  const float u = kGeluScale * (v + 0.044715f * v * v * v);
  return 1.0f / (1.0f + exp_fast(-2.0f * u));
}

struct Impl {
  void (*forward)(float*, size_t);
  void (*backward)(const float*, float*, size_t);
};

const Impl& impl() {
  static const Impl i = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
      return Impl{&avx2::gelu_forward_f32, &avx2::gelu_backward_f32};
    }
    return Impl{&scalar::gelu_forward_f32, &scalar::gelu_backward_f32};
  }();
  return i;
}

}  // namespace

namespace scalar {
void gelu_forward_f32(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] = x[i] * gelu_gate(x[i]);
}
void gelu_backward_f32(const float* v, float* g, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float s = gelu_gate(v[i]);
    const float du = kGeluScale * (1.0f + 3.0f * 0.044715f * v[i] * v[i]);
    g[i] *= s + v[i] * 2.0f * s * (1.0f - s) * du;
  }
}
}  // namespace scalar

const char* gelu_isa() { return impl().forward == &avx2::gelu_forward_f32 ? "avx2" : "scalar"; }

void gelu_forward(DType dt, void* out, const void* inp, size_t n) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* x = static_cast<const Tp*>(inp);
    parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
      float buf[kBlock];
      for (size_t b = i0; b < i1; b += kBlock) {
        const size_t m = std::min(kBlock, i1 - b);
        load_span(x + b, buf, m);
        impl().forward(buf, m);
        store_span(buf, y + b, m);
      }
    });
  });
}

namespace {

// dst[i] += dy[i] * gelu'(x[i]) (kAccumulate), else dst[i] = 0 + dy[i] * gelu'(x[i]): the bits of
// adding to a zeroed dst, with one rounding. dout may be dst (each block is read before written).
template <bool kAccumulate>
void gelu_backward_into(DType dt, void* dst, const void* inp, const void* dout, size_t n) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dst);
    auto* x = static_cast<const Tp*>(inp);
    auto* dy = static_cast<const Tp*>(dout);
    parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
      float v[kBlock], g[kBlock];
      for (size_t b = i0; b < i1; b += kBlock) {
        const size_t m = std::min(kBlock, i1 - b);
        load_span(x + b, v, m);
        load_span(dy + b, g, m);
        impl().backward(v, g, m);
        if constexpr (kAccumulate) {
          accumulate_span(g, dx + b, m);
        } else {
          for (size_t j = 0; j < m; ++j) g[j] = 0.0f + g[j];
          store_span(g, dx + b, m);
        }
      }
    });
  });
}

}  // namespace

void gelu_backward(DType dt, void* dinp, const void* inp, const void* dout, size_t n) {
  gelu_backward_into<true>(dt, dinp, inp, dout, n);
}

// In place: g[i] = 0 + g[i] * gelu'(x[i]), one rounding: the bits gelu_backward gives into a
// zeroed dinp from dout = g (accumulate_span adds the fp32 product to the stored 0).
void gelu_backward_replace(DType dt, void* g_io, const void* inp, size_t n) {
  gelu_backward_into<false>(dt, g_io, inp, g_io, n);
}

}  // namespace strata::cpu
