// Run-time choice of the GEMM implementation (see gemm.h).
#include "kernels/cpu/gemm.h"

#include <atomic>
#include <cstdlib>

#include "strata/log.h"
#include "strata/status.h"

namespace strata::cpu {
namespace {

#ifdef STRATA_HAVE_ONEDNN
constexpr bool kHaveOneDnn = true;
#else
constexpr bool kHaveOneDnn = false;
#endif

// The path a ScopedGemmPath forces, or -1.
std::atomic<int> forced_path{-1};

GemmPath decided_path() {
  static const GemmPath p = [] {
    const char* env = std::getenv("STRATA_CPU_ISA");
    std::string note;
    const GemmPath path = gemm_path_for(env ? env : "", detect_cpu_isa(), kHaveOneDnn, &note);
#ifdef STRATA_HAVE_ONEDNN
    if (path == GemmPath::kOneDnn) {
      note += fmt::format(" ({} on {}; bf16 operands {})", onednn::library_version(),
                          onednn::effective_isa(),
                          onednn::typed_matmul_available(DType::kBF16)
                              ? "read as bf16"
                              : "widened to fp32: no bf16 matmul on this CPU");
    }
#endif
    // A value that was refused (a level this CPU lacks, no oneDNN, a typo) is a warning.
    if (env != nullptr && *env != '\0' && note.rfind("forced by", 0) != 0) {
      log_warn("kernels: GEMM on the {} path: {}", gemm_path_name(path), note);
    } else {
      log_info("kernels: GEMM on the {} path: {}", gemm_path_name(path), note);
    }
    return path;
  }();
  return p;
}

}  // namespace

const char* gemm_path_name(GemmPath p) {
  switch (p) {
    case GemmPath::kBaseline:
      return "baseline";
    case GemmPath::kAvx2:
      return "avx2";
    case GemmPath::kOneDnn:
      return "onednn";
  }
  return "?";
}

bool gemm_path_available(GemmPath p) {
  switch (p) {
    case GemmPath::kBaseline:
      return true;
    case GemmPath::kAvx2:
      return cpu_isa_supported(CpuIsa::kAvx2);
    case GemmPath::kOneDnn:
      return kHaveOneDnn;
  }
  return false;
}

GemmPath gemm_path_for(std::string_view env, CpuIsa detected, bool have_onednn, std::string* note) {
  auto say = [&](std::string s) {
    if (note) *note = std::move(s);
  };
  const bool avx2 = static_cast<int>(detected) >= static_cast<int>(CpuIsa::kAvx2);
  const bool avx512 = static_cast<int>(detected) >= static_cast<int>(CpuIsa::kAvx512);
  const GemmPath by_cpu = avx512 && have_onednn ? GemmPath::kOneDnn
                          : avx2                ? GemmPath::kAvx2
                                                : GemmPath::kBaseline;
  const std::string detected_by = fmt::format("detected {} by CPUID", cpu_isa_name(detected));
  if (env.empty()) {
    say(fmt::format("{}{}; set STRATA_CPU_ISA to force one", detected_by,
                    avx512 && !have_onednn ? " (built without oneDNN)" : ""));
    return by_cpu;
  }
  if (env == "onednn") {
    if (have_onednn) {
      say(fmt::format("forced by STRATA_CPU_ISA=onednn; {}", detected_by));
      return GemmPath::kOneDnn;
    }
    say(
        fmt::format("STRATA_CPU_ISA=onednn, but this build has no oneDNN (install libdnnl-dev and "
                    "reconfigure); {}",
                    detected_by));
    return by_cpu;
  }
  CpuIsa level;
  if (!parse_cpu_isa(env, &level)) {
    say(fmt::format("STRATA_CPU_ISA={} is not one of scalar|avx2|avx512|avx512bf16|onednn; {}", env,
                    detected_by));
    return by_cpu;
  }
  if (static_cast<int>(level) > static_cast<int>(detected)) {
    say(fmt::format("STRATA_CPU_ISA={}, but this CPU supports at most {}; {}", env,
                    cpu_isa_name(detected), detected_by));
    return by_cpu;
  }
  switch (level) {
    case CpuIsa::kScalar:
      say(fmt::format("forced by STRATA_CPU_ISA={}; {}", env, detected_by));
      return GemmPath::kBaseline;
    case CpuIsa::kAvx2:
      say(fmt::format("forced by STRATA_CPU_ISA={}; {}", env, detected_by));
      return GemmPath::kAvx2;
    default:
      if (!have_onednn) {
        say(fmt::format("STRATA_CPU_ISA={} runs oneDNN, but this build has none; {}", env,
                        detected_by));
        return GemmPath::kAvx2;
      }
      say(fmt::format("forced by STRATA_CPU_ISA={}; {}", env, detected_by));
      return GemmPath::kOneDnn;
  }
}

GemmPath active_gemm_path() {
  const int f = forced_path.load(std::memory_order_relaxed);
  return f >= 0 ? static_cast<GemmPath>(f) : decided_path();
}

const char* gemm_isa() { return gemm_path_name(active_gemm_path()); }

bool gemm_tiles_follow_threads() { return active_gemm_path() != GemmPath::kOneDnn; }

ScopedGemmPath::ScopedGemmPath(GemmPath p) : previous_(forced_path.load()) {
  STRATA_CHECK(gemm_path_available(p),
               fmt::format("GEMM path {} is not available here", gemm_path_name(p)));
  forced_path.store(static_cast<int>(p));
}

ScopedGemmPath::~ScopedGemmPath() { forced_path.store(previous_); }

void gemm(const GemmArgs& g) {
  switch (active_gemm_path()) {
#ifdef STRATA_HAVE_ONEDNN
    case GemmPath::kOneDnn:
      onednn::gemm(g);
      return;
#endif
    case GemmPath::kAvx2:
      avx2::gemm(g);
      return;
    default:
      baseline::gemm(g);
      return;
  }
}

}  // namespace strata::cpu
