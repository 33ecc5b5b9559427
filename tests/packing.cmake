# Packed sequences masked per sequence: a window of conversations with positions against the
# conversations run alone (GPT-2, Llama, a mixture of experts), the data's positions, and
# strata eval on a packed chat file.
strata_test(packing_test ${CMAKE_CURRENT_LIST_DIR}/packing_test.cc)
