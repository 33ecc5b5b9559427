// Dispatcher for the fast CPU optimizer: ISA detection, per-call constants, tiling over TBB.
// Compiled with no ISA flags; it only calls into an ISA's table after CPUID allows it.
#include "strata/cpu_optim.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu_optim/isa_kernels.h"
#include "strata/log.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define STRATA_CPU_OPTIM_X86 1
#endif

namespace strata {
namespace {

using cpu_optim_internal::IsaKernels;
using cpu_optim_internal::kStatsLanes;
using cpu_optim_internal::StepConsts;

#ifdef STRATA_CPU_OPTIM_X86
uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuIsa detect_uncached() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return CpuIsa::kScalar;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29);
  if (!osxsave || !avx || !fma || !f16c) return CpuIsa::kScalar;
  const uint64_t xcr0 = read_xcr0();
  if ((xcr0 & 0x6) != 0x6) return CpuIsa::kScalar;  // OS does not save XMM/YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return CpuIsa::kScalar;
  if (!(b & (1u << 5))) return CpuIsa::kScalar;  // AVX2
  const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  if (!(f && dq && bw && vl) || (xcr0 & 0xe0) != 0xe0) return CpuIsa::kAvx2;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5))) return CpuIsa::kAvx512Bf16;
  return CpuIsa::kAvx512;
}
#else
CpuIsa detect_uncached() { return CpuIsa::kScalar; }
#endif

const IsaKernels& kernels_for(CpuIsa isa) {
  STRATA_CHECK(cpu_isa_supported(isa),
               fmt::format("cpu_optim: ISA path {} requested, but this CPU supports at most {}",
                           cpu_isa_name(isa), cpu_isa_name(detect_cpu_isa())));
  switch (isa) {
#ifdef STRATA_CPU_OPTIM_X86
    case CpuIsa::kAvx512Bf16:
      return cpu_optim_internal::avx512bf16_kernels();
    case CpuIsa::kAvx512:
      return cpu_optim_internal::avx512_kernels();
    case CpuIsa::kAvx2:
      return cpu_optim_internal::avx2_kernels();
#endif
    default:
      return cpu_optim_internal::scalar_kernels();
  }
}

// Runs f(tile_begin, tile_end) over [0, ntiles) on `threads` threads (see cpu_optim.h).
template <class Fn>
void for_tiles(size_t ntiles, int threads, const Fn& f) {
  if (ntiles == 0) return;
  if (threads == 1 || ntiles == 1) {
    f(size_t{0}, ntiles);
    return;
  }
  auto run = [&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, ntiles, 1),
                      [&](const tbb::blocked_range<size_t>& r) { f(r.begin(), r.end()); });
  };
  if (threads <= 0) {
    run();
  } else {
    tbb::task_arena arena(threads);
    arena.execute(run);
  }
}

// Exactly the reference's per-call constants (cpu_optim/reference.cc).
StepConsts make_consts(const OptimizerHyper& h) {
  StepConsts c;
  float bc1 = 1.0f, bc2 = 1.0f;
  if (h.bias_correction) {
    bc1 = static_cast<float>(1.0 -
                             std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step)));
    bc2 = static_cast<float>(1.0 -
                             std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step)));
  }
  c.lr = h.lr;
  c.beta1 = h.beta1;
  c.beta2 = h.beta2;
  c.eps = h.eps;
  c.weight_decay = h.weight_decay;
  c.one_minus_beta1 = 1.0f - h.beta1;
  c.one_minus_beta2 = 1.0f - h.beta2;
  c.lr_wd = h.lr * h.weight_decay;
  c.step_size = h.lr / bc1;
  c.inv_bc2_sqrt = 1.0f / std::sqrt(bc2);
  c.has_wd = h.weight_decay != 0.0f;
  return c;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "?";
}

bool parse_cpu_isa(std::string_view name, CpuIsa* out) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (name == cpu_isa_name(isa)) {
      *out = isa;
      return true;
    }
  }
  return false;
}

CpuIsa detect_cpu_isa() {
  static const CpuIsa isa = detect_uncached();
  return isa;
}

bool cpu_isa_supported(CpuIsa isa) {
  return static_cast<int>(isa) <= static_cast<int>(detect_cpu_isa());
}

CpuIsa active_cpu_isa() {
  static const CpuIsa isa = [] {
    const CpuIsa detected = detect_cpu_isa();
    const char* env = std::getenv("STRATA_CPU_ISA");
    if (env == nullptr || *env == '\0') {
      log_info("cpu_optim: using the {} path (detected by CPUID; set STRATA_CPU_ISA to force one)",
               cpu_isa_name(detected));
      return detected;
    }
    if (std::string_view(env) == "onednn") {  // a GEMM path (kernels/cpu/gemm.h), not ours
      log_info(
          "cpu_optim: using the {} path (detected by CPUID; STRATA_CPU_ISA=onednn names "
          "the kernels' GEMM path)",
          cpu_isa_name(detected));
      return detected;
    }
    CpuIsa forced;
    if (!parse_cpu_isa(env, &forced)) {
      log_warn(
          "cpu_optim: STRATA_CPU_ISA={} is not one of scalar|avx2|avx512|avx512bf16|onednn; "
          "using the detected {} path",
          env, cpu_isa_name(detected));
      return detected;
    }
    if (!cpu_isa_supported(forced)) {
      log_warn("cpu_optim: STRATA_CPU_ISA={} but this CPU supports at most {}; using {}", env,
               cpu_isa_name(detected), cpu_isa_name(detected));
      return detected;
    }
    log_info("cpu_optim: using the {} path (forced by STRATA_CPU_ISA; detected {})",
             cpu_isa_name(forced), cpu_isa_name(detected));
    return forced;
  }();
  return isa;
}

