// Checking every CUDA runtime and cuBLASLt call (internal to kernels/cuda).
//
// Every call into CUDA goes through one of these macros, so that a failure leaves a trail in
// the NCCL style: the call as written, the file and line, what strata was doing, and CUDA's own
// name and text for the error, e.g.
//   "cudaMalloc(&base, capacity) failed at kernels/cuda/cuda_device.cc:212 while reserving the
//    device arena (70.0 GiB): cudaErrorMemoryAllocation: out of memory"
//
//   STRATA_CUDA_CHECK(call, what)    returns a failed Status from the enclosing function.
//   STRATA_CUBLAS_CHECK(call, what)  the same for cublasStatus_t (cuBLASLt).
//   STRATA_CUDA_STATUS(call, what)   evaluates to the Status (OK on success), for callers
//                                    that cannot return, e.g. void enqueue functions that
//                                    defer the error to the next synchronize().
//   STRATA_CUDA_LAUNCH_CHECK(what)   checks the launch of the kernel just enqueued.
//
// `what` is a const char* (or anything convertible to std::string_view) evaluated eagerly;
// keep it a literal and add dynamic context one level up with Status::with_context.
//
// Thread safety: the functions are pure; any thread may use them.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string_view>

#include "strata/status.h"

namespace strata {

// A failed Status for `err` (kInternal, or kOutOfMemory for cudaErrorMemoryAllocation), or OK
// if err == cudaSuccess. Defined in cuda_device.cc.
Status cuda_check_status(cudaError_t err, const char* call, const char* file, int line,
                         std::string_view what);
// The same for a cuBLASLt status.
Status cublas_check_status(cublasStatus_t st, const char* call, const char* file, int line,
                           std::string_view what);

}  // namespace strata

#define STRATA_CUDA_STATUS(call, what) \
  ::strata::cuda_check_status((call), #call, __FILE__, __LINE__, (what))

#define STRATA_CUDA_CHECK(call, what)                                                        \
  do {                                                                                       \
    cudaError_t strata_cuda_err_ = (call);                                                   \
    if (strata_cuda_err_ != cudaSuccess) [[unlikely]]                                        \
      return ::strata::cuda_check_status(strata_cuda_err_, #call, __FILE__, __LINE__, what); \
  } while (0)

#define STRATA_CUBLAS_CHECK(call, what)                                                         \
  do {                                                                                          \
    cublasStatus_t strata_cublas_st_ = (call);                                                  \
    if (strata_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                \
      return ::strata::cublas_check_status(strata_cublas_st_, #call, __FILE__, __LINE__, what); \
  } while (0)

#define STRATA_CUDA_LAUNCH_CHECK(what) STRATA_CUDA_CHECK(cudaGetLastError(), what)
