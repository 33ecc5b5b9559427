#!/usr/bin/env bash
# Adversarial cases, round 2, that need the strata binary (docs/RELIABILITY.md): `strata export`
# over another model's directory (refused, naming it; --force replaces it whole), an export that
# fails leaving no empty directory, a config.json of a billion layers (an error, not an OOM
# kill), the largest model the ranges allow (planned, refused by the preflight and by generate
# before allocating), ZeRO++ keys on one rank (a warning naming them), and option values out of
# their range (trace replay, probe, plan --nvme); fp16 runs that diverge or overflow at every
# step (exit 1, naming the cause and the keys, no checkpoint of the failed run) and the summary
# line of the steps an overflow skipped.
# usage: hardening2_cli_test.sh STRATA_BINARY REPO_DIR
set -uo pipefail
strata=$1
repo=$2
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
cd "$work"
mkdir -p swap
common=(--config "$repo/configs/tiny-cpu.json" --set 'train.checkpoint_dir="ck"'
        --set 'zero_optimization.offload_optimizer.nvme_path="swap"' --set train.eval_interval=0
        --set scheduler.params.warmup_num_steps=1 --set train.steps=1)
"$strata" train "${common[@]}" --quiet >train.txt 2>&1
check "a 1-step run trains" test -f ck/ckpt-00000001.bin

# ZeRO++ keys on one rank: trained, with a warning naming them.
check "ZeRO++ keys on one rank warn, naming the key" \
  grep -q "zero_optimization.zero_quantized_weights.*one rank" \
  <("$strata" train "${common[@]}" --quiet --set zero_optimization.zero_quantized_weights=true \
      --set 'train.checkpoint_dir="ck-zpp"' 2>&1)

