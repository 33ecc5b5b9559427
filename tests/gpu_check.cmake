# tools/gpu_check.sh (the first run on a GPU): the measuring tool it runs, built with or without
# CUDA (with --backend cpu it runs the same code on the CPU backend), and the script's self-test,
# which needs no GPU: it runs every phase in its dry/CPU mode and validates the report it writes.
add_executable(bench_device_ops ${CMAKE_CURRENT_LIST_DIR}/bench_device_ops.cc)
target_link_libraries(bench_device_ops PRIVATE libstrata nlohmann_json::nlohmann_json)
add_test(NAME gpu_check_self_test
         COMMAND ${CMAKE_SOURCE_DIR}/tools/gpu_check.sh --self-test --build-dir ${CMAKE_BINARY_DIR})
set_tests_properties(gpu_check_self_test PROPERTIES TIMEOUT 600)

# tools/gpu_bundle.sh (gpu_check on a GPU machine that has the CUDA toolkit but none of strata's
# other build dependencies): packs this build's CUDA binaries and libraries, then runs the bundle
# dry (about 35 s, most of it xz). Only where the CUDA binaries are built.
if(STRATA_HAVE_CUDA)
  add_test(NAME gpu_bundle_self_test
           COMMAND ${CMAKE_SOURCE_DIR}/tools/gpu_bundle.sh --self-test ${CMAKE_BINARY_DIR})
  set_tests_properties(gpu_bundle_self_test PROPERTIES TIMEOUT 600)
endif()
