// Linear layer: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias (llm.c matmul_forward/backward).
//
// GEMMs run in Eigen (gemm.h: dispatched to the CPU's vector ISA) on fp32 operands: bf16/fp16
// operands are first widened into fp32 scratch, products accumulate in fp32, and results are
// rounded to the storage type once. Each GEMM is split into fixed output tiles (kTileRows x
// kTileCols, bounds from the shapes alone) computed in parallel; every tile sums over the whole
// inner dimension itself, so the result does not depend on the thread count.
#include <algorithm>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

constexpr size_t kTileRows = 128;
constexpr size_t kTileCols = 1024;

// An fp32 view of a typed [n] buffer: the buffer itself for fp32, else a widened copy.
class F32View {
 public:
  F32View(DType dt, const void* p, size_t n) {
    if (dt == DType::kF32) {
      ptr_ = static_cast<const float*>(p);
      return;
    }
    copy_.resize(n);
    dispatch_dtype(dt, [&](auto tag) {
      using Tp = decltype(tag);
      auto* src = static_cast<const Tp*>(p);
      parallel_ranges(n, kElementGrain, [&](size_t i0, size_t i1) {
        load_span(src + i0, copy_.data() + i0, i1 - i0);
      });
    });
    ptr_ = copy_.data();
  }
  const float* get() const { return ptr_; }

 private:
  const float* ptr_ = nullptr;
  std::vector<float> copy_;
};

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
  F32View x(dt, inp, size_t(N) * C), w(dt, weight, size_t(OC) * C);
  std::vector<float> b;
  if (bias) {
    b.resize(OC);
    dispatch_dtype(
        dt, [&](auto tag) { load_span(static_cast<const decltype(tag)*>(bias), b.data(), OC); });
  }
  const float *X = x.get(), *W = w.get();
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
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
            .a = X + r0 * C,
            .lda = C,
            .b = W + c0 * C,
            .ldb = C,
            .trans_b = true,
            .c = t,
            .ldc = ldt});
      for (int r = 0; r < rn; ++r) {
        float* row = t + size_t(r) * ldt;
        if (bias) {
          for (int c = 0; c < cn; ++c) row[c] += b[c0 + c];
        }
        if constexpr (!std::is_same_v<Tp, float>) store_span(row, y + (r0 + r) * OC + c0, cn);
      }
    });
  });
}

void matmul_backward(DType dt, void* dinp, float* dweight, float* dbias, const void* dout,
                     const void* inp, const void* weight, int N, int C, int OC) {
  F32View g(dt, dout, size_t(N) * OC), x(dt, inp, size_t(N) * C), w(dt, weight, size_t(OC) * C);
  const float *G = g.get(), *X = x.get(), *W = w.get();

  // dinp[N,C] += dout[N,OC] @ weight[OC,C]
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dinp);
    for_each_tile(N, C, [&](size_t r0, size_t r1, size_t c0, size_t c1) {
      const int rn = int(r1 - r0), cn = int(c1 - c0);
      GemmArgs a{.m = rn, .n = cn, .k = OC, .a = G + r0 * OC, .lda = OC, .b = W + c0, .ldb = C};
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
  });

  // dweight[OC,C] += dout^T[OC,N] @ inp[N,C]
  for_each_tile(OC, C, [&](size_t r0, size_t r1, size_t c0, size_t c1) {
    gemm({.m = int(r1 - r0),
          .n = int(c1 - c0),
          .k = N,
          .a = G + r0,
          .lda = OC,
          .trans_a = true,
          .b = X + c0,
          .ldb = C,
          .c = dweight + r0 * C + c0,
          .ldc = C,
          .accumulate = true});
  });

  // dbias[OC] += column sums of dout, each column summed over rows in order.
  if (dbias) {
    parallel_ranges(size_t(OC), 256, [&](size_t o0, size_t o1) {
      std::vector<float> sum(o1 - o0, 0.0f);
      for (int n = 0; n < N; ++n) {
        const float* row = G + size_t(n) * OC + o0;
        for (size_t o = 0; o < o1 - o0; ++o) sum[o] += row[o];
      }
      for (size_t o = o0; o < o1; ++o) dbias[o] += sum[o - o0];
    });
  }
}

}  // namespace strata::cpu
