#!/usr/bin/env bash
# strata against DeepSpeed ZeRO-Infinity on its own job, alternated.
#
#   tests/bench/bench_offload_vs_deepspeed.sh STRATA_BIN PYTHON [ROUNDS] [STEPS] [NVME_DIR]
#
# The configs/hostmem-190m.json shape (15 x 1024, 16 heads, context 128, micro-batch 1 x
# accumulation 2, AdamW, clipping 1.0, parameters and optimizer state on NVMe), ROUNDS times
# (default 3), in this order each round:
#   strata-256m   strata as shipped: host limit 256 MiB, gradients on NVMe
#   strata-4g     host limit 4 GiB, gradients in host memory
#   deepspeed     DeepSpeed ZeRO-Infinity with its defaults (../shared/peers/ds_zero_infinity.py:
#                 offload_param and offload_optimizer nvme, pin_memory, the same aio settings)
# PYTHON is an interpreter with torch and deepspeed installed (a throwaway virtual environment;
# neither is ever a dependency of strata; see the peer's header for the set-up). DeepSpeed runs
# in its faster precision on this CPU: bf16 where the CPU has avx512_bf16 or amx_bf16, else fp32
# (PyTorch emulates bf16 on AVX2-only CPUs); DS_DTYPE overrides. strata runs bf16 (its kernels
# are the same speed either way; the bytes it moves are the bf16 ones).
# STRATA_SET=KEY=VALUE adds one --set to both strata runs (e.g. 'strata.optimizer.defer="never"',
# the schedule strata.optimizer.defer "auto" settles on after 12 clipped steps on a machine where
# stepping after backward measures faster, for runs too short to reach that point).
# Every run trains STEPS steps (default 6); s/step is the median of the steps after the first
# two (strata: from its metrics log; DeepSpeed: its own timer, 2 warm-up steps); peak RSS is the
# process's VmHWM (/usr/bin/time's maximum resident set). Both write their swap files under
# NVME_DIR (default runs/bench-ds), on the same disk. Paste ../shared/tools/bench-env's header
# beside the table: a ratio taken on a busy machine is an order of magnitude only.
set -euo pipefail
bin=${1:?usage: bench_offload_vs_deepspeed.sh STRATA_BIN PYTHON [ROUNDS] [STEPS] [NVME_DIR]}
py=${2:?usage: bench_offload_vs_deepspeed.sh STRATA_BIN PYTHON [ROUNDS] [STEPS] [NVME_DIR]}
rounds=${3:-3}
steps=${4:-6}
nvme=${5:-runs/bench-ds}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$here")")
peer=${DS_PEER:-$repo/../shared/peers/ds_zero_infinity.py}
[ -f "$peer" ] || { echo "no DeepSpeed peer harness at $peer (set DS_PEER)" >&2; exit 2; }
if [ -z "${DS_DTYPE:-}" ]; then
  DS_DTYPE=fp32
  grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && DS_DTYPE=bf16
fi
out=$(mktemp -d /tmp/strata_bench_ds.XXXXXX)
mkdir -p "$nvme"
echo "runs in $out; swap under $nvme; DeepSpeed dtype $DS_DTYPE" >&2
"$repo/../shared/tools/bench-env" > "$out/env.txt" 2>&1 || true

strata_run() {  # strata_run NAME ROUND [--set k=v]...
  local name=$1 r=$2
  shift 2
  rm -rf "${nvme:?}/strata" "$out/ckpt-$name-$r"
  mkdir -p "$nvme/strata"
  /usr/bin/time -f "%M" -o "$out/$name-$r.rss" "$bin" train --config "$repo/configs/hostmem-190m.json" \
    --set "zero_optimization.offload_param.nvme_path=\"$nvme/strata\"" \
    --set "zero_optimization.offload_optimizer.nvme_path=\"$nvme/strata\"" \
    --set train.steps="$steps" --set train.final_checkpoint=false \
    --set "train.checkpoint_dir=\"$out/ckpt-$name-$r\"" \
    --set "train.log_file=\"$out/$name-$r.jsonl\"" ${STRATA_SET:+--set "$STRATA_SET"} "$@" \
    > "$out/$name-$r.out" 2>&1 ||
    { cat "$out/$name-$r.out"; exit 1; }
}
for r in $(seq 1 "$rounds"); do
  echo "round $r: strata-256m" >&2
  strata_run strata-256m "$r"
  echo "round $r: strata-4g" >&2
  strata_run strata-4g "$r" --set 'strata.host_memory_limit="4GiB"' \
    --set 'strata.placement.grads="host"'
  echo "round $r: deepspeed ($DS_DTYPE)" >&2
  rm -rf "${nvme:?}/ds"
  mkdir -p "$nvme/ds"
  DS_ACCELERATOR=cpu /usr/bin/time -f "%M" -o "$out/deepspeed-$r.rss" "$py" "$peer" \
    --n-layer 15 --n-head 16 --n-embd 1024 --vocab 256 --context 128 --micro-batch 1 \
    --grad-accum 2 --steps $((steps - 2)) --warmup 2 --dtype "$DS_DTYPE" --offload-param nvme \
    --offload-optimizer nvme --nvme-path "$nvme/ds" --threads 2 \
    > "$out/deepspeed-$r.json" 2> "$out/deepspeed-$r.err" || { tail -30 "$out/deepspeed-$r.err"; exit 1; }
  cut -d' ' -f1-3 /proc/loadavg > "$out/load-$r.txt"
done
cat "$out/env.txt"
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tokens = 1 * 128 * 2
def rss(name, r):
    return int(open(f"{out}/{name}-{r}.rss").read().split()[-1]) / 1024.0  # KiB -> MiB
print("| round | load avg | engine | s/step | tokens/s | peak RSS (MiB) | tokens/s vs DeepSpeed |"
      " RSS vs DeepSpeed |")
print("|---|---|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    ds = json.loads(open(f"{out}/deepspeed-{r}.json").read().strip().splitlines()[-1])
    ds_s, ds_rss = ds["ms_per_step"] / 1e3, rss("deepspeed", r)
    load = open(f"{out}/load-{r}.txt").read().split()[0]
    for name in ("strata-256m", "strata-4g"):
        rows = [json.loads(l) for l in open(f"{out}/{name}-{r}.jsonl") if '"loss"' in l]
        s = statistics.median(x["step_s"] for x in rows[2:])
        print(f"| {r} | {load} | {name} | {s:.2f} | {tokens / s:.1f} | {rss(name, r):.0f} |"
              f" {ds_s / s:.2f}x | {rss(name, r) / ds_rss:.2f} |")
    print(f"| {r} | {load} | deepspeed {ds['dtype']} | {ds_s:.2f} | {tokens / ds_s:.1f} |"
          f" {ds_rss:.0f} | 1.00x | 1.00 |")
PY
