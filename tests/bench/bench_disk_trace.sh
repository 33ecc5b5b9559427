#!/usr/bin/env bash
# What the disk does through a run, step by step: samples /proc/diskstats for the block device
# that holds the config's swap directory every 10 ms while `strata train` runs, then prints the
# last SHOWN steps in 100 ms buckets — read and write GB/s and the mean number of requests in
# flight (the disk's queue depth as the kernel sees it), each step's end marked where its
# progress line came out — so a phase that leaves the disk idle or one request deep shows up
# (docs/BENCHMARKS.md, "The optimizer under backward and the step's bound").
#
# usage: tests/bench/bench_disk_trace.sh STRATA_BIN CONFIG [STEPS=6] [SHOWN=2] [--set KEY=VALUE]...
#   e.g. tests/bench/bench_disk_trace.sh build/tools/strata configs/hostmem-190m.json 6 2
set -euo pipefail
bin=${1:?strata binary}
config=${2:?config}
steps=${3:-6}
shown=${4:-2}
shift $(($# < 4 ? $# : 4))
sets=("$@")
"$(dirname "$0")/../../../shared/tools/bench-env" true 2>/dev/null || true
work=$(mktemp -d "${TMPDIR:-/tmp}/bench_disk.XXXXXX")
sampler=
trap '[[ -n $sampler ]] && kill "$sampler" 2>/dev/null; rm -rf "$work"' EXIT

swap=$(python3 "$(dirname "$0")/bench_swap_dir.py" "$config")
mkdir -p "$swap"
# The whole disk behind the swap directory's filesystem (a partition's parent, if any).
src=$(df --output=source "$swap" | tail -1)
dev=$(lsblk -no PKNAME "$src" 2>/dev/null | head -1)
[[ -z $dev ]] && dev=$(basename "$src")
grep -qw "$dev" /proc/diskstats || { echo "no /proc/diskstats entry for $dev ($src)" >&2; exit 1; }
echo "config $config: swap directory $swap on /dev/$dev; $steps steps, the last $shown shown"

python3 - "$dev" "$work/samples" <<'PY' &
import sys, time
dev, out = sys.argv[1], open(sys.argv[2], 'w')
def read():
    for line in open('/proc/diskstats'):
        f = line.split()
        if f[2] == dev:  # sectors read, sectors written, requests in flight
            return int(f[5]) * 512, int(f[9]) * 512, int(f[11])
r0, w0, _ = read()
while True:
    time.sleep(0.01)
    r, w, inflight = read()
    out.write('%.3f %d %d %d\n' % (time.time(), r - r0, w - w0, inflight))
    out.flush()
    r0, w0 = r, w
PY
sampler=$!
"$bin" train --config "$config" --set "train.steps=$steps" --set train.final_checkpoint=false \
  --set "train.checkpoint_dir=\"$work/run\"" "${sets[@]}" >"$work/out" 2>&1 &
run=$!
# Each progress line stamped as it comes out (the step's end).
tail -n +1 -f --pid=$run "$work/out" | grep --line-buffered -E '^step +[0-9]+/[0-9]+ \| loss' |
  while IFS= read -r line; do
    echo "$(date +%s.%N) $line" >>"$work/steps"
    echo "${line:0:160}"
  done || true
wait $run || { echo "strata train failed:" >&2; tail -5 "$work/out" >&2; exit 1; }
kill "$sampler" 2>/dev/null || true
wait "$sampler" 2>/dev/null || true
sampler=

python3 - "$work/samples" "$work/steps" "$shown" <<'PY'
import collections, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
ends = [(float(l.split()[0]), l.split()[2]) for l in open(sys.argv[2]) if l.strip()]
shown = int(sys.argv[3])
if not rows or len(ends) <= shown:
    sys.exit('too few samples or steps to show %d' % shown)
t0, t1 = ends[-shown - 1][0], ends[-1][0]
buckets = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
for t, r, w, inflight in rows:
    if t0 <= t < t1:
        b = buckets[int((t - t0) * 10)]
        b[0] += r; b[1] += w; b[2] += inflight; b[3] += 1
marks = {int((t - t0) * 10): 'step ' + s + ' ends' for t, s in ends[-shown:]}
print('%6s %9s %10s %9s   (from the end of step %s)' % ('t (s)', 'read GB/s', 'write GB/s',
                                                       'in flight', ends[-shown - 1][1]))
for k in range(0, int((t1 - t0) * 10) + 1):
    r, w, q, n = buckets.get(k, [0, 0, 0, 1])
    print('%6.1f %9.2f %10.2f %9.1f  %-16s %s' % (k / 10, r / 1e8, w / 1e8, q / max(n, 1),
                                                 '#' * int((r + w) / 5e7), marks.get(k, '')))
PY
