# The fused attention: the CPU backend's against a scalar reference and the plain attention, and
# the CUDA kernels on a CPU emulation of CUDA (runs everywhere, no GPU needed). The kernels'
# 16-byte copies read 16-bit data through a vector type, as CUDA code does: no strict aliasing.
strata_test(flash_attention_test ${CMAKE_CURRENT_LIST_DIR}/flash_attention_test.cc)
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/flash_attention_test.cc PROPERTIES
                            COMPILE_OPTIONS "-fno-strict-aliasing")
# The CUDA fused attention against the CPU backend on a GPU (skips with the reason without one).
if(STRATA_HAVE_CUDA)
  strata_test(cuda_flash_attention_test ${CMAKE_CURRENT_LIST_DIR}/cuda_flash_attention_test.cc)
endif()
