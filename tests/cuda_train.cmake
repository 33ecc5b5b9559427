# A full training run on the CUDA backend against the CPU backend (skips without a GPU).
if(STRATA_HAVE_CUDA)
  strata_test(cuda_train_test ${CMAKE_CURRENT_LIST_DIR}/cuda_train_test.cc)
endif()
