// The fast CPU optimizer (strata/cpu_optim.h) against two references, on every ISA path:
//  - the fp32 scalar reference optimizer_step_reference(): the same bits, every step of 100;
//  - a double-precision reference written here: each step's fp32 results within 1e-6 of the
//    exact result, relative to the magnitude of the terms that make it up;
// plus: low-precision outputs correctly rounded from the fp32 master, gradient statistics with
// inf/nan anywhere, thread-count invariance, and the overflow-skip caller pattern.
#include "strata/cpu_optim.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "strata/dtype.h"
#include "strata/optimizer.h"

namespace strata {
namespace {

constexpr CpuIsa kAllIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512,
                               CpuIsa::kAvx512Bf16};
constexpr OptimizerKind kAllKinds[] = {OptimizerKind::kAdam, OptimizerKind::kAdamW,
                                       OptimizerKind::kAdagrad, OptimizerKind::kLion};

// A typed array at a chosen misalignment: `offset_elems` elements past a 64-byte boundary.
struct Buf {
  std::vector<uint8_t> storage;
  void* ptr = nullptr;
  size_t n = 0;
  DType t = DType::kF32;
  Buf() = default;
  Buf(DType type, size_t count, size_t offset_elems) : n(count), t(type) {
    storage.resize((count + offset_elems) * dtype_size(type) + 128);
    uintptr_t base = reinterpret_cast<uintptr_t>(storage.data());
    base = (base + 63) / 64 * 64 + offset_elems * dtype_size(type);
    ptr = reinterpret_cast<void*>(base);
  }
  float get(size_t i) const { return load_f32(ptr, t, i); }
  void set(size_t i, float x) { store_f32(ptr, t, i, x); }
  float* f32() { return static_cast<float*>(ptr); }
  bool same_bits(const Buf& o) const {
    return n == o.n && std::memcmp(ptr, o.ptr, n * dtype_size(t)) == 0;
  }
  Buf clone(size_t offset_elems) const {
    Buf b(t, n, offset_elems);
    std::memcpy(b.ptr, ptr, n * dtype_size(t));
    return b;
  }
};

// First index where two buffers' bits differ, for messages.
std::string first_diff(const Buf& a, const Buf& b) {
  const size_t es = dtype_size(a.t);
  for (size_t i = 0; i < a.n; ++i) {
    if (std::memcmp(static_cast<const uint8_t*>(a.ptr) + i * es,
                    static_cast<const uint8_t*>(b.ptr) + i * es, es) != 0) {
      return "element " + std::to_string(i) + " of " + std::to_string(a.n) + ": " +
             std::to_string(a.get(i)) + " vs " + std::to_string(b.get(i));
    }
  }
  return "none";
}

// One shard's state, owning its buffers.
struct Shard {
  Buf grad, master, m, v, lp;
  ShardState state(float grad_mult) {
    ShardState s;
    s.n = master.n;
    s.grad = grad.ptr;
    s.grad_dtype = grad.t;
    s.grad_mult = grad_mult;
    s.master = master.f32();
    s.m = m.ptr;
    s.v = v.ptr;
    s.moment_dtype = m.t;
    s.lp_out = lp.n ? lp.ptr : nullptr;
    s.lp_dtype = lp.t;
    return s;
  }
  Shard clone(size_t off) const {
    return Shard{grad.clone(off), master.clone(off), m.clone(off), v.clone(off), lp.clone(off)};
  }
};

Shard make_shard(std::mt19937_64& rng, size_t n, DType gt, DType mt, DType lt, bool with_lp,
                 size_t off) {
  Shard s{Buf(gt, n, off), Buf(DType::kF32, n, off), Buf(mt, n, off), Buf(mt, n, off),
          Buf(lt, with_lp ? n : 0, off)};
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    s.master.set(i, u(rng));
    s.m.set(i, 0.05f * nd(rng));
    s.v.set(i, 0.01f * std::fabs(nd(rng)) + 1e-6f);
  }
  return s;
}

