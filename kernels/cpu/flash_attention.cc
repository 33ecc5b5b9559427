// Fused causal attention with grouped-query heads (Kernels::fused_attention_*), the CPU twin of
// kernels/cuda/flash_attention.cu and the reference it is tested against. The same numbers as
// attention.cc without the [B,NH,T,T] probabilities: query rows go in blocks of kBlock, each
// block's scores against keys 0..(its last row) live in a [kBlock,T] buffer, and only each
// row's log-sum-exp is kept; the backward recomputes the probabilities from it. With positions
// a row's keys before its own sequence get probability 0 (Kernels::attention_gqa_forward).
//
// Forward tasks are (batch, query head) pairs. Backward tasks are (batch, key/value head)
// pairs: a task runs every query head of its group, so dK and dV of one key/value head are
// summed in one task, in a fixed head order, and no two tasks write the same memory.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

constexpr int kBlock = 64;

// S[t - t0, 0..t1) = scale * Q[t] . K[t2] for the rows t0..t1 of a block.
void block_scores(const float* Q, const float* K, int t0, int t1, int T, int hs, float scale,
                  float* S) {
  gemm({.m = t1 - t0,
        .n = t1,
        .k = hs,
        .a = Q + size_t(t0) * hs,
        .lda = hs,
        .b = K,
        .ldb = hs,
        .trans_b = true,
        .c = S,
        .ldc = T});
  for (int t = t0; t < t1; ++t) {
    float* row = S + size_t(t - t0) * T;
    for (int t2 = 0; t2 <= t; ++t2) row[t2] *= scale;
  }
}

}  // namespace

