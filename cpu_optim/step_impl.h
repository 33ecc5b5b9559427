// Internal: the fused optimizer pass and the gradient sum of squares, written once over a
// vector-ops policy `O` and included by each ISA translation unit (scalar.cc, avx2.cc,
// avx512.cc), which defines O with its intrinsics before including this file.
//
// O provides: W (lanes), kUnroll (vectors per loop iteration), F (vector of W floats),
// set1/add/sub/mul/div/sqrt (IEEE, one rounding each, never fused), load/store of fp32, bf16 and
// fp16 (stores round to nearest even and keep NaN a quiet NaN exactly like strata/dtype.h),
// non-temporal bf16/fp16/fp32 stores for aligned destinations, sign(), and the fp64 square
// accumulator (Acc, acc_load/acc_add/acc_store). bf16 stores go through H (W packed bf16):
// to_bf16 (exact) and store_h/stream_h; an ISA whose fast conversion is wrong on some inputs
// sets kBf16Fast and provides Chk, chk_init, to_bf16_fast (records such lanes in Chk) and
// chk_any, so that the loop can convert a whole group fast and redo it exactly only when needed.
//
// The arithmetic is the reference's (cpu_optim/reference.cc) operation for operation, so each
// path produces the reference's bits. Everything here has internal linkage (see the ODR note in
// isa_kernels.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu_optim/isa_kernels.h"

// Forced inlining for the per-vector helpers: GCC otherwise outlines some instantiations of the
// larger group helpers (measured: the bf16 stores then pass the vectors through memory and the
// loop runs 1.5x slower).
#define STRATA_OPTIM_INLINE inline __attribute__((always_inline))

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
STRATA_OPTIM_INLINE typename O::F load_as(const typename Storage<T>::type* p) {
  if constexpr (T == DType::kF32) {
    return O::load(p);
  } else if constexpr (T == DType::kBF16) {
    return O::load_bf16(p);
  } else {
    return O::load_f16(p);
  }
}

