// Internal: the fused optimizer pass and the gradient sum of squares, written once over a
// vector-ops policy `O` and included by each ISA translation unit (scalar.cc, avx2.cc,
// avx512.cc), which defines O with its intrinsics before including this file.
//
// O provides: W (lanes), F (vector of W floats), set1/add/sub/mul/div/sqrt (IEEE, one rounding
// each, never fused), load/store of fp32, bf16 and fp16 (stores round to nearest even and keep
// NaN a quiet NaN exactly like strata/dtype.h), non-temporal bf16/fp16/fp32 stores for aligned
// destinations, sign(), and the fp64 square accumulator (Acc, acc_load/acc_add/acc_store).
//
// The arithmetic is the reference's (cpu_optim/reference.cc) operation for operation, so each
// path produces the reference's bits. Everything here has internal linkage (see the ODR note in
// isa_kernels.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu_optim/isa_kernels.h"

namespace strata::cpu_optim_internal {
namespace {

// Storage type of a dtype.
template <DType T>
struct Storage {
  using type = uint16_t;
};
template <>
struct Storage<DType::kF32> {
  using type = float;
};

template <class O, DType T>
inline typename O::F load_as(const typename Storage<T>::type* p) {
  if constexpr (T == DType::kF32) {
    return O::load(p);
  } else if constexpr (T == DType::kBF16) {
    return O::load_bf16(p);
  } else {
    return O::load_f16(p);
  }
}

// Stores the new parameters as lp dtype T (kF32, kBF16 or kF16) at element i.
template <class O, DType T>
inline void store_lp(void* lp, size_t i, bool stream, typename O::F x) {
  if constexpr (T == DType::kF32) {
    if (stream) {
      O::stream(static_cast<float*>(lp) + i, x);
    } else {
      O::store(static_cast<float*>(lp) + i, x);
    }
  } else if constexpr (T == DType::kBF16) {
    if (stream) {
      O::stream_bf16(static_cast<uint16_t*>(lp) + i, x);
    } else {
      O::store_bf16(static_cast<uint16_t*>(lp) + i, x);
    }
  } else {
    if (stream) {
      O::stream_f16(static_cast<uint16_t*>(lp) + i, x);
    } else {
      O::store_f16(static_cast<uint16_t*>(lp) + i, x);
    }
  }
}

// The constants of one call, broadcast once per range.
template <class O>
struct VConsts {
  using F = typename O::F;
  F grad_mult, lr, beta1, beta2, eps, wd, omb1, omb2, lr_wd, step_size, inv_bc2_sqrt;
  VConsts(const StepConsts& c, float gm)
      : grad_mult(O::set1(gm)),
        lr(O::set1(c.lr)),
        beta1(O::set1(c.beta1)),
        beta2(O::set1(c.beta2)),
        eps(O::set1(c.eps)),
        wd(O::set1(c.weight_decay)),
        omb1(O::set1(c.one_minus_beta1)),
        omb2(O::set1(c.one_minus_beta2)),
        lr_wd(O::set1(c.lr_wd)),
        step_size(O::set1(c.step_size)),
        inv_bc2_sqrt(O::set1(c.inv_bc2_sqrt)) {}
};

// One vector of W elements at index i of the given arrays. Returns the new master.
template <class O, OptimizerKind K, DType G, bool kMomBf16>
inline typename O::F step_block(const VConsts<O>& k, bool has_wd,
                                const typename Storage<G>::type* grad, float* master, void* m_base,
                                void* v_base, size_t i) {
  using F = typename O::F;
  constexpr DType M = kMomBf16 ? DType::kBF16 : DType::kF32;
  using MT = typename Storage<M>::type;
  F g = O::mul(load_as<O, G>(grad + i), k.grad_mult);
  F p = O::load(master + i);
  if constexpr (K == OptimizerKind::kAdam || K == OptimizerKind::kAdamW) {
    if (K == OptimizerKind::kAdam && has_wd) g = O::add(g, O::mul(k.wd, p));
    MT* mp = static_cast<MT*>(m_base) + i;
    MT* vp = static_cast<MT*>(v_base) + i;
    F m = load_as<O, M>(mp);
    F v = load_as<O, M>(vp);
    m = O::add(O::mul(k.beta1, m), O::mul(k.omb1, g));
    v = O::add(O::mul(k.beta2, v), O::mul(O::mul(k.omb2, g), g));
    F denom = O::add(O::mul(O::sqrt(v), k.inv_bc2_sqrt), k.eps);
    if (K == OptimizerKind::kAdamW && has_wd) p = O::sub(p, O::mul(k.lr_wd, p));
    p = O::sub(p, O::mul(k.step_size, O::div(m, denom)));
    if constexpr (kMomBf16) {
      O::store_bf16(mp, m);
      O::store_bf16(vp, v);
    } else {
      O::store(mp, m);
      O::store(vp, v);
    }
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    if (has_wd) g = O::add(g, O::mul(k.wd, p));
    MT* vp = static_cast<MT*>(v_base) + i;
    F v = O::add(load_as<O, M>(vp), O::mul(g, g));
    p = O::sub(p, O::div(O::mul(k.lr, g), O::add(O::sqrt(v), k.eps)));
    if constexpr (kMomBf16) {
      O::store_bf16(vp, v);
    } else {
      O::store(vp, v);
    }
  } else {  // Lion
    MT* mp = static_cast<MT*>(m_base) + i;
    F m = load_as<O, M>(mp);
    F c = O::add(O::mul(k.beta1, m), O::mul(k.omb1, g));
    p = O::sub(p, O::mul(k.lr, O::add(O::sign(c), O::mul(k.wd, p))));
    F m_new = O::add(O::mul(k.beta2, m), O::mul(k.omb2, g));
    if constexpr (kMomBf16) {
      O::store_bf16(mp, m_new);
    } else {
      O::store(mp, m_new);
    }
  }
  O::store(master + i, p);
  return p;
}

// The vector loop over [begin, end - (end - begin) % W), for one lp dtype (kLp < 0: no lp).
template <class O, OptimizerKind K, DType G, bool kMomBf16, int kLp>
size_t step_loop(const VConsts<O>& k, const StepConsts& c, const ShardState& s, size_t begin,
                 size_t end) {
  using GT = typename Storage<G>::type;
  constexpr size_t W = O::W;
  // Locals, so that the compiler need not reload them after each store.
  const GT* const grad = static_cast<const GT*>(s.grad);
  float* const master = s.master;
  void* const m = s.m;
  void* const v = s.v;
  void* const lp = s.lp_out;
  const bool has_wd = c.has_wd, stream = c.lp_stream;
  using MT = typename Storage<kMomBf16 ? DType::kBF16 : DType::kF32>::type;
  size_t i = begin;
  for (; i + W <= end; i += W) {
    if constexpr (O::kPrefetchElems > 0) {
      // Software prefetch a fixed distance ahead on every stream, so that the misses are in
      // flight while the core is busy with the divisions (no-op past the end of the range).
      const size_t a = i + O::kPrefetchElems;
      if (a < end) {
        O::prefetch(grad + a);
        O::prefetchw(master + a);
        if (K != OptimizerKind::kAdagrad) O::prefetchw(static_cast<MT*>(m) + a);
        if (K != OptimizerKind::kLion) O::prefetchw(static_cast<MT*>(v) + a);
      }
    }
    auto p = step_block<O, K, G, kMomBf16>(k, has_wd, grad, master, m, v, i);
    if constexpr (kLp >= 0) store_lp<O, static_cast<DType>(kLp)>(lp, i, stream, p);
  }
  return i;
}

template <class O, OptimizerKind K, DType G, bool kMomBf16>
void step_range(const StepConsts& c, const ShardState& s, size_t begin, size_t end) {
  using GT = typename Storage<G>::type;
  using MT = typename Storage<kMomBf16 ? DType::kBF16 : DType::kF32>::type;
  constexpr size_t W = O::W;
  const VConsts<O> k(c, s.grad_mult);
  size_t i;
  if (s.lp_out == nullptr) {
    i = step_loop<O, K, G, kMomBf16, -1>(k, c, s, begin, end);
  } else if (s.lp_dtype == DType::kBF16) {
    i = step_loop<O, K, G, kMomBf16, static_cast<int>(DType::kBF16)>(k, c, s, begin, end);
  } else if (s.lp_dtype == DType::kF16) {
    i = step_loop<O, K, G, kMomBf16, static_cast<int>(DType::kF16)>(k, c, s, begin, end);
  } else {
    i = step_loop<O, K, G, kMomBf16, static_cast<int>(DType::kF32)>(k, c, s, begin, end);
  }
  if (i == end) return;
  // Tail (< W elements): run one full vector on zero-padded copies, then copy the results out.
  const size_t t = end - i;
  const GT* grad = static_cast<const GT*>(s.grad);
  alignas(64) GT gb[W] = {};
  alignas(64) float pb[W] = {};
  alignas(64) MT mb[W] = {};
  alignas(64) MT vb[W] = {};
  alignas(64) float lb[W] = {};  // room for W fp32 / bf16 / fp16 values
  std::memcpy(gb, grad + i, t * sizeof(GT));
  std::memcpy(pb, s.master + i, t * sizeof(float));
  if (s.m) std::memcpy(mb, static_cast<const MT*>(s.m) + i, t * sizeof(MT));
  if (s.v) std::memcpy(vb, static_cast<const MT*>(s.v) + i, t * sizeof(MT));
  auto p = step_block<O, K, G, kMomBf16>(k, c.has_wd, gb, pb, mb, vb, 0);
  std::memcpy(s.master + i, pb, t * sizeof(float));
  if (s.m) std::memcpy(static_cast<MT*>(s.m) + i, mb, t * sizeof(MT));
  if (s.v) std::memcpy(static_cast<MT*>(s.v) + i, vb, t * sizeof(MT));
  if (s.lp_out) {
    size_t es = 2;
    if (s.lp_dtype == DType::kBF16) {
      store_lp<O, DType::kBF16>(lb, 0, false, p);
    } else if (s.lp_dtype == DType::kF16) {
      store_lp<O, DType::kF16>(lb, 0, false, p);
    } else {
      store_lp<O, DType::kF32>(lb, 0, false, p);
      es = 4;
    }
    std::memcpy(static_cast<char*>(s.lp_out) + i * es, lb, t * es);
  }
}

template <class O, DType G>
void stats_range_t(const void* grad_v, size_t begin, size_t end, double lanes[kStatsLanes]) {
  using GT = typename Storage<G>::type;
  constexpr size_t W = O::W;
  static_assert(kStatsLanes % W == 0, "a lane group is a whole number of vectors");
  constexpr size_t kPer = kStatsLanes / W;
  const GT* grad = static_cast<const GT*>(grad_v);
  typename O::Acc acc;
  O::acc_load(acc, lanes);
  size_t i = begin;
  for (; i + kStatsLanes <= end; i += kStatsLanes) {
    for (size_t j = 0; j < kPer; ++j) O::acc_add(acc, j, load_as<O, G>(grad + i + j * W));
  }
  if (i < end) {
    // Zero-padded last group: 0^2 adds +0, which leaves every lane's bits unchanged.
    alignas(64) GT gb[kStatsLanes] = {};
    std::memcpy(gb, grad + i, (end - i) * sizeof(GT));
    for (size_t j = 0; j < kPer; ++j) O::acc_add(acc, j, load_as<O, G>(gb + j * W));
  }
  O::acc_store(acc, lanes);
}

template <class O>
void stats_range(const void* grad, DType t, size_t begin, size_t end, double lanes[kStatsLanes]) {
  switch (t) {
    case DType::kF32:
      return stats_range_t<O, DType::kF32>(grad, begin, end, lanes);
    case DType::kBF16:
      return stats_range_t<O, DType::kBF16>(grad, begin, end, lanes);
    default:
      return stats_range_t<O, DType::kF16>(grad, begin, end, lanes);
  }
}

// The table for one ISA.
template <class O, OptimizerKind K, DType G>
void fill_kind_grad(IsaKernels& t) {
  t.step[static_cast<int>(K)][static_cast<int>(G)][0] = &step_range<O, K, G, false>;
  t.step[static_cast<int>(K)][static_cast<int>(G)][1] = &step_range<O, K, G, true>;
}
template <class O, OptimizerKind K>
void fill_kind(IsaKernels& t) {
  fill_kind_grad<O, K, DType::kF32>(t);
  fill_kind_grad<O, K, DType::kBF16>(t);
  fill_kind_grad<O, K, DType::kF16>(t);
}
template <class O>
IsaKernels make_table() {
  IsaKernels t{};
  fill_kind<O, OptimizerKind::kAdam>(t);
  fill_kind<O, OptimizerKind::kAdamW>(t);
  fill_kind<O, OptimizerKind::kAdagrad>(t);
  fill_kind<O, OptimizerKind::kLion>(t);
  t.stats = &stats_range<O>;
  t.fence = &O::fence;
  return t;
}

}  // namespace
}  // namespace strata::cpu_optim_internal
