# Vectorized CPU optimizers (cpu_optim/): tests and the bandwidth benchmark.
strata_test(cpu_optim_test ${CMAKE_CURRENT_LIST_DIR}/cpu_optim_test.cc)
strata_benchmark(bench_cpu_optim ${CMAKE_CURRENT_LIST_DIR}/bench/bench_cpu_optim.cc)
