// The fused attention through cuDNN's fused attention (the cuDNN 9 graph API's SDPA nodes,
// through the header-only cudnn-frontend): causal, grouped-query heads, forward with the
// softmax statistics and backward, one graph pair built per shape and cached. The backward asks
// for cuDNN's deterministic algorithm (the own kernels are deterministic too: same inputs, same
// bits) unless device.deterministic is false; a cuDNN that cannot do it for a shape leaves that
// shape to the own kernels.
//
// Memory: each graph's workspace (per stream, cudaMalloc'd outside the device arena on first
// use, grown on demand) and the caller's gradient scratch come out of what the arena leaves free
// (device.reserve). On Hopper cuDNN's deterministic backward keeps the B·NH·T² bf16 scores in
// its workspace (1 GiB at B 4, T 2048, 32 heads); a shape whose workspace does not fit the free
// memory when its graphs are built is declined (supports() says why: raise device.reserve, or
// let the backward be non-deterministic), and an allocation that fails later returns
// kOutOfMemory with nothing enqueued (the caller runs the own kernels). An execute that cuDNN
// refuses with no CUDA error behind it returns kUnavailable: that call, and the shape from then
// on, run on the own kernels too.
//
// Loading: the frontend is compiled with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, so nothing
// links against libcudnn: the first supports() with a full shape dlopens libcudnn.so.9 from,
// in order, $STRATA_CUDNN_LIB (a file), the directory CMake found it in (STRATA_CUDNN_LIBDIR),
// and the loader's search path (LD_LIBRARY_PATH). A binary built with cuDNN thus runs, on the
// own kernels, where cuDNN is missing; supports() then says why.
//
// Layout, in place (no transposes): qkv [B,T,W], W = (NH+2*KVH)*hs, is read as three strided
// tensors, Q [B,NH,T,hs] at qkv with strides [T*W, hs, W, 1], K [B,KVH,T,hs] at qkv + NH*hs and
// V at qkv + (NH+KVH)*hs with the same strides; out [B,T,NH*hs] is O [B,NH,T,hs] with strides
// [T*NH*hs, hs, NH*hs, 1]; lse [B,NH,T] is cuDNN's Stats [B,NH,T,1] (fp32, natural-log
// log-sum-exp of the scaled scores: the own kernels' lse). The backward writes dQ, dK, dV into
// a buffer laid out as qkv (dqkv itself when written, a scratch the caller adds when
// accumulated).
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "kernels/cuda/attention_library.h"
#include "kernels/cuda/cuda_check.h"
#include "strata/log.h"

// The frontend's dynamic loading resolves every cuDNN call through this handle.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace strata {
namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// The process's one libcudnn (the frontend's handle is global): loaded once, the outcome kept.
struct CudnnLoad {
  bool ok = false;
  std::string message;  // the version when ok, else why not
};

const CudnnLoad& load_cudnn() {
  static const CudnnLoad load = [] {
    CudnnLoad l;
    std::string tried;
    auto try_open = [&](const std::string& path) {
      if (fe::cudnn_dlhandle != nullptr) return;
      fe::cudnn_dlhandle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (fe::cudnn_dlhandle == nullptr) {
        const char* e = dlerror();
        tried += (tried.empty() ? "" : "; ") + path + ": " + (e ? e : "not found");
      }
    };
    // The frontend dlopens a CUDA runtime of its own for the few runtime calls it makes, the
    // first of libcudart.so.12 / .13 it finds: make it the one strata is built with (a PyTorch
    // environment may put another on the path). The frontend reads this once, at that dlopen.
    const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
    setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), /*overwrite=*/0);
    if (const char* p = std::getenv("STRATA_CUDNN_LIB"); p != nullptr && *p != '\0') try_open(p);
#ifdef STRATA_CUDNN_LIBDIR
    try_open(std::string(STRATA_CUDNN_LIBDIR) + "/libcudnn.so.9");