void fill_grad(std::mt19937_64& rng, Buf& g, float scale) {
  std::normal_distribution<float> nd(0.0f, scale);
  for (size_t i = 0; i < g.n; ++i) g.set(i, nd(rng));
}

// ---------------------------------------------------------------- double-precision reference

struct Tol {
  double value;  // exact result from the fp32 inputs
  double scale;  // magnitude of the terms it is made of: the error bound is relative to this
};

struct DoubleStep {
  Tol p, m, v;
  bool sign_ambiguous = false;  // Lion: sign(c) decided by rounding noise; p not comparable
};

// The step of element i in double precision, from the same (fp32) inputs and hyperparameters.
DoubleStep double_step(const OptimizerHyper& h, double g, double p, double m, double v) {
  const double b1 = h.beta1, b2 = h.beta2, lr = h.lr, eps = h.eps, wd = h.weight_decay;
  DoubleStep r;
  double g_scale = std::fabs(g);
  switch (h.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      if (h.kind == OptimizerKind::kAdam) {
        g += wd * p;
        g_scale += std::fabs(wd * p);
      }
      double bc1 = 1.0, bc2 = 1.0;
      if (h.bias_correction) {
        bc1 = 1.0 - std::pow(b1, static_cast<double>(h.step));
        bc2 = 1.0 - std::pow(b2, static_cast<double>(h.step));
      }
      const double mn = b1 * m + (1.0 - b1) * g;
      const double m_scale = std::fabs(b1 * m) + (1.0 - b1) * g_scale;
      const double vn = b2 * v + (1.0 - b2) * g * g;
      const double v_scale = b2 * v + (1.0 - b2) * g_scale * g_scale;
      const double denom = std::sqrt(vn) / std::sqrt(bc2) + eps;
      const double step = lr / bc1;
      double pn = p;
      double p_scale = std::fabs(p);
      if (h.kind == OptimizerKind::kAdamW) {
        pn -= lr * wd * p;
        p_scale += std::fabs(lr * wd * p);
      }
      pn -= step * (mn / denom);
      p_scale += step * m_scale / denom;
      r.p = {pn, p_scale};
      r.m = {mn, m_scale};
      r.v = {vn, v_scale};
      break;
    }
    case OptimizerKind::kAdagrad: {
      g += wd * p;
      g_scale += std::fabs(wd * p);
      const double vn = v + g * g;
      const double denom = std::sqrt(vn) + eps;
      r.v = {vn, v + g_scale * g_scale};
      r.p = {p - lr * g / denom, std::fabs(p) + lr * g_scale / denom};
      r.m = {m, std::fabs(m)};
      break;
    }
    case OptimizerKind::kLion: {
      const double c = b1 * m + (1.0 - b1) * g;
      const double c_scale = std::fabs(b1 * m) + (1.0 - b1) * g_scale;
      r.sign_ambiguous = std::fabs(c) <= 1e-5 * c_scale;
      const double sgn = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
      r.p = {p - lr * (sgn + wd * p), std::fabs(p) + lr * (1.0 + std::fabs(wd * p))};
      r.m = {b2 * m + (1.0 - b2) * g, std::fabs(b2 * m) + (1.0 - b2) * g_scale};
      r.v = {v, std::fabs(v)};
      break;
    }
  }
  return r;
}

