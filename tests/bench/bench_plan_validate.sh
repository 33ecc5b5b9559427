#!/usr/bin/env bash
# The planner against the trainer: predicted vs measured step time and peak bytes per
# tier, for the seven CPU-backend configs of docs/PLANNER.md ("Validation on the CPU backend").
#
#   tests/bench/bench_plan_validate.sh build/tools/strata [ROUNDS] [SWAP_DIR]
#
# Each round (default 3) runs a fresh `strata probe --repeats 9` and then every row's
# `strata plan --validate` right after it, so that a profile and the runs it predicts see the
# same machine; rounds interleave probes and runs, because on a shared VM the machine's speed
# drifts by 10-30% over minutes (docs/PLANNER.md shows it). Per row it prints the median over
# rounds of the predicted and measured median step time and their ratio (with the rounds'
# range), and the predicted vs measured peak bytes per tier. Targets: step time within +-20%,
# peaks within +-10%.
set -euo pipefail
bin=${1:?usage: bench_plan_validate.sh STRATA_BIN [ROUNDS] [SWAP_DIR]}
rounds=${2:-3}
swap=${3:-runs/swap}
out=$(mktemp -d /tmp/strata_bench_plan.XXXXXX)
trap 'rm -rf "$out"' EXIT
mkdir -p "$swap"
SW=(--set "zero_optimization.offload_param.nvme_path=\"$swap\""
    --set "zero_optimization.offload_optimizer.nvme_path=\"$swap\"")
rows=(
  "configs/tiny-cpu.json --set train.steps=30"
  "configs/bench-25m.json"
  "configs/bench-25m.json --set zero_optimization.offload_param.device=cpu --set zero_optimization.offload_optimizer.device=cpu"
  "configs/bench-25m.json --set zero_optimization.offload_param.device=none --set zero_optimization.offload_optimizer.device=cpu --set device.memory_limit=256MiB"
  "configs/tiny-cpu.json --set train.steps=30 --set zero_optimization.offload_param.device=none --set zero_optimization.offload_optimizer.device=none --set device.memory_limit=64MiB"
  "configs/bench-25m.json --set zero_optimization.offload_param.device=cpu"
  "configs/tiny-cpu.json --set train.steps=30 --set zero_optimization.offload_param.device=nvme --set zero_optimization.offload_optimizer.device=cpu"
)
for r in $(seq 1 "$rounds"); do
  echo "round $r/$rounds: probe ($(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  "$bin" probe --path "$swap" --repeats 9 --json "$out/profile-$r.json" > "$out/probe-$r.out" 2>&1 \
    || { cat "$out/probe-$r.out"; exit 1; }
  for i in "${!rows[@]}"; do
    echo "round $r/$rounds: row $((i + 1))" >&2
    # shellcheck disable=SC2086
    # Each run its own checkpoint directory: a run refuses to write over another run's
    # checkpoints.
    "$bin" plan --config ${rows[$i]} "${SW[@]}" --set train.checkpoint_dir="\"$out/ckpt-$r-$i\"" \
      --profile "$out/profile-$r.json" --validate > "$out/row$((i + 1))-$r.out" 2>&1 \
      || { cat "$out/row$((i + 1))-$r.out"; exit 1; }
    rm -rf "$out/ckpt-$r-$i"
  done
done
python3 - "$out" "$rounds" "${#rows[@]}" <<'PY'
import re, statistics, sys
out, rounds, nrows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
def size(s):
    v, u = s.split()
    return float(v) * units[u]
def fmt(b):
    return f"{b / 2**20:.2f} MiB"
print("| # | config, placement | step ms: predicted / measured (median of rounds) | ratio - 1: median (range) | device peak | host peak | nvme peak |")
print("|---|---|---|---|---|---|---|")
for i in range(1, nrows + 1):
    pred, meas, ratio, peaks, name = [], [], [], {}, ""
    for r in range(1, rounds + 1):
        t = open(f"{out}/row{i}-{r}.out").read()
        m = re.search(r"^validate (\S+) \((\S+)\)", t, re.M)
        name = f"`{m.group(1)}` {m.group(2)}"
        m = re.search(r"predicted (\d+) ms with median rates vs measured median (\d+) ms", t)
        p, q = float(m.group(1)), float(m.group(2))
        pred.append(p); meas.append(q); ratio.append(p / q - 1)
        for tier in ("device", "host", "nvme"):
            m = re.search(rf"{tier}\s+peak: predicted ([\d.]+ \w+) .*measured ([\d.]+ \w+)", t)
            peaks.setdefault(tier, []).append((size(m.group(1)), size(m.group(2))))
    cells = []
    for tier in ("device", "host", "nvme"):
        pp = statistics.median(a for a, _ in peaks[tier])
        mm = statistics.median(b for _, b in peaks[tier])
        cells.append(f"{fmt(pp)} / {fmt(mm)} ({100 * (pp / mm - 1) if mm else 0:+.1f}%)")
    print(f"| {i} | {name} | {statistics.median(pred):.0f} / {statistics.median(meas):.0f} | "
          f"{100 * statistics.median(ratio):+.1f}% ({100 * min(ratio):+.1f}% .. {100 * max(ratio):+.1f}%) | "
          + " | ".join(cells) + " |")
PY
