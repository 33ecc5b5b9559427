# CPU kernels: every op against double-precision references, gradient checks, determinism.
strata_test(cpu_kernels_test ${CMAKE_CURRENT_LIST_DIR}/cpu_kernels_test.cc)
# The GEMM paths (baseline, avx2, onednn) each forced: the GEMM, the linear layer, the selection.
# Input gradients written instead of accumulated: the bits of an accumulation into zeros.
strata_test(written_gradients_test ${CMAKE_CURRENT_LIST_DIR}/written_gradients_test.cc)
strata_test(cpu_gemm_paths_test ${CMAKE_CURRENT_LIST_DIR}/cpu_gemm_paths_test.cc)
strata_test(cpu_kernels_gradcheck_test ${CMAKE_CURRENT_LIST_DIR}/cpu_kernels_gradcheck_test.cc)
strata_benchmark(bench_matmul ${CMAKE_CURRENT_LIST_DIR}/bench/bench_matmul.cc)
# The fused elementwise ops (residual + norm, GELU backward in the matmul) against the calls they
# replace, bit for bit, and GPT-2 and Llama steps fused and not.
strata_test(fused_ops_test ${CMAKE_CURRENT_LIST_DIR}/fused_ops_test.cc)