// |got - want| within 1e-6 of the scale; for a bf16-stored value, within half a bf16 ulp more.
::testing::AssertionResult close(const char* what, size_t i, float got, const Tol& want,
                                 bool bf16_stored) {
  double tol = 1e-6 * want.scale + 1e-30;
  if (bf16_stored) tol += std::ldexp(std::max(std::fabs(want.value), double{std::fabs(got)}), -8);
  const double err = std::fabs(static_cast<double>(got) - want.value);
  if (err <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << "[" << i << "] = " << got << ", double reference " << want.value << " (error "
         << err << " > tolerance " << tol << ", scale " << want.scale << ")";
}

// r is the correctly rounded 16-bit value of x: no neighbour is nearer, ties go to even.
bool correctly_rounded(float x, uint16_t r, DType t) {
  auto dec = [t](uint16_t h) -> double {
    return t == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
  };
  if (std::isnan(x)) return std::isnan(dec(r));
  const double xd = x, e = std::fabs(dec(r) - xd);
  for (int d : {-1, 1}) {
    const uint16_t nb = static_cast<uint16_t>(r + d);
    if ((nb & 0x7fff) == (t == DType::kBF16 ? 0x7f80 : 0x7c00) || std::isnan(dec(nb))) continue;
    if ((r & 0x7fff) == 0 && d == -1) continue;  // across zero: sign flip, not a neighbour
    const double en = std::fabs(dec(nb) - xd);
    if (en < e) return false;
    if (en == e && (r & 1)) return false;  // tie: the even one must win
  }
  return true;
}

uint16_t bits16(const Buf& b, size_t i) { return static_cast<const uint16_t*>(b.ptr)[i]; }

// ------------------------------------------------------------------------------ ISA fixture

class CpuOptimIsa : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!cpu_isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU lacks " << cpu_isa_name(GetParam()) << " (it supports up to "
                   << cpu_isa_name(detect_cpu_isa()) << "), so that path cannot run here";
    }
  }
};

// Every kind x grad dtype x moment dtype x lp dtype, 100 steps, random sizes with tails and
// unaligned pointers: bit-equal to the fp32 reference, within 1e-6 of the double reference,
// lp correctly rounded from the new master.
TEST_P(CpuOptimIsa, HundredStepsMatchReferences) {
  const CpuIsa isa = GetParam();
  std::mt19937_64 rng(1234 + static_cast<int>(isa));
  int combo = 0;
  for (OptimizerKind kind : kAllKinds) {
    for (DType gt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (DType mt : {DType::kF32, DType::kBF16}) {
        for (DType lt : {DType::kBF16, DType::kF16, DType::kF32}) {
          ++combo;
          // Sizes: mostly small with ragged tails; every 7th crosses a tile boundary.
          std::uniform_int_distribution<size_t> small(1, 700);
          const size_t n = combo % 7 == 0 ? kOptimizerTileElems + 1 + small(rng) % 40 : small(rng);
          const size_t off = 1 + combo % 3;  // never 64-byte aligned
          SCOPED_TRACE(::testing::Message()
                       << cpu_isa_name(isa) << " " << optimizer_kind_name(kind) << " grad "
                       << dtype_name(gt) << " moments " << dtype_name(mt) << " lp "
                       << dtype_name(lt) << " n=" << n << " offset=" << off);
          Shard fast = make_shard(rng, n, gt, mt, lt, true, off);
          Shard ref = fast.clone(0);
          OptimizerHyper h;
          h.kind = kind;
          h.lr = kind == OptimizerKind::kLion ? 1e-4f : 1e-3f;
          h.beta1 = 0.9f;
          h.beta2 = kind == OptimizerKind::kLion ? 0.99f : 0.999f;
          h.weight_decay = combo % 2 ? 0.01f : 0.0f;
          h.bias_correction = combo % 5 != 0;
          const float gscale = gt == DType::kF16 ? 256.0f : 1.0f;  // fp16: loss-scaled grads
          size_t ambiguous = 0;
          for (int step = 1; step <= 100; ++step) {
            h.step = step;
            fill_grad(rng, fast.grad, gscale);
            std::memcpy(ref.grad.ptr, fast.grad.ptr, n * dtype_size(gt));
            const float grad_mult = (1.0f / gscale) * (0.5f + 0.5f * (step % 3));
            const Shard before = fast.clone(0);
            optimizer_step_isa(isa, h, fast.state(grad_mult), 1 + step % 2);
            optimizer_step_reference(h, ref.state(grad_mult));
            ASSERT_TRUE(fast.master.same_bits(ref.master))
                << "step " << step << " master " << first_diff(fast.master, ref.master);
            ASSERT_TRUE(fast.m.same_bits(ref.m)) << "step " << step << " m";
            ASSERT_TRUE(fast.v.same_bits(ref.v)) << "step " << step << " v";
            ASSERT_TRUE(fast.lp.same_bits(ref.lp)) << "step " << step << " lp";
            const bool mb = mt == DType::kBF16;
            for (size_t i = 0; i < n; ++i) {
              const double g = static_cast<double>(before.grad.get(i)) * grad_mult;
              DoubleStep d =
                  double_step(h, g, before.master.get(i), before.m.get(i), before.v.get(i));
              if (d.sign_ambiguous) {
                ++ambiguous;
              } else {
                ASSERT_TRUE(close("master", i, fast.master.get(i), d.p, false)) << "step " << step;
              }
              ASSERT_TRUE(close("m", i, fast.m.get(i), d.m, mb)) << "step " << step;
              ASSERT_TRUE(close("v", i, fast.v.get(i), d.v, mb)) << "step " << step;
              if (lt == DType::kF32) {
                ASSERT_EQ(f32_bits(fast.lp.get(i)), f32_bits(fast.master.get(i)));
              } else {
                ASSERT_TRUE(correctly_rounded(fast.master.get(i), bits16(fast.lp, i), lt))
                    << "lp[" << i << "]=" << bits16(fast.lp, i) << " for master "
                    << fast.master.get(i) << " at step " << step;
              }
            }
          }
          EXPECT_LT(ambiguous, n * 100 / 1000 + 2) << "too many Lion sign ties to be noise";
        }
      }
    }
  }
}