# `strata export --out` over another model: refused, naming it, nothing changed.
cp -r "$repo/tests/fixtures/hf/llama" base
echo '{}' >base/generation_config.json
sum_before=$(cat base/* | md5sum)
"$strata" export "${common[@]}" --checkpoint ck --out base >over.txt 2>&1
rc=$?
check "export over another model exits 1" test "$rc" -eq 1
check "export over another model names it" grep -q "holds a model (\"LlamaForCausalLM\")" over.txt
check "export over another model says --force" grep -q -- "--force" over.txt
check "export over another model changed nothing" test "$(cat base/* | md5sum)" = "$sum_before"
# --force: one model in the directory, the new one.
"$strata" export "${common[@]}" --checkpoint ck --out base --force >force.txt 2>&1
rc=$?
check "export --force exits 0" test "$rc" -eq 0
check "export --force wrote the new weights" test -f base/model.safetensors
check "export --force left none of the old shards" test -z "$(ls base | grep -e '-of-' -e index)"
check "export --force removed the old generation_config.json" test ! -e base/generation_config.json
check "export --force wrote GPT2LMHeadModel's config" grep -q GPT2LMHeadModel base/config.json
# The same run's export again: no --force needed.
"$strata" export "${common[@]}" --checkpoint ck --out base >again.txt 2>&1
check "the same run exports again without --force" test $? -eq 0
check "export --help lists --force" grep -q -- "--force" <("$strata" export --help 2>&1)

# --temperature inf sampled uniformly at random (softmax(logits / inf)): refused.
"$strata" generate --config "$repo/configs/tiny-cpu.json" --checkpoint ck --prompt-ids 1,2 \
  --temperature inf >temp-inf.txt 2>&1
rc=$?
check "generate --temperature inf is bad usage (rc $rc)" test "$rc" -eq 2
check "generate --temperature inf is named" grep -q "inf is not a finite number" temp-inf.txt

# A failed export leaves no empty directory behind.
cp ck/ckpt-00000001.bin damaged.bin
size=$(stat -c %s damaged.bin)
printf '\x5a\x5a\x5a\x5a' | dd of=damaged.bin bs=1 seek=$((size - 64)) conv=notrunc 2>/dev/null
"$strata" export "${common[@]}" --checkpoint damaged.bin --out new/hf >failed.txt 2>&1
rc=$?
check "export of a damaged checkpoint exits 1" test "$rc" -eq 1
check "a failed export leaves no directory" test ! -e new

# A billion layers in a config.json: an error naming the key (before: the OOM killer).
mkdir -p huge
sed 's/"num_hidden_layers": 2/"num_hidden_layers": 1000000000/' \
  "$repo/tests/fixtures/hf/llama/config.json" >huge/config.json
python3 - "$repo/configs/tiny-cpu.json" >huge.json <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["model"] = {"from_pretrained": "huge"}
print(json.dumps(c))
PY
(ulimit -v 4000000; "$strata" train --config huge.json --set 'train.checkpoint_dir="ck-huge"' \
  >huge.txt 2>&1)
rc=$?
check "a billion layers exits 1 (not killed)" test "$rc" -eq 1
check "a billion layers names num_hidden_layers" grep -q "num_hidden_layers" huge.txt

# The largest model the ranges allow (4096 layers, width 65536, MLP 2^24, vocab 2^24): sized by
# the planner in closed form (it used to walk each of ~10^9 optimizer sub-groups: 9 GB and
# minutes, bad_alloc under a memory limit), and refused by the train preflight.
python3 - "$repo/tests/fixtures/hf/llama/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(num_hidden_layers=4096, hidden_size=65536, num_attention_heads=512,
         num_key_value_heads=8, head_dim=128, intermediate_size=1 << 24, vocab_size=1 << 24,
         max_position_embeddings=1 << 24)
json.dump(c, open("huge/config.json", "w"))
PY
sed -i 's/"from_pretrained": "huge"}/"from_pretrained": "huge", "context": 4096}/' huge.json
(ulimit -v 4000000; timeout 120 "$strata" plan --config huge.json >plan-huge.txt 2>&1)
rc=$?
check "the largest model plans within 4 GB and 120 s (rc $rc)" test "$rc" -eq 0
check "the largest model does not fit" grep -q "does NOT fit" plan-huge.txt
(ulimit -v 4000000; timeout 120 "$strata" train --config huge.json \
  --set 'train.checkpoint_dir="ck-huge"' >train-huge.txt 2>&1)
rc=$?
check "the largest model is refused by the preflight (rc $rc)" test "$rc" -eq 1
check "the preflight names the host tier" grep -q "host tier needs" train-huge.txt
# strata generate holds the model in host memory: checked before it allocates (was bad_alloc).
(ulimit -v 4000000; timeout 120 "$strata" generate --config huge.json --prompt-ids 1,2 \
  >gen-huge.txt 2>&1)
rc=$?
check "generate of the largest model exits 1 (rc $rc)" test "$rc" -eq 1
check "generate says the model does not fit in memory" grep -q "in host memory" gen-huge.txt

# Option values that ran on as zeros, nan or for days (exit 0): refused with exit 2, naming the
# option and the range (a probe io file of 0 bytes: exit 1, naming --size).
printf '{"step": 0}\n' >t.jsonl
mkdir -p pio
opt_refused() {  # NAME EXPECTED-RC PATTERN COMMAND...
  local name=$1 want=$2 pat=$3
  shift 3
  timeout 60 "$strata" "$@" >opt.txt 2>&1
  local rc=$?
  check "$name: exit $want (rc $rc)" test "$rc" -eq "$want"
  check "$name: says why" grep -q -- "$pat" opt.txt
}
opt_refused "trace replay --bandwidth nan" 2 "--bandwidth 'nan': expected a rate" \
  trace replay --trace t.jsonl --capacity 1MiB --bandwidth nan
opt_refused "trace replay --steps 2000000000" 2 "from 1 to 100000" \
  trace replay --trace t.jsonl --capacity 1MiB --steps 2000000000
opt_refused "trace replay --capacity 0" 2 "--capacity (above 0)" \
  trace replay --trace t.jsonl --capacity 0
opt_refused "trace replay --compute-ms -1" 2 "expected milliseconds" \
  trace replay --trace t.jsonl --capacity 1MiB --compute-ms -1
opt_refused "probe io --warmup -1" 2 "--warmup '-1': expected a whole number from 0" \
  probe io --path pio --warmup -1
opt_refused "probe --repeats x" 2 "--repeats 'x': expected a whole number from 1" \
  probe --repeats x
opt_refused "probe io --size 0" 1 "give --size at least the largest block size" \
  probe io --path pio --size 0
opt_refused "plan --nvme PATH:inf" 1 "rate after the colon must be GB/s in \\[1e-6, 1e6\\]" \
  plan --model gpt2-124m --nvme pio:inf
opt_refused "probe comm --timeout nan" 2 "--timeout 'nan': expected seconds above 0" \
  probe comm --timeout nan
opt_refused "probe comm --repeats 2000000000" 2 "expected a whole number from 1 to 1000" \
  probe comm --repeats 2000000000
opt_refused "eval on a simulated device (it printed ln of the vocabulary as the loss)" 1 \
  "device.simulate computes no real numbers: strata eval" \
  eval --config "$repo/configs/tiny-cpu.json" --set 'device.simulate="h200"'
opt_refused "plan --max-model --json (the file was silently not written)" 2 \
  "max-model prints its capacity table only" plan --model gpt2-124m --max-model --json p.json
# fp16 runs that cannot train used to finish with exit 0: a diverged run (every loss nan,
# each step skipped as an overflow) wrote its checkpoint, and an overflow at a scale that cannot
# go lower skipped every step. Now each stops with exit 1, the cause and the keys named.
fp16=(--config "$repo/configs/tiny-cpu.json" --set model.context=32 --quiet
      --set scheduler.params.warmup_num_steps=1 --set train.eval_interval=0
      --set bf16.enabled=false --set fp16.enabled=true
      --set 'zero_optimization.offload_optimizer.nvme_path="swap"')
fp16_fails() {  # fp16_fails NAME DIR PATTERN --set ...
  local name=$1 dir=$2 pat=$3
  shift 3
  "$strata" train "${fp16[@]}" --set "train.checkpoint_dir=\"$dir\"" "$@" >"$dir.txt" 2>&1
  local rc=$?
  check "$name: exit 1 (rc $rc)" test "$rc" -eq 1
  check "$name: says why" grep -q -- "$pat" "$dir.txt"
  check "$name: wrote no checkpoint" test -z "$(ls "$dir" 2>/dev/null | grep ckpt)"
}
fp16_fails "fp16 with lr 1e4 (nan from step 3)" ck-diverged \
  "steps 3 to 5: loss is nan — training diverged.*optimizer.params.lr" \
  --set train.steps=6 --set optimizer.params.lr=1e4 --set gradient_clipping=0
fp16_fails "fp16 at a static scale that always overflows" ck-static \
  "step 20: the loss overflowed at the static loss scale 1e+30 (fp16.loss_scale) on 20 steps" \
  --set train.steps=30 --set fp16.loss_scale=1e30
fp16_fails "fp16 overflowing at fp16.min_loss_scale" ck-floor \
  "step 3: the loss overflowed at the minimum loss scale 1e+12 (fp16.min_loss_scale).*bf16" \
  --set train.steps=30 --set fp16.initial_scale_power=40 --set fp16.min_loss_scale=1e12
# A run whose first steps overflow: the summary counts them.
"$strata" train "${fp16[@]}" --set 'train.checkpoint_dir="ck-skips"' --set train.steps=6 \
  --set fp16.initial_scale_power=24 --set fp16.hysteresis=1 >skips.txt 2>&1
rc=$?
check "fp16 with early overflows trains (rc $rc)" test "$rc" -eq 0
check "its summary counts the skipped steps" \
  grep -Eq "^fp16 overflow: [1-5] of 6 steps skipped .*; loss scale [0-9.e+]+ at the end$" skips.txt

"$strata" trace --help >trace-help.txt 2>trace-help.err
rc=$?
check "trace --help: exit 0 (rc $rc), the usage on stdout, nothing on stderr" \
  test "$rc" -eq 0 -a -s trace-help.txt -a ! -s trace-help.err

# A device too small for the activations: the preflight names the modes that need less than
# the run's own (with recompute, offload alone; it named recompute to a recompute run).
for mode in keep recompute; do
  "$strata" train "${common[@]}" --set "train.checkpoint_dir=\"ck-$mode\"" \
    --set "strata.activations=\"$mode\"" --set device.memory_limit=600000 >act-$mode.txt 2>&1
done
check "preflight, keep: recompute and offload named" \
  grep -q "activations (keep) take .*recompute needs .*offload" act-keep.txt
check "preflight, recompute: offload named, not recompute" \
  sh -c 'grep -q "activations (recompute) take .*offload needs" act-recompute.txt &&
         ! grep -q "recompute needs" act-recompute.txt'
"$strata" train "${common[@]}" --set 'train.checkpoint_dir="ck-ratio0"' \
  --set zero_optimization.offload_optimizer.ratio=0 --set device.memory_limit=3000000 \
  >ratio0.txt 2>&1
check "preflight, offload_optimizer.ratio 0: the ratio named as what keeps the state on the device" \
  grep -q "offload_optimizer.ratio 0 keeps 100% of the optimizer state on the device" ratio0.txt

# data.eval_fraction 0 holds nothing out: fine without evals, refused (naming both keys) with.
"$strata" train "${common[@]}" --set 'train.checkpoint_dir="ck-noeval"' \
  --set data.eval_fraction=0 --set train.eval_interval=0 >noeval.txt 2>&1
rc=$?
check "eval_fraction 0 without evals trains (rc $rc)" test "$rc" -eq 0
"$strata" train "${common[@]}" --set 'train.checkpoint_dir="ck-noeval2"' \
  --set data.eval_fraction=0 --set train.eval_interval=1 >noeval2.txt 2>&1
check "eval_fraction 0 with evals is refused naming both keys" \
  grep -q "no token is held out for eval (data.eval_fraction 0 .*train.eval_interval is 1" noeval2.txt
exit $fail
