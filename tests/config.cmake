strata_test(config_test ${CMAKE_CURRENT_LIST_DIR}/config_test.cc)
# The test reads configs/ and docs/CONFIG.md from the source tree.
strata_test(config_keys_test ${CMAKE_CURRENT_LIST_DIR}/config_keys_test.cc)
