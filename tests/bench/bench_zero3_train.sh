#!/bin/bash
# Training under `mpirun -np 2` (docs/BENCHMARKS.md, "Training with 2 ranks"): 60 steps of
# configs/tiny-cpu.json with a global batch of 32, then the mean per-step split of the logged
# windows after step 1 from the JSONL (step, fwd/bwd, fetch wait, comm, optimizer).
# usage (from the source dir, after building build/tools/strata):
#   tests/bench/bench_zero3_train.sh TAG [--set KEY=VALUE]...
set -o pipefail
tag=$1; shift
d=/tmp/zero3_bench/$tag
rm -rf $d; mkdir -p $d/swap
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --allow-run-as-root --oversubscribe -np 2 \
  build/tools/strata train --config configs/tiny-cpu.json --set train_batch_size=32 \
  --set train.steps=60 --set steps_per_print=20 --set train.eval_interval=0 \
  --set train.checkpoint_dir=\"$d/ckpt\" \
  --set zero_optimization.offload_optimizer.nvme_path=\"$d/swap\" "$@" 2>&1 | grep -E "^step|error|Error"
python3 - "$d/ckpt/metrics.jsonl" <<'PY'
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
r=[x for x in rows if x["step"]>1]
n=len(r)
print("steps>1 windows:",n, "avg step_s %.4f fwd_bwd %.4f fetch_wait %.4f comm %.4f opt %.4f"%tuple(sum(x[k] for x in r)/n for k in ["step_s","fwd_bwd_s","fetch_wait_s","comm_s","optimizer_s"]))
PY