// Special master values through the lp conversions (lr = 0 keeps master as set): subnormals
// (which vcvtneps2bf16 alone would flush), signed zeros, NaN with payloads, infinities, fp16
// overflow and subnormal range, exact rounding ties. The lp bits must equal dtype.h's.
TEST_P(CpuOptimIsa, LowPrecisionOutputOfSpecialValuesMatchesDtypeReference) {
  const CpuIsa isa = GetParam();
  std::vector<float> vals = {0.0f,
                             -0.0f,
                             std::numeric_limits<float>::denorm_min(),
                             -std::numeric_limits<float>::denorm_min(),
                             f32_from_bits(0x007fffffu),
                             f32_from_bits(0x80408000u),
                             f32_from_bits(0x00018000u),
                             std::numeric_limits<float>::min(),
                             std::numeric_limits<float>::max(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::infinity(),
                             f32_from_bits(0x7fc00001u),
                             f32_from_bits(0xff800123u),
                             f32_from_bits(0x7fa00000u),
                             65504.0f,
                             65519.99f,
                             65520.0f,
                             -70000.0f,
                             5.96e-8f,
                             2.98e-8f,
                             2.99e-8f,
                             1e-5f,
                             -6.1e-5f,
                             f32_from_bits(0x3f808000u),
                             f32_from_bits(0x3f818000u),
                             f32_from_bits(0x3f801000u),
                             1.0f + 1.0f / 2048,
                             1.0f + 3.0f / 2048,
                             -3.14159f};
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 300; ++i) vals.push_back(f32_from_bits(bits(rng)));  // any pattern
  const size_t n = vals.size();
  for (DType lt : {DType::kBF16, DType::kF16}) {
    for (DType mt : {DType::kF32, DType::kBF16}) {
      Shard s = make_shard(rng, n, DType::kF32, mt, lt, true, 1);
      for (size_t i = 0; i < n; ++i) s.master.set(i, vals[i]);
      fill_grad(rng, s.grad, 1.0f);
      OptimizerHyper h;
      h.lr = 0.0f;
      optimizer_step_isa(isa, h, s.state(1.0f));
      for (size_t i = 0; i < n; ++i) {
        // lr = 0 keeps every value except NaNs (quieted) and -0 (may become +0).
        const float x = s.master.get(i);
        if (!std::isnan(x) && x != 0.0f) {
          ASSERT_EQ(f32_bits(x), f32_bits(vals[i]));
        }
        const uint16_t want = lt == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
        ASSERT_EQ(bits16(s.lp, i), want)
            << dtype_name(lt) << " of 0x" << std::hex << f32_bits(x) << " (" << x << ")";
      }
    }
  }
}

