// Fused causal attention with grouped-query heads (Kernels::fused_attention_*): the launchers.
// The kernels are in flash_attention_kernels.cuh (they also run on a CPU emulation in the tests);
// CPU twin: kernels/cpu/flash_attention.cc. Tensor cores through WMMA: bf16 and fp16 with head
// size 64 or 128; anything else is reported unsupported (supports(kFusedAttention)) and the
// caller keeps the plain kernels of attention.cu.
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/flash_attention_kernels.cuh"

namespace strata {
namespace {

using flash::kBr;
using flash::kDotRowsPerBlock;
using flash::kThreads;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::string shape_text(int B, int T, int NH, int NKV, int hs) {
  return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
         " NKV=" + std::to_string(NKV) + " hs=" + std::to_string(hs);
}

Status check_args(const char* op, DType dt, int B, int T, int NH, int NKV, int hs,
                  std::initializer_list<const void*> ptrs) {
  if (B < 0 || T < 0 || NH <= 0 || NKV <= 0 || NH % NKV != 0) {
    return invalid_argument(std::string(op) + ": bad shape " + shape_text(B, T, NH, NKV, hs) +
                            " (NH must be a positive multiple of NKV)");
  }
  if (!cuda_fused_attention_supported(dt, hs)) {
    return invalid_argument(std::string(op) + ": dtype " + dtype_name(dt) + " with head size " +
                            std::to_string(hs) +
                            " is not supported by the CUDA fused attention (bf16/fp16, hs 64 or "
                            "128); check supports(kFusedAttention) and use attention_gqa_forward");
  }
  for (const void* p : ptrs) {
    if (!aligned16(p)) {
      return invalid_argument(std::string(op) +
                              ": tensors must be 16-byte aligned (the device arena is)");
    }
  }
  return Status::ok();
}

// Lets `kernel` use `bytes` of dynamic shared memory (above the 48 KiB default); per device, so
// it is set at every launch (a cheap attribute write).
template <typename K>
Status allow_smem(K* kernel, size_t bytes) {
  STRATA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
      "allowing the fused attention's shared memory (needs sm_80 or newer)");
  return Status::ok();
}

template <typename Tp, int HS>
Status forward(cudaStream_t s, void* out, float* lse, const void* qkv, const int32_t* pos, int B,
               int T, int NH, int NKV) {
  constexpr size_t smem = flash::ForwardSmem<HS>::kBytes;
  auto* kernel = flash::flash_forward_kernel<Tp, HS>;
  STRATA_RETURN_IF_ERROR(allow_smem(kernel, smem), "fused_attention_forward");
  const dim3 grid((T + kBr - 1) / kBr, NH, B);
  kernel<<<grid, kThreads, smem, s>>>(static_cast<Tp*>(out), lse, static_cast<const Tp*>(qkv), pos,
                                      T, NH, NKV);
  STRATA_CUDA_LAUNCH_CHECK("launching flash_forward_kernel");
  return Status::ok();
}

template <typename Tp, int HS>
Status backward(cudaStream_t s, void* dqkv, float* scratch, const void* dout, const void* qkv,
                const void* out, const float* lse, const int32_t* pos, int B, int T, int NH,
                int NKV) {
  constexpr size_t smem = flash::BackwardSmem<HS>::kBytes;
  auto* dkdv = flash::flash_backward_dkdv_kernel<Tp, HS>;
  auto* dq = flash::flash_backward_dq_kernel<Tp, HS>;
  STRATA_RETURN_IF_ERROR(allow_smem(dkdv, smem), "fused_attention_backward");
  STRATA_RETURN_IF_ERROR(allow_smem(dq, smem), "fused_attention_backward");
  const auto* x = static_cast<const Tp*>(qkv);
  const auto* g = static_cast<const Tp*>(dout);
  auto* dx = static_cast<Tp*>(dqkv);
  const size_t rows = size_t(B) * NH * T;
  flash::flash_backward_dot_kernel<Tp>
      <<<unsigned((rows + kDotRowsPerBlock - 1) / kDotRowsPerBlock), 32 * kDotRowsPerBlock, 0, s>>>(
          scratch, g, static_cast<const Tp*>(out), B, T, NH, HS);
  STRATA_CUDA_LAUNCH_CHECK("launching flash_backward_dot_kernel");
  const unsigned tiles = unsigned((T + kBr - 1) / kBr);
  dkdv<<<dim3(tiles, NKV, B), kThreads, smem, s>>>(dx, x, g, lse, scratch, pos, T, NH, NKV);
  STRATA_CUDA_LAUNCH_CHECK("launching flash_backward_dkdv_kernel");
  dq<<<dim3(tiles, NH, B), kThreads, smem, s>>>(dx, x, g, lse, scratch, pos, T, NH, NKV);
  STRATA_CUDA_LAUNCH_CHECK("launching flash_backward_dq_kernel");
  return Status::ok();
}

// Calls BODY with `Tp` bound to the 16-bit storage type and `HS` to the head size.
#define STRATA_FLASH_DISPATCH(dt, hs, ...) \
  do {                                     \
    if (dt == DType::kBF16 && hs == 64) {  \
      using Tp = __nv_bfloat16;            \
      constexpr int HS = 64;               \
      return __VA_ARGS__;                  \
    } else if (dt == DType::kBF16) {       \
      using Tp = __nv_bfloat16;            \
      constexpr int HS = 128;              \
      return __VA_ARGS__;                  \
    } else if (hs == 64) {                 \
      using Tp = __half;                   \
      constexpr int HS = 64;               \
      return __VA_ARGS__;                  \
    } else {                               \
      using Tp = __half;                   \
      constexpr int HS = 128;              \
      return __VA_ARGS__;                  \
    }                                      \
  } while (0)

}  // namespace

bool cuda_fused_attention_supported(DType dt, int hs) {
  return (dt == DType::kBF16 || dt == DType::kF16) && (hs == 64 || hs == 128);
}

Status cuda_fused_attention_forward(cudaStream_t s, DType dt, void* out, float* lse,
                                    const void* qkv, const int32_t* pos, int B, int T, int NH,
                                    int NKV, int hs) {
  Status st = check_args("fused_attention_forward", dt, B, T, NH, NKV, hs, {out, qkv});
  if (!st.is_ok()) return st;
  if (size_t(B) * T == 0) return Status::ok();
  STRATA_FLASH_DISPATCH(dt, hs, (forward<Tp, HS>(s, out, lse, qkv, pos, B, T, NH, NKV)));
}

Status cuda_fused_attention_backward(cudaStream_t s, DType dt, void* dqkv, float* scratch,
                                     const void* dout, const void* qkv, const void* out,
                                     const float* lse, const int32_t* pos, int B, int T, int NH,
                                     int NKV, int hs) {
  Status st = check_args("fused_attention_backward", dt, B, T, NH, NKV, hs, {dqkv, dout, qkv, out});
  if (!st.is_ok()) return st;
  if (size_t(B) * T == 0) return Status::ok();
  STRATA_FLASH_DISPATCH(
      dt, hs, (backward<Tp, HS>(s, dqkv, scratch, dout, qkv, out, lse, pos, B, T, NH, NKV)));
}

}  // namespace strata
