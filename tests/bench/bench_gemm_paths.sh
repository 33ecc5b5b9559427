#!/usr/bin/env bash
# The CPU GEMM paths (kernels/cpu/gemm.h) against the CPU's fp32 FMA peak, at the linear layers
# of configs/bench-25m.json (N = 2 x 128 tokens, width 512; bf16 operands, what training runs),
# forward and backward, 1 and 2 threads, through the Kernels table (bench_matmul).
#
#   tests/bench/bench_gemm_paths.sh [BENCH_MATMUL] [ROUNDS] [PATHS]
#
# BENCH_MATMUL defaults to build/tests/bench_matmul, ROUNDS to 2, PATHS to "avx2 onednn" (each
# forced with STRATA_CPU_ISA; on an AVX-512/AMX CPU add "avx512bf16", which is the onednn path
# with oneDNN reading bf16 where it can -- the same as "onednn" there; on an AMX CPU add
# "onednn-noamx", the onednn path with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: the kernels an
# AVX-512-BF16 CPU without AMX runs). Rounds alternate the paths. Reports GFLOP per CPU-second
# of the process (fairer than wall time on a shared machine) per case and round, and that as a
# share of the peak of the instructions the path runs, measured the same way in the same run
# (independent register-only chains, one core): BM_FmaPeakAvx2 for avx2; for onednn
# BM_AmxBf16Peak (tdpbf16ps, four tile chains) on CPUs with AMX unless ONEDNN_MAX_CPU_ISA keeps
# oneDNN below AMX, else BM_Bf16DotPeakAvx512 (vdpbf16ps) on CPUs with AVX512_BF16, else
# BM_FmaPeakAvx512 on AVX-512 CPUs, else the AVX2 FMA. A path this build or CPU lacks is
# reported by strata's log line (the path it fell back to) and left out of the table.
set -euo pipefail
bin=${1:-build/tests/bench_matmul}
rounds=${2:-2}
paths=${3:-avx2 onednn}
out=$(mktemp -d /tmp/strata_bench_gemm.XXXXXX)
filter='Peak|Kernels(Forward|Backward)BF16/N:256/C:(512/OC:(1536|512|2048|256)|2048/OC:512)/'
for r in $(seq 1 "$rounds"); do
  for p in $paths; do
    # onednn-noamx: the onednn path with oneDNN kept below AMX (what an AVX-512-BF16 CPU runs).
    cap=${ONEDNN_MAX_CPU_ISA:-}
    [[ $p == onednn-noamx ]] && cap=AVX512_CORE_BF16
    env STRATA_CPU_ISA="${p%-noamx}" ${cap:+ONEDNN_MAX_CPU_ISA=$cap} "$bin" \
      --benchmark_filter="$filter" --benchmark_min_time=0.5 --benchmark_format=json >"$out/$p-$r.json" 2>"$out/$p-$r.err"
    echo "round $r $p: $(grep -m1 -o 'GEMM on the .*' "$out/$p-$r.err" || echo 'no GEMM log line')"
  done
done
python3 - "$out" $paths <<'PY'
import collections, json, os, sys
out, paths = sys.argv[1], sys.argv[2:]
rate, peak = collections.defaultdict(list), collections.defaultdict(list)
for f in sorted(os.listdir(out)):
    if not f.endswith(".json"):
        continue
    path = f.rsplit("-", 1)[0]
    for b in json.load(open(os.path.join(out, f)))["benchmarks"]:
        if b.get("error_occurred"):
            continue
        cpu = b["cpu_time"] * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
        name = b["name"].replace("/process_time/real_time", "").replace("BM_Kernels", "")
        if "Peak" in name:  # BM_FmaPeakAvx2, BM_FmaPeakAvx512, BM_Bf16DotPeakAvx512, BM_AmxBf16Peak
            isa = {"BM_FmaPeakAvx2": "fma-avx2", "BM_FmaPeakAvx512": "fma-avx512",
                   "BM_Bf16DotPeakAvx512": "bf16dot-avx512", "BM_AmxBf16Peak": "amx-bf16"}[name]
            # FLOP per iteration: 12 chains of 2^20 vector FMAs (2 FLOP a lane), or 2^18 rounds
            # of 4 tile products of 2 * 16 * 16 * 32.
            flop = (4 * 2 * 16 * 16 * 32 * (1 << 18) if isa == "amx-bf16" else
                    2 * {"fma-avx2": 8, "fma-avx512": 16, "bf16dot-avx512": 32}[isa] * 12 * (1 << 20))
            peak[(path, isa)].append(flop / cpu * 1e-9)
        else:
            rate[(name, path)].append(b["flops"] / cpu * 1e-9)
for (path, isa), v in sorted(peak.items()):
    print(f"{path}: peak {isa} " + " / ".join(f"{x:.1f}" for x in v) + " GFLOP per CPU-s")
# Each path against the peak of the instructions it runs: avx2 (and baseline) the AVX2 FMA; the
# onednn path (bf16 operands) AMX's tile product where the CPU has it and ONEDNN_MAX_CPU_ISA
# does not keep oneDNN below it, else the AVX512_BF16 dot product where the CPU has it, else
# the widest FMA it has.
cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
amx = cap in ("", "ALL", "DEFAULT") or "AMX" in cap
def peak_of(p):
    order = ["fma-avx2"] if p in ("avx2", "scalar") else (
        ["amx-bf16"] if amx and p != "onednn-noamx" else []) + [
            "bf16dot-avx512", "fma-avx512", "fma-avx2"]
    for isa in order:
        if peak.get((p, isa)):
            return isa, peak[(p, isa)]
    return None, []
print("\n| case (bf16, N/C/OC/threads) |" +
      "".join(f" {p} GFLOP/CPU-s | % of {peak_of(p)[0]} peak |" for p in paths))
print("|---" * (1 + 2 * len(paths)) + "|")
for name in sorted({n for n, _ in rate}):
    line = f"| {name} |"
    for p in paths:
        v, pk = rate.get((name, p), []), peak_of(p)[1]
        if not v or not pk:
            line += " - | - |"
            continue
        share = 100 * (sum(v) / len(v)) / (sum(pk) / len(pk))
        line += " " + " / ".join(f"{x:.1f}" for x in v) + f" | {share:.0f}% |"
    print(line)
PY
echo "runs in $out"
