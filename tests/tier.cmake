strata_test(tier_test ${CMAKE_CURRENT_LIST_DIR}/tier_test.cc)
strata_test(host_memory_test ${CMAKE_CURRENT_LIST_DIR}/host_memory_test.cc)
# The host tier's need as the memory model counts it.
strata_test(host_memory_model_test ${CMAKE_CURRENT_LIST_DIR}/host_memory_model_test.cc)
strata_test(unaddressable_grads_test ${CMAKE_CURRENT_LIST_DIR}/unaddressable_grads_test.cc)
# The optimizer on the device, on the CPU backend and on a device the host cannot address.
strata_test(device_optimizer_test ${CMAKE_CURRENT_LIST_DIR}/device_optimizer_test.cc)
