#!/usr/bin/env bash
# A published-style LoRA recipe end to end, as README's "Fine-tuning recipe" runs it, on the tiny
# Llama, Mixtral, Qwen3, Qwen3-MoE and Phi-3 (tests/fixtures/hf): chat data from a Parquet file through
# tools/prepare_data.py (the fixture's tokenizer, a ChatML template), configs/lora-chat-recipe.json
# (r 16, alpha 32, lora_dropout 0.05, all-linear, packed conversations), then
#   - a run stopped at its step-10 checkpoint and resumed (--resume) gives the uninterrupted run's
#     losses, bit for bit;
#   - strata export --adapter writes a PEFT adapter with the recipe's LoraConfig (and, where the
#     Python has peft and torch, peft loads it: every adapter tensor as exported);
#   - strata generate runs on the trained checkpoint.
# Needs a Python with transformers, jinja2 and pyarrow (STRATA_HF_PYTHON, else python3 with
# build-deps/python-tools on its path, which tools/dev.sh deps fills); without them: exit 77.
# usage: recipe_cli_test.sh STRATA_BINARY REPO_DIR
set -uo pipefail
strata=$(realpath "$1")
repo=$(realpath "$2")
py=${STRATA_HF_PYTHON:-python3}
export PYTHONPATH="$repo/build-deps/python-tools${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import transformers, jinja2, pyarrow" 2>/dev/null; then
  echo "SKIPPED: $py lacks transformers, jinja2 or pyarrow (tools/dev.sh deps installs them into" \
       "build-deps/python-tools, or set STRATA_HF_PYTHON)"
  exit 77
fi
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
cd "$work"

"$py" - "$repo/tests/fixtures/chat/tiny_chat.jsonl" <<'PY'
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
rows = [json.loads(line) for line in open(sys.argv[1])]
pq.write_table(pa.Table.from_pylist(rows), "chat.parquet", row_group_size=64)
PY
check "a Parquet file of conversations" test -s chat.parquet

losses() {  # losses METRICS: each step's training loss, as logged
  "$py" -c "import json,sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if 'loss' in d and 'eval_loss' not in d: print(d['step'], d['loss'])" "$1"
}

for name in llama mixtral qwen3 qwen3-moe phi3; do
  fixture="$repo/tests/fixtures/hf/$name"
  mkdir -p "$name"
  "$py" "$repo/tools/prepare_data.py" --model "$fixture" \
    --chat-template "$repo/tests/fixtures/chat/chatml.jinja" --input chat.parquet \
    --out "$name/chat.bin" --val-out "$name/chat-val.bin" --val-fraction 0.1 >"$name/prep.txt" 2>&1
  check "$name: prepare_data reads the Parquet conversations" test $? -eq 0
  check "$name: ... and writes the loss masks" test -s "$name/chat.bin.mask"
  sets=(--set "model.from_pretrained=\"$fixture\"" --set "data.source=\"$name/chat.bin\""
        --set "data.eval_source=\"$name/chat-val.bin\"" --set train.log_interval=1)
  "$strata" train --config "$repo/configs/lora-chat-recipe.json" "${sets[@]}" \
    --set "train.checkpoint_dir=\"$name/whole\"" >"$name/whole.txt" 2>&1
  check "$name: the recipe trains" test $? -eq 0
  check "$name: ... and says how many micro-batches attention masked per conversation" \
    grep -qE 'attention per conversation \(data.packing "sequence"\): [0-9]+ of 40 micro-batches' \
    "$name/whole.txt"
  "$strata" train --config "$repo/configs/lora-chat-recipe.json" "${sets[@]}" \
    --set "train.checkpoint_dir=\"$name/parts\"" --set train.steps=10 \
    --set scheduler.params.total_num_steps=20 >"$name/first.txt" 2>&1
  check "$name: the first half trains" test $? -eq 0
  "$strata" train --config "$repo/configs/lora-chat-recipe.json" "${sets[@]}" \
    --set "train.checkpoint_dir=\"$name/parts\"" --resume >"$name/second.txt" 2>&1
  check "$name: the run resumes from its checkpoint" test $? -eq 0
  check "$name: ... and says so" grep -q "resum" "$name/second.txt"
  losses "$name/whole/metrics.jsonl" >"$name/whole.losses"
  losses "$name/parts/metrics.jsonl" | sort -n -u >"$name/parts.losses"
  check "$name: 20 steps logged" test "$(wc -l <"$name/whole.losses")" -eq 20
  check "$name: the resumed run's losses are the uninterrupted run's, bit for bit" \
    cmp -s "$name/whole.losses" "$name/parts.losses"

  "$strata" export --config "$repo/configs/lora-chat-recipe.json" "${sets[@]}" \
    --checkpoint "$name/whole" --adapter "$name/adapter" >"$name/export.txt" 2>&1
  check "$name: export --adapter" test $? -eq 0
  check "$name: ... writes adapter_model.safetensors" test -s "$name/adapter/adapter_model.safetensors"
  check "$name: ... with the recipe's LoraConfig" "$py" -c "import json,sys
c = json.load(open(sys.argv[1]))
assert (c['r'], c['lora_alpha'], c['lora_dropout']) == (16, 32, 0.05), c
assert c['peft_type'] == 'LORA', c" "$name/adapter/adapter_config.json"
  if "$py" -c "import peft, torch" 2>/dev/null; then
    check "$name: peft loads the adapter, every tensor as exported" "$py" - "$fixture" \
      "$name/adapter" <<'PY'
import sys
import peft, torch, transformers
from safetensors.torch import load_file
base_dir, adapter = sys.argv[1:3]
base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
model = peft.PeftModel.from_pretrained(base, adapter)
saved = load_file(adapter + "/adapter_model.safetensors")
state = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
assert sorted(state) == sorted(saved), (sorted(state)[:3], sorted(saved)[:3])
for k, v in saved.items():
    assert torch.equal(state[k].float(), v.float()), k
PY
  else
    echo "skip: $name: peft's load of the adapter (no peft and torch for $py)"
  fi
  "$strata" generate --config "$repo/configs/lora-chat-recipe.json" "${sets[@]}" \
    --checkpoint "$name/whole" --prompt-ids 1,5,9 --max-new-tokens 6 --ignore-eos --json \
    >"$name/gen.json" 2>"$name/gen.err"
  check "$name: strata generate runs on the trained adapters" test $? -eq 0
  check "$name: ... and gives 6 tokens" "$py" -c "import json,sys
assert len(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['ids']) == 6" \
    "$name/gen.json"
done
exit $fail
