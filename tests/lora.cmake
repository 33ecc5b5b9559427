# LoRA adapters over a frozen base: forward loss and adapter gradients against peft's on the
# tiny Llama, Qwen2 and GPT-2 fixtures (tests/fixtures/hf/lora-*, tools/make_lora_fixtures.py),
# bad lora sections and adapters refused, training with the base frozen on every placement,
# exact resume.
strata_test(lora_test ${CMAKE_CURRENT_LIST_DIR}/lora_test.cc)
strata_test(lora_config_test ${CMAKE_CURRENT_LIST_DIR}/lora_config_test.cc)
# strata export --adapter -> peft.PeftModel.from_pretrained gives strata eval's loss, and the
# merged export -> transformers the same (tools/check_lora_export.py). Needs torch, transformers
# and peft in STRATA_HF_PYTHON's interpreter (tests/hf.cmake sets strata_hf_python); without
# them the script exits 77 and ctest reports the test as skipped.
if(strata_hf_python)
  add_test(NAME lora_export_peft
           COMMAND ${strata_hf_python} ${CMAKE_SOURCE_DIR}/tools/check_lora_export.py
                   --strata $<TARGET_FILE:strata>)
  set_tests_properties(lora_export_peft PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
# NF4 (QLoRA's 4-bit NormalFloat, src/base/nf4.h) bit for bit against bitsandbytes'
# (tests/fixtures/nf4, tools/make_nf4_fixture.py).
strata_test(nf4_test ${CMAKE_CURRENT_LIST_DIR}/nf4_test.cc)
# A quantized base (lora.base_quantization nf4 / int8, src/model/base_quant.h): the stored layout
# and its fill, the device's dequantization, losses equal to those over the dequantized weights,
# the stored size in the tiers, every placement alike, exact resume, bad sections refused.
strata_test(qlora_test ${CMAKE_CURRENT_LIST_DIR}/qlora_test.cc)
# QLoRA against bitsandbytes + peft: strata eval's loss of an nf4-base LoRA run equals peft's over
# transformers' 4-bit NF4 model with the exported adapter (tools/check_qlora_bnb.py; skipped,
# exit 77, without torch, transformers, peft and bitsandbytes).
if(strata_hf_python)
  add_test(NAME qlora_bnb_peft
           COMMAND ${strata_hf_python} ${CMAKE_SOURCE_DIR}/tools/check_qlora_bnb.py
                   --strata $<TARGET_FILE:strata>)
  set_tests_properties(qlora_bnb_peft PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
# A published-style LoRA recipe end to end (configs/lora-chat-recipe.json, README): Parquet chat
# data through prepare_data, training, an exact resume, export --adapter (peft loads it where it
# is installed) and generate, on the tiny Llama, Mixtral, Qwen3, Qwen3-MoE and Phi-3
# (tests/recipe_cli_test.sh; exit 77, skipped, without transformers, jinja2 and pyarrow, which
# tools/dev.sh deps installs).
if(strata_hf_python)
  add_test(NAME lora_recipe
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/recipe_cli_test.sh $<TARGET_FILE:strata>
                   ${CMAKE_SOURCE_DIR})
  set_tests_properties(lora_recipe PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 ENVIRONMENT
                       "STRATA_HF_PYTHON=${strata_hf_python}")
endif()
# Preference training (DPO) end to end (configs/lora-dpo-recipe.json, README): prepare_data
# --format preference, ln 2 at the first step, the held-out reward accuracy rising, an exact
# resume, full fine-tuning against transformers' forward (with torch), two ranks = one, the
# refusals (tests/dpo_cli_test.sh; exit 77, skipped, without transformers and jinja2).
if(strata_hf_python)
  add_test(NAME dpo_recipe
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/dpo_cli_test.sh $<TARGET_FILE:strata>
                   ${CMAKE_SOURCE_DIR} "${MPIEXEC_EXECUTABLE}")
  set_tests_properties(dpo_recipe PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 ENVIRONMENT
                       "STRATA_HF_PYTHON=${strata_hf_python};OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endif()
