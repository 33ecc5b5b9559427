#!/usr/bin/env bash
# Preference training (DPO) end to end, as README's "Preference training (DPO)" runs it, on the
# tiny Llama (tests/fixtures/hf/llama): tests/fixtures/chat/tiny_preference_text.jsonl through
# tools/prepare_data.py --format preference, then configs/lora-dpo-recipe.json:
#   - the first step's loss is ln 2 (the policy is the reference), the held-out reward accuracy
#     and loss improve on a preference a small model can learn, metrics.jsonl has TRL's rewards;
#   - a run stopped at its step-10 checkpoint and resumed gives the uninterrupted run's losses,
#     bit for bit (the reference is computed again from the initial weights);
#   - full fine-tuning in fp32: the final eval's DPO loss and accuracy are transformers' over the
#     same held-out pairs, the exported model against the initial one (tests/dpo_reference.py);
#     the same with IPO (dpo.loss_type "ipo": per-token means of the log-ratios);
#   - two ranks (mpirun) give one rank's losses;
#   - strata eval of the trained checkpoint is the run's final eval, bit for bit (ln 2 for the
#     initial model);
#   - an odd micro-batch is refused, naming the fix.
# Needs a Python with transformers and jinja2 (STRATA_HF_PYTHON, else python3 with
# build-deps/python-tools on its path); without them: exit 77. The comparison with transformers'
# forward also needs torch: without it, that case alone is skipped (said in the output).
# usage: dpo_cli_test.sh STRATA_BINARY REPO_DIR [MPIEXEC]
set -uo pipefail
strata=$(realpath "$1")
repo=$(realpath "$2")
mpiexec=${3:-}
py=${STRATA_HF_PYTHON:-python3}
export PYTHONPATH="$repo/build-deps/python-tools${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import transformers, jinja2" 2>/dev/null; then
  echo "SKIPPED: $py lacks transformers or jinja2 (tools/dev.sh deps installs them into" \
       "build-deps/python-tools, or set STRATA_HF_PYTHON)"
  exit 77
fi
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
cd "$work"
fixture="$repo/tests/fixtures/hf/llama"
recipe="$repo/configs/lora-dpo-recipe.json"

# The fixture's pairs in TRL's standard (string) form: BOS + prompt + answer + EOS, about a
# dozen tokens with the tiny tokenizer (their ChatML rendering takes ~57, past the fixtures'
# 32-token context).
"$py" "$repo/tests/fixtures/chat/make_tiny_preference.py" --text regenerated.jsonl
check "tiny_preference_text.jsonl is its generator's output" \
  cmp -s regenerated.jsonl "$repo/tests/fixtures/chat/tiny_preference_text.jsonl"
"$py" "$repo/tools/prepare_data.py" --model "$fixture" --format preference \
  --input "$repo/tests/fixtures/chat/tiny_preference_text.jsonl" \
  --out pairs.bin --val-out pairs-val.bin --val-fraction 0.2 >prep.txt 2>&1
check "prepare_data --format preference" test $? -eq 0
check "... writes the pairs' mask" test -s pairs.bin.mask

field() {  # field METRICS KEY: "step value" of each record with KEY
  "$py" -c "import json,sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if sys.argv[2] in d: print(d['step'], repr(d[sys.argv[2]]))" "$1" "$2"
}
# A learning rate at which the tiny model learns the preference in 30 steps.
sets=(--set "model.from_pretrained=\"$fixture\"" --set "data.source=\"pairs.bin\"" --set "data.eval_source=\"pairs-val.bin\""
      --set train.log_interval=1 --set optimizer.params.lr=3e-3 --set train.steps=30
      --set data.eval_batches=100)
