# Hugging Face checkpoints: the safetensors reader's validation (every malformed file is an error
# naming the file, the tensor and the offset) and its reads.
strata_test(safetensors_test ${CMAKE_CURRENT_LIST_DIR}/safetensors_test.cc)
strata_test(hf_config_test ${CMAKE_CURRENT_LIST_DIR}/hf_config_test.cc)
# model.from_pretrained against transformers: tests/fixtures/hf/ (tools/make_hf_fixtures.py)
# loaded and run; losses and every gradient compared with transformers' own; import errors.
strata_test(hf_compare_test ${CMAKE_CURRENT_LIST_DIR}/hf_compare_test.cc)
target_compile_definitions(hf_compare_test PRIVATE STRATA_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
