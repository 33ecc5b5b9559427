# LoRA adapters over a frozen base: forward loss and adapter gradients against peft's on the
# tiny Llama, Qwen2 and GPT-2 fixtures (tests/fixtures/hf/lora-*, tools/make_lora_fixtures.py),
# bad lora sections and adapters refused, training with the base frozen on every placement,
# exact resume.
strata_test(lora_test ${CMAKE_CURRENT_LIST_DIR}/lora_test.cc)
