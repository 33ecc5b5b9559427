# Adversarial cases (docs/RELIABILITY.md): hardening_test (in-process) and the command-line
# cases that need the binary, a real mpirun and signals (hardening_cli_test.sh).
strata_test(hardening_test ${CMAKE_CURRENT_LIST_DIR}/hardening_test.cc)
# Round 2: the Hugging Face import and export, the metrics log, the checkpoint directory
# (hardening2_test), and their command-line cases (hardening2_cli_test.sh).
strata_test(hardening2_test ${CMAKE_CURRENT_LIST_DIR}/hardening2_test.cc)
add_test(NAME hardening2_cli_test
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/hardening2_cli_test.sh $<TARGET_FILE:strata>
                 ${CMAKE_SOURCE_DIR})
set_tests_properties(hardening2_cli_test PROPERTIES TIMEOUT 300)
add_test(NAME hardening_cli_test
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/hardening_cli_test.sh $<TARGET_FILE:strata>
                 ${CMAKE_SOURCE_DIR} "${MPIEXEC_EXECUTABLE}")
# Without mpirun the Ctrl-C cases (and crash_test's two ranks) cannot run: exit 77, skipped.
set_tests_properties(hardening_cli_test PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT
                     "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
# Crash consistency: SIGKILL at random moments (1 and 2 ranks), resume, losses bit for bit; and
# export --adapter killed at random moments over another run's adapter: the old pair or the new.
add_test(NAME crash_test COMMAND ${CMAKE_CURRENT_LIST_DIR}/crash_test.sh $<TARGET_FILE:strata>
                                 ${CMAKE_SOURCE_DIR} "${MPIEXEC_EXECUTABLE}")
set_tests_properties(crash_test PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT
                     "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
# Round 3: generate of a LoRA checkpoint, export --adapter's guards and its two files landing
# together, plan --write-config's guard (hardening3_cli_test.sh).
add_test(NAME hardening3_cli_test
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/hardening3_cli_test.sh $<TARGET_FILE:strata>
                 ${CMAKE_SOURCE_DIR})
set_tests_properties(hardening3_cli_test PROPERTIES TIMEOUT 300)
