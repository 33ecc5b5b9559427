// The CPU backend's GEMM paths (kernels/cpu/gemm.h: baseline, avx2, onednn), each one this
// build and CPU can run forced in turn (a ScopedGemmPath), whatever STRATA_CPU_ISA picked:
//   - the GEMM itself against a double-precision reference, every transposition and operand
//     dtype, and its bits independent of how the caller tiles the output;
//   - the linear layer (matmul_forward/backward through the Kernels table) against the
//     reference, and its bits independent of the thread count;
//   - which path STRATA_CPU_ISA selects on which CPU and build.
// The other CPU kernels, and determinism over a chain of ops on every path: cpu_kernels_test.cc.
// Inputs are drawn from a fixed seed per test; STRATA_TEST_SEED=<n> draws different ones.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"
#include "tests/cpu_gemm_test_util.h"
#include "tests/kernel_test_util.h"

namespace strata {
namespace {

using namespace kernel_test;

TEST(CpuKernels, MatmulForwardAndBackward) {
  struct Shape {
    int N, C, OC;
  };
  // Includes shapes that cross the 128-row and 1024-column output tiles.
  for (cpu::GemmPath path : available_gemm_paths()) {
    cpu::ScopedGemmPath force(path);
    SCOPED_TRACE(cpu::gemm_path_name(path));
    for (DType dt : kAllTypes) {
      for (Shape sh : {Shape{1, 1, 1}, Shape{7, 13, 5}, Shape{64, 96, 288}, Shape{130, 70, 1030},
                       Shape{3, 1030, 5}}) {
        for (bool with_bias : {true, false}) {
          const int N = sh.N, C = sh.C, OC = sh.OC;
          SCOPED_TRACE(
              fmt::format("{} N={} C={} OC={} bias={}", dtype_name(dt), N, C, OC, with_bias));
          std::mt19937_64 rng(test_seed(3));
          Typed x = random_typed(dt, size_t(N) * C, rng), w = random_typed(dt, size_t(OC) * C, rng);
          Typed b = random_typed(dt, OC, rng);
          Typed out(dt, size_t(N) * OC), dout = random_typed(dt, out.n, rng);
          Typed dx = random_typed(dt, x.n, rng);
          Vec dx0 = dx.to_double();
          auto dw = random_f32(w.n, rng), db = random_f32(OC, rng);
          Vec dw0 = as_double(dw), db0 = as_double(db);
          Fixture f;
          f.k().matmul_forward(f.s(), dt, out.data(), x.data(), w.data(),
                               with_bias ? b.data() : nullptr, N, C, OC);
          f.k().matmul_backward(f.s(), dt, dx.data(), dw.data(), with_bias ? db.data() : nullptr,
                                dout.data(), x.data(), w.data(), N, C, OC,
                                /*accumulate=*/true);
          f.sync();
          Vec bd = b.to_double();
          expect_close(
              out.to_double(),
              ref_matmul(x.to_double(), w.to_double(), with_bias ? &bd : nullptr, N, C, OC),
              tol_for(dt), "out");
          MmGrad g = ref_matmul_grad(dout.to_double(), x.to_double(), w.to_double(), N, C, OC);
          for (size_t i = 0; i < g.dx.size(); ++i) g.dx[i] += dx0[i];
          for (size_t i = 0; i < g.dw.size(); ++i) g.dw[i] += dw0[i];
          for (int o = 0; o < OC; ++o) g.db[o] = with_bias ? g.db[o] + db0[o] : db0[o];
          expect_close(dx.to_double(), g.dx, tol_for(dt), "dinp");
          expect_close(as_double(dw), g.dw, 1e-5, "dweight");
          expect_close(as_double(db), g.db, 1e-5, "dbias");
        }
      }
    }
  }
}

// Every GEMM implementation the CPU can run, every transposition, with and without
// accumulation, fp32 and bf16/fp16 operands (the AVX2 one widens them while packing; oneDNN reads
// bf16 pairs as they are where it can, else widens them), against a double reference. The
// shapes cross the AVX2 kernel's blocks: k = 300 > its 256-step inner block, m = 100 > its
// 96-row panel, and edge micro-tiles in both directions.
TEST(CpuKernels, GemmEveryIsaMatchesReference) {
  struct Isa {
    const char* name;
    cpu::GemmPath path;
  };
  std::vector<std::string> skipped;
  std::mt19937_64 rng(test_seed(20));
  for (Isa isa : {Isa{"avx2", cpu::GemmPath::kAvx2}, Isa{"onednn", cpu::GemmPath::kOneDnn},
                  Isa{"baseline", cpu::GemmPath::kBaseline}}) {
    if (!cpu::gemm_path_available(isa.path)) {
      skipped.push_back(isa.name);
      continue;
    }
    cpu::ScopedGemmPath force(isa.path);
    for (auto [m, n, k] : {std::tuple{1, 1, 1}, {5, 3, 7}, {67, 45, 131}, {100, 37, 300}}) {
      for (int mode = 0; mode < 8; ++mode) {
        for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
          const bool ta = mode & 1, tb = mode & 2, acc = mode & 4;
          // typed operands: A in dt, B in fp32 (and for bf16 both), so mixed pairs run too.
          const DType at = dt, bt = dt == DType::kF16 ? DType::kF32 : dt;
          SCOPED_TRACE(fmt::format("{} m={} n={} k={} ta={} tb={} acc={} a={} b={}", isa.name, m, n,
                                   k, ta, tb, acc, dtype_name(at), dtype_name(bt)));
          // Stored with padded row strides (ld = cols + 3) to exercise the strides.
          const int lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 3, ldc = n + 3;
          Typed a = random_typed(at, size_t(ta ? k : m) * lda, rng);
          Typed b = random_typed(bt, size_t(tb ? n : k) * ldb, rng);
          auto c = random_f32(size_t(m) * ldc, rng);
          Vec want(size_t(m) * n);
          for (int i = 0; i < m; ++i)
            for (int j = 0; j < n; ++j) {
              double s = acc ? c[size_t(i) * ldc + j] : 0.0;
              for (int l = 0; l < k; ++l) {
                double av = ta ? a.get(size_t(l) * lda + i) : a.get(size_t(i) * lda + l);
                double bv = tb ? b.get(size_t(j) * ldb + l) : b.get(size_t(l) * ldb + j);
                s += av * bv;
              }
              want[size_t(i) * n + j] = s;
            }
          cpu::gemm({.m = m,
                     .n = n,
                     .k = k,
                     .a = a.data(),
                     .a_type = at,
                     .lda = lda,
                     .trans_a = ta,
                     .b = b.data(),
                     .b_type = bt,
                     .ldb = ldb,
                     .trans_b = tb,
                     .c = c.data(),
                     .ldc = ldc,
                     .accumulate = acc});
          Vec got(size_t(m) * n);
          for (int i = 0; i < m; ++i)
            for (int j = 0; j < n; ++j) got[size_t(i) * n + j] = c[size_t(i) * ldc + j];
          expect_close(got, want, 1e-5, "C");
        }
      }
    }
  }
  if (!skipped.empty()) {
    GTEST_SKIP() << "this CPU or build cannot run the GEMM implementations: "
                 << fmt::format("{}", fmt::join(skipped, ", "))
                 << " (checked the others; dispatch uses " << cpu::gemm_isa()
                 << "; onednn needs a build with libdnnl-dev)";
  }
}

// The bits of an output element do not depend on how the caller tiles the output (what makes
// matmul and attention independent of the thread count): the whole product equals, bit for
// bit, the same product computed as uneven row x column tiles, with and without accumulation.
// Checked on the avx2 path (the baseline one where the CPU lacks AVX2); the onednn path does not
// promise it (gemm.h), and matmul.cc tiles its outputs independently of the thread count there.
TEST(CpuKernels, GemmBitsDoNotDependOnTiling) {
  cpu::ScopedGemmPath force(cpu::gemm_path_available(cpu::GemmPath::kAvx2)
                                ? cpu::GemmPath::kAvx2
                                : cpu::GemmPath::kBaseline);
  std::mt19937_64 rng(test_seed(21));
  const int m = 131, n = 1100, k = 520;  // more than one block of every kind
  for (bool tb : {false, true}) {
    for (bool acc : {false, true}) {
      SCOPED_TRACE(fmt::format("tb={} acc={}", tb, acc));
      Typed a = random_typed(DType::kBF16, size_t(m) * k, rng);
      Typed b = random_typed(DType::kBF16, size_t(k) * n, rng);
      auto c0 = random_f32(size_t(m) * n, rng);
      auto whole = c0, tiled = c0;
      cpu::GemmArgs g{.m = m,
                      .n = n,
                      .k = k,
                      .a = a.data(),
                      .a_type = DType::kBF16,
                      .lda = k,
                      .b = b.data(),
                      .b_type = DType::kBF16,
                      .ldb = tb ? k : n,
                      .trans_b = tb,
                      .c = whole.data(),
                      .ldc = n,
                      .accumulate = acc};
      cpu::gemm(g);
      for (int r0 = 0; r0 < m; r0 += 37) {
        for (int c0i = 0; c0i < n; c0i += 301) {
          cpu::GemmArgs t = g;
          t.m = std::min(37, m - r0);
          t.n = std::min(301, n - c0i);
          t.a = static_cast<const uint16_t*>(a.data()) + size_t(r0) * k;
          t.b = static_cast<const uint16_t*>(b.data()) + (tb ? size_t(c0i) * k : size_t(c0i));
          t.c = tiled.data() + size_t(r0) * n + c0i;
          cpu::gemm(t);
        }
      }
      ASSERT_EQ(0, std::memcmp(whole.data(), tiled.data(), whole.size() * sizeof(float)));
    }
  }
}

// The linear layer at bench-25m's shapes (N = 2 x 128 tokens, width 512) on 1 to 6 threads, on
// every GEMM path: the output tiles change with the thread count (matmul.cc's choose_tiles),
// and on the onednn path, whose bits depend on a call's shape, they must not -- this is the
// check that fails when matmul tiles by thread count there.
TEST(CpuKernels, MatmulBitsDoNotDependOnThreadCountOnEveryPath) {
  struct Shape {
    int N, C, OC;
  };
  for (cpu::GemmPath path : available_gemm_paths()) {
    cpu::ScopedGemmPath force(path);
    for (Shape sh : {Shape{256, 512, 1536}, Shape{256, 2048, 512}, Shape{200, 96, 1100}}) {
      const int N = sh.N, C = sh.C, OC = sh.OC;
      SCOPED_TRACE(fmt::format("{} N={} C={} OC={}", cpu::gemm_path_name(path), N, C, OC));
      std::mt19937_64 rng(test_seed(23));
      const DType dt = DType::kBF16;
      Typed x = random_typed(dt, size_t(N) * C, rng), w = random_typed(dt, size_t(OC) * C, rng);
      Typed dout = random_typed(dt, size_t(N) * OC, rng);
      std::vector<unsigned char> first;
      for (int threads : {1, 2, 3, 4, 6}) {
        Typed out(dt, size_t(N) * OC), dx(dt, x.n);
        std::vector<float> dw(w.n, 0.0f);
        Fixture f(threads);
        f.k().matmul_forward(f.s(), dt, out.data(), x.data(), w.data(), nullptr, N, C, OC);
        f.k().matmul_backward(f.s(), dt, dx.data(), dw.data(), nullptr, dout.data(), x.data(),
                              w.data(), N, C, OC, /*accumulate=*/true);
        f.sync();
        std::vector<unsigned char> bytes(out.n * 2 + dx.n * 2 + dw.size() * 4);
        std::memcpy(bytes.data(), out.data(), out.n * 2);
        std::memcpy(bytes.data() + out.n * 2, dx.data(), dx.n * 2);
        std::memcpy(bytes.data() + out.n * 2 + dx.n * 2, dw.data(), dw.size() * 4);
        if (first.empty()) {
          first = std::move(bytes);
        } else {
          EXPECT_TRUE(bytes == first) << threads << " threads differ from 1";
        }
      }
    }
  }
}

// A row's output does not depend on the other rows' values, on every GEMM path: a micro-batch's
// rows are sequences whose results (a preference pair's log-probabilities, DPO's reference)
// must not depend on what the other sequences hold. Shapes of a 110M Llama's layers (width 768:
// fused q/k/v, gate/up, down) at 4 x 256 tokens; rows [0, 256) and [512, 768) trade places and
// the rest stay. (On the onednn path a row's bits may still depend on where it sits: the
// shape of its tile; see docs/ARCHITECTURE.md.)
TEST(CpuKernels, MatmulRowsDoNotDependOnTheOtherRows) {
  struct Shape {
    int N, C, OC;
  };
  for (cpu::GemmPath path : available_gemm_paths()) {
    cpu::ScopedGemmPath force(path);
    for (Shape sh : {Shape{1024, 768, 1280}, Shape{1024, 768, 3072}, Shape{1024, 1536, 768}}) {
      const int N = sh.N, C = sh.C, OC = sh.OC;
      SCOPED_TRACE(fmt::format("{} N={} C={} OC={}", cpu::gemm_path_name(path), N, C, OC));
      std::mt19937_64 rng(test_seed(29));
      const DType dt = DType::kBF16;
      Typed x = random_typed(dt, size_t(N) * C, rng), w = random_typed(dt, size_t(OC) * C, rng);
      Typed swapped(dt, x.n);
      // Rows [0, 256) and [512, 768) trade places; the rest stay.
      const size_t q = size_t(N) / 4, row = size_t(C) * 2;
      auto* src = static_cast<unsigned char*>(x.data());
      auto* dst = static_cast<unsigned char*>(swapped.data());
      std::memcpy(dst, src, x.n * 2);
      std::memcpy(dst, src + 2 * q * row, q * row);
      std::memcpy(dst + 2 * q * row, src, q * row);
      Typed out(dt, size_t(N) * OC), out2(dt, size_t(N) * OC);
      Fixture f(2);
      f.k().matmul_forward(f.s(), dt, out.data(), x.data(), w.data(), nullptr, N, C, OC);
      f.k().matmul_forward(f.s(), dt, out2.data(), swapped.data(), w.data(), nullptr, N, C, OC);
      f.sync();
      const size_t orow = size_t(OC) * 2;
      auto* a = static_cast<unsigned char*>(out.data());
      auto* b = static_cast<unsigned char*>(out2.data());
      EXPECT_EQ(std::memcmp(a + q * orow, b + q * orow, q * orow), 0) << "rows [256, 512)";
      EXPECT_EQ(std::memcmp(a + 3 * q * orow, b + 3 * q * orow, q * orow), 0) << "rows [768, 1024)";
      EXPECT_EQ(std::memcmp(a, b + 2 * q * orow, q * orow), 0) << "rows [0, 256) moved";
    }
  }
}

// A sequence's outputs do not depend on where it sits among a micro-batch's rows, on every GEMM
// path (on onednn, whose bits may depend on a call's shape, through matmul.cc's row blocks of
// one height): DPO's reference log-probabilities come from other micro-batches than the
// policy's, in other rows. Four sequences of T = 256 and of T = 257 (blocks not aligned to
// them), sequences 1 and 3 trading places.
TEST(CpuKernels, MatmulRowsDoNotDependOnTheirPlaceInTheBatch) {
  for (cpu::GemmPath path : available_gemm_paths()) {
    cpu::ScopedGemmPath force(path);
    for (int T : {256, 257}) {
      const int N = 4 * T, C = 1536, OC = 768;
      SCOPED_TRACE(fmt::format("{} T={}", cpu::gemm_path_name(path), T));
      std::mt19937_64 rng(test_seed(31));
      const DType dt = DType::kBF16;
      Typed x = random_typed(dt, size_t(N) * C, rng), w = random_typed(dt, size_t(OC) * C, rng);
      Typed dout = random_typed(dt, size_t(N) * OC, rng);
      // Sequence i in rows [iT, (i + 1)T): 1 and 3 trade places, in the input and in dout.
      auto swap13 = [&](const Typed& v, int width) {
        Typed o(dt, v.n);
        const size_t seq = size_t(T) * width * 2;
        auto* s = static_cast<const unsigned char*>(v.data());
        auto* d = static_cast<unsigned char*>(o.data());
        std::memcpy(d, s, v.n * 2);
        std::memcpy(d + seq, s + 3 * seq, seq);
        std::memcpy(d + 3 * seq, s + seq, seq);
        return o;
      };
      const Typed xs = swap13(x, C), douts = swap13(dout, OC);
      Fixture f(2);
      Typed out(dt, size_t(N) * OC), outs(dt, size_t(N) * OC), dx(dt, x.n), dxs(dt, x.n);
      f.k().matmul_forward(f.s(), dt, out.data(), x.data(), w.data(), nullptr, N, C, OC);
      f.k().matmul_forward(f.s(), dt, outs.data(), xs.data(), w.data(), nullptr, N, C, OC);
      f.k().matmul_backward(f.s(), dt, dx.data(), nullptr, nullptr, dout.data(), x.data(), w.data(),
                            N, C, OC, /*accumulate=*/false);
      f.k().matmul_backward(f.s(), dt, dxs.data(), nullptr, nullptr, douts.data(), xs.data(),
                            w.data(), N, C, OC, /*accumulate=*/false);
      f.sync();
      const Typed back = swap13(outs, OC), dback = swap13(dxs, C);
      EXPECT_EQ(std::memcmp(out.data(), back.data(), out.n * 2), 0) << "forward";
      EXPECT_EQ(std::memcmp(dx.data(), dback.data(), dx.n * 2), 0) << "input gradient";
    }
  }
}

// STRATA_CPU_ISA's values (shared with cpu_optim) map to GEMM paths: by CPUID when unset, a
// forced level only where the CPU has it, onednn only where the build has oneDNN.
TEST(CpuKernels, GemmPathFromStrataCpuIsa) {
  using cpu::gemm_path_for;
  using cpu::GemmPath;
  const CpuIsa avx2 = CpuIsa::kAvx2, avx512 = CpuIsa::kAvx512, bf16 = CpuIsa::kAvx512Bf16;
  // Unset: oneDNN on AVX-512 CPUs only, and only when built in.
  EXPECT_EQ(gemm_path_for("", avx2, true), GemmPath::kAvx2);
  EXPECT_EQ(gemm_path_for("", avx512, true), GemmPath::kOneDnn);
  EXPECT_EQ(gemm_path_for("", bf16, true), GemmPath::kOneDnn);
  EXPECT_EQ(gemm_path_for("", bf16, false), GemmPath::kAvx2);
  EXPECT_EQ(gemm_path_for("", CpuIsa::kScalar, true), GemmPath::kBaseline);
  // Forced levels.
  EXPECT_EQ(gemm_path_for("avx2", bf16, true), GemmPath::kAvx2);
  EXPECT_EQ(gemm_path_for("scalar", avx2, true), GemmPath::kBaseline);
  EXPECT_EQ(gemm_path_for("avx512", bf16, true), GemmPath::kOneDnn);
  EXPECT_EQ(gemm_path_for("avx512bf16", bf16, false), GemmPath::kAvx2);
  EXPECT_EQ(gemm_path_for("onednn", avx2, true), GemmPath::kOneDnn);
  EXPECT_EQ(gemm_path_for("onednn", CpuIsa::kScalar, true), GemmPath::kOneDnn);
  // Refused, with the reason in the note: the CPU's choice instead.
  std::string note;
  EXPECT_EQ(gemm_path_for("avx512", avx2, true, &note), GemmPath::kAvx2);
  EXPECT_NE(note.find("supports at most avx2"), std::string::npos) << note;
  EXPECT_EQ(gemm_path_for("onednn", avx2, false, &note), GemmPath::kAvx2);
  EXPECT_NE(note.find("libdnnl-dev"), std::string::npos) << note;
  EXPECT_EQ(gemm_path_for("AVX2", avx2, true, &note), GemmPath::kAvx2);
  EXPECT_NE(note.find("is not one of"), std::string::npos) << note;
  EXPECT_EQ(gemm_path_for("amx", bf16, true, &note), GemmPath::kOneDnn);
  EXPECT_NE(note.find("is not one of"), std::string::npos) << note;
}

}  // namespace
}  // namespace strata
