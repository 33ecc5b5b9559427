strata_test(trainer_test ${CMAKE_CURRENT_LIST_DIR}/trainer_test.cc)
strata_test(schedule_data_test ${CMAKE_CURRENT_LIST_DIR}/schedule_data_test.cc)
strata_test(sft_data_test ${CMAKE_CURRENT_LIST_DIR}/sft_data_test.cc)