"$strata" train --config "$recipe" "${sets[@]}" --set 'train.checkpoint_dir="whole"' >whole.txt 2>&1
check "the DPO recipe trains" test $? -eq 0
check "... and says it trains DPO against the initial model" grep -q "DPO: .* preference pairs" whole.txt
field whole/metrics.jsonl loss >whole.losses
field whole/metrics.jsonl rewards/accuracies >whole.acc
field whole/metrics.jsonl eval_rewards/accuracies >whole.eval_acc
field whole/metrics.jsonl eval_loss >whole.eval_loss
check "30 steps logged, with TRL's reward metrics" test "$(wc -l <whole.acc)" -eq 30
check "the first step's loss is ln 2 exactly: the policy is the reference, the same rows in any micro-batch" "$py" -c "import math,sys
step, loss = open(sys.argv[1]).readline().split()
assert abs(float(loss) - math.log(2)) < 1e-12, loss" whole.losses
check "the held-out reward accuracy rises" "$py" -c "import sys
v = [float(l.split()[1]) for l in open(sys.argv[1])]
assert v[-1] > v[0] and v[-1] >= 0.75, v" whole.eval_acc
check "the held-out DPO loss falls" "$py" -c "import sys
v = [float(l.split()[1]) for l in open(sys.argv[1])]
assert v[-1] < v[0] - 0.05, v" whole.eval_loss
check "the summary names the reward accuracy" grep -q "eval reward accuracy (DPO)" whole.txt

"$strata" train --config "$recipe" "${sets[@]}" --set 'train.checkpoint_dir="parts"' \
  --set train.steps=10 --set scheduler.params.total_num_steps=30 >first.txt 2>&1
check "the first part trains" test $? -eq 0
"$strata" train --config "$recipe" "${sets[@]}" --set 'train.checkpoint_dir="parts"' \
  --resume >second.txt 2>&1
check "the run resumes" test $? -eq 0
check "... computing the reference again" grep -q "the reference's log-probabilities" second.txt
field parts/metrics.jsonl loss | sort -n -u >parts.losses
check "the resumed run's losses are the uninterrupted run's, bit for bit" cmp -s whole.losses parts.losses

# Full fine-tuning in fp32 against transformers: the exported model vs the initial one.
full=(--set "model.from_pretrained=\"$fixture\"" --set "data.source=\"pairs.bin\"" --set "data.eval_source=\"pairs-val.bin\""
      --set optimizer.params.lr=1e-3 --set train.steps=12 --set train.eval_interval=12
      --set data.eval_batches=100 --set bf16.enabled=false --set dpo.label_smoothing=0.1
      --set dpo.beta=0.2)
"$py" -c "import json,sys
c = json.load(open(sys.argv[1]))
del c['lora']
json.dump(c, open('full.json', 'w'))" "$recipe"
"$strata" train --config full.json "${full[@]}" --set 'train.checkpoint_dir="full"' \
  --set 'train.export_dir="full-hf"' >full.txt 2>&1
check "full fine-tuning with DPO trains and exports" test $? -eq 0
# against_transformers NAME LOSS RUN [dpo_reference.py options]: RUN's final held-out loss and
# reward accuracy against transformers' over the same pairs (its export vs the initial model).
against_transformers() {
  local name=$1 what=$2 run=$3
  shift 3
  field "$run/metrics.jsonl" eval_loss | tail -1 >"$run.eval_loss"
  field "$run/metrics.jsonl" eval_rewards/accuracies | tail -1 >"$run.eval_acc"
  "$py" "$repo/tests/dpo_reference.py" --policy "$run-hf" --reference "$fixture" \
    --tokens pairs-val.bin --seq-len 32 "$@" >"$run.ref.json" 2>"$run.ref.err"
  check "transformers computes the held-out $what loss" test $? -eq 0
  check "strata's final eval is transformers' $what loss and accuracy over the held-out pairs" \
    "$py" -c "import json,sys
ref = json.load(open(sys.argv[1]))
loss = float(open(sys.argv[2]).read().split()[1])
acc = float(open(sys.argv[3]).read().split()[1])
assert abs(loss - ref['loss']) < 2e-4 * max(1.0, abs(ref['loss'])), (loss, ref)
assert abs(acc - ref['accuracy']) < 1e-9, (acc, ref)
print('$name: strata', loss, acc, 'transformers', ref)" "$run.ref.json" "$run.eval_loss" "$run.eval_acc"
}
have_torch=0
"$py" -c "import torch" 2>/dev/null && have_torch=1
((have_torch)) && against_transformers full DPO full --beta 0.2 --label-smoothing 0.1
# IPO (per-token means of the log-ratios: each row's completion targets count) the same way.
"$strata" train --config full.json "${full[@]}" --set 'dpo.loss_type="ipo"' --set train.eval_interval=6 \
  --set dpo.label_smoothing=0 --set 'train.checkpoint_dir="ipo"' \
  --set 'train.export_dir="ipo-hf"' >ipo.txt 2>&1
