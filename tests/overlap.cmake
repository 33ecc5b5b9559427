strata_test(overlap_test ${CMAKE_CURRENT_LIST_DIR}/overlap_test.cc)
