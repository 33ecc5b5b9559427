#!/usr/bin/env bash
# strata's CPU backend against PyTorch on the CPU, same model shape, alternated runs.
#
#   tests/bench/bench_cpu_vs_torch.sh build/tools/strata PYTHON [ROUNDS] [STEPS] [SHAPE...]
#
# PYTHON is an interpreter with torch installed (a throwaway virtual environment: PyTorch is
# never a dependency of strata). For each of the bench-25m and tiny-cpu shapes, ROUNDS times
# (default 3): one strata run of STEPS steps (default 8) with everything on the device, then one
# PyTorch run of the same shape per dtype in TORCH_DTYPES (default "bf16 fp32";
# tests/bench/bench_torch_gpt.py: bf16 autocast or plain fp32, fused AdamW, the same micro-batch and
# accumulation, 2 threads). Alternating makes all of them see the same machine load; on a CPU
# without native bf16 (AVX2 only) the bf16 autocast runs are very slow at bench-25m's shape
# (minutes), TORCH_DTYPES=fp32 leaves them out.
# Per run it reports steady tokens/s (tokens over the wall time of the steps after the first
# two, for strata from its per-step log, for PyTorch the same from its own timer) and tokens
# per CPU-second of the whole process (start-up included: on a machine shared with other work,
# wall-clock rates move with the load, CPU time much less), and the load average at the end of
# each round. SHAPE... limits the run to those shapes (bench-25m, tiny-cpu). The runs' files
# stay in the directory printed at the start.
# STRATA_CPU_ISA (docs/ARCHITECTURE.md: the CPU GEMM path, e.g. onednn or avx2) is passed to
# strata as set; each strata run's GEMM path, from its log, is printed under the table.
set -euo pipefail
bin=${1:?usage: bench_cpu_vs_torch.sh STRATA_BIN PYTHON [ROUNDS] [STEPS]}
py=${2:?usage: bench_cpu_vs_torch.sh STRATA_BIN PYTHON [ROUNDS] [STEPS]}
rounds=${3:-3}
steps=${4:-8}
dtypes=${TORCH_DTYPES:-bf16 fp32}
shift $(( $# < 4 ? $# : 4 ))
only=" $* "
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$here")")
out=$(mktemp -d /tmp/strata_bench_torch.XXXXXX)
echo "runs in $out" >&2
# name config layers heads width vocab context micro accum (tiny-cpu's warm-up is cut to fit)
shapes=("bench-25m configs/bench-25m.json 8 8 512 256 128 2 2"
        "tiny-cpu configs/tiny-cpu.json 4 4 128 256 64 4 4 scheduler.params.warmup_num_steps=1")
for r in $(seq 1 "$rounds"); do
  for s in "${shapes[@]}"; do
    read -r name cfg L H C V T mb acc extra <<< "$s"
    [[ "$only" == "  " || "$only" == *" $name "* ]] || continue
    sets=()
    [[ -n "${extra:-}" ]] && sets=(--set "$extra")
    echo "round $r: $name strata" >&2
    /usr/bin/time -f "%U %S" -o "$out/$name-strata-$r.time" "$bin" train --config "$repo/$cfg" \
      --set 'zero_optimization.offload_param.device="none"' \
      --set 'zero_optimization.offload_optimizer.device="none"' \
      --set 'device.memory_limit="2GiB"' --set train.steps="$steps" --set train.eval_interval=0 \
      --set train.checkpoint_dir="\"$out/ckpt-$name-$r\"" \
      --set train.log_file="\"$out/$name-strata-$r.jsonl\"" --set steps_per_print=1 \
      "${sets[@]}" > "$out/$name-strata-$r.out" 2>&1 || { cat "$out/$name-strata-$r.out"; exit 1; }
    for dt in $dtypes; do
      echo "round $r: $name torch $dt" >&2
      /usr/bin/time -f "%U %S" -o "$out/$name-torch-$dt-$r.time" "$py" "$here/bench_torch_gpt.py" \
        --layers "$L" --heads "$H" --width "$C" --vocab "$V" --context "$T" --micro-batch "$mb" \
        --accum "$acc" --steps $((steps - 2)) --warmup 2 --dtype "$dt" > "$out/$name-torch-$dt-$r.out"
    done
    cut -d' ' -f1-3 /proc/loadavg > "$out/$name-load-$r.txt"
    grep -m1 -o 'GEMM on the .*' "$out/$name-strata-$r.out" > "$out/$name-gemm-$r.txt" || true
  done
done
python3 - "$out" "$rounds" "$steps" "$dtypes" <<'PY'
import json, os, sys
out, rounds, steps, dtypes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
shapes = {"bench-25m": 2 * 2 * 128, "tiny-cpu": 4 * 4 * 64}  # tokens per step
def cpu_s(f):
    u, s = open(f).read().split()[-2:]
    return float(u) + float(s)
head = "| shape | round | load avg | strata tok/s |"
for dt in dtypes:
    head += f" torch {dt} tok/s | ratio |"
head += " strata tok/CPU-s |" + "".join(f" torch {dt} tok/CPU-s |" for dt in dtypes)
print(head)
print("|---" * (head.count("|") - 1) + "|")
for name, tps in shapes.items():
    for r in range(1, rounds + 1):
        if not os.path.exists(f"{out}/{name}-load-{r}.txt"):
            continue
        rows = [json.loads(l) for l in open(f"{out}/{name}-strata-{r}.jsonl") if '"loss"' in l]
        s_tok = tps * len(rows[2:]) / sum(x["step_s"] for x in rows[2:])
        s_cpu = tps * steps / cpu_s(f"{out}/{name}-strata-{r}.time")
        load = open(f"{out}/{name}-load-{r}.txt").read().split()[0]
        line, cpus = f"| {name} | {r} | {load} | {s_tok:.0f} |", ""
        for dt in dtypes:
            t = open(f"{out}/{name}-torch-{dt}-{r}.out").read().split()
            t_tok = float(t[t.index("tokens/s") + 1])
            line += f" {t_tok:.0f} | {s_tok / t_tok:.2f}x |"
            cpus += f" {tps * steps / cpu_s(f'{out}/{name}-torch-{dt}-{r}.time'):.0f} |"
        print(line + f" {s_cpu:.0f} |" + cpus)
paths = sorted({open(f"{out}/{f}").read().strip() for f in os.listdir(out) if "-gemm-" in f})
print(f"\nSTRATA_CPU_ISA={os.environ.get('STRATA_CPU_ISA', '(unset)')}; strata's " +
      ("; ".join(paths) if paths else "GEMM path: not in its log"))
PY
