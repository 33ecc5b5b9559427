# The CUDA backend without a GPU: every kernels/cuda/*.cu file, translated
# (tests/cuda_emu/translate.cmake) and compiled as C++ against the CPU emulation of CUDA
# (tests/cuda_emu.h), with the real backend's host code (kernels/cuda/cuda_device.cc,
# cuda_kernels.cc, unchanged) over a CPU stand-in for the CUDA runtime and cuBLASLt
# (tests/cuda_emu/runtime.cc, cublaslt.cc). Needs no CUDA toolkit: the stand-in's headers
# (tests/cuda_emu/include) replace the toolkit's. Built and run everywhere.
set(strata_emu_dir ${CMAKE_CURRENT_LIST_DIR}/cuda_emu)
file(GLOB strata_emu_cu CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/kernels/cuda/*.cu)
set(strata_emu_generated)
foreach(cu ${strata_emu_cu})
  get_filename_component(name ${cu} NAME_WE)
  set(out ${CMAKE_CURRENT_BINARY_DIR}/cuda_emu/${name}.cc)
  add_custom_command(
    OUTPUT ${out}
    COMMAND ${CMAKE_COMMAND} -DIN=${cu} -DOUT=${out} -P ${strata_emu_dir}/translate.cmake
    DEPENDS ${cu} ${strata_emu_dir}/translate.cmake
    COMMENT "cuda_emu: translating ${name}.cu" VERBATIM)
  list(APPEND strata_emu_generated ${out})
endforeach()

# The emulated backend. The kernels' 16-byte copies read 16-bit data through a vector type, as
# CUDA code does (no strict aliasing); nothing is contracted into fused multiply-adds, as nvcc
# is told for adamw.cu (--fmad=false).
add_library(strata_cuda_emu OBJECT ${strata_emu_generated} ${strata_emu_dir}/runtime.cc
            ${strata_emu_dir}/device_memory.cc
            ${strata_emu_dir}/cublaslt.cc ${CMAKE_SOURCE_DIR}/kernels/cuda/cuda_device.cc
            ${CMAKE_SOURCE_DIR}/kernels/cuda/cuda_kernels.cc
            ${CMAKE_SOURCE_DIR}/kernels/cuda/library_attention.cc
            ${CMAKE_SOURCE_DIR}/kernels/cuda/no_cudnn.cc)
target_include_directories(strata_cuda_emu BEFORE PUBLIC ${strata_emu_dir}/include)
target_compile_options(strata_cuda_emu PRIVATE -fno-strict-aliasing -ffp-contract=off)
target_link_libraries(strata_cuda_emu PUBLIC strata_options)

# The communicators, the nccl one on the NCCL stand-in (tests/cuda_emu/nccl.cc).
get_target_property(strata_emu_comm_sources strata_comm SOURCES)
list(FILTER strata_emu_comm_sources EXCLUDE REGEX "nccl_comm")
list(TRANSFORM strata_emu_comm_sources PREPEND ${CMAKE_SOURCE_DIR}/src/comm/ REGEX "^[^/]")
add_library(strata_comm_emu OBJECT ${strata_emu_comm_sources} ${CMAKE_SOURCE_DIR}/src/comm/nccl_comm.cc
            ${strata_emu_dir}/nccl.cc)
target_include_directories(strata_comm_emu BEFORE PRIVATE ${strata_emu_dir}/include)
target_compile_definitions(strata_comm_emu PRIVATE STRATA_HAVE_CUDA=1 STRATA_HAVE_NCCL=1)
target_link_libraries(strata_comm_emu PUBLIC strata_options nlohmann_json::nlohmann_json)
if(STRATA_HAVE_MPI)
  target_link_libraries(strata_comm_emu PUBLIC MPI::MPI_CXX)
endif()

# libstrata with the emulated CUDA backend in place of the real one (or of no_cuda.cc).
add_library(libstrata_cuda_emu STATIC)
target_link_libraries(libstrata_cuda_emu PUBLIC strata_base strata_io strata_cpu_optim
                                                strata_kernels_cpu strata_cuda_emu strata_core
                                                strata_comm_emu)

# strata_emu_test(NAME src... [FILTER gtest-filter]): strata_test's twin linked with the emulated
# backend; FILTER leaves out tests too slow for CI under emulation.
function(strata_emu_test name)
  cmake_parse_arguments(PARSE_ARGV 1 emu "" "FILTER" "")
  set(filter)
  if(emu_FILTER)
    set(filter TEST_FILTER ${emu_FILTER})
  endif()
  add_executable(${name} ${emu_UNPARSED_ARGUMENTS})
  target_link_libraries(${name} PRIVATE libstrata_cuda_emu GTest::gtest GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE STRATA_SOURCE_DIR="${CMAKE_SOURCE_DIR}"
                                             STRATA_CUDA_EMU=1)
  target_compile_options(${name} PRIVATE -fno-strict-aliasing -ffp-contract=off)
  gtest_discover_tests(${name} DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60 ${filter}
                       PROPERTIES TIMEOUT 900 LABELS cuda_emu)
endfunction()

# Every kernel file's launchers, in both thread orders, against the CPU backend's kernels.
strata_emu_test(cuda_emu_kernels_test ${CMAKE_CURRENT_LIST_DIR}/cuda_emu_kernels_test.cc)
strata_emu_test(cuda_emu_norms_test ${CMAKE_CURRENT_LIST_DIR}/cuda_emu_norms_test.cc)
# The fused elementwise ops (residual + norm; the DGELU epilogue on the cuBLASLt stand-in).
strata_emu_test(cuda_emu_fused_test ${CMAKE_CURRENT_LIST_DIR}/cuda_emu_fused_test.cc)

# The GPU tests themselves, unchanged, on the emulated backend: create_cuda_device finds the
# emulated GPU, so nothing skips.
strata_emu_test(cuda_backend_emu_test ${CMAKE_CURRENT_LIST_DIR}/cuda_backend_test.cc)
# strata generate on the CUDA backend: a dense fixture and a mixture, greedy = transformers',
# the key/value cache (attention_decode.cu) against the whole window's forward.
strata_emu_test(hf_generate_emu_test ${CMAKE_CURRENT_LIST_DIR}/hf_generate_test.cc)
# Without the T = 2081 comparison with the plain kernels (O(T^2) per head: ~3 min emulated);
# the fused kernels at T up to 257 against the CPU twin and the double reference stay.
strata_emu_test(cuda_flash_attention_emu_test ${CMAKE_CURRENT_LIST_DIR}/cuda_flash_attention_test.cc
                FILTER "-*AtALongSequence")
# The choice between cuDNN's fused attention and the own kernels (kernels/cuda/attention_library.h):
# cuDNN absent or turned off, and a test double standing in for it.
strata_emu_test(cuda_library_attention_emu_test
                ${CMAKE_CURRENT_LIST_DIR}/cuda_library_attention_test.cc)
strata_emu_test(llama_cuda_emu_test ${CMAKE_CURRENT_LIST_DIR}/llama_cuda_test.cc)
strata_emu_test(cuda_train_emu_test ${CMAKE_CURRENT_LIST_DIR}/cuda_train_test.cc)
# The CUDA backend on 2 ranks under mpirun, the NCCL stand-in's collectives over MPI, against one
# rank (tests/zero3_test.cc's worker mode).
if(STRATA_HAVE_MPI)
  strata_emu_test(zero3_emu_test ${CMAKE_CURRENT_LIST_DIR}/zero3_test.cc FILTER "Zero3Cuda.*")
  target_compile_definitions(zero3_emu_test PRIVATE STRATA_MPIEXEC="${MPIEXEC_EXECUTABLE}")
endif()
# The emulation's own checks, each shown to fire.
strata_emu_test(cuda_emu_checks_test ${CMAKE_CURRENT_LIST_DIR}/cuda_emu_checks_test.cc)
# The attention kernels (plain and flash, with and without positions), on the same fixture.
strata_emu_test(cuda_emu_attention_test ${CMAKE_CURRENT_LIST_DIR}/cuda_emu_attention_test.cc)