#endif
    try_open("libcudnn.so.9");
    if (fe::cudnn_dlhandle == nullptr) {
      l.message = "libcudnn.so.9 not loadable (" + tried +
                  "); set STRATA_CUDNN_LIB to its path or add its directory to LD_LIBRARY_PATH";
      return l;
    }
    try {
      const size_t v = fe::detail::get_backend_version();
      if (v < 90000) {
        l.message = "cuDNN " + std::to_string(v) +
                    " is older than 9.0, which the graph API's "
                    "fused attention needs";
        return l;
      }
      l.ok = true;
      // The CUDA runtime the loaded library was built for (a PyTorch environment's cuDNN may be
      // a CUDA 12 build beside strata's CUDA 13 runtime): recorded in every path's name.
      std::string cudart_of_lib;
      using CudartVersion = size_t (*)();
      if (auto f =
              reinterpret_cast<CudartVersion>(dlsym(fe::cudnn_dlhandle, "cudnnGetCudartVersion"))) {
        const size_t r = f();
        cudart_of_lib =
            ", for CUDA " + std::to_string(r / 1000) + "." + std::to_string(r / 10 % 100);
      }
      l.message = "cudnn " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
                  std::to_string(v % 100) + cudart_of_lib + " (frontend " +
                  std::to_string(CUDNN_FRONTEND_MAJOR_VERSION) + "." +
                  std::to_string(CUDNN_FRONTEND_MINOR_VERSION) + "." +
                  std::to_string(CUDNN_FRONTEND_PATCH_VERSION) + ")";
    } catch (const std::exception& e) {
      l.message = std::string("loading cuDNN failed: ") + e.what();
    }
    return l;
  }();
  return load;
}

fe::DataType_t fe_type(DType dt) {
  return dt == DType::kBF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
}

std::string fe_message(fe::error_t e) { return e.get_message(); }

// One shape's graphs, built once.
struct Plans {
  bool ok = false;
  std::string why;  // when !ok
  std::shared_ptr<fe::graph::Graph> fwd, bwd;
  int64_t fwd_workspace = 0, bwd_workspace = 0;
};

using Key = std::tuple<int, int, int, int, int, int>;  // dt, B, T, NH, KVH, hs

// Device memory kept free beside a shape's workspace and gradient scratch when its graphs are
// built, for what the other libraries grow into (cuBLASLt's workspace, NCCL's buffers).
constexpr size_t kHeadroom = size_t{64} << 20;

class CudnnAttention final : public AttentionLibrary {
 public:
  CudnnAttention(int ordinal, bool deterministic)
      : ordinal_(ordinal), deterministic_(deterministic) {}
  ~CudnnAttention() override {
    for (auto& [s, ws] : workspace_) {
      if (ws.ptr != nullptr) cudaFree(ws.ptr);
    }
    cache_.clear();  // the graphs' plans were finalized with the handle: destroyed before it
    if (handle_ != nullptr) fe::detail::destroy_handle(handle_);
  }

  std::string name() const override {
    const CudnnLoad& load = load_cudnn();
    if (!load.ok) return load.message;
    return load.message + (deterministic_ ? ", deterministic backward"
                                          : ", non-deterministic backward (device.deterministic "
                                            "false)");
  }

  size_t workspace_bytes(const OpShape& shape) override {
    std::lock_guard<std::mutex> lock(mu_);
    const Plans* p = plans(shape);
    return p->ok ? size_t(std::max(p->fwd_workspace, p->bwd_workspace)) : 0;
  }

  bool supports(const OpShape& shape, std::string* why) override {
    std::lock_guard<std::mutex> lock(mu_);
    const Plans* p = plans(shape);
    if (!p->ok && why != nullptr) *why = p->why;
    return p->ok;
  }

  Status forward(cudaStream_t s, const OpShape& shape, void* out, float* lse,
                 const void* qkv) override {
    std::lock_guard<std::mutex> lock(mu_);
    const Plans* p = plans(shape);
    if (!p->ok) return invalid_argument("cuDNN attention: unsupported shape: " + p->why);
    if (!aligned({out, lse, qkv})) return misaligned("forward");
    const size_t es = dtype_size(shape.dt);
    auto* base = static_cast<char*>(const_cast<void*>(qkv));
    std::unordered_map<int64_t, void*> pack = {
        {kQ, base},
        {kK, base + size_t(shape.NH) * shape.hs * es},
        {kV, base + size_t(shape.NH + shape.KVH) * shape.hs * es},
        {kO, out},
        {kStats, lse}};
    return execute(s, *p->fwd, p->fwd_workspace, pack, "forward");
  }

