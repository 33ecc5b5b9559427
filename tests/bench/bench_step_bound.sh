#!/usr/bin/env bash
# The step-time bound's two ratios for one config, every term measured in the same sitting, alternated
# ROUNDS times so a noisy disk's drift hits all alike:
#
#   step / max(fwd+bwd, optimizer)   the overlapped run's step against the plain schedule's
#                                    (strata.optimizer.overlap false) fwd+bwd and optimizer
#   step / bound                     bound = max(compute alone, NVMe bytes / fio, optimizer
#                                    compute alone)
#   step / shared-core bound         only where the config's device is the CPU backend: its
#                                    compute and the optimizer then run on the same cores, so
#                                    their times add where the bound above takes the larger
#                                    (each term of that max is one processor: the GPU, the
#                                    disk, the host CPU): max(compute + optimizer alone, disk)
#   step / schedule bound            the schedule bound: what the exact schedules a clipped step
#                                    can run (its pass deferred into the next forward, or after
#                                    backward; the faster) allow with these terms: the planner's
#                                    own step_clipped_deferred and step_clipped_plain (strata plan
#                                    --json) with a profile of the measured rates — compute alone,
#                                    the optimizer alone, fio at the pass's mix for the disk (its
#                                    clipped_pass_bytes, and the step's whole NVMe term), copies
#                                    free — so the bytes the pass waits on are the planner's and
#                                    so is the formula. schedule / bound above 1.2
#                                    says a 1.2x target is beyond those schedules on this disk
#                                    and host budget; disk / max(f+b, opt) above 1.10 says no
#                                    schedule moving the placement's bytes meets the 1.10x target.
#
# Per round: fio on the config's swap directory (before the runs and again after them: the mean)
# with the step's read/write mix (the planner's
# bytes for the config's placement; 1 MiB, QD 32, O_DIRECT, io_uring, on hugetlb pages with
# registered buffers when reserved: docs/STORAGE.md); compute alone and the optimizer's compute
# alone (one run: parameters and gradients on the device, master weights and moments in host
# memory, the plain schedule: its fwd/bwd and its optimizer; with everything on the device the
# device's optimizer would run inside fwd/bwd); the plain schedule; the config as given (clipping 1.0 bites every step of hostmem-190m:
# every step deferred or after backward, strata.optimizer.defer). Medians of steps 3-STEPS.
#
# usage: tests/bench/bench_step_bound.sh STRATA_BIN CONFIG [ROUNDS=3] [STEPS=6] [--set KEY=VALUE]...
#   e.g. tests/bench/bench_step_bound.sh build/tools/strata configs/hostmem-190m.json 3 6 \
#          --set 'strata.host_memory_limit="4GiB"' --set 'strata.placement.grads="host"'
set -euo pipefail
bin=${1:?strata binary}
config=${2:?config}
rounds=${3:-3}
steps=${4:-6}
shift $(($# < 4 ? $# : 4))
sets=("$@")
"$(dirname "$0")/../../../shared/tools/bench-env" true 2>/dev/null || true
work=$(mktemp -d "${TMPDIR:-/tmp}/bench_bound.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The placement's bytes per step and the swap directory.
"$bin" plan --config "$config" "${sets[@]}" --json "$work/plan.json" >"$work/plan.txt"
placement=$(sed -nE 's/^config .* asks for ([^:]+):.*/\1/p' "$work/plan.txt")
cpu=0  # the CPU backend: compute and optimizer share the cores (the shared-core bound)
grep -qE '^batch: .*; cpu backend$' "$work/plan.txt" && cpu=1
# The step's bytes, and those of the optimizer's pass that a step whose clipping bites waits on
# (deferred into the next forward, or after backward) with the share of compute a deferred pass
# overlaps (the first micro-batch's forward).
read -r rbytes wbytes dr dw ar aw f0 < <(python3 -c "
import json, sys
j = json.load(open('$work/plan.json'))
o = [o for o in j['options'] if o['name'] == '$placement'][0]
p = o['clipped_pass_bytes']
print(o['nvme_read_bytes'], o['nvme_write_bytes'], p['deferred']['read'], p['deferred']['write'],
      p['after_backward']['read'], p['after_backward']['write'], o['first_forward_share'])")
# The planner with the rates of one round: a machine profile (strata probe's format) whose
# compute rate gives the step's FLOPs in the measured compute time, whose optimizer rate gives
# the placement's optimizer in the measured time, whose disk reads and writes at fio's rate for
# the pass's mix, and whose copies (the link, the undo copies) are free: the measured terms
# stand alone, as in the bound. Prints the option's step_clipped_deferred and step_clipped_plain
# in ms.
backend=cuda
[[ $cpu == 1 ]] && backend=cpu
profile() {  # gemm_flops optimizer_params_per_s nvme_gbps -> $work/profile.json
  cat >"$work/profile.json" <<JSON
{"magic": "strata-machine-profile", "version": 1,
 "device": {"backend": "$backend", "gemm_flops": $1}, "host": {"copy_gbps": 1e9},
 "link": {"h2d_pinned_gbps": 1e9}, "cpu_optimizer": {"params_per_s": $2},
 "nvme": {"read_gbps": $3, "write_gbps": $3}}
JSON
}
planned() {  # gemm_flops optimizer_params_per_s nvme_gbps -> "flops cpu_optimizer_s deferred_ms plain_ms"
  profile "$@"
  "$bin" plan --config "$config" "${sets[@]}" --profile "$work/profile.json" \
    --json "$work/rated.json" >/dev/null
  python3 -c "
import json
o = [o for o in json.load(open('$work/rated.json'))['options'] if o['name'] == '$placement'][0]
t = o['time_s']
print(o['flops'], t['cpu_optimizer'], t['step_clipped_deferred'] * 1e3, t['step_clipped_plain'] * 1e3)"
}
# The optimizer's parameters per step (over the node): its time at 1e9 parameters per second.
read -r flops opt_params _ _ < <(planned 1e12 1e9 1)
opt_params=$(python3 -c "print(round($opt_params * 1e9))")  # 0: no optimizer on the CPU
swap=$(python3 "$(dirname "$0")/bench_swap_dir.py" "$config")
mkdir -p "$swap"
mix=$(python3 -c "print(round(100 * $rbytes / max(1, $rbytes + $wbytes)))")
echo "config $config, placement $placement: NVMe per step read $rbytes + write $wbytes bytes" \
  "(read $mix%), swap directory $swap"

huge_free=$(awk '/HugePages_Free/ {print $2}' /proc/meminfo)
fio_mem=()
if [[ ${huge_free:-0} -ge 64 ]]; then
  fio_mem=(--mem=mmaphuge)
else
  # fio on 4 KiB pages runs at a fraction of the disk (measured: 1.5-1.9 against 2.4-3.6 GB/s),
  # which makes the disk term of the bound too slow and a disk-bound ratio look better than it is.
  echo "WARNING: no hugetlb pages reserved: fio runs on 4 KiB pages, the disk bound is too slow;"
  echo "         reserve them first: echo 128 > /proc/sys/vm/nr_hugepages"
fi
fio_file="$swap/strata-bench-bound.dat"
fio --name=lay --filename="$fio_file" --size=4G --rw=write --bs=1M --direct=1 \
  --ioengine=io_uring >/dev/null 2>&1
pass_mix=$(python3 -c "print(round(100 * $dr / max(1, $dr + $dw)))")
fio_mixed() {  # [read %] -> GB/s, reads and writes together
  fio --name=mix --filename="$fio_file" --size=4G --rw=rw --rwmixread="${1:-$mix}" --bs=1M \
    --iodepth=32 --iodepth_batch_submit=32 --iodepth_batch_complete_min=1 "${fio_mem[@]}" \
    --direct=1 --ioengine=io_uring --fixedbufs --registerfiles --output-format=json 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; \
print('%.3f' % ((j['read']['bw_bytes'] + j['write']['bw_bytes']) / 1e9))"
}
# One run: "step fwd/bwd optimizer" medians (ms) of steps 3.. from the progress lines.
run() {  # name, --set arguments...
  local name=$1
  shift
  "$bin" train --config "$config" "${sets[@]}" --set "train.steps=$steps" \
    --set train.final_checkpoint=false --set "train.checkpoint_dir=\"$work/$name\"" "$@" \
    >"$work/$name.out" 2>&1 || { tail -5 "$work/$name.out"; exit 1; }
  grep -E '^step ' "$work/$name.out" | tail -n +3 |
    sed -E 's/.*step ([0-9]+) ms: fwd\/bwd ([0-9]+).* opt ([0-9]+).*/\1 \2 \3/' |
    python3 -c "
import statistics, sys
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
print(' '.join('%.0f' % statistics.median(r[i] for r in rows) for i in range(3)))"
  rm -rf "${work:?}/$name"
}
opt_host=(--set 'zero_optimization.offload_param.device="none"'
  --set 'zero_optimization.offload_optimizer.device="cpu"' --set 'strata.placement.grads="device"'
  --set 'device.memory_limit="16GiB"' --set 'strata.host_memory_limit="16GiB"'
  --set strata.optimizer.overlap=false)

echo "the optimizer's pass when clipping bites: deferred read $dr + write $dw bytes" \
  "(read $pass_mix%), after backward read $ar + write $aw bytes; a deferred pass overlaps" \
  "$f0 of compute"
printf "%-5s | %-8s | %-12s | %-11s | %-26s | %-22s | %s\n" round "fio GB/s" "compute ms" \
  "opt alone" "plain fwd+bwd / opt ms" "overlapped step ms" \
  "step/max(f+b,opt)  step/bound  [step/shared-core bound on the CPU backend]"
echo "      schedule bound: the faster exact schedule a clipped step can run, with these terms and"
echo "      fio at the pass's mix (fio GB/s there in brackets); schedule/bound > 1.2 means no run"
echo "      of that schedule can be within 1.2x the bound on this disk"
for r in $(seq 1 "$rounds"); do
  gbps=$(fio_mixed)
  pass_gbps=$gbps
  [[ $pass_mix != "$mix" ]] && pass_gbps=$(fio_mixed "$pass_mix")
  read -r _ compute opt_alone < <(run alone "${opt_host[@]}")
  read -r _ pfb popt < <(run plain --set strata.optimizer.overlap=false)
  read -r step _ _ < <(run overlapped)
  # The disk drifts within minutes (measured: 1.7-2.9 GB/s): fio again right after the
  # overlapped run, and the two measurements' mean (both printed).
  gbps_after=$(fio_mixed)
  pass_after=$gbps_after
  [[ $pass_mix != "$mix" ]] && pass_after=$(fio_mixed "$pass_mix")
  gbps_before=$gbps pass_before=$pass_gbps
  gbps=$(python3 -c "print('%.3f' % (($gbps_before + $gbps_after) / 2))")
  pass_gbps=$(python3 -c "print('%.3f' % (($pass_before + $pass_after) / 2))")
  read -r _ _ deferred after < <(planned \
    "$(python3 -c "print($flops / ($compute / 1e3) if $compute > 0 else 1e30)")" \
    "$(python3 -c "print($opt_params / ($opt_alone / 1e3) if $opt_alone * $opt_params > 0 else 1e30)")" \
    "$pass_gbps")
  python3 -c "
disk = ($rbytes + $wbytes) / ($gbps * 1e9) * 1e3
bound = max($compute, disk, $opt_alone)
shared = max($compute + $opt_alone, disk)
print('%-5s | %-8s | %-12s | %-11s | %-26s | %-22s | %.2f  %.2f  (bound %.0f ms: %s)%s' % (
    $r, '$gbps', '$compute', '$opt_alone', '$pfb / $popt', '$step',
    $step / max($pfb, $popt), $step / bound, bound,
    'disk %.0f ms' % disk if bound == disk else ('compute' if bound == $compute else 'optimizer'),
    '  [%.2f: %.0f ms]' % ($step / shared, shared) if $cpu else ''))
# The schedule bound: the planner's step_clipped_deferred / step_clipped_plain at these rates.
deferred, after = $deferred, $after
pd = ($dr + $dw) / ($pass_gbps * 1e9) * 1e3
pa = ($ar + $aw) / ($pass_gbps * 1e9) * 1e3
sched = min(deferred, after)
print('      [fio before / after the runs: step mix $gbps_before / $gbps_after, pass mix'
      ' $pass_before / $pass_after GB/s; the means used]')
print('      [pass fio %s GB/s] schedule bound %.0f ms (%s; pass %.0f ms): step/schedule %.2f,'
      ' schedule/bound %.2f, disk/max(f+b,opt) %.2f' % ('$pass_gbps', sched,
      'deferred' if deferred <= after else 'after backward', pd if deferred <= after else pa,
      $step / sched, sched / bound, disk / max($pfb, $popt)))"
done
rm -f "$fio_file"
