#!/usr/bin/env bash
# Striping overhead: `strata probe io` (io_uring, 1 MiB, QD 32) on one directory vs the same total
# bytes striped over N directories, alternately A/B (ROUNDS times). On one physical disk expect
# no gain: the number shows what striping costs.
#
# usage: tests/bench/bench_io_striping.sh STRATA_BIN BASE_DIR [TOTAL_GiB=3] [N=3] [ROUNDS=3]
set -euo pipefail
strata=${1:?strata binary}
base=${2:?base directory}
total=${3:-3}
n=${4:-3}
rounds=${5:-3}
paths=()
for ((i = 0; i < n; i++)); do mkdir -p "$base/stripe$i" && paths+=("$base/stripe$i"); done
striped=$(IFS=,; echo "${paths[*]}")
mkdir -p "$base/single"
per=$((total * 1024 / n))
run() {  # paths size op -> GB/s
  "$strata" probe io --path "$1" --size "$2" --backends io_uring --block-sizes 1MiB \
    --queue-depths 32 --ops "$3" --warmup 0 --repeats 1 --keep-files | awk '$1 == "io_uring" { print $6 }'
}
printf "%-5s | %-28s | %-28s\n" op "1 dir, ${total} GiB (runs)" "${n} dirs x ${per} MiB (runs)"
for op in read write; do
  a=() b=()
  for ((r = 0; r < rounds; r++)); do
    a+=("$(run "$base/single" "${total}GiB" "$op")")
    b+=("$(run "$striped" "${per}MiB" "$op")")
  done
  printf "%-5s | %-28s | %-28s\n" "$op" "${a[*]}" "${b[*]}"
done
