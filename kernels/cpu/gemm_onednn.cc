// The oneDNN GEMM (gemm.h): cpu::gemm() as one dnnl::matmul, for CPUs with AVX-512 (and
// AVX-512-BF16, AMX), where oneDNN's own dispatch picks the kernel for the CPU it runs on.
// Built only where oneDNN was found (STRATA_HAVE_ONEDNN); gemm.cc never selects it otherwise.
//
// Types: when both operands are bf16 (or both fp16) the matmul reads them as they are, with
// fp32 accumulation and an fp32 result (AMX tiles or AVX-512-BF16 dot products on CPUs that
// have them) -- if oneDNN implements that type pair on this CPU. Where it does not (oneDNN 2.6
// has no bf16 or fp16 matmul on AVX2 CPUs), and for mixed pairs, the typed operand is widened
// into a per-thread fp32 copy and the fp32 matmul runs. Products of two bf16 values are exact
// in fp32, so both routes compute the same products; the kernel's summation order is oneDNN's.
// accumulate is a sum post-op (C = C + A @ B).
//
// Threads: parallelism is strata's (matmul.cc's TBB tiles); each call runs oneDNN on the
// calling thread only. With oneDNN's OpenMP runtime (Debian's build) the calling thread's
// OpenMP thread count is set to 1 before its first call, so no OpenMP team ever runs beside
// the TBB workers (no oversubscription) and a call's bits cannot depend on a team size.
//
// Primitives are created once per shape and cached per thread (a primitive descriptor takes
// tens of microseconds to create; attention calls the GEMM thousands of times per step).
// oneDNN allocates its scratchpad and packing buffers inside each call: the strata binary has
// malloc keep what it frees (tools/strata_main.cc), or each call would fault their pages in.
#include <cstring>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"
#include "strata/log.h"
#include "strata/status.h"

#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
#include <omp.h>
#elif DNNL_CPU_THREADING_RUNTIME != DNNL_RUNTIME_SEQ
#error "strata's oneDNN GEMM needs oneDNN's OpenMP or sequential CPU runtime (see gemm_onednn.cc)"
#endif

namespace strata::cpu::onednn {
namespace {

using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

// Never destroyed: TBB workers' thread-local streams (below) may outlive static destruction.
dnnl::engine& engine() {
  static dnnl::engine* e = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *e;
}

dt dnnl_type(DType t) {
  switch (t) {
    case DType::kBF16:
      return dt::bf16;
    case DType::kF16:
      return dt::f16;
    default:
      return dt::f32;
  }
}

// Everything a primitive depends on: the shape, the strides, the operand type, accumulation.
struct Key {
  int m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b, accumulate;
  DType type;  // of both operands (fp32 after widening)
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 0;
    for (long v : {long(k.m), long(k.n), long(k.k), long(k.lda), long(k.ldb), long(k.ldc),
                   long(k.trans_a), long(k.trans_b), long(k.accumulate), long(k.type)}) {
      h = h * 1000003u ^ size_t(v);
    }
    return h;
  }
};

struct Prim {
  dnnl::matmul matmul;
  dnnl::memory a, b, c;  // descriptors bound to the engine; handles set per call
};

// Creates the matmul for `key`; nullopt-like empty pointer when oneDNN has no implementation
// for that type on this CPU.
std::unique_ptr<Prim> create(const Key& key) {
  const dt t = dnnl_type(key.type);
  // Strides express the layouts: op(A)[i, p] at a[i * lda + p], or a[p * lda + i] if trans_a.
  dnnl::memory::desc ad({key.m, key.k}, t, key.trans_a ? dims{1, key.lda} : dims{key.lda, 1});
  dnnl::memory::desc bd({key.k, key.n}, t, key.trans_b ? dims{1, key.ldb} : dims{key.ldb, 1});
  dnnl::memory::desc cd({key.m, key.n}, dt::f32, dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  if (key.accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), attr, engine());
    auto p = std::make_unique<Prim>();
    p->matmul = dnnl::matmul(pd);
    p->a = dnnl::memory(ad, engine(), DNNL_MEMORY_NONE);
    p->b = dnnl::memory(bd, engine(), DNNL_MEMORY_NONE);
    p->c = dnnl::memory(cd, engine(), DNNL_MEMORY_NONE);
    return p;
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_unimplemented) return nullptr;
    STRATA_CHECK(false, fmt::format("oneDNN matmul {}x{}x{} ({}): {}", key.m, key.n, key.k,
                                    dtype_name(key.type), e.what()));
    return nullptr;
  }
}

