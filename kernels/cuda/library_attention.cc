// LibraryAttentionKernels: the fused attention on a vendor library where it supports the shape,
// on the own kernels elsewhere (kernels/cuda/attention_library.h).
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "kernels/cuda/attention_library.h"
#include "kernels/cuda/cuda_check.h"
#include "strata/log.h"

namespace strata {
namespace {

bool full_shape(const OpShape& s) {
  return s.B > 0 && s.T > 0 && s.NH > 0 && s.KVH > 0 && s.hs > 0;
}

}  // namespace

std::unique_ptr<AttentionLibrary> attention_library_from_env(int ordinal, bool deterministic,
                                                             std::string* why) {
  const char* env = std::getenv(kCudnnEnv);
  if (env != nullptr && std::strcmp(env, "0") == 0) {
    *why = std::string("cudnn turned off by ") + kCudnnEnv + "=0";
    return nullptr;
  }
  return create_cudnn_attention(ordinal, deterministic, why);
}

std::string library_memory_fits(size_t workspace, size_t scratch, size_t headroom,
                                size_t free_bytes, size_t held, bool deterministic) {
  const size_t need = workspace + scratch + headroom;
  if (need <= free_bytes + held) return "";
  return "its workspace of " + format_bytes(double(workspace)) + " and gradient scratch of " +
         format_bytes(double(scratch)) + " do not fit the " + format_bytes(double(free_bytes)) +
         " of device memory outside the arena: raise device.reserve by " +
         format_bytes(double(need - free_bytes - held)) +
         (deterministic ? " or set device.deterministic false (the deterministic backward's "
                          "workspace holds B*NH*T^2 bf16 scores on Hopper)"
                        : "");
}

LibraryAttentionKernels::LibraryAttentionKernels(std::unique_ptr<Kernels> own,
                                                 std::unique_ptr<AttentionLibrary> library,
                                                 std::string absent_reason, int ordinal,
                                                 CudaErrorSink* errors)
    : KernelsWrapper(own.get()),
      own_(std::move(own)),
      library_(std::move(library)),
      absent_reason_(std::move(absent_reason)),
      ordinal_(ordinal),
      errors_(errors) {}

LibraryAttentionKernels::~LibraryAttentionKernels() {
  // The device synchronizes its streams before destroying its kernels; nothing reads these now.
  for (auto& [stream, buf] : scratch_) {
    if (buf.ptr != nullptr) cudaFree(buf.ptr);
  }
}

bool LibraryAttentionKernels::library_runs(const OpShape& shape, std::string* why) const {
  std::string reason;
  bool runs = false;
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(declined_mu_);
    auto it = declined_.find(key(shape));
    if (it != declined_.end()) refused = it->second;
  }
  if (library_ == nullptr) {
    reason = absent_reason_;
  } else if (!refused.empty()) {
    reason = std::move(refused);
  } else if (shape.positions) {
    reason = "the library path does not mask attention per sequence (positions)";
  } else if (!full_shape(shape)) {
    reason = "the library is asked per call shape (B, T, NH, KVH, hs)";
  } else {
    runs = library_->supports(shape, &reason);
  }
  if (why != nullptr) *why = std::move(reason);
  return runs;
}

KernelSupport LibraryAttentionKernels::supports(KernelOp op, const OpShape& shape) const {
  if (op != KernelOp::kFusedAttention) return own_->supports(op, shape);
  std::string why;
  if (library_runs(shape, &why)) {
    const size_t ws = library_->workspace_bytes(shape);
    return {true, library_->name() +
                      (ws > 0 ? ", workspace " + format_bytes(double(ws)) : std::string())};
  }
  KernelSupport own = own_->supports(op, shape);
  own.path += "; library not used: " + why;
  return own;
}

void LibraryAttentionKernels::fused_attention_forward(Stream& s, DType dt, void* out, float* lse,
                                                      const void* qkv, const int32_t* pos, int B,
                                                      int T, int NH, int NKV, int hs) {
  OpShape shape{dt, hs, B, T, NH, NKV};
  shape.positions = pos != nullptr;
  if (!library_runs(shape, nullptr)) {
    own_->fused_attention_forward(s, dt, out, lse, qkv, pos, B, T, NH, NKV, hs);
    return;
  }
  CudaStream& cs = cuda_stream(s);
  Status st = STRATA_CUDA_STATUS(cudaSetDevice(ordinal_), "binding the thread to its GPU");
  if (st.is_ok()) st = library_->forward(cs.handle, shape, out, lse, qkv);
  if (declined(shape, st)) {
    own_->fused_attention_forward(s, dt, out, lse, qkv, pos, B, T, NH, NKV, hs);
    return;
  }
  if (!st.is_ok())
    errors_->note(st.with_context("fused_attention_forward (" + library_->name() + ")"));
}

