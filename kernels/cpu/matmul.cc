// Linear layer: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias (llm.c matmul_forward/backward).
//
// GEMMs run in Eigen on fp32 operands: bf16/fp16 operands are first widened into fp32 scratch,
// products accumulate in fp32, and results are rounded to the storage type once. Each GEMM is
// split into fixed output tiles (kTileRows x kTileCols, bounds from the shapes alone) computed
// in parallel; every tile sums over the whole inner dimension itself, so the result does not
// depend on the thread count.
#include <Eigen/Core>
#include <algorithm>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/ops.h"

namespace strata::cpu {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Map = Eigen::Map<RowMat>;
using CMap = Eigen::Map<const RowMat>;

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
  CMap X(x.get(), N, C), W(w.get(), OC, C);
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* y = static_cast<Tp*>(out);
    for_each_tile(N, OC, [&](size_t r0, size_t r1, size_t c0, size_t c1) {
      size_t rn = r1 - r0, cn = c1 - c0;
      RowMat tile(rn, cn);
      tile.noalias() = X.middleRows(r0, rn) * W.middleRows(c0, cn).transpose();
      for (size_t r = 0; r < rn; ++r) {
        float* t = tile.data() + r * cn;
        if (bias) {
          for (size_t c = 0; c < cn; ++c) t[c] += b[c0 + c];
        }
        store_span(t, y + (r0 + r) * OC + c0, cn);
      }
    });
  });
}

void matmul_backward(DType dt, void* dinp, float* dweight, float* dbias, const void* dout,
                     const void* inp, const void* weight, int N, int C, int OC) {
  F32View g(dt, dout, size_t(N) * OC), x(dt, inp, size_t(N) * C), w(dt, weight, size_t(OC) * C);
  CMap G(g.get(), N, OC), X(x.get(), N, C), W(w.get(), OC, C);

  // dinp[N,C] += dout[N,OC] @ weight[OC,C]
  dispatch_dtype(dt, [&](auto tag) {
    using Tp = decltype(tag);
    auto* dx = static_cast<Tp*>(dinp);
    for_each_tile(N, C, [&](size_t r0, size_t r1, size_t c0, size_t c1) {
      size_t rn = r1 - r0, cn = c1 - c0;
      if constexpr (std::is_same_v<Tp, float>) {
        Eigen::Map<RowMat, 0, Eigen::OuterStride<>> D(dx + r0 * C + c0, rn, cn,
                                                      Eigen::OuterStride<>(C));
        D.noalias() += G.middleRows(r0, rn) * W.middleCols(c0, cn);
      } else {
        RowMat tile(rn, cn);
        tile.noalias() = G.middleRows(r0, rn) * W.middleCols(c0, cn);
        for (size_t r = 0; r < rn; ++r) {
          accumulate_span(tile.data() + r * cn, dx + (r0 + r) * C + c0, cn);
        }
      }
    });
  });

  // dweight[OC,C] += dout^T[OC,N] @ inp[N,C]
  for_each_tile(OC, C, [&](size_t r0, size_t r1, size_t c0, size_t c1) {
    size_t rn = r1 - r0, cn = c1 - c0;
    Eigen::Map<RowMat, 0, Eigen::OuterStride<>> D(dweight + r0 * C + c0, rn, cn,
                                                  Eigen::OuterStride<>(C));
    D.noalias() += G.middleCols(r0, rn).transpose() * X.middleCols(c0, cn);
  });

  // dbias[OC] += column sums of dout, each column summed over rows in order.
  if (dbias) {
    parallel_ranges(size_t(OC), 256, [&](size_t o0, size_t o1) {
      std::vector<float> sum(o1 - o0, 0.0f);
      for (int n = 0; n < N; ++n) {
        const float* row = g.get() + size_t(n) * OC + o0;
        for (size_t o = 0; o < o1 - o0; ++o) sum[o] += row[o];
      }
      for (size_t o = o0; o < o1; ++o) dbias[o] += sum[o - o0];
    });
  }
}

}  // namespace strata::cpu
