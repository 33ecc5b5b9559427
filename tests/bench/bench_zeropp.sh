#!/bin/bash
# ZeRO++ under `mpirun -np 4` on one machine, ranks grouped as 2 nodes of 2
# (strata.comm.ranks_per_node=2; docs/BENCHMARKS.md, "ZeRO++"). Trains CONFIG for STEPS steps
# with a global batch of 4 ranks x 1 sequence x ACCUM micro-batches, evaluates at the end, and
# prints one table row: the JSONL's bytes this rank (0) sent per step for parameter gathers and
# gradient reductions and the step time (means over the logged window after step 1), the last
# training loss and the final eval loss.
# usage (from the source dir, after building build/tools/strata):
#   tests/bench/bench_zeropp.sh CONFIG STEPS ACCUM TAG [--set KEY=VALUE]...
#   e.g. tests/bench/bench_zeropp.sh configs/tiny-cpu.json 200 4 all \
#          --set zero_optimization.zero_quantized_weights=true \
#          --set zero_optimization.zero_hpz_partition_size=2 \
#          --set zero_optimization.zero_quantized_gradients=true
set -o pipefail
config=$1 steps=$2 accum=$3 tag=$4; shift 4
d=/tmp/zeropp_bench/$(basename "$config" .json)/$tag
rm -rf "$d"; mkdir -p "$d/swap"
start=$(date +%s)
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --allow-run-as-root \
  --oversubscribe -np 4 build/tools/strata train --config "$config" \
  --set train_micro_batch_size_per_gpu=1 --set gradient_accumulation_steps=$accum \
  --set train_batch_size=$((4 * accum)) --set train.steps=$steps --set steps_per_print=$steps \
  --set train.eval_interval=$steps --set strata.comm.ranks_per_node=2 \
  --set train.checkpoint_dir=\"$d/ckpt\" \
  --set zero_optimization.offload_param.nvme_path=\"$d/swap\" \
  --set zero_optimization.offload_optimizer.nvme_path=\"$d/swap\" "$@" > "$d/out.txt" 2>&1 ||
  { tail -20 "$d/out.txt"; exit 1; }
end=$(date +%s)
python3 - "$d/ckpt/metrics.jsonl" "$tag" $((end - start)) <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if "loss" in r and r["step"] > 1]
ev = [r for r in rows if "eval_loss" in r]
w = train[-1]
print("| %s | %.0f | %.0f | %.0f | %.0f | %.4f | %.4f | %s s |" % (
    sys.argv[2], w["comm_param_bytes"], w["comm_grad_bytes"], w["comm_bytes"],
    1e3 * w["step_s"], w["loss"], ev[-1]["eval_loss"], sys.argv[3]))
PY