void LibraryAttentionKernels::fused_attention_backward(Stream& s, DType dt, void* dqkv,
                                                       float* scratch, const void* dout,
                                                       const void* qkv, const void* out,
                                                       const float* lse, const int32_t* pos, int B,
                                                       int T, int NH, int NKV, int hs,
                                                       bool accumulate) {
  OpShape shape{dt, hs, B, T, NH, NKV};
  shape.positions = pos != nullptr;
  if (!library_runs(shape, nullptr)) {
    own_->fused_attention_backward(s, dt, dqkv, scratch, dout, qkv, out, lse, pos, B, T, NH, NKV,
                                   hs, accumulate);
    return;
  }
  CudaStream& cs = cuda_stream(s);
  const size_t n = size_t(B) * T * size_t(NH + 2 * NKV) * hs;
  const std::string where = "fused_attention_backward (" + library_->name() + ")";
  Status st = STRATA_CUDA_STATUS(cudaSetDevice(ordinal_), "binding the thread to its GPU");
  // A written dqkv is the library's output itself; an accumulated one takes a scratch buffer
  // and an add.
  void* grad = accumulate ? nullptr : dqkv;
  if (st.is_ok() && accumulate) {
    Result<void*> r = gradient_scratch(cs.handle, n * dtype_size(dt));
    if (r.is_ok()) {
      grad = *r;
    } else {
      st = r.status();
    }
  }
  if (st.is_ok()) st = library_->backward(cs.handle, shape, grad, dout, qkv, out, lse);
  if (declined(shape, st)) {
    // The library's forward and the own backward agree: the same out and the same lse (the
    // natural-log log-sum-exp of the scaled scores).
    own_->fused_attention_backward(s, dt, dqkv, scratch, dout, qkv, out, lse, pos, B, T, NH, NKV,
                                   hs, accumulate);
    return;
  }
  if (!st.is_ok()) {
    errors_->note(st.with_context(where));
    return;
  }
  // The library wrote the gradient; an accumulated dqkv adds it (one more rounding to dt).
  if (accumulate) own_->add_inplace(s, dt, dqkv, grad, n);
}

bool LibraryAttentionKernels::declined(const OpShape& shape, const Status& st) {
  const bool memory = st.code() == StatusCode::kOutOfMemory;
  if (!memory && st.code() != StatusCode::kUnavailable) return false;
  std::lock_guard<std::mutex> lock(declined_mu_);
  if (declined_.emplace(key(shape), st.message()).second) {
    log_warn(
        "fused attention {} B={} T={} NH={} KVH={} hs={}: on the own kernels from now on, {} "
        "({})",
        dtype_name(shape.dt), shape.B, shape.T, shape.NH, shape.KVH, shape.hs,
        memory ? "the library's memory ran out" : "the library did not run it", st.message());
  }
  return true;
}

Result<void*> LibraryAttentionKernels::gradient_scratch(cudaStream_t s, size_t bytes) {
  std::lock_guard<std::mutex> lock(scratch_mu_);
  Scratch& buf = scratch_[s];
  if (buf.bytes >= bytes) return buf.ptr;
  if (buf.ptr != nullptr) {
    STRATA_CUDA_CHECK(cudaStreamSynchronize(s),
                      "waiting for the stream before growing the "
                      "library attention's gradient scratch");
    STRATA_CUDA_CHECK(cudaFree(buf.ptr), "freeing the library attention's gradient scratch");
    buf = Scratch{};
  }
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation failure is not sticky: clear it for later checks
    return out_of_memory("the library attention's gradient scratch of " +
                         format_bytes(double(bytes)) +
                         " (outside the device arena, from its reserve): cudaMalloc " +
                         cudaGetErrorName(e) + "; raise device.reserve to run it on the library");
  }
  buf = Scratch{p, bytes};
  log_debug("library attention: gradient scratch of {} bytes for a stream", bytes);
  return p;
}

}  // namespace strata
