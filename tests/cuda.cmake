# CUDA backend: every op against the CPU backend, the device features, and the
# no-GPU path. Built only with CUDA; without a visible GPU its GPU tests report SKIPPED with the
# reason and CudaUnavailable.* checks that the factory explains why.
if(STRATA_HAVE_CUDA)
  strata_test(cuda_backend_test ${CMAKE_CURRENT_LIST_DIR}/cuda_backend_test.cc)
endif()
