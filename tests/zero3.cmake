# ZeRO-3 across ranks in the trainer. zero3_test is a GoogleTest binary that also
# serves as its own MPI worker (`zero3_test --worker ...`): the tests launch it under
# `mpirun -np 2|3` (oversubscribed, --allow-run-as-root) and compare with a one-rank run
# in-process. Without MPI the multi-rank tests report skipped.
add_executable(zero3_test ${CMAKE_CURRENT_LIST_DIR}/zero3_test.cc
                          ${CMAKE_CURRENT_LIST_DIR}/zero3_finetune_test.cc)
target_link_libraries(zero3_test PRIVATE libstrata GTest::gtest)
target_compile_definitions(zero3_test PRIVATE STRATA_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
if(STRATA_HAVE_MPI)
  target_compile_definitions(zero3_test PRIVATE STRATA_MPIEXEC="${MPIEXEC_EXECUTABLE}")
endif()
gtest_discover_tests(zero3_test DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60
                     PROPERTIES TIMEOUT 900
                     ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")

# The IoWorker's per-extent read-after-write ordering (a lost wake-up there hung NVMe fetches).
strata_test(io_worker_test ${CMAKE_CURRENT_LIST_DIR}/io_worker_test.cc)
