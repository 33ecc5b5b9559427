add_test(NAME cli_test COMMAND ${CMAKE_CURRENT_LIST_DIR}/cli_test.sh $<TARGET_FILE:strata>
                               ${CMAKE_SOURCE_DIR})
set_tests_properties(cli_test PROPERTIES TIMEOUT 600)