// Stores the new parameters as lp dtype T (kF32 or kF16; bf16 goes through store_block's
// batched conversion) at element i.
template <class O, DType T>
STRATA_OPTIM_INLINE void store_lp(void* lp, size_t i, bool stream, typename O::F x) {
  if constexpr (T == DType::kF32) {
    if (stream) {
      O::stream(static_cast<float*>(lp) + i, x);
    } else {
      O::store(static_cast<float*>(lp) + i, x);
    }
  } else if constexpr (T == DType::kBF16) {
    if (stream) {
      O::stream_h(static_cast<uint16_t*>(lp) + i, O::to_bf16(x));
    } else {
      O::store_h(static_cast<uint16_t*>(lp) + i, O::to_bf16(x));
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

// The new values of one vector of W elements: master p and the moments this kind keeps (m for
// Adam/AdamW/Lion, v for Adam/AdamW/Adagrad; the other is left unset), still in fp32.
template <class O>
struct BlockOut {
  typename O::F p, m, v;
};

// Computes one vector at index i from the given arrays; loads only, stores nothing.
template <class O, OptimizerKind K, DType G, bool kMomBf16>
STRATA_OPTIM_INLINE BlockOut<O> step_block(const VConsts<O>& k, bool has_wd,
                                           const typename Storage<G>::type* grad,
                                           const float* master, const void* m_base,
                                           const void* v_base, size_t i) {
  using F = typename O::F;
  constexpr DType M = kMomBf16 ? DType::kBF16 : DType::kF32;
  using MT = typename Storage<M>::type;
  BlockOut<O> o{};
  F g = O::mul(load_as<O, G>(grad + i), k.grad_mult);
  F p = O::load(master + i);
  if constexpr (K == OptimizerKind::kAdam || K == OptimizerKind::kAdamW) {
    if (K == OptimizerKind::kAdam && has_wd) g = O::add(g, O::mul(k.wd, p));
    F m = load_as<O, M>(static_cast<const MT*>(m_base) + i);
    F v = load_as<O, M>(static_cast<const MT*>(v_base) + i);
    m = O::add(O::mul(k.beta1, m), O::mul(k.omb1, g));
    v = O::add(O::mul(k.beta2, v), O::mul(O::mul(k.omb2, g), g));
    F denom = O::add(O::mul(O::sqrt(v), k.inv_bc2_sqrt), k.eps);
    if (K == OptimizerKind::kAdamW && has_wd) p = O::sub(p, O::mul(k.lr_wd, p));
    o.p = O::sub(p, O::mul(k.step_size, O::div(m, denom)));
    o.m = m;
    o.v = v;
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    if (has_wd) g = O::add(g, O::mul(k.wd, p));
    F v = O::add(load_as<O, M>(static_cast<const MT*>(v_base) + i), O::mul(g, g));
    o.p = O::sub(p, O::div(O::mul(k.lr, g), O::add(O::sqrt(v), k.eps)));
    o.v = v;
  } else {  // Lion
    F m = load_as<O, M>(static_cast<const MT*>(m_base) + i);
    F c = O::add(O::mul(k.beta1, m), O::mul(k.omb1, g));
    o.p = O::sub(p, O::mul(k.lr, O::add(O::sign(c), O::mul(k.wd, p))));
    o.m = O::add(O::mul(k.beta2, m), O::mul(k.omb2, g));
  }
  return o;
}

// Converts the bf16 outputs of U vectors (moments if kMomBf16, lp if kLpBf16) into hm/hv/hl.
// Where the ISA has a fast conversion that is wrong on rare inputs (vcvtneps2bf16 flushes fp32
// subnormals), all U*3 conversions use it and one check for the whole group decides whether to
// redo them exactly: one branch per group, not one per vector (a mask test and branch per
// vector cost more than the conversions themselves).
template <class O, OptimizerKind K, bool kMomBf16, bool kLpBf16, int U>
STRATA_OPTIM_INLINE void to_bf16_group(const BlockOut<O> (&o)[U], typename O::H (&hm)[U],
                                       typename O::H (&hv)[U], typename O::H (&hl)[U]) {
  constexpr bool kM = kMomBf16 && K != OptimizerKind::kAdagrad;
  constexpr bool kV = kMomBf16 && K != OptimizerKind::kLion;
  if constexpr (O::kBf16Fast) {
    typename O::Chk chk = O::chk_init();
    for (int u = 0; u < U; ++u) {
      if constexpr (kM) hm[u] = O::to_bf16_fast(o[u].m, chk);
      if constexpr (kV) hv[u] = O::to_bf16_fast(o[u].v, chk);
      if constexpr (kLpBf16) hl[u] = O::to_bf16_fast(o[u].p, chk);
    }
    if (!O::chk_any(chk)) [[likely]]
      return;
  }
  for (int u = 0; u < U; ++u) {
    if constexpr (kM) hm[u] = O::to_bf16(o[u].m);
    if constexpr (kV) hv[u] = O::to_bf16(o[u].v);
    if constexpr (kLpBf16) hl[u] = O::to_bf16(o[u].p);
  }
}

// Stores U vectors of results starting at element i: master, the moments in their dtype, and
// the lp output (kLp < 0: none).
template <class O, OptimizerKind K, bool kMomBf16, int kLp, int U>
STRATA_OPTIM_INLINE void store_group(const BlockOut<O> (&o)[U], float* master, void* m_base,
                                     void* v_base, void* lp, bool stream, size_t i) {
  constexpr size_t W = O::W;
  constexpr bool kUsesM = K != OptimizerKind::kAdagrad, kUsesV = K != OptimizerKind::kLion;
  constexpr bool kLpBf16 = kLp == static_cast<int>(DType::kBF16);
  for (int u = 0; u < U; ++u) O::store(master + i + u * W, o[u].p);
  if constexpr ((kMomBf16 || kLpBf16) && O::kBf16Pairs && U == 2) {
    // Pairs of vectors: one conversion instruction and one full-width store per pair.
    typename O::H2 hm, hv, hl;
    constexpr bool kM = kMomBf16 && kUsesM, kV = kMomBf16 && kUsesV;
    typename O::Chk chk = O::chk_init();
    if constexpr (kM) hm = O::to_bf16_pair_fast(o[0].m, o[1].m, chk);
    if constexpr (kV) hv = O::to_bf16_pair_fast(o[0].v, o[1].v, chk);
    if constexpr (kLpBf16) hl = O::to_bf16_pair_fast(o[0].p, o[1].p, chk);
    if (O::chk_any(chk)) [[unlikely]] {
      if constexpr (kM) hm = O::to_bf16_pair(o[0].m, o[1].m);
      if constexpr (kV) hv = O::to_bf16_pair(o[0].v, o[1].v);
      if constexpr (kLpBf16) hl = O::to_bf16_pair(o[0].p, o[1].p);
    }
    if constexpr (kM) O::store_h2(static_cast<uint16_t*>(m_base) + i, hm);
    if constexpr (kV) O::store_h2(static_cast<uint16_t*>(v_base) + i, hv);
    if constexpr (kLpBf16) {
      if (stream) {
        O::stream_h2(static_cast<uint16_t*>(lp) + i, hl);
      } else {
        O::store_h2(static_cast<uint16_t*>(lp) + i, hl);
      }
    }
  } else if constexpr (kMomBf16 || kLpBf16) {
    typename O::H hm[U], hv[U], hl[U];
    to_bf16_group<O, K, kMomBf16, kLpBf16, U>(o, hm, hv, hl);
    for (int u = 0; u < U; ++u) {
      const size_t j = i + u * W;
      if constexpr (kMomBf16 && kUsesM) O::store_h(static_cast<uint16_t*>(m_base) + j, hm[u]);
      if constexpr (kMomBf16 && kUsesV) O::store_h(static_cast<uint16_t*>(v_base) + j, hv[u]);
      if constexpr (kLpBf16) {
        if (stream) {
          O::stream_h(static_cast<uint16_t*>(lp) + j, hl[u]);
        } else {
          O::store_h(static_cast<uint16_t*>(lp) + j, hl[u]);
        }
      }
    }
  }
  for (int u = 0; u < U; ++u) {
    const size_t j = i + u * W;
    if constexpr (!kMomBf16 && kUsesM) O::store(static_cast<float*>(m_base) + j, o[u].m);
    if constexpr (!kMomBf16 && kUsesV) O::store(static_cast<float*>(v_base) + j, o[u].v);
    if constexpr (kLp >= 0 && !kLpBf16) {
      store_lp<O, static_cast<DType>(kLp)>(lp, j, stream, o[u].p);
    }
  }
}

// Software prefetch of the bytes of `elems` elements of T starting at element a: one per line.
template <class O, class T>
STRATA_OPTIM_INLINE void prefetch_span(const T* base, size_t a, size_t elems) {
  constexpr size_t kLine = 64;
  const char* p = reinterpret_cast<const char*>(base + a);
  for (size_t b = 0; b < elems * sizeof(T); b += kLine) O::prefetch(p + b);
}

// The vector loop over [begin, end - (end - begin) % W), for one lp dtype (kLp < 0: no lp):
// groups of U = O::kUnroll vectors (independent work for the out-of-order core to overlap with
// the divisions, and one bf16 check per group), then single vectors.
template <class O, OptimizerKind K, DType G, bool kMomBf16, int kLp>
size_t step_loop(const VConsts<O>& k, const StepConsts& c, const ShardState& s, size_t begin,
                 size_t end) {
  using GT = typename Storage<G>::type;
  constexpr size_t W = O::W;
  constexpr int U = O::kUnroll;
  // Locals, so that the compiler need not reload them after each store.
  const GT* const grad = static_cast<const GT*>(s.grad);
  float* const master = s.master;
  void* const m = s.m;
  void* const v = s.v;
  // The pre-step state: in place, or out of place from *_src (ShardState).
  const float* const master_src = s.master_src ? s.master_src : master;
  const void* const m_src = s.m_src ? s.m_src : m;
  const void* const v_src = s.v_src ? s.v_src : v;
  void* const lp = s.lp_out;
  const bool has_wd = c.has_wd, stream = c.lp_stream;
  using MT = typename Storage<kMomBf16 ? DType::kBF16 : DType::kF32>::type;
  size_t i = begin;
  for (; i + U * W <= end; i += U * W) {
    if constexpr (O::kPrefetchElems > 0) {
      // Software prefetch a fixed distance ahead on every stream, so that the misses are in
      // flight while the core is busy with the divisions (none past the end of the range).
      const size_t a = i + O::kPrefetchElems;
      if (a + U * W <= end) {
        prefetch_span<O>(grad, a, U * W);
        prefetch_span<O>(master_src, a, U * W);
        if (K != OptimizerKind::kAdagrad) {
          prefetch_span<O>(static_cast<const MT*>(m_src), a, U * W);
        }
        if (K != OptimizerKind::kLion) prefetch_span<O>(static_cast<const MT*>(v_src), a, U * W);
      }
    }
    BlockOut<O> o[U];
    for (int u = 0; u < U; ++u) {
      o[u] = step_block<O, K, G, kMomBf16>(k, has_wd, grad, master_src, m_src, v_src, i + u * W);
    }
    store_group<O, K, kMomBf16, kLp, U>(o, master, m, v, lp, stream, i);
  }
  for (; i + W <= end; i += W) {
    BlockOut<O> o[1] = {
        step_block<O, K, G, kMomBf16>(k, has_wd, grad, master_src, m_src, v_src, i)};
    store_group<O, K, kMomBf16, kLp, 1>(o, master, m, v, lp, stream, i);
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
  const float* master_src = s.master_src ? s.master_src : s.master;
  const void* m_src = s.m_src ? s.m_src : s.m;
  const void* v_src = s.v_src ? s.v_src : s.v;
  std::memcpy(pb, master_src + i, t * sizeof(float));
  if (s.m) std::memcpy(mb, static_cast<const MT*>(m_src) + i, t * sizeof(MT));
  if (s.v) std::memcpy(vb, static_cast<const MT*>(v_src) + i, t * sizeof(MT));
  const BlockOut<O> o[1] = {step_block<O, K, G, kMomBf16>(k, c.has_wd, gb, pb, mb, vb, 0)};
  size_t es = 2;
  if (s.lp_out == nullptr) {
    store_group<O, K, kMomBf16, -1, 1>(o, pb, mb, vb, nullptr, false, 0);
  } else if (s.lp_dtype == DType::kBF16) {
    store_group<O, K, kMomBf16, static_cast<int>(DType::kBF16), 1>(o, pb, mb, vb, lb, false, 0);
  } else if (s.lp_dtype == DType::kF16) {
    store_group<O, K, kMomBf16, static_cast<int>(DType::kF16), 1>(o, pb, mb, vb, lb, false, 0);
  } else {
    store_group<O, K, kMomBf16, static_cast<int>(DType::kF32), 1>(o, pb, mb, vb, lb, false, 0);
    es = 4;
  }
  std::memcpy(s.master + i, pb, t * sizeof(float));
  if (s.m) std::memcpy(static_cast<MT*>(s.m) + i, mb, t * sizeof(MT));
  if (s.v) std::memcpy(static_cast<MT*>(s.v) + i, vb, t * sizeof(MT));
  if (s.lp_out) std::memcpy(static_cast<char*>(s.lp_out) + i * es, lb, t * es);
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
