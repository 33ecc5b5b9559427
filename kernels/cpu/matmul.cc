// Linear layer: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias (llm.c matmul_forward/backward).
//
// The GEMMs (gemm.h) read the bf16/fp16/fp32 operands where they are -- the GEMM widens them to
// fp32 as it packs them, so no call makes a full-size fp32 copy of a weight or an activation --
// accumulate in fp32 and round the result to the storage type once. Each GEMM is split into
// fixed output tiles (kTileRows x kTileCols, bounds from the shapes alone) computed in parallel;
// every tile sums over the whole inner dimension itself, so the result does not depend on the
// thread count. A tile's fp32 result lives in a per-task buffer of kTileRows x kTileCols.
#include <algorithm>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

// Tall tiles: the GEMM packs a tile's slice of op(B) once and reuses it over all the tile's
// rows, so a tile of a micro-batch's N rows x 256 columns packs each weight element once.
constexpr size_t kTileRows = 512;
constexpr size_t kTileCols = 256;

// Calls f(r0, r1, c0, c1) for every tile of a rows x cols output, in parallel.
template <typename F>
void for_each_tile(size_t rows, size_t cols, F&& f) {
  size_t tr = (rows + kTileRows - 1) / kTileRows, tc = (cols + kTileCols - 1) / kTileCols;
  parallel_ranges(tr * tc, 1, [&](size_t t0, size_t t1) {
    for (size_t t = t0; t < t1; ++t) {
      size_t r0 = (t / tc) * kTileRows, c0 = (t % tc) * kTileCols;
      f(r0, std::min(rows, r0 + kTileRows), c0, std::min(cols, c0 + kTileCols));
    }
  });
}

}  // namespace

void matmul_forward(DType dt, void* out, const void* inp, const void* weight, const void* bias,
                    int N, int C, int OC) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    auto* x = static_cast<const Tp*>(inp);
    auto* w = static_cast<const Tp*>(weight);
    auto* bs = static_cast<const Tp*>(bias);
    for_each_tile(N, OC, [&](size_t r0, size_t r1, size_t c0, size_t c1) {
      const int rn = int(r1 - r0), cn = int(c1 - c0);
      // fp32 output: the tile is computed in place; else in fp32 scratch, then rounded.
      std::vector<float> scratch;
      float* t = nullptr;
      int ldt = OC;
      if constexpr (std::is_same_v<Tp, float>) {
        t = y + r0 * OC + c0;
      } else {
        scratch.resize(size_t(rn) * cn);
        t = scratch.data();
        ldt = cn;
      }
      gemm({.m = rn,
            .n = cn,
            .k = C,
            .a = x + r0 * C,
            .a_type = dt,
            .lda = C,
            .b = w + c0 * C,
            .b_type = dt,
            .ldb = C,
            .trans_b = true,
            .c = t,
            .ldc = ldt});
      float b[kTileCols];
      if (bias) load_span(bs + c0, b, cn);
      for (int r = 0; r < rn; ++r) {
        float* row = t + size_t(r) * ldt;
        if (bias) {
          for (int c = 0; c < cn; ++c) row[c] += b[c];
        }
        if constexpr (!std::is_same_v<Tp, float>) store_span(row, y + (r0 + r) * OC + c0, cn);
      }
    });
  });
}

void matmul_backward(DType dt, void* dinp, float* dweight, float* dbias, const void* dout,
                     const void* inp, const void* weight, int N, int C, int OC) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dinp);
    auto* g = static_cast<const Tp*>(dout);
    auto* x = static_cast<const Tp*>(inp);
    auto* w = static_cast<const Tp*>(weight);

    // dinp[N,C] += dout[N,OC] @ weight[OC,C]
    for_each_tile(N, C, [&](size_t r0, size_t r1, size_t c0, size_t c1) {
      const int rn = int(r1 - r0), cn = int(c1 - c0);
      GemmArgs a{.m = rn,
                 .n = cn,
                 .k = OC,
                 .a = g + r0 * OC,
                 .a_type = dt,
                 .lda = OC,
                 .b = w + c0,
                 .b_type = dt,
                 .ldb = C};
      if constexpr (std::is_same_v<Tp, float>) {
        a.c = dx + r0 * C + c0;
        a.ldc = C;
        a.accumulate = true;
        gemm(a);
      } else {
        std::vector<float> tile(size_t(rn) * cn);
        a.c = tile.data();
        a.ldc = cn;
        gemm(a);
        for (int r = 0; r < rn; ++r) {
          accumulate_span(tile.data() + size_t(r) * cn, dx + (r0 + r) * C + c0, cn);
        }
      }
    });

    // dweight[OC,C] += dout^T[OC,N] @ inp[N,C]
    for_each_tile(OC, C, [&](size_t r0, size_t r1, size_t c0, size_t c1) {
      gemm({.m = int(r1 - r0),
            .n = int(c1 - c0),
            .k = N,
            .a = g + r0,
            .a_type = dt,
            .lda = OC,
            .trans_a = true,
            .b = x + c0,
            .b_type = dt,
            .ldb = C,
            .c = dweight + r0 * C + c0,
            .ldc = C,
            .accumulate = true});
    });

    // dbias[OC] += column sums of dout, each column summed over rows in order.
    if (dbias) {
      parallel_ranges(size_t(OC), 256, [&](size_t o0, size_t o1) {
        std::vector<float> sum(o1 - o0, 0.0f), row(o1 - o0);
        for (int n = 0; n < N; ++n) {
          load_span(g + size_t(n) * OC + o0, row.data(), o1 - o0);
          for (size_t o = 0; o < o1 - o0; ++o) sum[o] += row[o];
        }
        for (size_t o = o0; o < o1; ++o) dbias[o] += sum[o - o0];
      });
    }
  });
}

}  // namespace strata::cpu