// Moments and parameters driven into and out of the fp32 subnormal range and onto exact zeros,
// where vcvtneps2bf16 alone would flush: the AVX512_BF16 path converts a pair of vectors at a
// time and redoes the pair exactly when a word came out as +-0, so the bits must still equal the
// reference's for every moment dtype, kind and lp dtype, wherever in a pair (or in the single
// vector and tail after the pairs) the special element sits.
TEST_P(CpuOptimIsa, SubnormalAndZeroMomentsMatchReference) {
  const CpuIsa isa = GetParam();
  std::mt19937_64 rng(99);
  const float kTiny[] = {0.0f,
                         -0.0f,
                         std::numeric_limits<float>::denorm_min(),
                         -3 * std::numeric_limits<float>::denorm_min(),
                         f32_from_bits(0x00400000u),
                         f32_from_bits(0x807fffffu),
                         std::numeric_limits<float>::min(),
                         1.1e-38f,
                         -2e-38f,
                         1e-30f};
  std::uniform_int_distribution<size_t> pick(0, std::size(kTiny) - 1);
  std::bernoulli_distribution special(0.25);
  for (OptimizerKind kind : kAllKinds) {
    for (DType mt : {DType::kBF16, DType::kF32}) {
      for (DType lt : {DType::kBF16, DType::kF16}) {
        const size_t n = 16 * 13 + 5;  // pairs of 16-lane vectors, one single vector, a tail
        SCOPED_TRACE(::testing::Message()
                     << cpu_isa_name(isa) << " " << optimizer_kind_name(kind) << " moments "
                     << dtype_name(mt) << " lp " << dtype_name(lt));
        Shard fast = make_shard(rng, n, DType::kF32, mt, lt, true, 0);
        for (size_t i = 0; i < n; ++i) {
          if (special(rng)) fast.m.set(i, kTiny[pick(rng)]);
          if (special(rng)) fast.v.set(i, std::fabs(kTiny[pick(rng)]));
          if (special(rng)) fast.master.set(i, kTiny[pick(rng)]);
        }
        Shard ref = fast.clone(0);
        OptimizerHyper h;
        h.kind = kind;
        h.weight_decay = 0.01f;
        for (int step = 1; step <= 4; ++step) {
          h.step = step;
          // Gradients: zero (moments decay toward the subnormal range), tiny (g*g is
          // subnormal), or ordinary.
          for (size_t i = 0; i < n; ++i) {
            const int c = static_cast<int>(rng() % 3);
            const float g = c == 0 ? 0.0f : (c == 1 ? 1e-21f : 1e-3f) * (rng() % 2 ? 1 : -1);
            fast.grad.set(i, g);
            ref.grad.set(i, g);
          }
          optimizer_step_isa(isa, h, fast.state(1.0f), 1);
          optimizer_step_reference(h, ref.state(1.0f));
          ASSERT_TRUE(fast.master.same_bits(ref.master))
              << "step " << step << " master " << first_diff(fast.master, ref.master);
          ASSERT_TRUE(fast.m.same_bits(ref.m))
              << "step " << step << " m " << first_diff(fast.m, ref.m);
          ASSERT_TRUE(fast.v.same_bits(ref.v))
              << "step " << step << " v " << first_diff(fast.v, ref.v);
          ASSERT_TRUE(fast.lp.same_bits(ref.lp))
              << "step " << step << " lp " << first_diff(fast.lp, ref.lp);
        }
      }
    }
  }
}

