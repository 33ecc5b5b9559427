# libFuzzer targets for everything strata parses from users or files (tests/fuzz/): the config
# file and --set values, checkpoints and shard manifests, token files, machine profiles. Only
# with -DSTRATA_FUZZ=ON and clang (tools/dev.sh fuzz sets both up in build-fuzz/).
option(STRATA_FUZZ "libFuzzer targets for the parsers (clang; tests/fuzz)" OFF)
set(STRATA_FUZZ_SECONDS 20 CACHE STRING "how long each fuzz_* ctest entry fuzzes")
if(STRATA_FUZZ)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/fuzz ${CMAKE_CURRENT_BINARY_DIR}/fuzz)
endif()
