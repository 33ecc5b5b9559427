// The CPU stand-in for a GPU (tests/cuda_emu/runtime.cc): what tests set and read beyond the CUDA
// API itself. Test-only.
//
// The stand-in behaves like one GPU (STRATA_EMU_GPU_COUNT makes it show that many ordinals, each
// the same emulated GPU: one per rank under mpirun):
//   - device memory (cudaMalloc) lies between inaccessible guard pages; the bytes between the
//     allocation and the guard pages (256-byte alignment) are checked after every kernel and at
//     cudaFree. An access into a guard page stops the process with a report naming the
//     allocation. Fresh device memory reads as 0xFF bytes (NaN in every float type) until written.
//   - every stream is a worker thread; kernels, copies, memsets, host functions, event records
//     and waits run there in order. Streams are lazy (set_lazy): work runs only once the host
//     synchronizes with something (a stream, an event, the device, cudaFree, a pageable copy,
//     or the 64th cudaEventQuery that finds a record not done; one query only looks). Such a
//     release lets everything issued so far run, one operation at a time: the work of an earlier
//     release first, and within a release the streams in an order drawn for that release from
//     the seed (a stream waiting for an event steps aside until the record is done). So every
//     run is one schedule a GPU could have run, chosen deterministically, with copies and
//     kernels late: a consumer that lacks the event it needs reads what was there before its
//     producer's work (stale or never-written 0xFF bytes) whenever the draw puts its stream
//     first, and the host that reuses a buffer before the copy from it ran overwrites its data.
//     Over the releases of a run both orders of every pair of streams come up.
//   - a kernel that breaks a rule (deadlock, WMMA misuse, a pointer argument outside device
//     memory, a guard zone written) or a cuBLASLt call with bad arguments makes the context
//     fail as a GPU's does: every later synchronize returns cudaErrorLaunchFailure, whose
//     cudaGetErrorString carries the report.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "cuda_runtime.h"
#include "tests/cuda_emu.h"

namespace strata::emu {

// The thread order of every following launch (both orders must give the same results).
void set_order(Order order);
Order order();

// Lazy streams (the default; STRATA_EMU_STREAMS=concurrent starts without): the file comment.
// Not lazy: every operation runs as soon as its stream reaches it, streams truly concurrent,
// each operation after a random sleep (set_delay): races show at random, not every time.
void set_lazy(bool lazy);
bool lazy();

// Each stream operation sleeps for a random time in [0, max_us] microseconds with probability
// `percent`/100, with streams not lazy. Defaults: STRATA_EMU_DELAY_US (50) and
// STRATA_EMU_DELAY_PERCENT (20). STRATA_EMU_SEED (default 1, printed with any failure) seeds
// these draws and the lazy streams' orders.
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

// Releases every operation issued so far (as a synchronization does, without waiting).
void release();

// How many times cublasLtMatmulAlgoGetHeuristic has been called in this process.
uint64_t cublaslt_heuristic_queries();

// Fails the context with `report` (from a stream's worker).
void fail_context(const std::string& report);

}  // namespace strata::emu
