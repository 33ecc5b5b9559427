#!/usr/bin/env bash
# The optimizer under backward: step time of the plain schedule (all of backward,
# then the optimizer) against the overlapped one, on the CPU backend, in one invocation.
#
#   tests/bench/bench_overlap.sh build/tools/strata [CONFIG] [ROUNDS] [--set key=value ...]
#
# Runs CONFIG (default configs/bench-25m.json: params and optimizer state on NVMe) ROUNDS times
# (default 2) with strata.optimizer.overlap=false and =true, alternating, and reads the JSONL
# logs. Per schedule it reports medians over every step after the first two of each run: step
# time, fwd+bwd, optimizer (its I/O included) and the share of it hidden under backward. Target
# (CPU backend): overlapped step <= 1.25 x max(fwd+bwd, optimizer) of the plain run.
set -euo pipefail
bin=${1:?usage: bench_overlap.sh STRATA_BIN [CONFIG] [ROUNDS] [--set k=v ...]}
cfg=${2:-configs/bench-25m.json}
rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
out=$(mktemp -d /tmp/strata_bench_overlap.XXXXXX)
trap 'rm -rf "$out"' EXIT
mkdir -p runs/swap
for r in $(seq 1 "$rounds"); do
  for ov in false true; do
    echo "round $r: strata.optimizer.overlap=$ov" >&2
    "$bin" train --config "$cfg" --set strata.optimizer.overlap=$ov \
      --set train.checkpoint_dir="\"$out/ckpt-$ov-$r\"" --set train.log_file="\"$out/$ov-$r.jsonl\"" \
      --set steps_per_print=1 "$@" > "$out/$ov-$r.out" 2>&1 || { cat "$out/$ov-$r.out"; exit 1; }
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys, glob
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(ov):
    rs = []
    for f in sorted(glob.glob(f"{out}/{ov}-*.jsonl")):
        steps = [json.loads(l) for l in open(f) if '"loss"' in l]
        rs += steps[2:]
    return rs
med = lambda rs, k: statistics.median(r[k] for r in rs)
plain, over = rows("false"), rows("true")
p_step, p_fb, p_opt = med(plain, "step_s"), med(plain, "fwd_bwd_s"), med(plain, "optimizer_s")
o_step, o_fb, o_opt = med(over, "step_s"), med(over, "fwd_bwd_s"), med(over, "optimizer_s")
hid = med(over, "optimizer_hidden_share")
rb = max(r["rollbacks"] for r in over)
bound = max(p_fb, p_opt)
print(f"steps measured: {len(plain)} plain, {len(over)} overlapped (medians, ms)")
print(f"plain:      step {1e3*p_step:.0f} = fwd/bwd {1e3*p_fb:.0f} + optimizer {1e3*p_opt:.0f} (incl. I/O)")
print(f"overlapped: step {1e3*o_step:.0f}, fwd/bwd phase {1e3*o_fb:.0f}, optimizer {1e3*o_opt:.0f} "
      f"({100*hid:.0f}% hidden under backward), rollbacks {rb}")
print(f"speed-up {p_step/o_step:.2f}x; overlapped / max(fwd+bwd, optimizer) = {o_step/bound:.2f} "
      f"(target <= 1.25)")
PY
