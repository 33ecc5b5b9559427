#!/usr/bin/env bash
# Storage benchmark: `strata probe io` against fio on the same file, block size and queue depth,
# run alternately A/B/A/B (ROUNDS times) so drift on a noisy disk hits both tools alike.
# Sequential read and write, 1 MiB blocks, queue depth 8 and 32; io_uring vs fio's io_uring and
# libaio vs fio's libaio; fio on huge-page buffers when hugetlb pages are reserved. Prints, per
# case, both tools' runs, the ratio of the medians, and the median of the per-round ratios
# (strata run r / fio run r, the two runs back to back).
#
# usage: tests/bench/bench_io_vs_fio.sh STRATA_BIN DIR [SIZE=4GiB] [ROUNDS=3]
#   env BACKENDS="io_uring libaio", OPS="read write", QDS="8 32" narrow the sweep.
set -euo pipefail
strata=${1:?strata binary}
dir=${2:?directory on the disk to test}
size=${3:-4GiB}
rounds=${4:-3}
file="$dir/strata-probe-io.dat"
fio_size=${size/iB/}   # fio: 4G means 4 GiB

# Create (or reuse) the probe file once.
"$strata" probe io --path "$dir" --size "$size" --backends io_uring --block-sizes 1MiB \
  --queue-depths 8 --ops read --warmup 0 --repeats 1 --keep-files >/dev/null

strata_run() {  # backend op qd -> GB/s
  "$strata" probe io --path "$dir" --size "$size" --backends "$1" --block-sizes 1MiB \
    --queue-depths "$3" --ops "$2" --warmup 0 --repeats 1 --keep-files |
    awk -v b="$1" '$1 == b { print $6 }'
}
# fio with the buffers strata uses: huge pages (strata's pool is on 2 MiB transparent huge
# pages; fio takes hugetlb pages, --mem=mmaphuge) and, for io_uring, registered buffers and
# files. On 4 KiB pages a 1 MiB O_DIRECT piece is split at the disk queue's segment limit and
# fio measures its allocator's luck (docs/STORAGE.md, "Huge pages"). Needs >= 8 free 2 MiB
# hugetlb pages per queue slot: `echo 128 > /proc/sys/vm/nr_hugepages` (FIO_HUGE=0: plain).
huge_free=$(awk '/HugePages_Free/ {print $2}' /proc/meminfo)
fio_mem=()
if [[ ${FIO_HUGE:-1} = 1 && ${huge_free:-0} -ge 64 ]]; then
  fio_mem=(--mem=mmaphuge)
  echo "fio buffers: hugetlb 2 MiB pages (--mem=mmaphuge), $huge_free free"
else
  echo "fio buffers: malloc, 4 KiB pages (no hugetlb pages: echo 128 > /proc/sys/vm/nr_hugepages)"
fi
fio_run() {  # engine op qd -> GB/s
  local extra=()  # engine options: after --ioengine
  [[ $1 = io_uring ]] && extra=(--fixedbufs --registerfiles)
  fio --name=bench --filename="$file" --size="$fio_size" --rw="$2" --bs=1M --iodepth="$3" \
    --iodepth_batch_submit="$3" --iodepth_batch_complete_min=1 "${fio_mem[@]}" --direct=1 \
    --ioengine="$1" "${extra[@]}" --numjobs=1 --output-format=json 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; \
print('%.3f' % ((j['read']['bw_bytes'] + j['write']['bw_bytes']) / 1e9))"
}
median() { tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

printf "%-9s %-5s %3s | %-22s | %-22s | %s | %s\n" backend op qd "strata GB/s (runs)" \
  "fio GB/s (runs)" "strata/fio (medians)" "median of paired ratios"
for backend in ${BACKENDS:-io_uring libaio}; do
  for op in ${OPS:-read write}; do
    for qd in ${QDS:-8 32}; do
      s=() f=() p=()
      for ((r = 0; r < rounds; r++)); do
        s+=("$(strata_run "$backend" "$op" "$qd")")
        f+=("$(fio_run "$backend" "$op" "$qd")")
        p+=("$(echo "${s[r]} / ${f[r]}" | bc -l)")
      done
      sm=$(echo "${s[@]}" | median)
      fm=$(echo "${f[@]}" | median)
      printf "%-9s %-5s %3s | %-5s (%s) | %-5s (%s) | %.3f | %.3f\n" "$backend" "$op" "$qd" \
        "$sm" "${s[*]}" "$fm" "${f[*]}" "$(echo "$sm / $fm" | bc -l)" "$(echo "${p[@]}" | median)"
    done
  done
done
