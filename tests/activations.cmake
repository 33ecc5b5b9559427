strata_test(activations_test ${CMAKE_CURRENT_LIST_DIR}/activations_test.cc)
