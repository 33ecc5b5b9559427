// The process's memory, for the trainer's peak-RSS report and its bound on the malloc heap.
#pragma once

#include <cstddef>

namespace strata {

// A "Vm...:" line of /proc/self/status in bytes, e.g. proc_status_bytes("VmRSS:") (0 where
// there is none).
size_t proc_status_bytes(const char* key);
// The peak resident set (VmHWM).
inline size_t peak_rss_bytes() { return proc_status_bytes("VmHWM:"); }

// Keeps the process's malloc heap to what is live. glibc's default mmap threshold rises to the
// size of each large block freed (up to 32 MiB), after which blocks of that size come from the
// heap and its per-thread arenas; the CPU backend's device buffers and kernel scratch (modules
// of tens of MiB, allocated and freed as they are fetched) then fragment the heap, whose freed
// pages stay resident: a 190M-parameter run on a 640 MiB device arena and a 256 MiB host tier
// peaked at 2.0 GiB resident for 0.95 GiB live. A fixed threshold of 1 MiB makes every larger
// block its own mapping, returned to the system when freed (at the cost of faulting its pages
// in afresh: 5-12% more CPU time, measured on that run and a 4-layer A/B). Setting a threshold
// also freezes the trim threshold at glibc's 128 KiB: each per-thread heap gave back its free
// top past 128 KiB and faulted it in again, inside every oneDNN GEMM call (its scratchpad and
// packing buffers under 1 MiB): bench-25m on a 100 MiB device faulted 0.5-0.75 million pages
// in 14 steps. The trim threshold is 8 MiB: ~31 thousand faults, all at start (8 and 64 MiB
// alike, hostmem-190m too; docs/BENCHMARKS.md, host memory). MALLOC_MMAP_THRESHOLD_ /
// MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES in the environment take precedence.
void bound_malloc_heap();

}  // namespace strata
