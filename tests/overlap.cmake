strata_test(overlap_test ${CMAKE_CURRENT_LIST_DIR}/overlap_test.cc)
strata_test(grouped_forwards_test ${CMAKE_CURRENT_LIST_DIR}/grouped_forwards_test.cc)
strata_test(schedule_fuzz_test ${CMAKE_CURRENT_LIST_DIR}/schedule_fuzz_test.cc)
