strata_test(overlap_test ${CMAKE_CURRENT_LIST_DIR}/overlap_test.cc)
target_compile_definitions(overlap_test PRIVATE STRATA_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
