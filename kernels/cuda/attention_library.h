// The fused attention through a vendor library (cuDNN's fused attention), with the backend's own
// kernels (flash_attention.cu) as the fallback. Not a public header.
//
// Two pieces:
//   - AttentionLibrary: one library's forward and backward of Kernels::fused_attention_*, for
//     the shapes it supports. The real one is cuDNN's (cudnn_attention.cc, built when CMake
//     finds cuDNN; no_cudnn.cc otherwise); tests drive the dispatch below with a double.
//   - LibraryAttentionKernels: the CUDA backend's Kernels table as the device hands it out. A
//     KernelsWrapper over the own kernels that sends a fused attention call to the library when
//     the library supports that exact shape, and every other call (and every shape the library
//     does not take) to the own kernels.
//
// The two differ in one convention: Kernels' backward ACCUMULATES into dqkv, a library writes
// its gradients. LibraryAttentionKernels has the library write into a scratch laid out as qkv
// (the wrapper's, per stream, grown on demand with cudaMalloc outside the device arena, i.e. out
// of CudaDeviceOptions::reserve) and adds it to dqkv with the own add_inplace.
//
// Memory: a library's workspace and that scratch come out of the reserve, not the arena. A
// library declines a shape whose workspace does not fit what the device leaves free (cuDNN's
// deterministic backward on Hopper keeps B·heads·T² bf16 scores: 1 GiB at 4 x 2048 tokens and
// 32 heads), and a call whose memory runs out all the same (kOutOfMemory) runs on the own
// kernels, as does every later call of that shape: a step never fails for the library's memory.
// Nor for a call the library refuses at execution (kUnavailable: cuDNN's execute failed without
// a CUDA error): that shape, too, runs on the own kernels from then on.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/cuda/cuda_ops.h"
#include "strata/kernels.h"
#include "strata/kernels_wrapper.h"
#include "strata/status.h"

namespace strata {

// The environment switch: STRATA_CUDNN=0 keeps every call on the own kernels (cuDNN is then not
// even loaded). Any other value, or unset, lets the library run the shapes it supports.
inline constexpr const char* kCudnnEnv = "STRATA_CUDNN";

class AttentionLibrary {
 public:
  virtual ~AttentionLibrary() = default;

  // The implementation's name for KernelSupport::path, e.g. "cudnn 9.28.1 (frontend 1.32.0)".
  virtual std::string name() const = 0;

  // Whether forward AND backward run for this shape (every field of `shape` set, > 0); else
  // false with the reason in *why. The first call for a shape builds and checks the library's
  // plans (cuDNN: the graphs, check_support, build_plans) and caches them; later calls are a
  // lookup. Thread-safe. A library that cannot load answers false for every shape, saying why.
  virtual bool supports(const OpShape& shape, std::string* why) = 0;
  // The device bytes a supported shape's calls allocate outside the arena (the larger of its
  // forward's and backward's workspaces); 0 for a shape it does not support.
  virtual size_t workspace_bytes(const OpShape& /*shape*/) { return 0; }

