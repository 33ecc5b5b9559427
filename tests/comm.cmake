# Communicator tests.
#   comm_test:      single backend, shard layout, probe JSON, the rank-order reduction, the nccl
#                   backend (skipped without a GPU), and the MpiFault tests, which launch
#                   comm_mpi_test under mpirun with a rank that hangs or dies.
#   comm_mpi_test:  every collective under `mpirun -np 2` and `-np 3` (oversubscribed; root needs
#                   --allow-run-as-root). Not gtest-discovered: one ctest entry per world size,
#                   failing if any rank fails.
strata_test(comm_test ${CMAKE_CURRENT_LIST_DIR}/comm_test.cc)
if(STRATA_HAVE_MPI)
  add_executable(comm_mpi_test ${CMAKE_CURRENT_LIST_DIR}/comm_mpi_test.cc)
  target_link_libraries(comm_mpi_test PRIVATE libstrata GTest::gtest)
  add_dependencies(comm_test comm_mpi_test)
  target_compile_definitions(comm_test PRIVATE
    STRATA_MPIEXEC="${MPIEXEC_EXECUTABLE}"
    STRATA_COMM_MPI_TEST="$<TARGET_FILE:comm_mpi_test>")
  foreach(np 2 3)
    add_test(NAME comm_mpi_np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np}
                     $<TARGET_FILE:comm_mpi_test>)
    set_tests_properties(comm_mpi_np${np} PROPERTIES TIMEOUT 600
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;STRATA_COMM_TIMEOUT_S=120")
  endforeach()
endif()
