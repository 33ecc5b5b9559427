# The planner and the machine probe.
strata_test(plan_test ${CMAKE_CURRENT_LIST_DIR}/plan_test.cc)
# Its model of the optimizer pass: pipeline sub-groups, deferred peaks, read-ahead, time, undo.
strata_test(plan_optimizer_test ${CMAKE_CURRENT_LIST_DIR}/plan_optimizer_test.cc)
# The planner against the tier manager's preflight and the trainer's reading of a config.
strata_test(plan_engine_test ${CMAKE_CURRENT_LIST_DIR}/plan_engine_test.cc)
# `strata plan` for GPT-3 175B on 8 x 80 GiB answers (a placement or why none fits) at once.
add_test(NAME plan_cli_gpt3_175b
         COMMAND strata plan --model gpt3-175b --gpus 8 --gpu-mem 80GiB --host-mem 1TiB
                 --nvme /tmp:6 --seq 512)
set_tests_properties(plan_cli_gpt3_175b PROPERTIES TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "best: [a-z+-]+ .* s/step|no placement fits")
# A shape beyond what a config takes is refused at once (a billion layers planned for minutes,
# gigabytes of layout, before the key table's ranges applied to --layers and --hf).
add_test(NAME plan_cli_layers_beyond_range
         COMMAND strata plan --layers 1073741824 --width 64 --heads 1)
set_tests_properties(plan_cli_layers_beyond_range PROPERTIES TIMEOUT 30
                     PASS_REGULAR_EXPRESSION "the model shape: model.n_layer: 1073741824 out of range")
# A stale profile is refused with the command that regenerates it.
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/stale_profile.json
     "{\"magic\": \"strata-machine-profile\", \"version\": 0}\n")
add_test(NAME plan_cli_stale_profile
         COMMAND strata plan --model gpt2-124m
                 --profile ${CMAKE_CURRENT_BINARY_DIR}/stale_profile.json)
set_tests_properties(plan_cli_stale_profile PROPERTIES
                     PASS_REGULAR_EXPRESSION "version 0 is not the version 1.*strata probe")
# `strata plan --hf DIR`: the shape of a transformers config.json (the llama fixture: 2 layers,
# grouped-query attention 4/2, SwiGLU 48, untied head), planned with Llama's arithmetic.
add_test(NAME plan_cli_hf_llama
         COMMAND strata plan --hf ${CMAKE_SOURCE_DIR}/tests/fixtures/hf/llama --backend cpu)
set_tests_properties(plan_cli_hf_llama PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION
                     "Llama 2 layers, 4 heads \\(2 key/value\\), width 32, MLP 48, vocab 100")
# A config that leaves strata.placement.grads unset is planned with the engine's default for
# the gradients: hostmem-2b's 2B-parameter fp32 gradients do not fit its 2 GiB host budget, so
# they go to NVMe, and the config's placement (all-nvme) fits.
add_test(NAME plan_cli_grads_default
         COMMAND strata plan --config ${CMAKE_SOURCE_DIR}/configs/hostmem-2b.json)
set_tests_properties(plan_cli_grads_default PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION
                     "asks for all-nvme: fits")
# The planner on a simulated fast device: its compute, the schedule a run picks, the ratio.
strata_test(plan_sim_test ${CMAKE_CURRENT_LIST_DIR}/plan_sim_test.cc)
