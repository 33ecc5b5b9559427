#!/usr/bin/env bash
# Two strata builds on one config, alternated A/B/A/B (ROUNDS times) so a noisy disk's drift hits
# both alike: per run, the step, fwd/bwd and optimizer times (ms) of each step after the first
# two, from the progress lines, the bytes per step against the placement's minimum, and the time
# the fresh weights and optimizer state took to initialize (start-up's largest part).
#
# usage: tests/bench/bench_ab.sh STRATA_A STRATA_B CONFIG ROUNDS STEPS [--set KEY=VALUE]...
#   e.g. build the commit before a change into /tmp/strata-a and the change into build/, then
#   tests/bench/bench_ab.sh /tmp/strata-a build/tools/strata configs/hostmem-190m.json 3 6 \
#     --set 'strata.optimizer.defer="never"'
set -euo pipefail
a=${1:?strata binary A}
b=${2:?strata binary B}
config=${3:?config}
rounds=${4:-3}
steps=${5:-6}
shift 5 || shift $#
"$(dirname "$0")/../../../shared/tools/bench-env" true 2>/dev/null || true
work=$(mktemp -d "${TMPDIR:-/tmp}/bench_ab.XXXXXX")
trap 'rm -rf "$work"' EXIT
for r in $(seq 1 "$rounds"); do
  for v in A B; do
    bin=$a
    [[ $v = B ]] && bin=$b
    "$bin" train --config "$config" --set "train.steps=$steps" --set train.final_checkpoint=false \
      --set "train.checkpoint_dir=\"$work/run-$v\"" "$@" >"$work/out" 2>&1
    grep -E '^step ' "$work/out" | tail -n +3 |
      sed -E 's/.*step ([0-9]+) ms: fwd\/bwd ([0-9]+).* opt ([0-9]+).*/\1 \2 \3/' |
      awk -v v="$v" -v r="$r" '{s = s " " $1; f = f " " $2; o = o " " $3}
        END {print "round " r " " v " | step ms:" s " | fwd/bwd:" f " | optimizer:" o}'
    grep -E 'bytes per step' "$work/out" | sed "s/^/round $r $v | /" || true
    grep -oE 'initialized .* in [0-9.]+ s' "$work/out" | sed "s/^/round $r $v | /" || true
    rm -rf "$work/run-$v"
  done
done
