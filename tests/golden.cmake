# The recorded losses of six reference runs (tests/golden/), compared bit for bit: a change
# that claims not to change the numbers must leave every step's loss as it is.
add_test(NAME golden_losses COMMAND ${CMAKE_CURRENT_LIST_DIR}/golden_losses.sh
                                    $<TARGET_FILE:strata>)
# A run that cannot start (no mpirun) is exit 77, skipped; under CI=true it fails.
set_tests_properties(golden_losses PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77 ENVIRONMENT
                     "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
