# Hugging Face checkpoints: the safetensors reader's validation (every malformed file is an error
# naming the file, the tensor and the offset) and its reads.
strata_test(safetensors_test ${CMAKE_CURRENT_LIST_DIR}/safetensors_test.cc)
strata_test(hf_config_test ${CMAKE_CURRENT_LIST_DIR}/hf_config_test.cc)
# model.from_pretrained against transformers: tests/fixtures/hf/ (tools/make_hf_fixtures.py)
# loaded and run; losses and every gradient compared with transformers' own; DPO's loss and every
# gradient against torch's (llama/dpo.safetensors, tools/make_dpo_fixture.py); import errors.
strata_test(hf_compare_test ${CMAKE_CURRENT_LIST_DIR}/hf_compare_test.cc)
# strata generate's decoder: greedy tokens = transformers' for every fixture (the mixtures
# included), the key/value cache against the whole window's forward, sampling, the context's end.
strata_test(hf_generate_test ${CMAKE_CURRENT_LIST_DIR}/hf_generate_test.cc)
# strata eval against transformers' loss over the fixtures' token corpora; any placement; a
# checkpoint evaluates as its export; a corpus shorter than one window is an error.
strata_test(hf_eval_test ${CMAKE_CURRENT_LIST_DIR}/hf_eval_test.cc)
# strata export -> transformers' AutoModelForCausalLM.from_pretrained gives the reference losses
# (tools/check_hf_export.py). Needs torch + transformers: set STRATA_HF_PYTHON to a python that
# has them; without them the script exits 77 and ctest reports the test as skipped.
if(DEFINED ENV{STRATA_HF_PYTHON})
  set(strata_hf_python $ENV{STRATA_HF_PYTHON})
else()
  find_program(strata_hf_python NAMES python3)
endif()
if(strata_hf_python)
  add_test(NAME hf_export_transformers
           COMMAND ${strata_hf_python} ${CMAKE_SOURCE_DIR}/tools/check_hf_export.py
                   --strata $<TARGET_FILE:strata>)
  set_tests_properties(hf_export_transformers PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
  # The masked (SFT) loss: prepare_data --chat + strata eval against transformers' loss with
  # labels = -100 on the same packed windows, per sequence and per window (data.packing;
  # tools/check_sft_loss.py; skipped without them).
  add_test(NAME sft_loss_transformers
           COMMAND ${strata_hf_python} ${CMAKE_SOURCE_DIR}/tools/check_sft_loss.py
                   --strata $<TARGET_FILE:strata>)
  set_tests_properties(sft_loss_transformers PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
  # tools/prepare_data.py: errors as one line with the file and line, bounded memory on a 16 MB
  # line, empty outputs refused, the input never overwritten, killed before every rename and at
  # random moments the old set or the new one (PREPARE_KILLS; a test double of transformers).
  add_test(NAME prepare_data COMMAND ${strata_hf_python} ${CMAKE_CURRENT_LIST_DIR}/prepare_data_test.py)
  set_tests_properties(prepare_data PROPERTIES TIMEOUT 600)
  # prepare_data on the dataset shapes (text, messages, conversations, alpaca, prompt-completion)
  # from JSONL and Parquet: tokens and masks against a hand-written expectation, the errors
  # naming file, row and column, bounded memory over many row groups (the Parquet cases need
  # pyarrow in this python and say so when they skip).
  add_test(NAME prepare_data_shapes
           COMMAND ${strata_hf_python} ${CMAKE_CURRENT_LIST_DIR}/prepare_data_shapes_test.py)
  set_tests_properties(prepare_data_shapes PROPERTIES TIMEOUT 600 ENVIRONMENT
                      "PYTHONPATH=${CMAKE_SOURCE_DIR}/build-deps/python-tools")
  # prepare_data --format preference (DPO's pairs): each form, chosen then rejected per pair, the
  # mask header's "pairs" word, the held-out split by pairs, the errors; the generated fixture
  # tests/fixtures/chat/tiny_preference.jsonl with the tiny Llama tokenizer.
  add_test(NAME prepare_data_preference
           COMMAND ${strata_hf_python} ${CMAKE_CURRENT_LIST_DIR}/prepare_data_preference_test.py)
  set_tests_properties(prepare_data_preference PROPERTIES TIMEOUT 600 ENVIRONMENT
                      "PYTHONPATH=${CMAKE_SOURCE_DIR}/build-deps/python-tools")
  # tools/hf_tokenizer.py encode DIR MAX (strata generate): a prompt past the context refused
  # after a piece of it is encoded, in bounded memory; within it, the whole prompt's ids.
  add_test(NAME hf_tokenizer COMMAND ${strata_hf_python} ${CMAKE_CURRENT_LIST_DIR}/hf_tokenizer_test.py)
  set_tests_properties(hf_tokenizer PROPERTIES TIMEOUT 300)
endif()
# The fine-tuning path through the CLI: plan --hf --write-config trains from the checkpoint
# (first-step loss == strata eval), metrics every step to JSONL, TensorBoard (read back with
# TensorBoard's reader where STRATA_HF_PYTHON has it) and CSV, a missing nvme_path created.
add_test(NAME hf_finetune_cli COMMAND ${CMAKE_CURRENT_LIST_DIR}/hf_finetune_cli_test.sh
                                      $<TARGET_FILE:strata> ${CMAKE_SOURCE_DIR})
set_tests_properties(hf_finetune_cli PROPERTIES TIMEOUT 600)
# The round trip on shapes drawn at random (GPT-2, Llama with GQA/biases/rope scaling, Mixtral,
# Qwen2-MoE; one file or shards): config.json and every weight back bit for bit.
strata_test(hf_roundtrip_fuzz_test ${CMAKE_CURRENT_LIST_DIR}/hf_roundtrip_fuzz_test.cc)
