// Linear layer: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias (llm.c matmul_forward/backward).
//
// The GEMMs (gemm.h) read the bf16/fp16/fp32 operands where they are -- the GEMM widens them to
// fp32 as it packs them, so no call makes a full-size fp32 copy of a weight or an activation --
// accumulate in fp32 and round the result to the storage type once. Each GEMM is split into
// output tiles (at most kTileRows x kTileCols, smaller when that gives the arena's threads too
// few tiles: choose_tiles) computed in parallel; every tile sums over the whole inner dimension
// itself and the GEMM's bits do not depend on the tiling, so the result does not depend on the
// thread count. On the onednn GEMM path (gemm.h), whose bits may depend on a call's shape, the
// tiles are those of kFixedTileThreads threads whatever the arena's size, so again the thread
// count only decides which thread computes which tile; and every call of one layer has the
// same row count (block_rows: the last block's missing rows are zeros in a padded copy), so a
// row's bits do not depend on where it sits among the micro-batch's rows either -- a sequence
// gets the same outputs in any row of any micro-batch of the same size (DPO's reference
// log-probabilities are computed in other micro-batches than the policy's). A tile's fp32
// result lives in a per-thread buffer of at most one tile.
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

// Tiles at most kTileRows x kTileCols. Tall tiles: the GEMM packs a tile's slice of op(B) once
// and reuses it over all the tile's rows, so a tile of a micro-batch's N rows x 256 columns
// packs each weight element once.
constexpr size_t kTileRows = 512;
constexpr size_t kTileCols = 256;

// Tile sizes of a rows x cols output on `threads` threads: the largest tiles (fewest packings),
// split further while there are fewer tiles than threads, or a count of tiles that the threads
// share unevenly (a small GEMM -- width 128 -- is otherwise one tile on one core). A split along
// the columns re-packs the tile's op(A) rows (rows x k elements), a split along the rows
// re-packs its op(B) columns (cols x k): each step splits the dimension whose extra packing is
// smaller, and stops before a tile would drop below kMinRows x kMinCols (4 x 2 micro-tiles).
// Tiles are rounded up to whole micro-tiles (6 rows, 16 columns). Bits do not depend on the
// tiles (see gemm.h), so neither on the thread count.
constexpr size_t kMinRows = 24;  // 4 micro-tile rows of 6
constexpr size_t kMinCols = 32;  // 2 micro-tile columns of 16

struct Tiles {
  size_t rows, cols;  // tile extent; the edge tiles are smaller
};

Tiles choose_tiles(size_t rows, size_t cols, int threads) {
  auto round_up = [](size_t x, size_t m) { return (x + m - 1) / m * m; };
  size_t tr = (rows + kTileRows - 1) / kTileRows, tc = (cols + kTileCols - 1) / kTileCols;
  const size_t want = size_t(std::max(threads, 1));
  while (tr * tc < want || (want > 1 && (tr * tc) % want != 0 && tr * tc < 4 * want)) {
    const bool can_rows = rows / (tr + 1) >= kMinRows, can_cols = cols / (tc + 1) >= kMinCols;
    if (!can_rows && !can_cols) break;
    // One more column tile re-packs `rows` more A lines; one more row tile `cols` B lines.
    if (can_cols && (!can_rows || rows <= cols)) {
      ++tc;
    } else {
      ++tr;
    }
  }
  return {round_up((rows + tr - 1) / tr, 6), round_up((cols + tc - 1) / tc, 16)};
}

// The thread count the tiles are chosen for when the GEMM's bits may depend on the tiling.
constexpr int kFixedTileThreads = 4;