Status validate_shard(const OptimizerHyper& h, const ShardState& s) {
  const char* kind = optimizer_kind_name(h.kind);
  if (!std::isfinite(h.lr) || !std::isfinite(h.beta1) || !std::isfinite(h.beta2) ||
      !std::isfinite(h.eps) || !std::isfinite(h.weight_decay)) {
    return invalid_argument(fmt::format(
        "{} hyperparameters must be finite (lr={}, beta1={}, beta2={}, eps={}, weight_decay={})",
        kind, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay));
  }
  if (h.bias_correction && h.step < 1 &&
      (h.kind == OptimizerKind::kAdam || h.kind == OptimizerKind::kAdamW)) {
    return invalid_argument(
        fmt::format("{} step is {}; the step count is 1-based (pass step >= 1)", kind, h.step));
  }
  if (s.moment_dtype != DType::kF32 && s.moment_dtype != DType::kBF16) {
    return invalid_argument(fmt::format("moment_dtype {} is not supported; use fp32 or bf16",
                                        dtype_name(s.moment_dtype)));
  }
  if (s.n == 0) return Status::ok();
  if (s.grad == nullptr || s.master == nullptr) {
    return invalid_argument(
        fmt::format("shard of {} elements needs grad and master buffers (grad={}, master={})", s.n,
                    s.grad ? "set" : "null", s.master ? "set" : "null"));
  }
  const bool needs_m = h.kind != OptimizerKind::kAdagrad;
  const bool needs_v = h.kind != OptimizerKind::kLion;
  if ((needs_m && s.m == nullptr) || (needs_v && s.v == nullptr)) {
    return invalid_argument(fmt::format(
        "{} shard of {} elements needs {} (m={}, v={}): allocate {} bytes per moment", kind, s.n,
        needs_m && needs_v ? "both moments m and v" : (needs_m ? "moment m" : "moment v"),
        s.m ? "set" : "null", s.v ? "set" : "null", s.n * dtype_size(s.moment_dtype)));
  }
  return Status::ok();
}

void optimizer_step_isa(CpuIsa isa, const OptimizerHyper& h, const ShardState& s, int threads) {
  if (s.n == 0) return;
  const Status st = validate_shard(h, s);
  STRATA_CHECK(st.is_ok(), st.message());
  const IsaKernels& k = kernels_for(isa);
  StepConsts c = make_consts(h);
  // Non-temporal stores for a large, 64-byte aligned lp_out: the new parameters are read next
  // by a transfer, not by this core, so they need not displace the states from cache (and the
  // stores skip the read-for-ownership).
  const size_t lp_bytes = s.lp_out ? s.n * dtype_size(s.lp_dtype) : 0;
  c.lp_stream = isa != CpuIsa::kScalar && lp_bytes >= (size_t{1} << 20) &&
                reinterpret_cast<uintptr_t>(s.lp_out) % 64 == 0;
  const auto fn = k.step[static_cast<int>(h.kind)][static_cast<int>(s.grad_dtype)]
                        [s.moment_dtype == DType::kBF16 ? 1 : 0];
  const size_t ntiles = (s.n + kOptimizerTileElems - 1) / kOptimizerTileElems;
  for_tiles(ntiles, threads, [&](size_t t0, size_t t1) {
    fn(c, s, t0 * kOptimizerTileElems, std::min(s.n, t1 * kOptimizerTileElems));
    if (c.lp_stream) k.fence();
  });
}

void optimizer_step(const OptimizerHyper& h, const ShardState& s, int threads) {
  optimizer_step_isa(active_cpu_isa(), h, s, threads);
}

GradStats grad_stats_isa(CpuIsa isa, const void* grad, DType dtype, size_t n, int threads) {
  GradStats out;
  if (n == 0) return out;
  STRATA_CHECK(grad != nullptr, fmt::format("grad_stats: null gradient of {} elements", n));
  const IsaKernels& k = kernels_for(isa);
  const size_t ntiles = (n + kStatsTileElems - 1) / kStatsTileElems;
  std::vector<double> partial(ntiles);
  for_tiles(ntiles, threads, [&](size_t t0, size_t t1) {
    for (size_t t = t0; t < t1; ++t) {
      double lanes[kStatsLanes] = {};
      k.stats(grad, dtype, t * kStatsTileElems, std::min(n, (t + 1) * kStatsTileElems), lanes);
      for (int w = kStatsLanes / 2; w >= 1; w /= 2) {
        for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
      }
      partial[t] = lanes[0];
    }
  });
  for (double p : partial) out.norm_sq += p;
  // Squares are >= 0 and cannot overflow fp64, so the sum is finite iff every element is.
  out.nonfinite = !std::isfinite(out.norm_sq);
  return out;
}

void add_into(float* __restrict acc, const float* __restrict x, size_t n, int threads) {
  if (n == 0) return;
  const size_t ntiles = (n + kOptimizerTileElems - 1) / kOptimizerTileElems;
  for_tiles(ntiles, threads, [&](size_t t0, size_t t1) {
    const size_t end = std::min(n, t1 * kOptimizerTileElems);
    for (size_t i = t0 * kOptimizerTileElems; i < end; ++i) acc[i] += x[i];
  });
}

GradStats grad_stats(const void* grad, DType dtype, size_t n, int threads) {
  return grad_stats_isa(active_cpu_isa(), grad, dtype, n, threads);
}

}  // namespace strata
