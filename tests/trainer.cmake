strata_test(trainer_test ${CMAKE_CURRENT_LIST_DIR}/trainer_test.cc)
strata_test(schedule_data_test ${CMAKE_CURRENT_LIST_DIR}/schedule_data_test.cc)
strata_test(sft_data_test ${CMAKE_CURRENT_LIST_DIR}/sft_data_test.cc)
# Preference pairs (DPO data): the mask header's kind, pairs of rows cut at T + 1, the same rows
# over ranks, the held-out split by pairs.
strata_test(preference_data_test ${CMAKE_CURRENT_LIST_DIR}/preference_data_test.cc)
# DPO's sigmoid loss on the host: the pair's loss and slope, the rows' weights against a finite
# difference, the metrics.
strata_test(preference_test ${CMAKE_CURRENT_LIST_DIR}/preference_test.cc)
