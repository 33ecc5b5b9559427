#!/usr/bin/env bash
# Crash consistency: training is killed with SIGKILL at random moments (a checkpoint is written
# after every step, so many kills land inside a checkpoint write) and resumed each time, with
# one rank and with two (mpirun -np 2: both ranks killed at once, or one of them). Every resume
# must start from a complete checkpoint (never an error), and every loss the killed and resumed
# runs logged (metrics.jsonl, steps_per_print=1) must equal the uninterrupted run's bit for bit.
# Then the writers of user-visible files: `strata export --adapter` killed at random moments
# while it replaces another run's adapter (another rank) leaves the old pair or the new one,
# never a mix (tools/prepare_data.py's kills: prepare_data_test.py).
# usage: crash_test.sh STRATA_BINARY REPO_DIR [MPIEXEC]
#   env: CRASH_SEED, CRASH_KILLS (training, default 8 per case), CRASH_WRITER_KILLS (export
#   --adapter, default 15; 50 for a longer check), CRASH_CASES (default "train writers")
set -uo pipefail
strata=$1
repo=$2
mpiexec=${3:-}
seed=${CRASH_SEED:-$(date +%s)}
kills=${CRASH_KILLS:-8}
RANDOM=$seed
echo "crash_test: seed $seed (CRASH_SEED=$seed reproduces the kill times), $kills kills per case"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail=0
check() {  # check NAME CONDITION...
  local name=$1
  shift
  if "$@"; then echo "ok: $name"; else echo "FAILED: $name"; fail=1; fi
}
steps=24
args=(--config "$repo/configs/tiny-cpu.json" --quiet --set train.steps=$steps
      --set steps_per_print=1 --set train.eval_interval=0 --set train.checkpoint_interval=1
      --set scheduler.params.warmup_num_steps=4 --set gradient_accumulation_steps=1
      --set train_micro_batch_size_per_gpu=4 --set model.n_layer=2)

# step -> loss (the JSON text, so equal means bit-identical doubles) of a metrics.jsonl.
losses() { sed -n 's/^{.*"loss":\([^,]*\),.*"step":\([0-9]*\).*/\2 \1/p' "$1"; }

