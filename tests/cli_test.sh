#!/usr/bin/env bash
# The strata command as a user meets it: --help, clear errors with exit codes, and a clean stop
# on SIGTERM that leaves a checkpoint --resume continues from.
# usage: cli_test.sh STRATA_BINARY REPO_DIR
set -uo pipefail
strata=$1
repo=$2
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
cd "$work"
mkdir -p swap

"$strata" --help >out.txt 2>&1
check "--help exits 0 and lists train" grep -q "train" out.txt
"$strata" train --help >out.txt 2>&1
check "train --help documents --resume" grep -q -- "--resume" out.txt

"$strata" train --config "$repo/configs/tiny-cpu.json" --set zero_optimization.offload_parm=1 \
  >out.txt 2>&1
rc=$?
check "unknown key exits 1" test "$rc" -eq 1
check "unknown key suggests the right one" grep -q "did you mean offload_param" out.txt

echo x >afile
"$strata" train --config "$repo/configs/tiny-cpu.json" \
  --set 'zero_optimization.offload_optimizer.nvme_path="afile/strata-swap"' >out.txt 2>&1
rc=$?
check "nvme_path under a file exits 1" test "$rc" -eq 1
check "nvme_path under a file is named" grep -q "afile is a file" out.txt

"$strata" train >out.txt 2>&1
rc=$?
check "missing --config exits 2" test "$rc" -eq 2

