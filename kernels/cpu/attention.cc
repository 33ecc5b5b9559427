// Causal multi-head self-attention (llm.c attention_forward / attention_backward), scale
// 1/sqrt(hs). Each (batch, head) pair is one task: its q, k, v [T,hs] are gathered into fp32
// scratch and the score and value products run as Eigen GEMMs; the softmax and its backward
// are plain row loops. Different heads touch disjoint channels of qkv/dqkv, so the tasks never
// write the same memory and the results do not depend on the thread count.
#include <Eigen/Core>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Map = Eigen::Map<RowMat>;
using CMap = Eigen::Map<const RowMat>;

// dst[t, :] = src[t * stride + offset .. + hs) for t < T, widened to fp32.
template <typename Tp>
void gather(const Tp* src, int T, size_t stride, size_t offset, int hs, float* dst) {
  for (int t = 0; t < T; ++t) load_span(src + t * stride + offset, dst + size_t(t) * hs, hs);
}

// dst[t * stride + offset + i] += src[t, i].
template <typename Tp>
void scatter_add(const float* src, int T, size_t stride, size_t offset, int hs, Tp* dst) {
  for (int t = 0; t < T; ++t) accumulate_span(src + size_t(t) * hs, dst + t * stride + offset, hs);
}

}  // namespace

void attention_forward(DType dt, void* out, float* att, const void* qkv, int B, int T, int C,
                       int NH) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* in = static_cast<const Tp*>(qkv);
    const int hs = C / NH;
    const size_t C3 = size_t(3) * C;
    const float scale = 1.0f / std::sqrt(float(hs));
    parallel_ranges(size_t(B) * NH, 1, [&](size_t p0, size_t p1) {
      RowMat Q(T, hs), K(T, hs), V(T, hs), O(T, hs);
      for (size_t p = p0; p < p1; ++p) {
        const int b = int(p / NH), h = int(p % NH);
        const Tp* base = in + size_t(b) * T * C3;
        gather(base, T, C3, size_t(h) * hs, hs, Q.data());
        gather(base, T, C3, size_t(C) + size_t(h) * hs, hs, K.data());
        gather(base, T, C3, size_t(2) * C + size_t(h) * hs, hs, V.data());
        Map P(att + p * size_t(T) * T, T, T);
        P.noalias() = Q * K.transpose();
        for (int t = 0; t < T; ++t) {
          float* row = P.data() + size_t(t) * T;
          float maxval = -10000.0f;
          for (int t2 = 0; t2 <= t; ++t2) {
            row[t2] *= scale;
            if (row[t2] > maxval) maxval = row[t2];
          }
          float expsum = 0.0f;
          for (int t2 = 0; t2 <= t; ++t2) {
            row[t2] = std::exp(row[t2] - maxval);
            expsum += row[t2];
          }
          float inv = expsum == 0.0f ? 0.0f : 1.0f / expsum;
          for (int t2 = 0; t2 <= t; ++t2) row[t2] *= inv;
          for (int t2 = t + 1; t2 < T; ++t2) row[t2] = 0.0f;
        }
        O.noalias() = P * V;
        for (int t = 0; t < T; ++t) {
          store_span(O.data() + size_t(t) * hs, y + (size_t(b) * T + t) * C + size_t(h) * hs, hs);
        }
      }
    });
  });
}

void attention_backward(DType dt, void* dqkv, float* scratch, const void* dout, const void* qkv,
                        const float* att, int B, int T, int C, int NH) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dqkv);
    auto* in = static_cast<const Tp*>(qkv);
    auto* dy = static_cast<const Tp*>(dout);
    const int hs = C / NH;
    const size_t C3 = size_t(3) * C;
    const float scale = 1.0f / std::sqrt(float(hs));
    parallel_ranges(size_t(B) * NH, 1, [&](size_t p0, size_t p1) {
      RowMat Q(T, hs), K(T, hs), V(T, hs), dO(T, hs), dQ(T, hs), dK(T, hs), dV(T, hs);
      for (size_t p = p0; p < p1; ++p) {
        const int b = int(p / NH), h = int(p % NH);
        const Tp* base = in + size_t(b) * T * C3;
        gather(base, T, C3, size_t(h) * hs, hs, Q.data());
        gather(base, T, C3, size_t(C) + size_t(h) * hs, hs, K.data());
        gather(base, T, C3, size_t(2) * C + size_t(h) * hs, hs, V.data());
        gather(dy + size_t(b) * T * C, T, size_t(C), size_t(h) * hs, hs, dO.data());
        CMap P(att + p * size_t(T) * T, T, T);
        Map dS(scratch + p * size_t(T) * T, T, T);
        // dP = dO V^T (only the lower triangle is used); dV = P^T dO.
        dS.noalias() = dO * V.transpose();
        dV.noalias() = P.transpose() * dO;
        // Softmax backward: dS[t,t3] = P[t,t3] (dP[t,t3] - sum_t2 P[t,t2] dP[t,t2]), times the
        // score scale; zero above the diagonal.
        for (int t = 0; t < T; ++t) {
          const float* prow = P.data() + size_t(t) * T;
          float* row = dS.data() + size_t(t) * T;
          float dot = 0.0f;
          for (int t2 = 0; t2 <= t; ++t2) dot += prow[t2] * row[t2];
          for (int t2 = 0; t2 <= t; ++t2) row[t2] = prow[t2] * (row[t2] - dot) * scale;
          for (int t2 = t + 1; t2 < T; ++t2) row[t2] = 0.0f;
        }
        dQ.noalias() = dS * K;
        dK.noalias() = dS.transpose() * Q;
        Tp* dbase = dx + size_t(b) * T * C3;
        scatter_add(dQ.data(), T, C3, size_t(h) * hs, hs, dbase);
        scatter_add(dK.data(), T, C3, size_t(C) + size_t(h) * hs, hs, dbase);
        scatter_add(dV.data(), T, C3, size_t(2) * C + size_t(h) * hs, hs, dbase);
      }
    });
  });
}

}  // namespace strata::cpu