// One thread's primitives, stream and widening buffers.
class ThreadState {
 public:
  ThreadState() : stream_(engine()) {
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
    omp_set_num_threads(1);  // this thread's OpenMP ICV only: oneDNN runs on the caller alone
#endif
  }

  // The primitive for key, or nullptr when oneDNN does not implement it here.
  Prim* get(const Key& key) {
    auto it = prims_.find(key);
    if (it != prims_.end()) return it->second.get();
    if (prims_.size() >= kMaxCached) prims_.clear();  // bounded: shapes of one model are few
    return prims_.emplace(key, create(key)).first->second.get();
  }

  dnnl::stream& stream() { return stream_; }

  // An fp32 copy of the rows x cols matrix at p (row stride ld), or p itself when fp32.
  const float* widened(int which, const void* p, DType t, int rows, int cols, int ld) {
    if (t == DType::kF32) return static_cast<const float*>(p);
    std::vector<float>& w = widen_[which];
    w.resize(size_t(rows) * ld);
    dispatch_dtype(t, [&](auto tag) {
      using Tp = decltype(tag);
      const Tp* s = static_cast<const Tp*>(p);
      for (int r = 0; r < rows; ++r) load_span(s + size_t(r) * ld, w.data() + size_t(r) * ld, cols);
    });
    return w.data();
  }

 private:
  static constexpr size_t kMaxCached = 512;
  std::unordered_map<Key, std::unique_ptr<Prim>, KeyHash> prims_;
  dnnl::stream stream_;
  std::vector<float> widen_[2];
};

ThreadState& state() {
  thread_local ThreadState ts;
  return ts;
}

void run(ThreadState& ts, Prim& p, const void* a, const void* b, float* c) {
  p.a.set_data_handle(const_cast<void*>(a));
  p.b.set_data_handle(const_cast<void*>(b));
  p.c.set_data_handle(c);
  p.matmul.execute(ts.stream(),
                   {{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, p.c}});
  ts.stream().wait();
}

}  // namespace

void gemm(const GemmArgs& g) {
  if (g.m <= 0 || g.n <= 0) return;
  if (g.k <= 0) {
    if (!g.accumulate) {
      for (int i = 0; i < g.m; ++i) std::memset(g.c + size_t(i) * g.ldc, 0, size_t(g.n) * 4);
    }
    return;
  }
  ThreadState& ts = state();
  Key key{g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.trans_a, g.trans_b, g.accumulate, g.a_type};
  if (g.a_type == g.b_type && g.a_type != DType::kF32) {
    if (Prim* p = ts.get(key)) {
      run(ts, *p, g.a, g.b, g.c);
      return;
    }
  }
  // fp32 operands, widened where typed (the strides stay the caller's).
  const float* a = g.trans_a ? ts.widened(0, g.a, g.a_type, g.k, g.m, g.lda)
                             : ts.widened(0, g.a, g.a_type, g.m, g.k, g.lda);
  const float* b = g.trans_b ? ts.widened(1, g.b, g.b_type, g.n, g.k, g.ldb)
                             : ts.widened(1, g.b, g.b_type, g.k, g.n, g.ldb);
  key.type = DType::kF32;
  Prim* p = ts.get(key);
  STRATA_CHECK(p != nullptr, "oneDNN has no fp32 matmul for this CPU");
  run(ts, *p, a, b, g.c);
}

bool typed_matmul_available(DType t) {
  return state().get(Key{16, 16, 16, 16, 16, 16, false, true, false, t}) != nullptr;
}

const char* library_version() {
  static const std::string v = [] {
    const dnnl_version_t* ver = dnnl_version();
    return fmt::format("oneDNN {}.{}.{}", ver->major, ver->minor, ver->patch);
  }();
  return v.c_str();
}

const char* effective_isa() {
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_sse41:
      return "sse41";
    default:
      return "another";
  }
}

}  // namespace strata::cpu::onednn
