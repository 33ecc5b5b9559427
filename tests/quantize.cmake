# ZeRO++'s block-wise quantize kernels on the CPU: the AVX2 path against the scalar reference
# (bit-for-bit: cpu_kernels_test's CpuKernels.Quantize*), and their throughput.
strata_benchmark(bench_quantize ${CMAKE_CURRENT_LIST_DIR}/bench/bench_quantize.cc)
