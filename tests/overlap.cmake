strata_test(overlap_test ${CMAKE_CURRENT_LIST_DIR}/overlap_test.cc)
strata_test(grouped_forwards_test ${CMAKE_CURRENT_LIST_DIR}/grouped_forwards_test.cc)
strata_test(schedule_fuzz_test ${CMAKE_CURRENT_LIST_DIR}/schedule_fuzz_test.cc)

# The offload benchmark on the simulated H200 (tests/bench/bench_sim_offload.py): GPT-2 124M with
# its optimizer in host RAM, every exact schedule at both norms, the plain one and the planner's
# optimizer ratio, 8 steps, one round. It prints each row's step against the all-on-device step
# and the optimizer alone, and the planner's step; no time is asserted (the numbers are the
# report). It fails where a run, a plan or the probe does. About a minute on 2 cores.
find_package(Python3 3.9 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME sim_offload_bench
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/bench/bench_sim_offload.py
                   $<TARGET_FILE:strata> --models gpt2 --steps 8 --rounds 1)
  set_tests_properties(sim_offload_bench PROPERTIES TIMEOUT 900 LABELS bench)
endif()