// Where the GEMM's bits may depend on a call's shape (onednn): the rows go in blocks of one
// height, at most kBlockRows and a multiple of kBlockAlign (no partial micro-tile of rows in any
// call), as few blocks as that allows; the last block is padded with zero rows to the same
// height. The height depends on the row count alone.
constexpr size_t kBlockRows = 256;
constexpr size_t kBlockAlign = 32;
size_t block_rows(size_t rows) {
  const size_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  const size_t per = (rows + blocks - 1) / blocks;
  return (per + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
}

// Calls f(r0, r1, c0, c1, m) for every tile of a rows x cols output, in parallel on the threads
// of the calling arena; m (>= r1 - r0) is the row count the tile's GEMM is to be called with:
// the rows from r1 - r0 on are zeros (onednn's padded last block; else m = r1 - r0).
template <typename F>
void for_each_tile(size_t rows, size_t cols, F&& f) {
  const bool follow = gemm_tiles_follow_threads();
  const int threads = follow ? tbb::this_task_arena::max_concurrency() : kFixedTileThreads;
  Tiles t = choose_tiles(rows, cols, threads);
  if (!follow) t.rows = block_rows(rows);
  size_t tr = (rows + t.rows - 1) / t.rows, tc = (cols + t.cols - 1) / t.cols;
  parallel_ranges(tr * tc, 1, [&](size_t t0, size_t t1) {
    for (size_t i = t0; i < t1; ++i) {
      size_t r0 = (i / tc) * t.rows, c0 = (i % tc) * t.cols, r1 = std::min(rows, r0 + t.rows);
      f(r0, r1, c0, std::min(cols, c0 + t.cols), follow ? r1 - r0 : t.rows);
    }
  });
}

// a's first `rows` rows (m x k, not transposed, lda) followed by m - rows zero rows, in the
// thread's scratch: the operand of a padded block's call.
template <typename Tp>
const Tp* padded_rows(const Tp* a, size_t rows, size_t m, size_t k, size_t lda) {
  thread_local std::vector<Tp> buf;
  buf.assign(m * k, Tp{});
  for (size_t r = 0; r < rows; ++r) std::memcpy(&buf[r * k], a + r * lda, k * sizeof(Tp));
  return buf.data();
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
    for_each_tile(N, OC, [&](size_t r0, size_t r1, size_t c0, size_t c1, size_t m) {
      const int rn = int(r1 - r0), cn = int(c1 - c0);
      // fp32 output: the tile is computed in place; else (or padded) in fp32 scratch, then
      // rounded.
      float* t = nullptr;
      int ldt = OC;
      if (std::is_same_v<Tp, float> && m == r1 - r0) {
        t = reinterpret_cast<float*>(y) + r0 * OC + c0;
      } else {
        thread_local ThreadScratch scratch;
        t = scratch.get(m * size_t(cn));
        ldt = cn;
      }
      const bool pad = m > r1 - r0;
      gemm({.m = int(m),
            .n = cn,
            .k = C,
            .a = pad ? padded_rows(x + r0 * C, r1 - r0, m, C, C) : x + r0 * C,
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
        if (!std::is_same_v<Tp, float> || pad) store_span(row, y + (r0 + r) * OC + c0, cn);
      }
    });
  });
}

void matmul_backward(DType dt, void* dinp, float* dweight, float* dbias, const void* dout,
                     const void* inp, const void* weight, int N, int C, int OC, bool accumulate) {
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dinp);
    auto* g = static_cast<const Tp*>(dout);
    auto* x = static_cast<const Tp*>(inp);
    auto* w = static_cast<const Tp*>(weight);

    // dinp[N,C] (+)= dout[N,OC] @ weight[OC,C]: the fp32 tile added to dinp, or stored (the
    // sum's bits either way: 0 + x is x, but for the sign of a zero).
    for_each_tile(N, C, [&](size_t r0, size_t r1, size_t c0, size_t c1, size_t m) {
      const int rn = int(r1 - r0), cn = int(c1 - c0);
      const bool pad = m > r1 - r0;
      GemmArgs a{.m = int(m),
                 .n = cn,
                 .k = OC,
                 .a = pad ? padded_rows(g + r0 * OC, r1 - r0, m, OC, OC) : g + r0 * OC,
                 .a_type = dt,
                 .lda = OC,
                 .b = w + c0,
                 .b_type = dt,
                 .ldb = C};
      if (std::is_same_v<Tp, float> && !pad) {
        a.c = reinterpret_cast<float*>(dx) + r0 * C + c0;
        a.ldc = C;
        a.accumulate = accumulate;
        gemm(a);
      } else {
        thread_local ThreadScratch scratch;
        float* tile = scratch.get(m * size_t(cn));
        a.c = tile;
        a.ldc = cn;
        gemm(a);
        for (int r = 0; r < rn; ++r) {
          if (accumulate) {
            accumulate_span(tile + size_t(r) * cn, dx + (r0 + r) * C + c0, cn);
          } else {
            store_span(tile + size_t(r) * cn, dx + (r0 + r) * C + c0, cn);
          }
        }
      }
    });

    // dweight[OC,C] += dout^T[OC,N] @ inp[N,C] (nullptr: a frozen weight, no gradient)
    if (dweight) {
      // (Rows of dweight: its tiles are no sequences; m is r1 - r0 or, padded, unneeded.)
      for_each_tile(OC, C, [&](size_t r0, size_t r1, size_t c0, size_t c1, size_t) {
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
    }

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