// The same shard stepped with 1, 2, 3 and 5 threads gives the same bits, on sizes of many tiles,
// with 64-byte aligned lp_out (the non-temporal store path) and unaligned.
TEST_P(CpuOptimIsa, ThreadCountDoesNotChangeResults) {
  const CpuIsa isa = GetParam();
  std::mt19937_64 rng(99);
  for (size_t off : {size_t{0}, size_t{3}}) {
    for (DType lt : {DType::kBF16, DType::kF16, DType::kF32}) {
      // lp >= 1 MiB: non-temporal stores when aligned (off = 0).
      const size_t n = 17 * kOptimizerTileElems + 13;
      Shard base = make_shard(rng, n, DType::kBF16, DType::kF32, lt, true, off);
      fill_grad(rng, base.grad, 1.0f);
      OptimizerHyper h;
      h.weight_decay = 0.1f;
      h.step = 3;
      Shard ref = base.clone(0);
      optimizer_step_reference(h, ref.state(0.75f));
      for (int threads : {1, 2, 3, 5, 0}) {
        Shard s = base.clone(off);
        optimizer_step_isa(isa, h, s.state(0.75f), threads);
        EXPECT_TRUE(s.master.same_bits(ref.master)) << threads << " threads, offset " << off;
        EXPECT_TRUE(s.m.same_bits(ref.m)) << threads << " threads";
        EXPECT_TRUE(s.v.same_bits(ref.v)) << threads << " threads";
        EXPECT_TRUE(s.lp.same_bits(ref.lp)) << threads << " threads: " << first_diff(s.lp, ref.lp);
      }
    }
  }
}

// A step of `src`'s state written to `dst`'s buffers (ShardState::*_src), src left as it is.
ShardState out_of_place(Shard& src, Shard& dst, float grad_mult) {
  ShardState s = src.state(grad_mult);
  s.master_src = s.master;
  s.m_src = s.m;
  s.v_src = s.v;
  s.master = dst.master.f32();
  s.m = dst.m.ptr;
  s.v = dst.v.ptr;
  s.lp_out = dst.lp.ptr;
  return s;
}

// Out of place (ShardState::*_src, the speculation's undo without copies): the new state in
// master/m/v has the bits of the in-place step, and the sources are left as they were, for
// every kind, moment dtype and lp dtype, on the vector loop and the tail.
TEST_P(CpuOptimIsa, OutOfPlaceStepMatchesInPlaceAndLeavesSourcesUntouched) {
  const CpuIsa isa = GetParam();
  std::mt19937_64 rng(123);
  for (OptimizerKind kind : kAllKinds) {
    for (DType mt : {DType::kF32, DType::kBF16}) {
      for (DType lt : {DType::kBF16, DType::kF32}) {
        const size_t n = 2 * kOptimizerTileElems + 37;
        Shard base = make_shard(rng, n, DType::kBF16, mt, lt, true, 1);
        fill_grad(rng, base.grad, 1.0f);
        OptimizerHyper h;
        h.kind = kind;
        h.weight_decay = 0.05f;
        h.step = 4;
        Shard in_place = base.clone(0);
        optimizer_step_isa(isa, h, in_place.state(0.5f), 2);
        Shard src = base.clone(0);
        Shard dst = make_shard(rng, n, DType::kBF16, mt, lt, true, 3);  // other values
        optimizer_step_isa(isa, h, out_of_place(src, dst, 0.5f), 2);
        SCOPED_TRACE(::testing::Message() << optimizer_kind_name(kind) << " moments "
                                          << dtype_name(mt) << " lp " << dtype_name(lt));
        EXPECT_TRUE(dst.master.same_bits(in_place.master))
            << first_diff(dst.master, in_place.master);
        if (kind != OptimizerKind::kAdagrad) EXPECT_TRUE(dst.m.same_bits(in_place.m));
        if (kind != OptimizerKind::kLion) EXPECT_TRUE(dst.v.same_bits(in_place.v));
        EXPECT_TRUE(dst.lp.same_bits(in_place.lp)) << first_diff(dst.lp, in_place.lp);
        EXPECT_TRUE(src.master.same_bits(base.master)) << "the source master weights changed";
        EXPECT_TRUE(src.m.same_bits(base.m)) << "the source first moments changed";
        EXPECT_TRUE(src.v.same_bits(base.v)) << "the source second moments changed";
        // The reference agrees.
        Shard ref_src = base.clone(0);
        Shard ref_dst = make_shard(rng, n, DType::kBF16, mt, lt, true, 0);
        optimizer_step_reference(h, out_of_place(ref_src, ref_dst, 0.5f));
        EXPECT_TRUE(ref_dst.master.same_bits(in_place.master));
        EXPECT_TRUE(ref_src.master.same_bits(base.master));
      }
    }
  }
}

