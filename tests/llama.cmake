# Llama-family models: the RMSNorm, SwiGLU, RoPE and grouped-query attention kernels against
# double-precision references and finite differences (CPU), and their CUDA twins against the
# CPU backend (built only with CUDA; without a visible GPU they report SKIPPED with the reason).
strata_test(llama_kernels_test ${CMAKE_CURRENT_LIST_DIR}/llama_kernels_test.cc)
if(STRATA_HAVE_CUDA)
  strata_test(llama_cuda_test ${CMAKE_CURRENT_LIST_DIR}/llama_cuda_test.cc)
endif()
# model.type llama through the trainer: bit-identical losses across placements and modes.
strata_test(llama_train_test ${CMAKE_CURRENT_LIST_DIR}/llama_train_test.cc)
# A Llama under ZeRO-3 on 2 MPI ranks through the strata command (train on host and NVMe, export
# and eval of the sharded checkpoint) against one rank; reports skipped without MPI.
strata_test(llama_zero3_test ${CMAKE_CURRENT_LIST_DIR}/llama_zero3_test.cc)
add_dependencies(llama_zero3_test strata)
target_compile_definitions(llama_zero3_test PRIVATE STRATA_BIN="$<TARGET_FILE:strata>")
if(STRATA_HAVE_MPI)
  target_compile_definitions(llama_zero3_test PRIVATE STRATA_MPIEXEC="${MPIEXEC_EXECUTABLE}")
endif()