  // Kernels::fused_attention_forward for a supported shape, enqueued on `s`: out and lse.
  // kOutOfMemory: the library's device memory could not be had; kUnavailable: the library
  // declined to run the call (cuDNN's execute failed with no CUDA error behind it, a buffer
  // it cannot take). Either way nothing was enqueued that the caller relies on, and the caller
  // runs the own kernels; any other error is the call's.
  virtual Status forward(cudaStream_t s, const OpShape& shape, void* out, float* lse,
                         const void* qkv) = 0;
  // The gradient w.r.t. qkv for a supported shape, WRITTEN (not accumulated) to every element
  // of dqkv [B,T,(NH+2*KVH)*hs], enqueued on `s`. kOutOfMemory and kUnavailable as for
  // forward.
  virtual Status backward(cudaStream_t s, const OpShape& shape, void* dqkv, const void* dout,
                          const void* qkv, const void* out, const float* lse) = 0;
};

// cuDNN's fused attention on GPU `ordinal`, loaded on first use: nullptr with the reason in
// *why when strata was built without cuDNN (no_cudnn.cc). Loading itself (the library, a
// handle) happens at the first supports() with a full shape; a failure there makes every
// supports() answer false with the loader's message. `deterministic` (CudaDeviceOptions): the
// backward takes cuDNN's deterministic algorithm, the same bits run to run (on Hopper with a
// workspace of B·heads·T² bf16); false: its faster non-deterministic one (dQ accumulated by
// atomics, no such workspace).
std::unique_ptr<AttentionLibrary> create_cudnn_attention(int ordinal, bool deterministic,
                                                         std::string* why);

// Whether a library's shape fits the device memory outside the arena: its `workspace`, the
// wrapper's gradient `scratch` (B*T*W elements of the dtype) and `headroom` for what the other
// libraries grow into, against `free_bytes` (cudaMemGetInfo) plus `held` (the stream's
// workspace a grown one replaces). "" when it fits, else why not and how much more
// device.reserve it needs (and, for a deterministic backward, that device.deterministic false
// needs no such workspace).
std::string library_memory_fits(size_t workspace, size_t scratch, size_t headroom,
                                size_t free_bytes, size_t held, bool deterministic);

// The library the CUDA backend uses: none when kCudnnEnv is "0" (reason says so), else
// create_cudnn_attention's.
std::unique_ptr<AttentionLibrary> attention_library_from_env(int ordinal, bool deterministic,
                                                             std::string* why);

class LibraryAttentionKernels final : public KernelsWrapper {
 public:
  // own: the backend's own kernels (owned). library: may be null, with absent_reason saying why
  // (shown in supports()' path so a log or a benchmark tells why the library did not run).
  // Enqueue failures of the library path go to `errors` (the device's sink), from which the
  // next synchronize returns them, as for every other op.
  LibraryAttentionKernels(std::unique_ptr<Kernels> own, std::unique_ptr<AttentionLibrary> library,
                          std::string absent_reason, int ordinal, CudaErrorSink* errors);
  ~LibraryAttentionKernels() override;

  // kFusedAttention with every field of the shape set: the library's name when it runs that
  // call, else the own kernels' answer (with why the library does not run it). A query for
  // "any shape" (B, T, NH or KVH 0) is the own kernels' answer: the library is a faster path
  // for the shapes it checks, never the only one. A call with positions (OpShape::positions)
  // runs on the own kernels: the library path does not mask per sequence. The library's path
  // names its workspace where it has one ("cudnn ..., workspace 1.00 GiB").
  KernelSupport supports(KernelOp op, const OpShape& shape) const override;
  void fused_attention_forward(Stream& s, DType dt, void* out, float* lse, const void* qkv,
                               const int32_t* pos, int B, int T, int NH, int NKV, int hs) override;
  void fused_attention_backward(Stream& s, DType dt, void* dqkv, float* scratch, const void* dout,
                                const void* qkv, const void* out, const float* lse,
                                const int32_t* pos, int B, int T, int NH, int NKV, int hs,
                                bool accumulate) override;

 private:
  // Whether the library runs this full shape (why it does not in *why, if non-null).
  bool library_runs(const OpShape& shape, std::string* why) const;
  // After a library call (or the gradient scratch) failed with `st`: true when the library
  // declined it (kOutOfMemory: its memory; kUnavailable: it did not run the call), the shape
  // then declined for good (a warning says why once), so the caller runs this call on the own
  // kernels; false for any other error.
  bool declined(const OpShape& shape, const Status& st);
  // The gradient scratch of stream `s`, at least `bytes` (grown: the stream is synchronized
  // before the old buffer is freed, since queued work may still read it).
  Result<void*> gradient_scratch(cudaStream_t s, size_t bytes);

  std::unique_ptr<Kernels> own_;
  std::unique_ptr<AttentionLibrary> library_;
  const std::string absent_reason_;
  const int ordinal_;
  CudaErrorSink* const errors_;

  struct Scratch {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  std::mutex scratch_mu_;
  std::map<cudaStream_t, Scratch> scratch_;

  using ShapeKey = std::tuple<int, int, int, int, int, int>;  // dt, B, T, NH, KVH, hs
  static ShapeKey key(const OpShape& s) { return {int(s.dt), s.B, s.T, s.NH, s.KVH, s.hs}; }
  mutable std::mutex declined_mu_;
  std::map<ShapeKey, std::string> declined_;  // shapes the library declined, and why
};

}  // namespace strata