# run_case NAME RANKS: uninterrupted reference, then kill/resume until a run completes.
run_case() {
  local name=$1 ranks=$2
  local launch=()
  if [ "$ranks" -gt 1 ]; then
    launch=("$mpiexec" --oversubscribe -np "$ranks")
    [ "$(id -u)" -eq 0 ] && launch+=(--allow-run-as-root)
  fi
  local batch=$((4 * ranks))
  mkdir -p "$name/ref" "$name/run" "$name/swap"
  local common=("${args[@]}" --set train_batch_size=$batch
                --set "zero_optimization.offload_optimizer.nvme_path=\"$name/swap\"")
  "${launch[@]}" "$strata" train "${common[@]}" --set "train.checkpoint_dir=\"$name/ref\"" \
    >"$name/ref.txt" 2>&1
  check "$name: uninterrupted run" test $? -eq 0
  losses "$name/ref/metrics.jsonl" | sort -n >"$name/ref.losses"
  check "$name: reference logged $steps losses" test "$(wc -l <"$name/ref.losses")" -eq $steps

  local attempt=0 finished=0 resumes=0 bad_resume=0 mid=0
  while [ $finished -eq 0 ] && [ $attempt -lt $((kills + 20)) ]; do
    attempt=$((attempt + 1))
    local resume=()
    ls "$name/run"/ckpt-*.bin >/dev/null 2>&1 && resume=(--resume)
    [ ${#resume[@]} -gt 0 ] && resumes=$((resumes + 1))
    "${launch[@]}" "$strata" train "${common[@]}" --set "train.checkpoint_dir=\"$name/run\"" \
      "${resume[@]}" >"$name/attempt$attempt.txt" 2>&1 &
    local pid=$!
    if [ $attempt -le "$kills" ]; then
      # Once set-up is done (mpirun starts slowly), 0 .. 1.5 s in: steps and checkpoint writes.
      for _ in $(seq 1 200); do
        grep -q "activations:" "$name/attempt$attempt.txt" 2>/dev/null && break
        sleep 0.1
      done
      sleep "$((RANDOM % 2)).$(printf '%03d' $((RANDOM % 500)))"
      if [ "$ranks" -eq 1 ]; then
        kill -KILL "$pid" 2>/dev/null
      else
        local kids
        kids=$(pgrep -P "$pid")
        if [ $((attempt % 2)) -eq 0 ]; then
          kids=$(echo "$kids" | shuf -n 1 --random-source=<(yes "$seed"))  # one rank only
        fi
        for k in $kids; do kill -KILL "$k" 2>/dev/null; done
      fi
      ls "$name/run"/*.tmp >/dev/null 2>&1 && mid=$((mid + 1))  # killed inside a save
    fi
    { wait "$pid"; } 2>/dev/null
    local rc=$?
    if [ $rc -eq 0 ]; then
      finished=1
    elif grep -q "strata train: " "$name/attempt$attempt.txt" &&
         ! grep -q "Primary job\|mpirun noticed\|exited on signal\|killed" "$name/attempt$attempt.txt"; then
      # An error of strata's own (not the kill, not the peer's death): a resume that failed.
      echo "  attempt $attempt failed on its own:"
      grep "strata train: " "$name/attempt$attempt.txt" | head -3
      bad_resume=1
    fi
  done
  check "$name: finished after $((attempt - 1)) kills ($mid inside a checkpoint write), $resumes resumes" \
    test $finished -eq 1
  check "$name: every resume started from a complete checkpoint" test $bad_resume -eq 0
  # Every logged loss (killed runs included) equals the uninterrupted run's for its step.
  local mismatches
  mismatches=$(losses "$name/run/metrics.jsonl" | sort -n | join -j1 - "$name/ref.losses" |
               awk '$2 != $3' | head -3)
  check "$name: every loss equals the uninterrupted run's bit for bit" test -z "$mismatches"
  [ -n "$mismatches" ] && echo "  step killed/resumed uninterrupted: $mismatches"
  check "$name: all $steps steps logged" \
    test "$(losses "$name/run/metrics.jsonl" | cut -d' ' -f1 | sort -un | wc -l)" -eq $steps
}

# export --adapter over another run's adapter, killed at random moments: the old pair or the new.
writer_case() {
  local kills=${CRASH_WRITER_KILLS:-15} dir=writers
  mkdir -p "$dir/swap"
  python3 - "$repo" "$dir" <<'PY'
import json, sys
repo, d = sys.argv[1:3]
cfg = json.load(open(repo + "/configs/tiny-cpu.json"))
cfg["model"] = {"from_pretrained": repo + "/tests/fixtures/hf/llama", "context": 32}
cfg["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
cfg["train"].update({"steps": 1, "eval_interval": 0})
cfg["scheduler"]["params"]["warmup_num_steps"] = 1
cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = d + "/swap"
json.dump(cfg, open(d + "/lora.json", "w"))
PY
  local a=(--config "$dir/lora.json" --set "train.checkpoint_dir=\"$dir/ck4\"")
  local b=(--config "$dir/lora.json" --set "train.checkpoint_dir=\"$dir/ck64\"" --set lora.r=64
           --set lora.lora_alpha=128)
  "$strata" train "${a[@]}" --quiet >"$dir/train4.txt" 2>&1 &&
    "$strata" train "${b[@]}" --quiet >"$dir/train64.txt" 2>&1
  local rc=$?
  check "writers: two LoRA runs (rank 4 and 64) train" test $rc -eq 0
  [ $rc -eq 0 ] || tail -3 "$dir"/train*.txt
  local t0 t1 ms
  t0=$(date +%s%N)
  "$strata" export "${a[@]}" --checkpoint "$dir/ck4" --adapter "$dir/adapter" >/dev/null 2>&1
  t1=$(date +%s%N)
  ms=$(((t1 - t0) / 1000000 + 1))
  local mixes=0 i
  for i in $(seq 1 "$kills"); do
    local run=("${a[@]}" --checkpoint "$dir/ck4")
    [ $((i % 2)) -eq 1 ] && run=("${b[@]}" --checkpoint "$dir/ck64")
    "$strata" export "${run[@]}" --adapter "$dir/adapter" --force >/dev/null 2>&1 &
    local pid=$!
    sleep "$(awk -v r=$RANDOM -v ms=$ms 'BEGIN { printf "%.3f", r / 32768 * ms * 1.2 / 1000 }')"
    kill -KILL "$pid" 2>/dev/null
    { wait "$pid"; } 2>/dev/null
    local got
    got=$(python3 "$repo/tests/adapter_pair.py" "$dir/adapter")
    case "$got" in
      r4 | r64) ;;
      *) mixes=$((mixes + 1)); echo "  kill $i: $got" ;;
    esac
  done
  check "writers: export --adapter killed $kills times (an export takes ~$ms ms): never a mix" \
    test $mixes -eq 0
}

cases=${CRASH_CASES:-train writers}
skipped=0
if [[ " $cases " == *" train "* ]]; then
  run_case one-rank 1
  # Without a launcher the two-rank case cannot run: the test is skipped (exit 77, ctest's
  # SKIP_RETURN_CODE) after the other cases, never passed; under CI (CI=true) it fails.
  if [ -n "$mpiexec" ] && command -v "$mpiexec" >/dev/null; then
    run_case two-ranks 2
  elif [ "${CI:-}" = "true" ]; then
    echo "FAILED: two-ranks: no mpirun ('${mpiexec}' not found; Open MPI: apt-get install" \
         "openmpi-bin); CI needs every case"
    fail=1
  else
    echo "skipped: two-ranks: no mpirun ('${mpiexec}' not found; Open MPI: apt-get install" \
         "openmpi-bin); the other cases ran"
    skipped=1
  fi
fi
if [[ " $cases " == *" writers "* ]]; then writer_case; fi
[ "$fail" = 0 ] && [ "$skipped" = 1 ] && exit 77
exit $fail