// grad_stats: equal to the sequential fp64 reference up to summation order, the same bits for
// every ISA and thread count, and inf/nan found wherever it sits.
TEST_P(CpuOptimIsa, GradStatsMatchReferenceAndFindNonFinite) {
  const CpuIsa isa = GetParam();
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<size_t> sz(1, 3 * kStatsTileElems + 100);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int rep = 0; rep < 6; ++rep) {
      const size_t n = rep == 0 ? 1 : (rep == 1 ? 17 : sz(rng));
      Buf g(t, n, 1 + rep % 2);
      fill_grad(rng, g, t == DType::kF16 ? 100.0f : 3.0f);
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " n=" << n);
      const GradStats want = grad_stats_reference(g.ptr, t, n);
      const GradStats got = grad_stats_isa(isa, g.ptr, t, n, 1);
      EXPECT_FALSE(got.nonfinite);
      EXPECT_NEAR(got.norm_sq, want.norm_sq, 1e-12 * want.norm_sq);
      for (int threads : {2, 3, 0}) {
        EXPECT_EQ(grad_stats_isa(isa, g.ptr, t, n, threads).norm_sq, got.norm_sq) << threads;
      }
      EXPECT_EQ(grad_stats_isa(CpuIsa::kScalar, g.ptr, t, n, 2).norm_sq, got.norm_sq)
          << "the scalar path sums in the same lanes and order";
      // Inf/NaN at the first, last, middle, tail and a tile boundary.
      std::vector<size_t> where = {0, n - 1, n / 2, n - 1 - (n % 16) / 2,
                                   std::min(n - 1, kStatsTileElems)};
      for (size_t pos : where) {
        for (float bad :
             {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
              std::numeric_limits<float>::quiet_NaN()}) {
          const float keep = g.get(pos);
          g.set(pos, bad);
          const GradStats r = grad_stats_isa(isa, g.ptr, t, n, 2);
          EXPECT_TRUE(r.nonfinite) << bad << " at " << pos << " not detected";
          EXPECT_TRUE(grad_stats_reference(g.ptr, t, n).nonfinite);
          g.set(pos, keep);
        }
      }
      EXPECT_FALSE(grad_stats_isa(isa, g.ptr, t, n).nonfinite) << "restored values are finite";
    }
  }
  // Overflow to fp16 Inf from a finite-looking fp32 value is still Inf in the fp16 buffer.
  Buf h(DType::kF16, 40, 0);
  for (size_t i = 0; i < 40; ++i) h.set(i, 1.0f);
  h.set(37, 70000.0f);
  EXPECT_TRUE(grad_stats_isa(isa, h.ptr, DType::kF16, 40).nonfinite);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuOptimIsa, ::testing::ValuesIn(kAllIsas),
                         [](const ::testing::TestParamInfo<CpuIsa>& i) {
                           return std::string(cpu_isa_name(i.param));
                         });

// ------------------------------------------------------------------------------ the rest