check "full fine-tuning with IPO trains and exports" test $? -eq 0
check "... and says which loss it trains" grep -q "loss ipo, beta 0.2" ipo.txt
field ipo/metrics.jsonl eval_loss >ipo.eval_losses
check "the held-out IPO loss falls" "$py" -c "import sys
v = [float(l.split()[1]) for l in open(sys.argv[1])]
assert v[-1] < v[0], v" ipo.eval_losses
if ((have_torch)); then
  against_transformers ipo IPO ipo --beta 0.2 --loss-type ipo
else
  echo "skipped: the held-out DPO and IPO losses against transformers' forward ($py lacks torch)"
fi

"$strata" train --config "$recipe" "${sets[@]}" --set train_micro_batch_size_per_gpu=3 \
  --set train_batch_size=6 --set 'train.checkpoint_dir="odd"' >odd.txt 2>&1
check "an odd micro-batch is refused" test $? -ne 0
check "... naming the fix" grep -q "preference pairs need an even micro-batch" odd.txt
"$strata" eval --config "$recipe" "${sets[@]}" --checkpoint whole --json >eval.json 2>eval.err
check "strata eval of a preference file" test $? -eq 0
check "... is the run's final eval, bit for bit" "$py" -c "import json,sys
e = json.loads(open(sys.argv[1]).read())
last = [json.loads(l) for l in open(sys.argv[2]) if 'eval_loss' in l][-1]
assert e['loss'] == last['eval_loss'], (e, last)
assert e['rewards/accuracies'] == last['eval_rewards/accuracies'], (e, last)
assert e['pairs'] == 12, e" eval.json whole/metrics.jsonl
"$strata" eval --config "$recipe" "${sets[@]}" --json >eval0.json 2>eval0.err
check "strata eval of the initial model: ln 2, no pair preferred" "$py" -c "import json,math,sys
e = json.loads(open(sys.argv[1]).read())
assert abs(e['loss'] - math.log(2)) < 1e-15 and e['rewards/accuracies'] == 0.0, e" eval0.json

if [ -n "$mpiexec" ] && command -v "$mpiexec" >/dev/null; then
  launch=("$mpiexec" --oversubscribe -np 2)
  [ "$(id -u)" -eq 0 ] && launch+=(--allow-run-as-root)
  two=("${sets[@]}" --set train.steps=6 --set train_batch_size=8)
  "$strata" train --config "$recipe" "${two[@]}" --set 'train.checkpoint_dir="one"' >one.txt 2>&1
  check "one rank, 6 steps" test $? -eq 0
  "${launch[@]}" "$strata" train --config "$recipe" "${two[@]}" \
    --set train_micro_batch_size_per_gpu=2 --set 'train.checkpoint_dir="two"' >two.txt 2>&1
  check "two ranks, 6 steps" test $? -eq 0
  field one/metrics.jsonl loss >one.losses
  field two/metrics.jsonl loss >two.losses
  check "two ranks' losses are one rank's" "$py" -c "import sys
a = [float(l.split()[1]) for l in open(sys.argv[1])]
b = [float(l.split()[1]) for l in open(sys.argv[2])]
assert len(a) == len(b) == 6 and all(abs(x - y) < 1e-4 for x, y in zip(a, b)), (a, b)" \
    one.losses two.losses
else
  echo "skipped: two ranks (no mpirun)"
fi
exit $fail
