# The planner and the machine probe (issue #8).
strata_test(plan_test ${CMAKE_CURRENT_LIST_DIR}/plan_test.cc)
# `strata plan` for GPT-3 175B on 8 x 80 GiB answers (a placement or why none fits) at once.
add_test(NAME plan_cli_gpt3_175b
         COMMAND strata plan --model gpt3-175b --gpus 8 --gpu-mem 80GiB --host-mem 1TiB
                 --nvme /tmp:6 --seq 512)
set_tests_properties(plan_cli_gpt3_175b PROPERTIES TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "best: [a-z+-]+ .* s/step|no placement fits")
# A stale profile is refused with the command that regenerates it.
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/stale_profile.json
     "{\"magic\": \"strata-machine-profile\", \"version\": 0}\n")
add_test(NAME plan_cli_stale_profile
         COMMAND strata plan --model gpt2-124m
                 --profile ${CMAKE_CURRENT_BINARY_DIR}/stale_profile.json)
set_tests_properties(plan_cli_stale_profile PROPERTIES
                     PASS_REGULAR_EXPRESSION "version 0 is not the version 1.*strata probe")