# A DeepSpeed config with no model (as the Hugging Face Trainer writes them) is refused.
cat >ds_zero3.json <<'JSON'
{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
 "train_batch_size": "auto", "bf16": {"enabled": "auto"},
 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
JSON
"$strata" train --config ds_zero3.json >out.txt 2>&1
rc=$?
check "a config with no model exits 1" test "$rc" -eq 1
check "a config with no model says so" grep -q "the config has no model" out.txt

"$strata" --help >out.txt 2>&1
check "--help lists export" grep -q "export" out.txt
"$strata" export --help >out.txt 2>&1
check "export --help documents --checkpoint" grep -q -- "--checkpoint" out.txt
"$strata" export --config "$repo/configs/tiny-cpu.json" >out.txt 2>&1
rc=$?
check "export without --checkpoint/--out exits 2" test "$rc" -eq 2

"$strata" eval --help >out.txt 2>&1
check "eval --help documents --json and --checkpoint" \
  bash -c 'grep -q -- "--json" out.txt && grep -q -- "--checkpoint" out.txt'
# --json: exactly one line on stdout, {"loss": L, "perplexity": P, "tokens": N}.
"$strata" eval --config "$repo/configs/tiny-cpu.json" --json --set data.synthetic_tokens=4096 \
  --set 'zero_optimization.offload_optimizer.nvme_path="swap"' >out.txt 2>err.txt
rc=$?
check "eval --json exits 0" test "$rc" -eq 0
check "eval --json prints one JSON line" test "$(wc -l <out.txt)" -eq 1
check "eval --json line has loss, perplexity, tokens" grep -Eq \
  '^\{"loss":[0-9.e+-]+,"perplexity":[0-9.e+-]+,"tokens":4032\}$' out.txt
# The summary puts the bytes each step moved beside the placement's minimum (the planner's):
# tiny-cpu with parameters and optimizer on NVMe, 4 steps (the median of steps 3-4).
"$strata" train --config "$repo/configs/tiny-cpu.json" --quiet --set train.steps=4 \
  --set scheduler.params.warmup_num_steps=1 --set train.final_checkpoint=false \
  --set 'train.checkpoint_dir="bytes_run"' --set 'zero_optimization.offload_param.device="nvme"' \
  --set 'zero_optimization.offload_param.nvme_path="swap"' \
  --set 'zero_optimization.offload_optimizer.device="nvme"' \
  --set 'zero_optimization.offload_optimizer.nvme_path="swap"' >out.txt 2>err.txt
rc=$?
check "a 4-step NVMe run exits 0" test "$rc" -eq 0
check "its summary gives NVMe bytes per step against the placement's minimum" grep -Eq \
  "^nvme bytes per step: [0-9.]+ [KMG]iB \(median of steps 3-4\), the placement's minimum [0-9.]+ [KMG]iB \([+-][0-9.]+%\)$" out.txt
check "and host<->device bytes the same way" grep -Eq \
  "^host<->device bytes per step: [0-9.]+ [KMG]iB \(median of steps 3-4\), the placement's minimum [0-9.]+ [KMG]iB \([+-][0-9.]+%\)$" out.txt
check "split by direction, with the optimizer's schedule of each of those steps" grep -Eq \
  "^  of which host->device [0-9.]+ [KMG]?i?B, device->host [0-9.]+ [KMG]?i?B \(medians\); the optimizer of those steps: (after backward|under backward|rolled back|deferred), (after backward|under backward|rolled back|deferred)$" \
  out.txt
# fp16 from a loss scale of 2^24 (hysteresis 1): the first steps overflow and are skipped; the
# median leaves them out, and the ones after them (their deferred pass did not run).
"$strata" train --config "$repo/configs/tiny-cpu.json" --quiet --set train.steps=8 \
  --set scheduler.params.warmup_num_steps=1 --set train.final_checkpoint=false \
  --set 'train.checkpoint_dir="fp16_run"' --set 'zero_optimization.offload_param.device="nvme"' \
  --set 'zero_optimization.offload_param.nvme_path="swap"' \
  --set 'zero_optimization.offload_optimizer.device="nvme"' \
  --set 'zero_optimization.offload_optimizer.nvme_path="swap"' --set bf16.enabled=false \
  --set fp16.enabled=true --set fp16.initial_scale_power=24 --set fp16.hysteresis=1 \
  >out.txt 2>err.txt
rc=$?
check "an fp16 run with overflows exits 0" test "$rc" -eq 0
check "its summary leaves the skipped steps out of the bytes per step" grep -Eq \
  "^nvme bytes per step: [0-9.]+ [KMG]iB \(median of steps 3-8 but [1-5] skipped by fp16 overflow or after one\), the placement's minimum" \
  out.txt
# A corpus shorter than model.context + 1 tokens: exit 1, naming data.source and the sizes.
printf 'too short' >short.txt
"$strata" eval --config "$repo/configs/tiny-cpu.json" --set data.source=\"short.txt\" >out.txt 2>&1
rc=$?
check "eval of a too-short file exits 1" test "$rc" -eq 1
check "eval of a too-short file says why" grep -q "short.txt holds 9 tokens; eval needs at least" \
  out.txt

# The optimizer in host RAM on a fast device (simulated), not overlapped: about half of each
# step (50-55% on 2 cores); the run's summary points at offload_optimizer.ratio and `strata
# plan` where a tenth or more is not hidden. All on the device, or on the CPU backend itself,
# it says nothing of it.
lacks() { ! grep -q "$1" "$2"; }
fast=(--config "$repo/configs/tiny-cpu.json" --set train.steps=24 --set train.eval_interval=0
      --set train.final_checkpoint=false --set data.eval_batches=0
      --set scheduler.params.warmup_num_steps=2 --set scheduler.params.total_num_steps=24
      --set train_batch_size=4 --set gradient_accumulation_steps=1 --set model.n_embd=256
      --set strata.optimizer.overlap=false --set device.memory_limit=268435456
      --set 'zero_optimization.offload_param.device="none"')
"$strata" train "${fast[@]}" --set 'device.simulate="h200"' \
  --set 'zero_optimization.offload_optimizer.device="cpu"' --quiet >hint.txt 2>&1
check "optimizer in host RAM on a fast device: the run ends" grep -q "^done at step 24" hint.txt
check "optimizer in host RAM on a fast device: the ratio hint" \
  grep -q "not hidden .* at zero_optimization.offload_optimizer.ratio 1: .*strata plan --config" \
  hint.txt
# The hint and the summary give the rate the CPU optimizer's kernel ran at in this run, and
# `strata plan` takes it in place of the profile's.
check "the summary gives the CPU optimizer's rate" \
  grep -q "the CPU optimizer's kernel [0-9.e+]* parameters/s" hint.txt
rate=$(grep -o -- "--cpu-optimizer-rate [0-9.e+]*" hint.txt | head -1 | cut -d' ' -f2)
check "the ratio hint names the measured rate" test -n "$rate"
"$strata" plan "${fast[@]}" --set 'device.simulate="h200"' \
  --set 'zero_optimization.offload_optimizer.device="cpu"' --cpu-optimizer-rate "$rate" \
  >plan_rate.txt 2>&1
check "plan at the measured rate runs" grep -q "best:" plan_rate.txt
check "plan at the measured rate says where its rate came from" \
  grep -q -- "--cpu-optimizer-rate (beside the device: $rate)" plan_rate.txt
check "the metrics carry the CPU optimizer's rate" \
  sh -c "tail -1 runs/tiny-cpu/metrics.jsonl | grep -q '\"cpu_optimizer_params_per_s\":[1-9]'"
"$strata" train "${fast[@]}" --set 'device.simulate="h200"' \
  --set 'zero_optimization.offload_optimizer.device="none"' --quiet >nohint.txt 2>&1
check "all on a fast device: the run ends" grep -q "^done at step 24" nohint.txt
check "all on a fast device: no ratio hint" lacks "offload_optimizer.ratio" nohint.txt
"$strata" train "${fast[@]}" --set 'zero_optimization.offload_optimizer.device="cpu"' --quiet \
  >cpu.txt 2>&1
check "on the CPU backend: the run ends" grep -q "^done at step 24" cpu.txt
check "on the CPU backend: no ratio hint" lacks "offload_optimizer.ratio" cpu.txt

# A long run, stopped with SIGTERM once it has made progress.
common=(--config "$repo/configs/tiny-cpu.json" --set train.steps=100000
        --set 'train.checkpoint_dir="ck"' --set steps_per_print=1 --set train.eval_interval=0
        --set 'zero_optimization.offload_optimizer.nvme_path="swap"'
        --set scheduler.params.total_num_steps=100000)
"$strata" train "${common[@]}" >run.txt 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  grep -q "^step *3/" run.txt 2>/dev/null && break
  sleep 0.1
done
kill -TERM "$pid"
wait "$pid"
rc=$?
check "SIGTERM exits 128+15" test "$rc" -eq 143
check "SIGTERM wrote a checkpoint" test -f ck/latest
check "SIGTERM says how to continue" grep -q "resume" run.txt
step=$(sed -n 's/^stopped at step \([0-9]*\).*/\1/p' run.txt)
check "stop reports its step" test -n "$step"
check "swap files removed on exit" test -z "$(ls swap)"

"$strata" train "${common[@]}" --set train.steps=$((step + 2)) --resume >res.txt 2>&1
rc=$?
check "--resume continues" test "$rc" -eq 0
check "--resume starts after the stop" grep -q "resumed from .* at step $step" res.txt
check "--resume reaches the end" grep -q "done at step $((step + 2))" res.txt
check "--resume with the same batch says nothing of it" lacks "other samples" res.txt
"$strata" train "${common[@]}" --set train.steps=$((step + 3)) --set train_batch_size=8 \
  --set gradient_accumulation_steps=2 \
  --resume >res2.txt 2>&1
check "--resume with another batch continues" grep -q "done at step $((step + 3))" res2.txt
check "--resume with another batch names it" grep -q "other samples than an uninterrupted" res2.txt

printf 'garbage' >ck/bad.bin
"$strata" train "${common[@]}" --resume ck/bad.bin >bad.txt 2>&1
rc=$?
check "a corrupt checkpoint is refused" test "$rc" -eq 1
check "the refusal names the file" grep -q "ck/bad.bin" bad.txt

exit $fail
