# Adversarial cases (docs/RELIABILITY.md), each with the unit it breaks (their shared helpers:
# tests/adversarial_util.h): the checkpoint directory, checkpoint metadata, the stop signals,
# links and swap files, the metrics log, inputs that crashed, the Hugging Face import and export;
# and the command-line cases that need the binary, a real mpirun and signals
# (hardening*_cli_test.sh).
foreach(unit checkpoint_dir checkpoint_meta stop_signals safe_paths metrics_log input_errors
        hf_guards)
  strata_test(${unit}_test ${CMAKE_CURRENT_LIST_DIR}/${unit}_test.cc)
endforeach()
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
