# Storage engine tests: every backend and the fault wrapper, buffer pool, extent
# allocator, swap space and nvme_path preflight. Linked against the base and io libraries only
# (not all of libstrata), so storage tests build and run whatever state other areas are in.
add_executable(storage_test ${CMAKE_CURRENT_LIST_DIR}/storage_test.cc
                            ${CMAKE_CURRENT_LIST_DIR}/extent_allocator_test.cc)
target_link_libraries(storage_test PRIVATE strata_base strata_io GTest::gtest GTest::gtest_main)
gtest_discover_tests(storage_test DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60
                     PROPERTIES TIMEOUT 900)