  Status backward(cudaStream_t s, const OpShape& shape, void* dqkv, const void* dout,
                  const void* qkv, const void* out, const float* lse) override {
    std::lock_guard<std::mutex> lock(mu_);
    const Plans* p = plans(shape);
    if (!p->ok) return invalid_argument("cuDNN attention: unsupported shape: " + p->why);
    if (!aligned({dqkv, dout, qkv, out, lse})) return misaligned("backward");
    const size_t es = dtype_size(shape.dt);
    const size_t k_off = size_t(shape.NH) * shape.hs * es;
    const size_t v_off = size_t(shape.NH + shape.KVH) * shape.hs * es;
    auto* base = static_cast<char*>(const_cast<void*>(qkv));
    auto* dbase = static_cast<char*>(dqkv);
    std::unordered_map<int64_t, void*> pack = {{kQ, base},
                                               {kK, base + k_off},
                                               {kV, base + v_off},
                                               {kO, const_cast<void*>(out)},
                                               {kDO, const_cast<void*>(dout)},
                                               {kStats, const_cast<float*>(lse)},
                                               {kDQ, dbase},
                                               {kDK, dbase + k_off},
                                               {kDV, dbase + v_off}};
    return execute(s, *p->bwd, p->bwd_workspace, pack, "backward");
  }

 private:
  // The frontend takes every buffer as 16-byte aligned (its tensors' default alignment); the
  // models' buffers are (the arena's 256-byte blocks, head sizes a multiple of 8).
  static bool aligned(std::initializer_list<const void*> ps) {
    for (const void* p : ps) {
      if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    }
    return true;
  }
  static Status misaligned(const char* what) {
    return unavailable(std::string("cuDNN attention ") + what +
                       ": a buffer is not 16-byte aligned, which cuDNN's kernels assume");
  }

  // Binds the calling thread to the library's GPU while it lives (plans are built and
  // finalized on the current device), then gives the thread its device back.
  class OnDevice {
   public:
    explicit OnDevice(int ordinal) {
      cudaError_t e = cudaGetDevice(&prev_);
      if (e == cudaSuccess) e = cudaSetDevice(ordinal);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        why_ = "binding the thread to GPU " + std::to_string(ordinal) + ": " + cudaGetErrorName(e);
      }
    }
    ~OnDevice() {
      if (why_.empty()) cudaSetDevice(prev_);
    }
    const std::string& why() const { return why_; }  // "" when bound

