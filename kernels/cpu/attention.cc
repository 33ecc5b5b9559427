// Causal self-attention with grouped-query heads, optionally masked per sequence (positions) (llm.c
// attention_forward / attention_backward, generalized to KVH key/value heads shared by NH query
// heads; multi-head attention is the case KVH == NH), scale 1/sqrt(hs). Forward: each (batch, query
// head) pair is one task: its q, k, v [T,hs] are gathered into fp32 scratch and the score and value
// products run as GEMMs (gemm.h) over blocks of kBlock query rows, each block touching only the key
// columns at or below its last row (the causal half); the softmax and its backward are plain row
// loops over each row's keys (0..t, or its own sequence's with positions: the other probabilities
// are 0). Backward: each (batch, key/value head) is one task over its query heads in order. Tasks
// touch disjoint channels of qkv/dqkv, so they never write the same memory and the results do not
// depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

constexpr int kBlock = 64;

}  // namespace

void attention_gqa_forward(DType dt, void* out, float* att, const void* qkv, const int32_t* pos,
                           int B, int T, int NH, int KVH, int hs) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* in = static_cast<const Tp*>(qkv);
    const size_t C = size_t(NH) * hs, C3 = size_t(NH + 2 * KVH) * hs, th = size_t(T) * hs;
    const int rep = NH / KVH;
    const float scale = 1.0f / std::sqrt(float(hs));
    parallel_ranges(size_t(B) * NH, 1, [&](size_t p0, size_t p1) {
      std::vector<float> buf(4 * th);
      float *Q = buf.data(), *K = Q + th, *V = K + th, *O = V + th;
      for (size_t p = p0; p < p1; ++p) {
        const int b = int(p / NH), h = int(p % NH);
        const Tp* base = in + size_t(b) * T * C3;
        gather_columns(base, T, C3, size_t(h) * hs, hs, Q);
        gather_columns(base, T, C3, C + size_t(h / rep) * hs, hs, K);
        gather_columns(base, T, C3, C + size_t(KVH + h / rep) * hs, hs, V);
        float* P = att + p * size_t(T) * T;
        const int32_t* pb = pos == nullptr ? nullptr : pos + size_t(b) * T;
        for (int t0 = 0; t0 < T; t0 += kBlock) {
          const int t1 = std::min(T, t0 + kBlock);
          // Scores of rows t0..t1 against keys 0..t1.
          gemm({.m = t1 - t0,
                .n = t1,
                .k = hs,
                .a = Q + size_t(t0) * hs,
                .lda = hs,
                .b = K,
                .ldb = hs,
                .trans_b = true,
                .c = P + size_t(t0) * T,
                .ldc = T});
          for (int t = t0; t < t1; ++t) {
            float* row = P + size_t(t) * T;
            const int lo = attention_key_start(pb, t);
            float maxval = -10000.0f;
            for (int t2 = lo; t2 <= t; ++t2) {
              row[t2] *= scale;
              if (row[t2] > maxval) maxval = row[t2];
            }
            float expsum = 0.0f;
            for (int t2 = lo; t2 <= t; ++t2) {
              row[t2] = std::exp(row[t2] - maxval);
              expsum += row[t2];
            }
            const float inv = expsum == 0.0f ? 0.0f : 1.0f / expsum;
            for (int t2 = 0; t2 < lo; ++t2) row[t2] = 0.0f;
            for (int t2 = lo; t2 <= t; ++t2) row[t2] *= inv;
            for (int t2 = t + 1; t2 < T; ++t2) row[t2] = 0.0f;
          }
          gemm({.m = t1 - t0,
                .n = hs,
                .k = t1,
                .a = P + size_t(t0) * T,
                .lda = T,
                .b = V,
                .ldb = hs,
                .c = O + size_t(t0) * hs,
                .ldc = hs});
        }
        for (int t = 0; t < T; ++t) {
          store_span(O + size_t(t) * hs, y + (size_t(b) * T + t) * C + size_t(h) * hs, hs);
        }
      }
    });
  });
}

