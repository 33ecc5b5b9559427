#!/usr/bin/env bash
# The loss of every step (and every eval) of six reference runs, compared with the recording in
# tests/golden/ as exact strings: a change that claims not to change the numbers (a refactor, a
# new tier, a new architecture beside GPT) must leave them bit for bit as they are.
#
#   tests/golden_losses.sh STRATA_BINARY [--record]
#
#   tiny         configs/tiny-cpu.json, 30 steps (params in host RAM, optimizer on NVMe)
#   tiny-nvme    the same with params on NVMe, strata.activations=recompute and a 6 MiB device
#   bench-25m    configs/bench-25m.json, 6 steps (everything on NVMe)
#   tiny-2rank   configs/tiny-cpu.json under mpirun -np 2, 30 steps (ZeRO-3 over 2 ranks)
#   llama        configs/tiny-cpu.json as a Llama (grouped-query attention, q/k/v biases, untied
#                head), strata.activations=offload, 30 steps
#   llama-2rank  that Llama under mpirun -np 2, 30 steps
#
# --record rewrites tests/golden/*.txt from this binary (say why in the commit: the recording
# is the contract). Every case must run: a missing launcher (no mpirun) fails the script under
# CI (CI=true) and otherwise exits 77 (ctest's SKIP_RETURN_CODE: reported skipped, not passed)
# after running the others.
#
# The runs are taken on a forced CPU path, STRATA_CPU_ISA=avx2 (the hand AVX2 GEMM; see
# kernels/cpu/gemm.h), so that the recording holds on AVX2 CPUs and on AVX-512/AMX ones, whose
# default GEMM path (oneDNN) rounds differently. The optimizer's bits are the same on every path.
set -euo pipefail
export STRATA_CPU_ISA=avx2
strata=$(realpath "$1")
record=${2:-}
src=$(cd "$(dirname "$0")/.." && pwd)
golden="$src/tests/golden"
work=$(mktemp -d /tmp/strata-golden.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$src"

# Every step's loss and every eval loss from a metrics.jsonl, one "step N loss X" line each.
losses() {
  sed -n -e 's/.*"eval_loss":\([^,}]*\).*"step":\([0-9]*\).*/eval \2 \1/p' \
         -e 's/.*"loss":\([^,}]*\).*"step":\([0-9]*\).*/step \2 \1/p' "$1"
}

run_case() {
  local name=$1; shift
  local dir="$work/$name"
  mkdir -p "$dir/swap"
  local common=(--set steps_per_print=1 --set train.checkpoint_dir="$dir/ckpt"
                --set zero_optimization.offload_optimizer.nvme_path="$dir/swap"
                --set zero_optimization.offload_param.nvme_path="$dir/swap")
  if ! "$@" "${common[@]}" >"$dir/out.txt" 2>&1; then
    echo "FAIL $name: the run failed:"; tail -20 "$dir/out.txt"; return 1
  fi
  losses "$dir/ckpt/metrics.jsonl" >"$dir/losses.txt"
  if [ ! -s "$dir/losses.txt" ]; then
    echo "FAIL $name: no losses in $dir/ckpt/metrics.jsonl"; return 1
  fi
  if [ "$record" = "--record" ]; then
    cp "$dir/losses.txt" "$golden/$name.txt"
    echo "recorded $name: $(wc -l <"$golden/$name.txt") lines"
  elif diff -u "$golden/$name.txt" "$dir/losses.txt" >"$dir/diff.txt"; then
    echo "ok   $name: $(wc -l <"$dir/losses.txt") losses identical"
  else
    echo "FAIL $name: losses differ from tests/golden/$name.txt:"; head -20 "$dir/diff.txt"
    return 1
  fi
}

# The tiny Llama of the llama cases.
llama=(--set model.type=llama --set model.num_key_value_heads=2 --set model.intermediate_size=352
       --set model.tied_embeddings=false --set model.attention_bias=true
       --set model.rope_theta=50000)

mkdir -p "$golden"
failed=0
missing=0
run_case tiny "$strata" train --config configs/tiny-cpu.json --set train.steps=30 || failed=1
run_case tiny-nvme "$strata" train --config configs/tiny-cpu.json --set train.steps=30 \
  --set zero_optimization.offload_param.device=nvme --set strata.activations=recompute \
  --set device.memory_limit=6MiB || failed=1
run_case bench-25m "$strata" train --config configs/bench-25m.json --set train.steps=6 || failed=1
run_case llama "$strata" train --config configs/tiny-cpu.json --set train.steps=30 "${llama[@]}" \
  --set strata.activations=offload || failed=1
if command -v mpirun >/dev/null; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # CI runs as root
  mpi=(mpirun --allow-run-as-root --oversubscribe -np 2)
  run_case tiny-2rank "${mpi[@]}" "$strata" train --config configs/tiny-cpu.json \
    --set train.steps=30 --set train_batch_size=32 || failed=1
  run_case llama-2rank "${mpi[@]}" "$strata" train --config configs/tiny-cpu.json \
    --set train.steps=30 --set train_batch_size=32 "${llama[@]}" || failed=1
elif [ "${CI:-}" = "true" ]; then
  echo "FAIL tiny-2rank, llama-2rank: mpirun is not installed (Open MPI: apt-get install" \
       "openmpi-bin); CI needs every golden run"
  failed=1
else
  echo "skipped tiny-2rank, llama-2rank: mpirun is not installed (Open MPI: apt-get install" \
       "openmpi-bin)"
  missing=1
fi
if [ "$failed" != 0 ]; then exit 1; fi
if [ "$missing" != 0 ]; then exit 77; fi
exit 0
