// The baseline GEMM (gemm.h) for CPUs without AVX2 + FMA: Eigen's GEMM built with the project's
// baseline x86-64 flags, on fp32 copies of typed operands.
#include <Eigen/Core>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"

namespace strata::cpu::baseline {
namespace {

// An fp32 view of the rows x cols matrix at p (row stride ld): p itself for fp32, else a copy.
const float* as_f32(const void* p, DType dt, int rows, int cols, int ld, std::vector<float>* copy) {
  if (dt == DType::kF32) return static_cast<const float*>(p);
  copy->resize(size_t(rows) * ld);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      (*copy)[size_t(r) * ld + c] = load_f32(p, dt, size_t(r) * ld + c);
    }
  }
  return copy->data();
}

}  // namespace

void gemm(const GemmArgs& g) {
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
  using Map = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
  if (g.m <= 0 || g.n <= 0) return;
  Map C(g.c, g.m, g.n, Eigen::OuterStride<>(g.ldc));
  if (g.k <= 0) {
    if (!g.accumulate) C.setZero();
    return;
  }
  std::vector<float> a_copy, b_copy;
  const float* a = g.trans_a ? as_f32(g.a, g.a_type, g.k, g.m, g.lda, &a_copy)
                             : as_f32(g.a, g.a_type, g.m, g.k, g.lda, &a_copy);
  const float* b = g.trans_b ? as_f32(g.b, g.b_type, g.n, g.k, g.ldb, &b_copy)
                             : as_f32(g.b, g.b_type, g.k, g.n, g.ldb, &b_copy);
  auto run = [&](const auto& A, const auto& B) {
    if (g.accumulate) {
      C.noalias() += A * B;
    } else {
      C.noalias() = A * B;
    }
  };
  CMap A = g.trans_a ? CMap(a, g.k, g.m, Eigen::OuterStride<>(g.lda))
                     : CMap(a, g.m, g.k, Eigen::OuterStride<>(g.lda));
  CMap B = g.trans_b ? CMap(b, g.n, g.k, Eigen::OuterStride<>(g.ldb))
                     : CMap(b, g.k, g.n, Eigen::OuterStride<>(g.ldb));
  if (!g.trans_a && !g.trans_b) {
    run(A, B);
  } else if (!g.trans_a) {
    run(A, B.transpose());
  } else if (!g.trans_b) {
    run(A.transpose(), B);
  } else {
    run(A.transpose(), B.transpose());
  }
}

}  // namespace strata::cpu::baseline
