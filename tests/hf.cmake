# Hugging Face checkpoints: the safetensors reader's validation (every malformed file is an error
# naming the file, the tensor and the offset) and its reads.
strata_test(safetensors_test ${CMAKE_CURRENT_LIST_DIR}/safetensors_test.cc)
strata_test(hf_config_test ${CMAKE_CURRENT_LIST_DIR}/hf_config_test.cc)