// The caller pattern for fp16 loss scaling: stats first; an overflowed step is not taken and
// leaves every byte of the state as it was; a clean step is taken with grad_mult = 1/scale.
TEST(CpuOptim, OverflowedStepIsSkippedByTheCallerAndLeavesStateUntouched) {
  std::mt19937_64 rng(11);
  const size_t n = 5000;
  Shard s = make_shard(rng, n, DType::kF16, DType::kF32, DType::kF16, true, 1);
  OptimizerHyper h;
  float loss_scale = 65536.0f;
  auto train_step = [&](int step) {  // what the trainer does with one shard
    const GradStats st = grad_stats(s.grad.ptr, s.grad.t, n);
    if (st.nonfinite) {
      loss_scale /= 2;
      return false;
    }
    h.step = step;
    optimizer_step(h, s.state(1.0f / loss_scale));
    return true;
  };
  fill_grad(rng, s.grad, 1000.0f);
  s.grad.set(4321, 1e6f);  // over fp16 max: stored as Inf
  const Shard before = s.clone(0);
  EXPECT_FALSE(train_step(1));
  EXPECT_EQ(loss_scale, 32768.0f);
  EXPECT_TRUE(s.master.same_bits(before.master));
  EXPECT_TRUE(s.m.same_bits(before.m));
  EXPECT_TRUE(s.v.same_bits(before.v));
  EXPECT_TRUE(s.lp.same_bits(before.lp));
  s.grad.set(4321, 5.0f);
  EXPECT_TRUE(train_step(1));
  EXPECT_FALSE(s.master.same_bits(before.master)) << "a clean step must move the weights";
}

// A gradient accumulator's add: the bits of one sequential loop, whatever the thread count,
// over sizes around the tile (tails, one tile, several), the source untouched.
TEST(CpuOptim, AddIntoIsTheSequentialSumOnAnyThreads) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, kOptimizerTileElems - 1, kOptimizerTileElems,
                   3 * kOptimizerTileElems + 5}) {
    std::vector<float> acc(n), x(n);
    for (float& v : acc) v = u(rng);
    for (float& v : x) v = u(rng);
    std::vector<float> want = acc;
    for (size_t i = 0; i < n; ++i) want[i] += x[i];
    const std::vector<float> x0 = x;
    for (int threads : {0, 1, 2, 3}) {
      std::vector<float> got = acc;
      add_into(got.data(), x.data(), n, threads);
      EXPECT_EQ(got, want) << n << " elements on " << threads << " threads";
    }
    EXPECT_EQ(x, x0);
  }
}

TEST(CpuOptim, ValidateShardNamesWhatIsMissing) {
  std::vector<float> a(8), b(8);
  ShardState s;
  s.n = 8;
  s.grad = a.data();
  s.master = b.data();
  OptimizerHyper h;
  Status st = validate_shard(h, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("both moments m and v"), std::string::npos) << st.message();
  s.v = a.data();
  h.kind = OptimizerKind::kAdagrad;
  EXPECT_TRUE(validate_shard(h, s).is_ok());
  h.kind = OptimizerKind::kLion;
  EXPECT_NE(validate_shard(h, s).message().find("moment m"), std::string::npos);
  s.m = a.data();
  s.moment_dtype = DType::kF16;
  EXPECT_NE(validate_shard(h, s).message().find("use fp32 or bf16"), std::string::npos);
  s.moment_dtype = DType::kF32;
  h.lr = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(validate_shard(h, s).is_ok());
}

TEST(CpuOptim, IsaNamesDetectionAndActivePath) {
  for (CpuIsa isa : kAllIsas) {
    CpuIsa back;
    ASSERT_TRUE(parse_cpu_isa(cpu_isa_name(isa), &back));
    EXPECT_EQ(back, isa);
  }
  CpuIsa x;
  EXPECT_FALSE(parse_cpu_isa("sse9", &x));
  EXPECT_TRUE(cpu_isa_supported(CpuIsa::kScalar));
  EXPECT_TRUE(cpu_isa_supported(detect_cpu_isa()));
  EXPECT_TRUE(cpu_isa_supported(active_cpu_isa()));
  const char* env = std::getenv("STRATA_CPU_ISA");
  if (env && parse_cpu_isa(env, &x) && cpu_isa_supported(x)) {
    EXPECT_EQ(active_cpu_isa(), x);
  }
  // `onednn` names a GEMM path of the kernels (kernels/cpu/gemm.h): the optimizer keeps the
  // detected one.
  if (env && std::string_view(env) == "onednn") EXPECT_EQ(active_cpu_isa(), detect_cpu_isa());
}

}  // namespace
}  // namespace strata