void fused_attention_forward(DType dt, void* out, float* lse, const void* qkv, const int32_t* pos,
                             int B, int T, int NH, int NKV, int hs) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* in = static_cast<const Tp*>(qkv);
    const size_t W = size_t(NH + 2 * NKV) * hs, C = size_t(NH) * hs, th = size_t(T) * hs;
    const int group = NH / NKV;
    const float scale = 1.0f / std::sqrt(float(hs));
    parallel_ranges(size_t(B) * NH, 1, [&](size_t p0, size_t p1) {
      thread_local ThreadScratch buf;
      float *Q = buf.get(4 * th + size_t(kBlock) * T), *K = Q + th, *V = K + th, *O = V + th,
            *S = O + th;
      for (size_t p = p0; p < p1; ++p) {
        const int b = int(p / NH), h = int(p % NH), g = h / group;
        const Tp* base = in + size_t(b) * T * W;
        gather_columns(base, T, W, size_t(h) * hs, hs, Q);
        gather_columns(base, T, W, C + size_t(g) * hs, hs, K);
        gather_columns(base, T, W, C + size_t(NKV + g) * hs, hs, V);
        float* L = lse + p * T;
        const int32_t* pb = pos == nullptr ? nullptr : pos + size_t(b) * T;
        for (int t0 = 0; t0 < T; t0 += kBlock) {
          const int t1 = std::min(T, t0 + kBlock);
          block_scores(Q, K, t0, t1, T, hs, scale, S);
          for (int t = t0; t < t1; ++t) {
            float* row = S + size_t(t - t0) * T;
            const int lo = attention_key_start(pb, t);
            float mx = -INFINITY;
            for (int t2 = lo; t2 <= t; ++t2) mx = std::max(mx, row[t2]);
            float sum = 0.0f;
            for (int t2 = lo; t2 <= t; ++t2) {
              row[t2] = std::exp(row[t2] - mx);
              sum += row[t2];
            }
            const float inv = 1.0f / sum;
            for (int t2 = 0; t2 < lo; ++t2) row[t2] = 0.0f;
            for (int t2 = lo; t2 <= t; ++t2) row[t2] *= inv;
            for (int t2 = t + 1; t2 < t1; ++t2) row[t2] = 0.0f;
            L[t] = mx + std::log(sum);
          }
          gemm({.m = t1 - t0,
                .n = hs,
                .k = t1,
                .a = S,
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

void fused_attention_backward(DType dt, void* dqkv, float* scratch, const void* dout,
                              const void* qkv, const void* out, const float* lse,
                              const int32_t* pos, int B, int T, int NH, int NKV, int hs) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dqkv);
    auto* in = static_cast<const Tp*>(qkv);
    auto* dy = static_cast<const Tp*>(dout);
    auto* y = static_cast<const Tp*>(out);
    const size_t W = size_t(NH + 2 * NKV) * hs, C = size_t(NH) * hs, th = size_t(T) * hs;
    const int group = NH / NKV;
    const float scale = 1.0f / std::sqrt(float(hs));
    parallel_ranges(size_t(B) * NKV, 1, [&](size_t p0, size_t p1) {
      const size_t sb = size_t(kBlock) * T;
      thread_local ThreadScratch buf;
      float *Q = buf.get(8 * th + 2 * sb), *K = Q + th, *V = K + th, *dO = V + th, *O = dO + th;
      float *dQ = O + th, *dK = dQ + th, *dV = dK + th, *P = dV + th, *dS = P + sb;
      for (size_t p = p0; p < p1; ++p) {
        const int b = int(p / NKV), g = int(p % NKV);
        const Tp* base = in + size_t(b) * T * W;
        gather_columns(base, T, W, C + size_t(g) * hs, hs, K);
        gather_columns(base, T, W, C + size_t(NKV + g) * hs, hs, V);
        std::fill(dK, dK + th, 0.0f);
        std::fill(dV, dV + th, 0.0f);
        for (int h = g * group; h < (g + 1) * group; ++h) {
          gather_columns(base, T, W, size_t(h) * hs, hs, Q);
          gather_columns(dy + size_t(b) * T * C, T, C, size_t(h) * hs, hs, dO);
          gather_columns(y + size_t(b) * T * C, T, C, size_t(h) * hs, hs, O);
          const size_t row0 = (size_t(b) * NH + h) * T;
          const float* L = lse + row0;
          float* D = scratch + row0;
          const int32_t* pb = pos == nullptr ? nullptr : pos + size_t(b) * T;
          for (int t = 0; t < T; ++t) {
            float d = 0.0f;
            for (int i = 0; i < hs; ++i) d += dO[size_t(t) * hs + i] * O[size_t(t) * hs + i];
            D[t] = d;
          }
          for (int t0 = 0; t0 < T; t0 += kBlock) {
            const int t1 = std::min(T, t0 + kBlock);
            // P from the saved log-sum-exp; dP = dO V^T; dS = P (dP - D) * scale.
            block_scores(Q, K, t0, t1, T, hs, scale, P);
            gemm({.m = t1 - t0,
                  .n = t1,
                  .k = hs,
                  .a = dO + size_t(t0) * hs,
                  .lda = hs,
                  .b = V,
                  .ldb = hs,
                  .trans_b = true,
                  .c = dS,
                  .ldc = T});
            for (int t = t0; t < t1; ++t) {
              float* prow = P + size_t(t - t0) * T;
              float* drow = dS + size_t(t - t0) * T;
              const int lo = attention_key_start(pb, t);
              for (int t2 = 0; t2 < lo; ++t2) prow[t2] = drow[t2] = 0.0f;
              for (int t2 = lo; t2 <= t; ++t2) {
                prow[t2] = std::exp(prow[t2] - L[t]);
                drow[t2] = prow[t2] * (drow[t2] - D[t]) * scale;
              }
              for (int t2 = t + 1; t2 < t1; ++t2) prow[t2] = drow[t2] = 0.0f;
            }
            gemm({.m = t1 - t0,
                  .n = hs,
                  .k = t1,
                  .a = dS,
                  .lda = T,
                  .b = K,
                  .ldb = hs,
                  .c = dQ + size_t(t0) * hs,
                  .ldc = hs});
            gemm({.m = t1,
                  .n = hs,
                  .k = t1 - t0,
                  .a = P,
                  .lda = T,
                  .trans_a = true,
                  .b = dO + size_t(t0) * hs,
                  .ldb = hs,
                  .c = dV,
                  .ldc = hs,
                  .accumulate = true});
            gemm({.m = t1,
                  .n = hs,
                  .k = t1 - t0,
                  .a = dS,
                  .lda = T,
                  .trans_a = true,
                  .b = Q + size_t(t0) * hs,
                  .ldb = hs,
                  .c = dK,
                  .ldc = hs,
                  .accumulate = true});
          }
          scatter_add_columns(dQ, T, W, size_t(h) * hs, hs, dx + size_t(b) * T * W);
        }
        Tp* dbase = dx + size_t(b) * T * W;
        scatter_add_columns(dK, T, W, C + size_t(g) * hs, hs, dbase);
        scatter_add_columns(dV, T, W, C + size_t(NKV + g) * hs, hs, dbase);
      }
    });
  });
}

}  // namespace strata::cpu
