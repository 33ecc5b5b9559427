# tools/gpu_check.py (the check on a GPU machine): the measuring tool it runs, built with or
# without CUDA (with --backend cpu it runs the same code on the CPU backend), and the tool's
# self-test, which needs no GPU: it runs every phase in its dry/CPU mode (the PyTorch peers
# through a stand-in interpreter) and validates the report it writes. Python 3.9+, stdlib only.
add_executable(bench_device_ops ${CMAKE_CURRENT_LIST_DIR}/bench/bench_device_ops.cc
                                ${CMAKE_CURRENT_LIST_DIR}/bench/bench_device_elementwise.cc)
target_link_libraries(bench_device_ops PRIVATE libstrata nlohmann_json::nlohmann_json)
find_package(Python3 3.9 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME gpu_check_self_test
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_SOURCE_DIR}/tools/gpu_check.py --self-test
                   --build-dir ${CMAKE_BINARY_DIR})
  set_tests_properties(gpu_check_self_test PROPERTIES TIMEOUT 600)
else()
  message(STATUS "gpu_check_self_test: no Python 3.9+ found; the test is not registered")
endif()

# tools/gpu_bundle.sh (gpu_check on a GPU machine that has the CUDA toolkit but none of strata's
# other build dependencies): packs this build's CUDA binaries and libraries, then runs the bundle
# dry (about 35 s, most of it xz). Only where the CUDA binaries are built.
if(STRATA_HAVE_CUDA)
  add_test(NAME gpu_bundle_self_test
           COMMAND ${CMAKE_SOURCE_DIR}/tools/gpu_bundle.sh --self-test ${CMAKE_BINARY_DIR})
  set_tests_properties(gpu_bundle_self_test PROPERTIES TIMEOUT 600)
endif()
