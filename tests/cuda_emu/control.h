// The CPU stand-in for a GPU (tests/cuda_emu/runtime.cc): what tests set and read beyond the CUDA
// API itself. Test-only.
//
// The stand-in behaves like one GPU:
//   - device memory (cudaMalloc) lies between inaccessible guard pages; the bytes between the
//     allocation and the guard pages (256-byte alignment) are checked after every kernel and at
//     cudaFree. An access into a guard page stops the process with a report naming the
//     allocation. Fresh device memory reads as 0xFF bytes (NaN in every float type) until written.
//   - every stream is a worker thread; kernels, copies, memsets, host functions, event records
//     and waits run there in order. Before each operation a stream may sleep a random while
//     (set_delay), so that work on different streams overlaps in ever different ways: an
//     operation that lacks the event it needs reads or overwrites data at the wrong time.
//   - a kernel that breaks a rule (deadlock, WMMA misuse, a pointer argument outside device
//     memory, a guard zone written) or a cuBLASLt call with bad arguments makes the context
//     fail as a GPU's does: every later synchronize returns cudaErrorLaunchFailure, whose
//     cudaGetErrorString carries the report.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "cuda_runtime.h"
#include "tests/cuda_emu.h"

namespace strata::emu {

// The thread order of every following launch (both orders must give the same results).
void set_order(Order order);
Order order();

// Each stream operation sleeps for a random time in [0, max_us] microseconds with probability
// `percent`/100. Defaults: STRATA_EMU_DELAY_US (50) and STRATA_EMU_DELAY_PERCENT (20);
// STRATA_EMU_SEED seeds the draws (else random, printed with any failure).
void set_delay(unsigned max_us, unsigned percent);

// The report of the failure that broke the context, or "" if none; clear_failure() makes the
// context usable again (for tests that provoke failures on purpose).
std::string failure();
void clear_failure();

// Whether [p, p + bytes) lies within one live device allocation.
bool is_device_memory(const void* p, size_t bytes);

// What a launch hands to the runtime (tests/cuda_emu/launch.h): the configuration, the kernel's
// address (for its attributes), a body that runs one thread, and the first pointer argument
// that is not device memory ("" if none). Checks the configuration as cudaLaunchKernel does and
// notes a bad one for cudaGetLastError.
void enqueue_kernel(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const void* kernel,
                    std::function<void()> body, std::string bad_argument);

// Runs `op` on `stream`'s worker in order with the stream's other work (cuBLASLt and NCCL use
// it). A thrown std::exception fails the context with its message.
void enqueue(cudaStream_t stream, const char* what, std::function<void()> op);

// Fails the context with `report` (from a stream's worker).
void fail_context(const std::string& report);

}  // namespace strata::emu