// One task per (batch, key/value head): its query heads run one after another, each adding its
// share of dK and dV (the first overwrites), which are scattered once at the end.
void attention_gqa_backward(DType dt, void* dqkv, float* scratch, const void* dout, const void* qkv,
                            const float* att, const int32_t* pos, int B, int T, int NH, int KVH,
                            int hs) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dqkv);
    auto* in = static_cast<const Tp*>(qkv);
    auto* dy = static_cast<const Tp*>(dout);
    const size_t C = size_t(NH) * hs, C3 = size_t(NH + 2 * KVH) * hs, th = size_t(T) * hs;
    const int rep = NH / KVH;
    const float scale = 1.0f / std::sqrt(float(hs));
    parallel_ranges(size_t(B) * KVH, 1, [&](size_t g0, size_t g1) {
      std::vector<float> buf(7 * th);
      float *Q = buf.data(), *K = Q + th, *V = K + th, *dO = V + th;
      float *dQ = dO + th, *dK = dQ + th, *dV = dK + th;
      for (size_t bg = g0; bg < g1; ++bg) {
        const int b = int(bg / KVH), g = int(bg % KVH);
        const Tp* base = in + size_t(b) * T * C3;
        Tp* dbase = dx + size_t(b) * T * C3;
        gather_columns(base, T, C3, C + size_t(g) * hs, hs, K);
        gather_columns(base, T, C3, C + size_t(KVH + g) * hs, hs, V);
        for (int h = g * rep; h < (g + 1) * rep; ++h) {
          const size_t p = size_t(b) * NH + h;
          const bool first = h == g * rep;
          gather_columns(base, T, C3, size_t(h) * hs, hs, Q);
          gather_columns(dy + size_t(b) * T * C, T, size_t(C), size_t(h) * hs, hs, dO);
          const float* P = att + p * size_t(T) * T;
          float* dS = scratch + p * size_t(T) * T;
          const int32_t* pb = pos == nullptr ? nullptr : pos + size_t(b) * T;
          for (int t0 = 0; t0 < T; t0 += kBlock) {
            const int t1 = std::min(T, t0 + kBlock);
            // dP = dO V^T for rows t0..t1, keys 0..t1.
            gemm({.m = t1 - t0,
                  .n = t1,
                  .k = hs,
                  .a = dO + size_t(t0) * hs,
                  .lda = hs,
                  .b = V,
                  .ldb = hs,
                  .trans_b = true,
                  .c = dS + size_t(t0) * T,
                  .ldc = T});
            // Softmax backward: dS[t,t2] = P[t,t2] (dP[t,t2] - sum_t3 P[t,t3] dP[t,t3]), times
            // the score scale; zero above the diagonal.
            for (int t = t0; t < t1; ++t) {
              const float* prow = P + size_t(t) * T;
              float* row = dS + size_t(t) * T;
              const int lo = attention_key_start(pb, t);
              float dot = 0.0f;
              for (int t2 = lo; t2 <= t; ++t2) dot += prow[t2] * row[t2];
              for (int t2 = 0; t2 < lo; ++t2) row[t2] = 0.0f;
              for (int t2 = lo; t2 <= t; ++t2) row[t2] = prow[t2] * (row[t2] - dot) * scale;
              for (int t2 = t + 1; t2 < T; ++t2) row[t2] = 0.0f;
            }
            // dQ rows t0..t1 = dS[t0..t1, 0..t1] K[0..t1].
            gemm({.m = t1 - t0,
                  .n = hs,
                  .k = t1,
                  .a = dS + size_t(t0) * T,
                  .lda = T,
                  .b = K,
                  .ldb = hs,
                  .c = dQ + size_t(t0) * hs,
                  .ldc = hs});
          }
          for (int t0 = 0; t0 < T; t0 += kBlock) {
            const int t1 = std::min(T, t0 + kBlock);
            // Keys t0..t1 are seen by query rows t0..T: dV = P^T dO, dK = dS^T Q over those rows.
            gemm({.m = t1 - t0,
                  .n = hs,
                  .k = T - t0,
                  .a = P + size_t(t0) * T + t0,
                  .lda = T,
                  .trans_a = true,
                  .b = dO + size_t(t0) * hs,
                  .ldb = hs,
                  .c = dV + size_t(t0) * hs,
                  .ldc = hs,
                  .accumulate = !first});
            gemm({.m = t1 - t0,
                  .n = hs,
                  .k = T - t0,
                  .a = dS + size_t(t0) * T + t0,
                  .lda = T,
                  .trans_a = true,
                  .b = Q + size_t(t0) * hs,
                  .ldb = hs,
                  .c = dK + size_t(t0) * hs,
                  .ldc = hs,
                  .accumulate = !first});
          }
          scatter_add_columns(dQ, T, C3, size_t(h) * hs, hs, dbase);
        }
        scatter_add_columns(dK, T, C3, C + size_t(g) * hs, hs, dbase);
        scatter_add_columns(dV, T, C3, C + size_t(KVH + g) * hs, hs, dbase);
      }
    });
  });
}

}  // namespace strata::cpu
