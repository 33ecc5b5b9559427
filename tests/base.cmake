strata_test(base_test ${CMAKE_CURRENT_LIST_DIR}/base_test.cc)
strata_test(cpu_device_test ${CMAKE_CURRENT_LIST_DIR}/cpu_device_test.cc)
strata_test(sim_device_test ${CMAKE_CURRENT_LIST_DIR}/sim_device_test.cc)
strata_test(op_profile_test ${CMAKE_CURRENT_LIST_DIR}/op_profile_test.cc)