   private:
    int prev_ = 0;
    std::string why_;
  };

  // The cached plans of `shape`, built on first use. Caller holds mu_.
  const Plans* plans(const OpShape& shape) {
    const Key key{int(shape.dt), shape.B, shape.T, shape.NH, shape.KVH, shape.hs};
    auto it = cache_.find(key);
    if (it != cache_.end()) return &it->second;
    Plans& p = cache_[key];
    OnDevice on(ordinal_);
    p.why = on.why().empty() ? build(shape, &p) : on.why();
    p.ok = p.why.empty();
    if (p.ok) {
      log_info(
          "cuDNN attention: {} B={} T={} NH={} KVH={} hs={}: graphs built (workspace {} + {} "
          "bytes)",
          dtype_name(shape.dt), shape.B, shape.T, shape.NH, shape.KVH, shape.hs, p.fwd_workspace,
          p.bwd_workspace);
    } else {
      log_info("cuDNN attention: {} B={} T={} NH={} KVH={} hs={}: own kernels ({})",
               dtype_name(shape.dt), shape.B, shape.T, shape.NH, shape.KVH, shape.hs, p.why);
    }
    return &p;
  }

  // Builds both graphs of `shape` into *p; returns "" or why not.
  std::string build(const OpShape& shape, Plans* p) {
    if (shape.dt != DType::kBF16 && shape.dt != DType::kF16) {
      return "cuDNN's fused attention takes bf16 and fp16 only";
    }
    if (shape.NH % shape.KVH != 0) return "NH is not a multiple of KVH";
    const CudnnLoad& load = load_cudnn();
    if (!load.ok) return load.message;
    if (std::string e = ensure_handle(); !e.empty()) return e;
    try {
      if (std::string e = build_forward(shape, p); !e.empty()) return "forward: " + e;
      if (std::string e = build_backward(shape, p); !e.empty()) return "backward: " + e;
    } catch (const std::exception& e) {
      return std::string("cudnn-frontend threw: ") + e.what();
    }
    return fits(shape, *p);
  }

  // Whether the shape's workspace and the caller's gradient scratch fit the device memory left
  // outside the arena (a workspace grown for it frees the stream's old one): "" or why not.
  std::string fits(const OpShape& shape, const Plans& p) const {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return "";  // unknown: an allocation that fails later falls back (kOutOfMemory)
    }
    size_t held = 0;
    for (const auto& [stream, ws] : workspace_) held = std::max(held, ws.bytes);
    const size_t ws = size_t(std::max(p.fwd_workspace, p.bwd_workspace));
    const size_t scratch = size_t(shape.B) * size_t(shape.T) * size_t(shape.NH + 2 * shape.KVH) *
                           size_t(shape.hs) * dtype_size(shape.dt);
    return library_memory_fits(ws, scratch, kHeadroom, free_bytes, held, deterministic_);
  }

  std::string ensure_handle() {  // on the library's GPU (plans() binds it)
    if (handle_ != nullptr) return "";
    try {
      const cudnnStatus_t st = fe::detail::create_handle(&handle_);
      if (st != CUDNN_STATUS_SUCCESS) {
        handle_ = nullptr;
        return std::string("cudnnCreate failed: ") + fe::detail::get_error_string(st);
      }
    } catch (const std::exception& e) {
      handle_ = nullptr;
      return std::string("cudnnCreate threw: ") + e.what();
    }
    return "";
  }

  // The four strided views of one call's buffers.
  struct Dims {
    int64_t B, T, NH, KVH, hs, W;
    std::vector<int64_t> q_dim() const { return {B, NH, T, hs}; }
    std::vector<int64_t> kv_dim() const { return {B, KVH, T, hs}; }
    std::vector<int64_t> qkv_stride() const { return {T * W, hs, W, 1}; }
    std::vector<int64_t> o_stride() const { return {T * NH * hs, hs, NH * hs, 1}; }
    std::vector<int64_t> stats_dim() const { return {B, NH, T, 1}; }
    std::vector<int64_t> stats_stride() const { return {NH * T, T, 1, 1}; }
  };
  static Dims dims(const OpShape& s) {
    return {s.B, s.T, s.NH, s.KVH, s.hs, int64_t(s.NH + 2 * s.KVH) * s.hs};
  }

  static std::shared_ptr<fe::graph::Graph> new_graph(DType dt) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe_type(dt))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return g;
  }
  static std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name,
                                                             Uid uid, std::vector<int64_t> dim,
                                                             std::vector<int64_t> stride) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim(std::move(dim))
                        .set_stride(std::move(stride)));
  }

  // validate, operation graph, heuristics, check_support, plans, workspace: "" or why not.
  std::string finish(fe::graph::Graph& g, int64_t* workspace) {
    if (auto e = g.validate(); !e.is_good()) return "validate: " + fe_message(e);
    if (auto e = g.build_operation_graph(handle_); !e.is_good()) {
      return "build_operation_graph: " + fe_message(e);
    }
    if (auto e = g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
        !e.is_good()) {
      return "create_execution_plans: " + fe_message(e);
    }
    if (auto e = g.check_support(handle_); !e.is_good()) return "check_support: " + fe_message(e);
    if (auto e = g.build_plans(handle_); !e.is_good()) return "build_plans: " + fe_message(e);
    if (auto e = g.get_workspace_size(*workspace); !e.is_good()) {
      return "get_workspace_size: " + fe_message(e);
    }
    return "";
  }

  std::string build_forward(const OpShape& shape, Plans* p) {
    const Dims d = dims(shape);
    auto g = new_graph(shape.dt);
    auto q = input(*g, "Q", kQ, d.q_dim(), d.qkv_stride());
    auto k = input(*g, "K", kK, d.kv_dim(), d.qkv_stride());
    auto v = input(*g, "V", kV, d.kv_dim(), d.qkv_stride());
    auto options = fe::graph::SDPA_attributes()
                       .set_name("strata_attention_forward")
                       .set_generate_stats(true)
                       .set_causal_mask(true)
                       .set_attn_scale(float(1.0 / std::sqrt(double(shape.hs))));
    auto [o, stats] = g->sdpa(q, k, v, options);
    o->set_output(true).set_uid(kO).set_dim(d.q_dim()).set_stride(d.o_stride());
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(d.stats_dim())
        .set_stride(d.stats_stride());
    if (std::string e = finish(*g, &p->fwd_workspace); !e.empty()) return e;
    p->fwd = std::move(g);
    return "";
  }

  std::string build_backward(const OpShape& shape, Plans* p) {
    const Dims d = dims(shape);
    auto g = new_graph(shape.dt);
    auto q = input(*g, "Q", kQ, d.q_dim(), d.qkv_stride());
    auto k = input(*g, "K", kK, d.kv_dim(), d.qkv_stride());
    auto v = input(*g, "V", kV, d.kv_dim(), d.qkv_stride());
    auto o = input(*g, "O", kO, d.q_dim(), d.o_stride());
    auto dout = input(*g, "dO", kDO, d.q_dim(), d.o_stride());
    auto stats = input(*g, "Stats", kStats, d.stats_dim(), d.stats_stride());
    stats->set_data_type(fe::DataType_t::FLOAT);
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("strata_attention_backward")
                       .set_causal_mask(true)
                       .set_deterministic_algorithm(deterministic_)
                       .set_attn_scale(float(1.0 / std::sqrt(double(shape.hs))));
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
    dq->set_output(true).set_uid(kDQ).set_dim(d.q_dim()).set_stride(d.qkv_stride());
    dk->set_output(true).set_uid(kDK).set_dim(d.kv_dim()).set_stride(d.qkv_stride());
    dv->set_output(true).set_uid(kDV).set_dim(d.kv_dim()).set_stride(d.qkv_stride());
    if (std::string e = finish(*g, &p->bwd_workspace); !e.empty()) return e;
    p->bwd = std::move(g);
    return "";
  }

  // Runs one built graph on `s` with a workspace of `bytes` private to that stream. Caller
  // holds mu_ (the handle is not safe to use from two threads at once).
  Status execute(cudaStream_t s, fe::graph::Graph& g, int64_t bytes,
                 std::unordered_map<int64_t, void*>& pack, const char* what) {
    Workspace& ws = workspace_[s];
    if (ws.bytes < size_t(bytes)) {
      if (ws.ptr != nullptr) {
        STRATA_CUDA_CHECK(cudaStreamSynchronize(s), "waiting before growing cuDNN's workspace");
        STRATA_CUDA_CHECK(cudaFree(ws.ptr), "freeing cuDNN's workspace");
        ws = Workspace{};
      }
      if (const cudaError_t e = cudaMalloc(&ws.ptr, size_t(bytes)); e != cudaSuccess) {
        (void)cudaGetLastError();  // not sticky: clear it for the checks after later launches
        ws = Workspace{};
        return out_of_memory("cuDNN attention's " + std::string(what) + " workspace of " +
                             format_bytes(double(bytes)) +
                             " (outside the device arena, from device.reserve): cudaMalloc " +
                             cudaGetErrorName(e));
      }
      ws.bytes = size_t(bytes);
    }
    std::string failed;
    try {
      if (cudnnStatus_t st = fe::detail::set_stream(handle_, s); st != CUDNN_STATUS_SUCCESS) {
        failed = std::string("cudnnSetStream: ") + fe::detail::get_error_string(st);
      } else if (auto e = g.execute(handle_, pack, ws.ptr); !e.is_good()) {
        failed = fe_message(e);
      }
    } catch (const std::exception& e) {
      failed = std::string("threw: ") + e.what();
    }
    if (failed.empty()) return Status::ok();
    // A CUDA error behind it is the device's (a sticky one ends the step); cuDNN refusing to
    // run the graph declines the call, which the caller then runs on the own kernels.
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      return internal_error(std::string("cuDNN attention ") + what + ": " + failed + " (" +
                            cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")");
    }
    return unavailable(std::string("cuDNN attention ") + what + " did not run: " + failed);
  }

  struct Workspace {
    void* ptr = nullptr;
    size_t bytes = 0;
  };

  const int ordinal_;
  const bool deterministic_;
  std::mutex mu_;
  cudnnHandle_t handle_ = nullptr;
  std::map<Key, Plans> cache_;
  std::map<cudaStream_t, Workspace> workspace_;
};

}  // namespace

std::unique_ptr<AttentionLibrary> create_cudnn_attention(int ordinal, bool deterministic,
                                                         std::string* why) {
  why->clear();
  return std::make_unique<CudnnAttention>(ordinal, deterministic);
}

}  // namespace strata
