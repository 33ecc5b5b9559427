#!/usr/bin/env bash
# tools/gpu_check.sh: strata's first run on an NVIDIA GPU, in one command (about 10 minutes on
# one H100). Builds for the GPU's architecture, runs every CUDA test, runs compute-sanitizer
# (memcheck, racecheck, synccheck) over the CUDA tests, and measures GEMM TFLOP/s, host<->device
# copies, attention (plain vs fused) and training tokens/s and MFU for a GPT-2 124M shape (five
# placements) and a ~1B Llama shape (three: on the device, in host RAM, optimizer on NVMe). Writes one Markdown report (for docs/GPU.md) and one JSON file and
# prints where they are.
#
#   tools/gpu_check.sh [options]
#   tools/gpu_check.sh --self-test [--build-dir DIR]   check this script on a machine without a
#                                                      GPU (CI runs it; see tests/gpu_check.cmake)
# options:
#   --results DIR      where the report goes (default: <build dir>/gpu-check-<UTC date-time>)
#   --build-dir DIR    build directory (default: build-gpu; an existing build is reused)
#   --jobs N           parallel build jobs (default: all cores)
#   --phases LIST      comma-separated subset of:
#                      env,build,tests,sanitizer,gemm,copy,attention,train,offload
#   --arch SM          CUDA architecture, e.g. 90 (default: from nvidia-smi's compute_cap)
#   --peak-tflops X    the GPU's dense bf16 peak, for GEMM share and MFU (default: from its name)
#   --nvme-path DIR    swap directory of the "optimizer on NVMe" row (default: <results>/swap)
#   --quick            fewer repeats and training steps
#   --deadline S       finish within S seconds: every command's time limit is cut to what is
#                      left, phases that cannot start are recorded as skipped (for 10 minutes
#                      on the machine: --deadline 560). The report is rewritten after each phase,
#                      and a later run with the same --results adds its phases to it.
#   --dry-run          run every phase without a GPU: the build is checked (not run), the tests
#                      run and skip, the benchmarks and the training run on the CPU backend at
#                      small shapes (what --self-test runs)
#   -h, --help         this text
#
# Every phase fails soft: a failure is recorded in the report, and the next phase runs. Nothing
# is installed (the GPU machine may have no network): missing tools and packages are reported.
# Exit status: 0 every phase ok; 1 some phase failed (the report says which); 2 bad usage.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$ROOT/tools/gpu_check.sh"
ALL_PHASES=(env build tests sanitizer gemm copy attention train offload)

usage() { sed -n '2,32p' "$SELF" | sed 's/^# \{0,1\}//'; }

# --- arguments ----------------------------------------------------------------------------------
RESULTS="" BUILD="" JOBS=$(nproc 2>/dev/null || echo 4) PHASES="" ARCH="" PEAK="" NVME="" DEADLINE=""
QUICK=0 DRY=0 SELF_TEST=0
ARGS=("$@")
while (($#)); do
  case "$1" in
    --results | --build-dir | --jobs | --phases | --arch | --peak-tflops | --nvme-path | --deadline)
      if (($# < 2)); then
        echo "gpu_check: $1 needs a value" >&2
        exit 2
      fi
      case "$1" in
        --results) RESULTS=$2 ;;
        --build-dir) BUILD=$2 ;;
        --jobs) JOBS=$2 ;;
        --phases) PHASES=$2 ;;
        --arch) ARCH=$2 ;;
        --peak-tflops) PEAK=$2 ;;
        --nvme-path) NVME=$2 ;;
        --deadline) DEADLINE=$2 ;;
      esac
      shift 2
      ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --self-test) SELF_TEST=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *)
      echo "gpu_check: unknown option '$1' (see --help)" >&2
      exit 2
      ;;
  esac
done
if [[ -n $PHASES ]]; then
  IFS=, read -r -a SELECTED <<<"$PHASES"
  for p in "${SELECTED[@]}"; do
    if [[ " ${ALL_PHASES[*]} " != *" $p "* ]]; then
      echo "gpu_check: --phases: unknown phase '$p' (phases: ${ALL_PHASES[*]})" >&2
      exit 2
    fi
  done
else
  SELECTED=("${ALL_PHASES[@]}")
fi
[[ $JOBS =~ ^[0-9]+$ && $JOBS -ge 1 ]] || { echo "gpu_check: --jobs must be a positive integer" >&2; exit 2; }
[[ -z $ARCH || $ARCH =~ ^[0-9]+[af]?$ ]] || { echo "gpu_check: --arch must look like 90" >&2; exit 2; }
[[ -z $PEAK || $PEAK =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "gpu_check: --peak-tflops must be a number" >&2; exit 2; }
[[ -z $DEADLINE || $DEADLINE =~ ^[0-9]+$ ]] || { echo "gpu_check: --deadline must be seconds" >&2; exit 2; }

BUILD=${BUILD:-$ROOT/build-gpu}
[[ $BUILD = /* ]] || BUILD="$PWD/$BUILD"

# --- helpers ------------------------------------------------------------------------------------
json_str() {  # a JSON string literal of $1
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/\\t}
  s=${s//$'\r'/}
  printf '"%s"' "$(printf '%s' "$s" | tr -d '\000-\010\013\014\016-\037')"
}
json_num() { [[ $1 =~ ^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]] && printf '%s' "$1" || printf 'null'; }

find_tool() {  # first executable among the candidates (names on PATH or paths)
  local c
  for c in "$@"; do
    if [[ $c == */* ]]; then
      [[ -x $c ]] && { echo "$c"; return 0; }
    elif command -v "$c" >/dev/null 2>&1; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}

# Dense bf16 tensor-core TFLOP/s (no sparsity) by GPU name; empty if unknown.
peak_for() {
  case "$1" in
    *H100*PCIe*) echo 756 ;;
    *H100*NVL*) echo 835 ;;
    *GH200* | *H200* | *H100* | *H800*) echo 989 ;;
    *B200*) echo 2250 ;;
    *B100*) echo 1750 ;;
    *A100* | *A800*) echo 312 ;;
    *L40S*) echo 366 ;;
    *L40*) echo 181 ;;
    *L4*) echo 121 ;;
    *A10*) echo 125 ;;
    *) echo "" ;;
  esac
}
# PCIe GB/s per lane and direction by generation.
pcie_lane_gbps() {
  case "$1" in 1) echo 0.25 ;; 2) echo 0.5 ;; 3) echo 0.985 ;; 4) echo 1.969 ;; 5) echo 3.938 ;;
    6) echo 7.563 ;; *) echo "" ;; esac
}

# Phase bookkeeping: each phase runs in a subshell with its output in logs/<phase>.log; it
# reports through result (status and one-line summary), and may leave json/<phase>.json (a JSON
# value) and md/<phase>.md (Markdown). Facts for later phases go to state.env.
result() {  # result ok|failed|skipped "summary"
  printf '%s\n%s\n' "$1" "$2" >"$R/status/$PHASE"
}
state() { printf '%s=%q\n' "$1" "$2" >>"$R/state.env"; }
md() { printf '%s\n' "$*" >>"$R/md/$PHASE.md"; }
run() {  # run TIMEOUT CMD...: logs the command, runs it with a time limit, returns its status
  local limit=$1
  shift
  if [[ -n ${GPU_CHECK_END:-} ]]; then
    local left=$((GPU_CHECK_END - $(date +%s) - 20))
    ((left < limit)) && limit=$((left > 1 ? left : 1))
  fi
  echo "\$ $*"
  if command -v timeout >/dev/null; then
    timeout --kill-after=15 "$limit" "$@"
  else
    "$@"
  fi
}

# --- phases -------------------------------------------------------------------------------------

phase_env() {
  local smi name="" cc="" driver="" mem="" clock="" gen="" width="" cuda_drv="" nvcc="" nvcc_ver=""
  smi=$(find_tool nvidia-smi) || smi=""
  if [[ -n $smi ]]; then
    local line
    line=$(run 30 "$smi" --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader,nounits 2>&1 | sed -n 2p)
    echo "$line"
    IFS=, read -r name cc driver mem clock gen width <<<"$line"
    name=$(echo "$name" | sed 's/^ *//;s/ *$//')
    cc=${cc// /} driver=${driver// /} mem=${mem// /} clock=${clock// /} gen=${gen// /} width=${width// /}
    cuda_drv=$("$smi" 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | grep -o '[0-9.]*$' | head -1)
    "$smi" 2>&1 | head -20
  fi
  nvcc=$(find_tool "${CUDACXX:-}" /usr/local/cuda/bin/nvcc nvcc /usr/local/cuda-*/bin/nvcc) || nvcc=""
  [[ -n $nvcc ]] && nvcc_ver=$("$nvcc" --version | grep -o 'release [0-9.]*' | grep -o '[0-9.]*$')
  local cmake ninja make cxx sanitizer
  cmake=$(find_tool cmake) || cmake=""
  ninja=$(find_tool ninja ninja-build) || ninja=""
  make=$(find_tool make) || make=""
  cxx=$(find_tool "${CXX:-}" c++ g++ clang++) || cxx=""
  sanitizer=$(find_tool compute-sanitizer /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer) || sanitizer=""
  # The packages tools/dev.sh deps installs (one list, read from there).
  local pkgs missing=()
  pkgs=$(sed -n '/^PKGS=(/,/)/p' "$ROOT/tools/dev.sh" | sed 's/#.*//' | tr -d '()' | sed 's/PKGS=//')
  if command -v dpkg-query >/dev/null; then
    for p in $pkgs; do
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
  fi
  local arch=${ARCH:-${cc//./}} peak=${PEAK:-$(peak_for "$name")} lane link=""
  lane=$(pcie_lane_gbps "$gen")
  [[ -n $lane && -n $width ]] && link=$(awk -v a="$lane" -v b="$width" 'BEGIN{printf "%.1f", a*b}')
  state GPU_NAME "$name"; state GPU_CC "$cc"; state ARCH_SEL "$arch"; state PEAK_SEL "$peak"
  state NVCC "$nvcc"; state CMAKE "$cmake"; state NINJA "$ninja"; state MAKE "$make"
  state CXX_TOOL "$cxx"; state SANITIZER "$sanitizer"; state LINK_GBPS "$link"; state SMI "$smi"

  md "| item | value |"
  md "|---|---|"
  md "| GPU | ${name:-none found} (compute capability ${cc:-?}, ${mem:-?} MiB, max SM clock ${clock:-?} MHz) |"
  md "| driver | ${driver:-?} (supports CUDA ${cuda_drv:-?}) |"
  md "| host link | PCIe gen ${gen:-?} x${width:-?} = ${link:-?} GB/s per direction |"
  md "| build for | sm_${arch:-?}; dense bf16 peak used: ${peak:-unknown} TFLOP/s |"
  md "| toolkit | nvcc ${nvcc_ver:-not found} (${nvcc:-}) |"
  md "| tools | cmake: ${cmake:-MISSING}; ninja: ${ninja:-missing}; make: ${make:-missing}; C++: ${cxx:-MISSING}; compute-sanitizer: ${sanitizer:-MISSING} |"
  md "| CPU | $(nproc 2>/dev/null) cores; $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo 2>/dev/null) RAM |"
  md "| missing packages | ${missing[*]:-none} |"
  local problems=()
  [[ -z $name && $DRY -eq 0 ]] && problems+=("no NVIDIA GPU (nvidia-smi ${smi:-not found})")
  # The build's tools and packages matter only to a run that builds (tools/gpu_bundle.sh carries
  # binaries built elsewhere: its machines lack them, and that is no failure).
  if [[ " ${SELECTED[*]} " == *" build "* ]]; then
    [[ -z $nvcc ]] && problems+=("no nvcc")
    [[ -z $cmake ]] && problems+=("no cmake")
    [[ -z $cxx ]] && problems+=("no C++ compiler")
    [[ -z $ninja && -z $make ]] && problems+=("neither ninja nor make")
    ((${#missing[@]})) && problems+=("missing packages: ${missing[*]} (tools/dev.sh deps needs network)")
  fi
  if [[ -n $cuda_drv && -n $nvcc_ver && ${cuda_drv%%.*} -lt ${nvcc_ver%%.*} ]]; then
    problems+=("the driver supports CUDA $cuda_drv but nvcc is $nvcc_ver: binaries will fail with cudaErrorInsufficientDriver")
  fi
  cat >"$R/json/env.json" <<EOF
{"gpu": $(json_str "$name"), "compute_capability": $(json_str "$cc"), "driver": $(json_str "$driver"),
 "driver_cuda": $(json_str "$cuda_drv"), "memory_mib": $(json_num "$mem"), "max_sm_clock_mhz": $(json_num "$clock"),
 "pcie_gen": $(json_num "$gen"), "pcie_width": $(json_num "$width"), "link_gbps_per_direction": $(json_num "$link"),
 "arch": $(json_str "$arch"), "peak_bf16_tflops": $(json_num "$peak"), "nvcc": $(json_str "$nvcc_ver"),
 "compute_sanitizer": $(json_str "$sanitizer"), "cores": $(json_num "$(nproc 2>/dev/null)"),
 "missing_packages": $(json_str "${missing[*]}"), "dry_run": $([[ $DRY = 1 ]] && echo true || echo false)}
EOF
  if ((${#problems[@]})); then
    result failed "$(IFS=';'; echo "${problems[*]}")"
  else
    result ok "${name:-no GPU (dry run)}, sm_${arch:-?}, driver ${driver:-?}, nvcc ${nvcc_ver:-?}"
  fi
}

BINARIES=(strata bench_device_ops cuda_backend_test cuda_train_test cuda_flash_attention_test
          llama_cuda_test flash_attention_test)
bin_path() {  # where the build puts target $1
  case "$1" in
    strata) echo "$BUILD/tools/strata" ;;
    *) echo "$BUILD/tests/$1" ;;
  esac
}

phase_build() {
  local gen="" args
  if [[ -n $NINJA ]]; then gen=Ninja; elif [[ -n $MAKE ]]; then gen="Unix Makefiles"; fi
  args=(-S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DSTRATA_WITH_CUDA=ON
        -DSTRATA_BUILD_BENCHMARKS=OFF "-DSTRATA_CUDA_ARCHITECTURES=${ARCH_SEL:-90}")
  [[ -n $gen ]] && args+=(-G "$gen")
  [[ -n $NVCC ]] && args+=("-DCMAKE_CUDA_COMPILER=$NVCC")
  if command -v ccache >/dev/null; then
    args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  local targets=(strata bench_device_ops cuda_backend_test cuda_train_test cuda_flash_attention_test
                 llama_cuda_test flash_attention_test)
  md "configure: \`cmake ${args[*]}\`"
  md ""
  md "build: \`cmake --build $BUILD -j $JOBS --target ${targets[*]}\`"
  if [[ $DRY = 1 ]]; then
    # Check that the commands exist and the build directory holds what later phases run.
    local missing=()
    [[ -n $CMAKE ]] || missing+=(cmake)
    [[ -n $gen ]] || missing+=("ninja or make")
    for b in strata bench_device_ops; do [[ -x $(bin_path $b) ]] || missing+=("$(bin_path $b)"); done
    if ((${#missing[@]})); then
      result failed "dry run: missing ${missing[*]}"
    else
      result ok "dry run: not built; cmake and $gen found, $BUILD has the binaries"
    fi
    return
  fi
  [[ -n $CMAKE ]] || { result failed "cmake not found"; return; }
  [[ -n $gen ]] || { result failed "neither ninja nor make found"; return; }
  [[ -n $NVCC ]] || { result failed "nvcc not found: the CUDA backend cannot be built"; return; }
  local t0=$SECONDS
  if ! run 600 "$CMAKE" "${args[@]}"; then
    result failed "cmake configure failed (see logs/build.log; missing packages are listed under env)"
    return
  fi
  local t1=$SECONDS
  if ! run 900 "$CMAKE" --build "$BUILD" -j "$JOBS" --target "${targets[@]}"; then
    result failed "build failed after $((SECONDS - t1)) s (see logs/build.log)"
    return
  fi
  md ""
  md "configure $((t1 - t0)) s, build $((SECONDS - t1)) s with $JOBS jobs."
  printf '{"generator": %s, "arch": %s, "configure_s": %d, "build_s": %d, "jobs": %d}\n' \
    "$(json_str "$gen")" "$(json_str "${ARCH_SEL:-90}")" $((t1 - t0)) $((SECONDS - t1)) "$JOBS" \
    >"$R/json/build.json"
  result ok "sm_${ARCH_SEL:-90} with $gen in $((SECONDS - t0)) s"
}

# Counts from a gtest run's output: "passed failed skipped".
gtest_counts() {
  local log=$1 p f s
  p=$(grep -o '^\[  PASSED  \] [0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  f=$(grep -o '^\[  FAILED  \] [0-9]* test' "$log" | grep -o '[0-9]* ' | tail -1)
  s=$(grep -o '^\[  SKIPPED \] [0-9]* test' "$log" | grep -o '[0-9]* ' | tail -1)
  echo "${p:-0} ${f:-0} ${s:-0}"
}

phase_tests() {
  local bins=(cuda_backend_test cuda_flash_attention_test cuda_train_test llama_cuda_test flash_attention_test)
  local tp=0 tf=0 ts=0 tgpu=0 any=0 bad=() reasons=() failures=() json="" b line
  md "| binary | passed | failed | skipped | seconds |"
  md "|---|---|---|---|---|"
  for b in "${bins[@]}"; do
    local exe
    exe=$(bin_path "$b")
    if [[ ! -x $exe ]]; then
      md "| $b | not built | | | |"
      [[ $DRY = 1 ]] || bad+=("$b not built")
      continue
    fi
    any=1
    local log="$R/logs/tests-$b.log" t0=$SECONDS rc filter=()
    # flash_attention_test (the CUDA kernels on a CPU emulation) is slow and needs no GPU: on
    # the GPU machine it runs in full; in a dry run CI already runs it, so only its listing.
    if [[ $DRY = 1 && $b = flash_attention_test ]]; then filter=(--gtest_list_tests); fi
    run 600 "$exe" "${filter[@]}" --gtest_output="json:$R/tests/$b.json" >"$log" 2>&1
    rc=$?
    read -r p f s < <(gtest_counts "$log")
    if [[ ${#filter[@]} -gt 0 ]]; then
      p=$(grep -c '^  ' "$log")
      md "| $b | listed $p tests (dry run) | | | $((SECONDS - t0)) |"
    else
      md "| $b | $p | $f | $s | $((SECONDS - t0)) |"
      while read -r line; do failures+=("$b: ${line#\[  FAILED  \] }"); done \
        < <(grep '^\[  FAILED  \] [A-Za-z]' "$log" | sort -u)
    fi
    tp=$((tp + p)); tf=$((tf + f)); ts=$((ts + s))
    # The one skip a GPU machine should give: the no-GPU path's test, which needs no GPU.
    tgpu=$((tgpu + $(grep -A1 ': Skipped$' "$log" | grep -c 'a GPU is visible')))
    ((rc == 0)) || bad+=("$b exited $rc")
    if [[ $s -gt 0 ]]; then
      # A skip must say why (never a silent pass): gtest prints the reason after "Skipped".
      local why
      why=$(grep -m1 -A1 ': Skipped$' "$log" | tail -1 | head -c 240)
      if [[ -n $why ]]; then
        reasons+=("$b: \`$why\`")
      else
        bad+=("$b skipped tests without a reason")
      fi
    fi
    json+="$(json_str "$b"): {\"passed\": $p, \"failed\": $f, \"skipped\": $s, \"exit\": $rc},"
  done
  if ((${#failures[@]})); then
    md ""
    md "Failed tests:"
    for b in "${failures[@]}"; do md "- $b"; done
  fi
  if ((${#reasons[@]})); then
    md ""
    md "Skip reasons (first per binary):"
    for b in "${reasons[@]}"; do md "- $b"; done
  fi
  printf '{%s "total": {"passed": %d, "failed": %d, "skipped": %d}}\n' "$json" $tp $tf $ts \
    >"$R/json/tests.json"
  if [[ $DRY = 0 && $ts -gt $tgpu ]]; then
    bad+=("$((ts - tgpu)) skipped on a GPU machine (see logs)")
  fi
  if ((any == 0)); then
    if [[ $DRY = 1 ]]; then result skipped "no CUDA test binaries (built without CUDA)"; return; fi
    result failed "no test binaries"
    return
  fi
  if ((${#bad[@]})); then
    result failed "$tp passed, $tf failed, $ts skipped; $(IFS=';'; echo "${bad[*]}")"
  else
    result ok "$tp passed, $tf failed, $ts skipped"
  fi
}

# compute-sanitizer runs: tool, binary, gtest filter (kept short: sanitizers are 10-100x slower).
SANITIZER_RUNS=(
  "memcheck cuda_backend_test AllDtypes/CudaOpTest.*/bf16:CudaBackendTest.*:CudaDeviceTest.*"
  "memcheck cuda_flash_attention_test CudaFlashAttentionTest.MatchesTheCpuBackendAndTheReference:CudaFlashAttentionTest.UnsupportedCallsFailAtTheNextSynchronize"
  "racecheck cuda_backend_test AllDtypes/CudaOpTest.Layernorm/bf16:AllDtypes/CudaOpTest.CrossEntropy/bf16:CudaBackendTest.NormSquaredAndNonfinite"
  "racecheck cuda_flash_attention_test CudaFlashAttentionTest.IsDeterministic"
  "synccheck cuda_backend_test AllDtypes/CudaOpTest.*/bf16"
  "synccheck cuda_flash_attention_test CudaFlashAttentionTest.IsDeterministic"
)

phase_sanitizer() {
  local bad=() json="" line tool b filter n_ok=0
  md "| tool | binary | gtest filter | result | seconds |"
  md "|---|---|---|---|---|"
  for line in "${SANITIZER_RUNS[@]}"; do
    read -r tool b filter <<<"$line"
    local exe
    exe=$(bin_path "$b")
    if [[ ! -x $exe ]]; then
      md "| $tool | $b | \`$filter\` | not built | |"
      [[ $DRY = 1 ]] || bad+=("$b not built")
      continue
    fi
    # The filter must select tests, or the run proves nothing.
    local listed
    listed=$("$exe" --gtest_list_tests --gtest_filter="$filter" 2>/dev/null | grep -c '^  ')
    if ((listed == 0)); then
      md "| $tool | $b | \`$filter\` | FILTER MATCHES NO TEST | |"
      bad+=("$tool/$b: the filter matches no test")
      continue
    fi
    if [[ $DRY = 1 || -z $SANITIZER ]]; then
      md "| $tool | $b | \`$filter\` | not run ($listed tests selected; $([[ $DRY = 1 ]] && echo 'dry run' || echo 'compute-sanitizer not found')) | |"
      continue
    fi
    local log="$R/logs/sanitizer-$tool-$b.log" t0=$SECONDS rc errors
    run 300 "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 20 "$exe" \
      --gtest_filter="$filter" >"$log" 2>&1
    rc=$?
    errors=$(grep -o 'ERROR SUMMARY: [0-9]* error' "$log" | grep -o '[0-9]*' | tail -1)
    local verdict
    if ((rc == 0)) && [[ ${errors:-0} = 0 ]]; then
      verdict="clean ($listed tests)"
      n_ok=$((n_ok + 1))
    elif ((rc == 124 || rc == 137)); then
      verdict="TIMED OUT"
      bad+=("$tool/$b timed out")
    else
      verdict="${errors:-?} errors, exit $rc"
      bad+=("$tool/$b: ${errors:-?} errors, exit $rc")
    fi
    md "| $tool | $b | \`$filter\` | $verdict | $((SECONDS - t0)) |"
    json+="{\"tool\": \"$tool\", \"binary\": \"$b\", \"errors\": $(json_num "${errors:-}"), \"exit\": $rc},"
  done
  printf '{"runs": [%s]}\n' "${json%,}" >"$R/json/sanitizer.json"
  if ((${#bad[@]})); then
    result failed "$(IFS=';'; echo "${bad[*]}")"
  elif [[ $DRY = 1 ]]; then
    result ok "dry run: every filter selects tests; compute-sanitizer ${SANITIZER:-not found}"
  elif [[ -z $SANITIZER ]]; then
    result failed "compute-sanitizer not found (it ships with the CUDA toolkit: cuda-sanitizer package)"
  else
    result ok "$n_ok runs clean"
  fi
}

bench() {  # bench MODE: bench_device_ops MODE into json/ and md/
  local exe backend=cuda extra=()
  exe=$(bin_path bench_device_ops)
  [[ -x $exe ]] || { result failed "bench_device_ops not built"; return 1; }
  if [[ $DRY = 1 ]]; then backend=cpu; extra+=(--quick --repeats 2); fi
  [[ $QUICK = 1 && $DRY = 0 ]] && extra+=(--repeats 3)
  [[ -n ${PEAK_SEL:-} ]] && extra+=(--peak-tflops "$PEAK_SEL")
  run 420 "$exe" "$1" --backend "$backend" "${extra[@]}" --json "$R/json/$1.json" \
    --md "$R/md/$1.md"
}

phase_gemm() {
  bench gemm || { [[ -f $R/status/gemm ]] || result failed "bench_device_ops gemm failed (see log)"; return; }
  local best
  best=$(grep -o '"forward_tflops": [0-9.e+-]*' "$R/json/gemm.json" | awk '{print $2}' | sort -g | tail -1)
  md ""
  md "FLOPs: forward 2·N·C·OC, backward 4·N·C·OC (dinp and dweight); peak: ${PEAK_SEL:-unknown} TFLOP/s dense bf16."
  result ok "best forward $(printf '%.3g' "${best:-0}") TFLOP/s (peak ${PEAK_SEL:-unknown})"
}

phase_copy() {
  bench copy || { [[ -f $R/status/copy ]] || result failed "bench_device_ops copy failed (see log)"; return; }
  local h2d d2h
  h2d=$(grep -A1 '"h2d_pinned"' "$R/json/copy.json" | grep -o '"gbps": [0-9.e+-]*' | awk '{print $2}')
  d2h=$(grep -A1 '"d2h_pinned"' "$R/json/copy.json" | grep -o '"gbps": [0-9.e+-]*' | awk '{print $2}')
  md ""
  md "Link: ${LINK_GBPS:-unknown} GB/s per direction (PCIe generation x width from nvidia-smi)."
  result ok "pinned h2d $(printf '%.1f' "${h2d:-0}") GB/s, d2h $(printf '%.1f' "${d2h:-0}") GB/s (link ${LINK_GBPS:-?})"
}

phase_attention() {
  bench attention || { [[ -f $R/status/attention ]] || result failed "bench_device_ops attention failed (see log)"; return; }
  md ""
  md "Attention memory: plain = the [B,NH,T,T] fp32 probabilities and their gradient scratch; fused = [B,NH,T] fp32 log-sum-exp and scratch."
  result ok "$(grep -c '| fused |' "$R/md/attention.md") fused and $(grep -c '| plain |' "$R/md/attention.md") plain cases measured"
}

# train_table KEY CONFIG FLOPS_PER_TOKEN ROW...: trains CONFIG once per row
# ("name|offload_param|offload_optimizer|offload_optimizer.ratio|what"), appends the table to
# the report and sets TABLE_JSON (the rows as a JSON object) and TABLE_BAD (the failed rows).
# bytes_vs_min LOG: a run summary's bytes per step beside the placement's minimum, e.g.
# "nvme 1.62 GiB (1.62 GiB, +0.0%); link 1.16 GiB (1.16 GiB, +0.0%)"; "" when it printed none.
bytes_vs_min() {
  local out=() t line
  for t in nvme 'host<->device'; do
    line=$(grep -m1 "^$t bytes per step" "$1" 2>/dev/null) || continue
    line=$(sed 's/^[^:]*: //; s/ (median of steps [^)]*)//; s/, the placement.s minimum \([^(]*\) (\(.*\))$/ (\1, \2)/' <<<"$line")
    out+=("${t/host<->device/link} $line")
  done
  local IFS=';'
  echo "${out[*]}" | sed 's/;/; /g'
}

train_table() {
  local key=$1 cfg=$2 flops_tok=$3
  shift 3
  local dir nvme=${NVME:-$R/swap} row
  dir=$(dirname "$cfg")
  md "| row | parameters | optimizer state | tokens/s | MFU | step ms | fwd/bwd ms | optimizer ms | bytes per step (the placement's minimum) | result |"
  md "|---|---|---|---|---|---|---|---|---|---|"
  TABLE_JSON="" TABLE_BAD=()
  for row in "$@"; do
    local name pdev odev ratio what
    IFS='|' read -r name pdev odev ratio what <<<"$row"
    local rdir="$dir/$key-$name" log="$R/logs/train-$key-$name.log" t0=$SECONDS rc
    rm -rf "$rdir"
    run 300 "$exe" train --config "$cfg" --quiet \
      --set "zero_optimization.offload_param.device=\"$pdev\"" \
      --set "zero_optimization.offload_optimizer.device=\"$odev\"" \
      --set "zero_optimization.offload_optimizer.ratio=$ratio" \
      --set "zero_optimization.offload_optimizer.nvme_path=\"$nvme\"" \
      --set "train.checkpoint_dir=\"$rdir\"" >"$log" 2>&1
    rc=$?
    local m="$rdir/metrics.jsonl" tps="" step="" fb="" opt="" mfu="n/a"
    if ((rc == 0)) && [[ -f $m ]]; then
      # Median over the steps after the first two (trace recording, allocation warm-up).
      med() { grep -o "\"$1\":[0-9.e+-]*" "$m" | cut -d: -f2 | tail -n +3 | sort -g |
                awk '{v[NR]=$1} END{if (NR) print v[int((NR+1)/2)]}'; }
      tps=$(med tokens_per_s) step=$(med step_s) fb=$(med fwd_bwd_s) opt=$(med optimizer_s)
      if [[ -n $tps && -n ${PEAK_SEL:-} && $DRY = 0 ]]; then
        mfu=$(awk -v t="$tps" -v f="$flops_tok" -v p="$PEAK_SEL" 'BEGIN{printf "%.1f%%", 100*t*f/(p*1e12)}')
      fi
      ms() { [[ -n $1 ]] && awk -v s="$1" 'BEGIN{printf "%.0f", s*1000}' || echo "?"; }
      md "| $name: $what | $pdev | $odev | $(printf '%.0f' "${tps:-0}") | $mfu | $(ms "$step") | $(ms "$fb") | $(ms "$opt") | $(bytes_vs_min "$log") | ok ($((SECONDS - t0)) s) |"
    else
      local why
      why=$(grep -m1 'strata train:' "$log" | head -c 300)
      md "| $name: $what | $pdev | $odev | | | | | | | FAILED (exit $rc): ${why:-see logs/train-$key-$name.log} |"
      TABLE_BAD+=("$key $name: exit $rc")
    fi
    TABLE_JSON+="$(json_str "$name"): {\"offload_param\": \"$pdev\", \"offload_optimizer\": \"$odev\", \"ratio\": $ratio, \"exit\": $rc, \"tokens_per_s\": $(json_num "$tps"), \"step_s\": $(json_num "$step"), \"fwd_bwd_s\": $(json_num "$fb"), \"optimizer_s\": $(json_num "$opt"), \"mfu\": $(json_str "$mfu")},"
  done
  TABLE_JSON="{${TABLE_JSON%,}}"
}

# train_config FILE MICRO ACCUM ACTIVATIONS MODEL_JSON STEPS: a training config for phase_train.
train_config() {
  cat >"$1" <<EOF
{
  "train_batch_size": $(($2 * $3)), "train_micro_batch_size_per_gpu": $2,
  "gradient_accumulation_steps": $3, "steps_per_print": 1, "gradient_clipping": 1.0,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
  "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true},
                        "offload_optimizer": {"device": "cpu", "pin_memory": true}},
  "model": $5,
  "data": {"source": "synthetic", "eval_batches": 0},
  "device": {"backend": "$TRAIN_BACKEND"},
  "strata": {"activations": "$4"},
  "train": {"steps": $6, "eval_interval": 0, "seed": 1, "final_checkpoint": false}
}
EOF
}

# GPT-2 124M in five placements and a ~1B Llama (TinyLlama-1.1B's shape) in three; in a dry
# run, tiny shapes of both on the CPU backend.
phase_train() {
  exe=$(bin_path strata)
  [[ -x $exe ]] || { result failed "strata not built"; return; }
  TRAIN_BACKEND=cuda TRAIN_STEPS=12
  ((QUICK)) && TRAIN_STEPS=6
  [[ $DRY = 1 ]] && TRAIN_BACKEND=cpu TRAIN_STEPS=3
  local dir="$R/train" bad=() nvme=${NVME:-$R/swap}
  mkdir -p "$dir" "$nvme"

  # GPT-2 124M. Parameters: wte [Vp,C] + wpe [T,C] + L blocks (12C^2 + 13C) + final norm (2C);
  # tied head. FLOPs per token: 6 N + 6 L C T (llm.c's estimate: causal attention at half of
  # 12 L C T).
  local L=12 NH=12 C=768 V=50257 Vp=50304 T=1024 micro=8 accum=2
  if [[ $DRY = 1 ]]; then L=2 NH=2 C=64 V=256 Vp=256 T=64 micro=2 accum=1; fi
  train_config "$dir/gpt.json" $micro $accum keep \
    "{\"n_layer\": $L, \"n_head\": $NH, \"n_embd\": $C, \"vocab_size\": $V, \"padded_vocab_size\": $Vp, \"context\": $T}" \
    "$TRAIN_STEPS"
  local params flops_tok
  params=$(awk -v Vp=$Vp -v C=$C -v T=$T -v L=$L 'BEGIN{printf "%.0f", Vp*C + T*C + L*(12*C*C + 13*C) + 2*C}')
  flops_tok=$(awk -v N="$params" -v L=$L -v C=$C -v T=$T 'BEGIN{printf "%.0f", 6*N + 6*L*C*T}')
  md "### GPT-2 124M"
  md ""
  md "Model: GPT-2 shape L=$L, heads=$NH, C=$C, T=$T, vocab $V (padded $Vp): $params parameters; micro-batch $micro x $T, $accum micro-batches per step, $TRAIN_STEPS steps, bf16, AdamW; synthetic data. Backend: $TRAIN_BACKEND."
  md ""
  md "MFU = tokens/s x (6 N + 6 L C T = $flops_tok FLOPs per token) / peak (${PEAK_SEL:-unknown} TFLOP/s). tokens/s is the median of the per-step values after the first 2 steps."
  md ""
  train_table gpt2 "$dir/gpt.json" "$flops_tok" \
    "device|none|none|1|everything on the device, the optimizer stepped by the device's kernel" \
    "device-opt-host|none|cpu|1|parameters on the device, optimizer in host RAM" \
    "ratio|none|cpu|0.5|parameters on the device, optimizer ratio 0.5 (half on the device, half in host RAM)" \
    "host|cpu|cpu|1|parameters and optimizer in host RAM" \
    "nvme|cpu|nvme|1|parameters in host RAM, optimizer on NVMe ($nvme)"
  local gpt="{\"params\": $params, \"flops_per_token\": $flops_tok, \"steps\": $TRAIN_STEPS, \"rows\": $TABLE_JSON}"
  bad+=(${TABLE_BAD[@]+"${TABLE_BAD[@]}"})

  # A ~1B Llama: TinyLlama-1.1B's shape (22 layers, width 2048, 32 query and 4 key-value heads,
  # SwiGLU 5632, vocab 32000, untied head), activations recomputed. Parameters: 2 V C
  # (embedding, head) + L (2 C^2 + 2 C (C KV/NH) + 3 C I + 2 C) + C. FLOPs per token:
  # 6 (N - V C) (every weight but the embedding lookup) + 6 L C T. Five steps (three measured):
  # with the optimizer on NVMe a step moves ~40 GB (the planner predicts ~12 s at 3 GB/s).
  local KV=4 I=5632 steps=5
  L=22 NH=32 C=2048 V=32000 T=2048 micro=4 accum=1
  if [[ $DRY = 1 ]]; then L=2 NH=4 KV=2 I=176 C=64 V=256 T=64 micro=2 accum=1 steps=3; fi
  train_config "$dir/llama.json" $micro $accum recompute \
    "{\"type\": \"llama\", \"n_layer\": $L, \"n_head\": $NH, \"num_key_value_heads\": $KV, \"n_embd\": $C, \"intermediate_size\": $I, \"vocab_size\": $V, \"context\": $T, \"tied_embeddings\": false}" \
    "$steps"
  params=$(awk -v V=$V -v C=$C -v L=$L -v I=$I -v NH=$NH -v KV=$KV 'BEGIN{printf "%.0f", 2*V*C + L*(2*C*C + 2*C*(C*KV/NH) + 3*C*I + 2*C) + C}')
  flops_tok=$(awk -v N="$params" -v V=$V -v L=$L -v C=$C -v T=$T 'BEGIN{printf "%.0f", 6*(N - V*C) + 6*L*C*T}')
  md ""
  md "### Llama ~1B"
  md ""
  md "Model: Llama (TinyLlama-1.1B's shape) L=$L, heads=$NH (key-value $KV), C=$C, SwiGLU $I, T=$T, vocab $V, untied head: $params parameters; micro-batch $micro x $T, $accum micro-batches per step, $steps steps, bf16, AdamW, activations recomputed; synthetic data. Backend: $TRAIN_BACKEND."
  md ""
  md "MFU = tokens/s x (6 (N - V C) + 6 L C T = $flops_tok FLOPs per token) / peak (${PEAK_SEL:-unknown} TFLOP/s)."
  md ""
  train_table llama "$dir/llama.json" "$flops_tok" \
    "device|none|none|1|everything on the device, the optimizer stepped by the device's kernel" \
    "host|cpu|cpu|1|parameters and optimizer in host RAM" \
    "nvme|cpu|nvme|1|parameters in host RAM, optimizer on NVMe ($nvme)"
  local llama="{\"params\": $params, \"flops_per_token\": $flops_tok, \"steps\": $steps, \"rows\": $TABLE_JSON}"
  bad+=(${TABLE_BAD[@]+"${TABLE_BAD[@]}"})
  printf '{"backend": "%s", "models": {"gpt2-124m": %s, "llama-1b": %s}}\n' \
    "$TRAIN_BACKEND" "$gpt" "$llama" >"$R/json/train.json"
  if ((${#bad[@]})); then
    result failed "$(IFS=';'; echo "${bad[*]}")"
  else
    result ok "8 runs trained ($TRAIN_BACKEND): GPT-2 124M in 5 placements, Llama ~1B in 3"
  fi
}

# The planner's NVMe terms for a config (and --set arguments): "read write deferred_read
# deferred_write after_read after_write first_forward_share" of the placement it asks for, per
# step (plan --json; no Python on the GPU machine, so the JSON is flattened and grepped).
plan_terms() {  # plan_terms OUT_PREFIX strata train args... (--config FILE --set ...)
  local out=$1
  shift
  "$exe" plan "$@" --json "$out.json" >"$out.txt" 2>&1 || return 1
  local placement flat
  placement=$(sed -nE 's/^config .* asks for ([^:]+):.*/\1/p' "$out.txt")
  [[ -n $placement ]] || return 1
  flat=$(tr -d ' \n' <"$out.json" | sed 's/{"bottleneck"/\n&/g' | grep -m1 "\"name\":\"$placement\"")
  g() { grep -o "$1" <<<"$flat" | head -1 | grep -o '[0-9][0-9.e+-]*' | tr '\n' ' '; }
  echo "$(g '"nvme_read_bytes":[0-9]*')$(g '"nvme_write_bytes":[0-9]*')$(g '"deferred":{"read":[0-9]*,"write":[0-9]*}')$(g '"after_backward":{"read":[0-9]*,"write":[0-9]*}')$(g '"first_forward_share":[0-9.e+-]*')"
}

# The offload shape on the GPU: configs/hostmem-190m.json (15 x 1024, bf16, clipping 1.0 biting
# every step, parameters and optimizer state on NVMe) in four schedules and budgets. Every row
# must give the same losses bit for bit (the metrics' losses compared as written); each row's
# step (median after the first two), optimizer, NVMe bytes per step against the placement's
# minimum, and peak RSS. In a dry run, a 2-layer shape of it on the CPU backend.
phase_offload() {
  exe=$(bin_path strata)
  [[ -x $exe ]] || { result failed "strata not built"; return; }
  local cfg="$ROOT/configs/hostmem-190m.json" steps=8 backend=cuda
  ((QUICK)) && steps=6
  local shape=()
  if [[ $DRY = 1 ]]; then
    backend=cpu steps=3
    shape=(--set model.n_layer=2 --set model.n_embd=64 --set model.n_head=2)
  fi
  local dir="$R/offload" nvme=${NVME:-$R/swap}/offload bad=() json="" ref="" row
  mkdir -p "$dir" "$nvme"
  md "configs/hostmem-190m.json on the $backend backend, $steps steps, swap in $nvme."
  md ""
  # The step-time bound's terms on this machine: the swap disk by strata's own engine (1 MiB,
  # QD 32, io_uring; >= 0.95x fio where both ran, docs/STORAGE.md: fio is not on the GPU
  # machine), and compute and the optimizer alone (parameters and gradients on the device,
  # master + moments in host memory, the plain schedule: its fwd/bwd and its optimizer).
  local rgb="" wgb="" comp="" optalone=""
  if run 90 "$exe" probe io --path "$nvme" --size "$( ((DRY)) && echo 64MiB || echo 2GiB)" \
      --backends io_uring --block-sizes 1MiB --queue-depths 32 --repeats 3 \
      --json "$dir/io.json" >"$R/logs/offload-io.log" 2>&1; then
    local flat
    flat=$(tr -d ' \n' <"$dir/io.json" | sed 's/},{/}\n{/g')
    rgb=$(grep '"op":"read"' <<<"$flat" | grep -o '"gbps_median":[0-9.e+-]*' | cut -d: -f2)
    wgb=$(grep '"op":"write"' <<<"$flat" | grep -o '"gbps_median":[0-9.e+-]*' | cut -d: -f2)
  fi
  rm -rf "${nvme:?}"/*
  if run 240 "$exe" train --config "$cfg" "${shape[@]}" --set "device.backend=\"$backend\"" \
      --set "train.steps=$steps" --set "train.checkpoint_dir=\"$dir/alone\"" \
      --set "train.final_checkpoint=false" \
      --set 'zero_optimization.offload_param.device="none"' \
      --set 'zero_optimization.offload_optimizer.device="cpu"' \
      --set 'strata.placement.grads="device"' --set 'device.memory_limit="16GiB"' \
      --set 'strata.host_memory_limit="16GiB"' --set strata.optimizer.overlap=false \
      >"$R/logs/offload-alone.log" 2>&1 && [[ -f $dir/alone/metrics.jsonl ]]; then
    local m="$dir/alone/metrics.jsonl"
    comp=$(grep -o '"fwd_bwd_s":[0-9.e+-]*' "$m" | cut -d: -f2 | tail -n +3 | sort -g |
             awk '{v[NR]=$1} END{if (NR) print v[int((NR+1)/2)]}')
    optalone=$(grep -o '"optimizer_s":[0-9.e+-]*' "$m" | cut -d: -f2 | tail -n +3 | sort -g |
             awk '{v[NR]=$1} END{if (NR) print v[int((NR+1)/2)]}')
  fi
  local r3 w3
  r3=$([[ -n $rgb ]] && awk -v x="$rgb" 'BEGIN{printf "%.2f", x}' || echo "?")
  w3=$([[ -n $wgb ]] && awk -v x="$wgb" 'BEGIN{printf "%.2f", x}' || echo "?")
  md "Bound terms: disk read $r3 / write $w3 GB/s (\`strata probe io\`, 1 MiB, QD 32, io_uring); compute alone ${comp:-?} s, optimizer alone ${optalone:-?} s (parameters and gradients on the device, master + moments in host memory, plain schedule)."
  md ""
  local -A row_step row_fb row_opt row_sets
  md "| row | step ms | fwd/bwd ms | optimizer ms | bytes per step (the placement's minimum) | peak RSS | losses | result |"
  md "|---|---|---|---|---|---|---|---|"
  for row in "plain|the plain schedule (strata.optimizer.overlap false)|strata.optimizer.overlap=false" \
             "auto|as shipped (256 MiB host budget, gradients on NVMe, defer auto)|" \
             "never|the pass after backward (defer never)|strata.optimizer.defer=\"never\"" \
             "host-4g|4 GiB host budget, gradients in host RAM, defer auto|strata.host_memory_limit=\"4GiB\";strata.placement.grads=\"host\""; do
    local name what sets
    IFS='|' read -r name what sets <<<"$row"
    local rdir="$dir/$name" log="$R/logs/offload-$name.log" t0=$SECONDS rc extra=()
    local IFS_SAVE=$IFS
    IFS=';'
    for kv in $sets; do extra+=(--set "$kv"); done
    IFS=$IFS_SAVE
    rm -rf "$rdir" "${nvme:?}"/*
    run 240 "$exe" train --config "$cfg" "${shape[@]}" --set "device.backend=\"$backend\"" \
      --set "train.steps=$steps" --set "train.checkpoint_dir=\"$rdir\"" \
      --set "train.final_checkpoint=false" \
      --set "zero_optimization.offload_param.nvme_path=\"$nvme\"" \
      --set "zero_optimization.offload_optimizer.nvme_path=\"$nvme\"" \
      ${extra[@]+"${extra[@]}"} >"$log" 2>&1
    rc=$?
    local m="$rdir/metrics.jsonl" step="" fb="" opt="" losses="" nv="" rss="" same="?"
    if ((rc == 0)) && [[ -f $m ]]; then
      med() { grep -o "\"$1\":[0-9.e+-]*" "$m" | cut -d: -f2 | tail -n +3 | sort -g |
                awk '{v[NR]=$1} END{if (NR) print v[int((NR+1)/2)]}'; }
      ms() { [[ -n $1 ]] && awk -v s="$1" 'BEGIN{printf "%.0f", s*1000}' || echo "?"; }
      step=$(med step_s) fb=$(med fwd_bwd_s) opt=$(med optimizer_s)
      losses=$(grep -o '"loss":[0-9.e+-]*' "$m" | cut -d: -f2 | paste -sd, -)
      nv=$(bytes_vs_min "$log")
      rss=$(grep -m1 'peak RSS (VmHWM)' "$log" | sed 's/.*peak RSS (VmHWM) \([0-9.]* [KMG]iB\).*/\1/')
      if [[ -z $ref ]]; then
        ref=$losses same="reference"
      elif [[ $losses == "$ref" ]]; then
        same="same bits"
      else
        same="DIFFER"
        bad+=("$name: losses differ from plain")
      fi
      row_step[$name]=$step row_fb[$name]=$fb row_opt[$name]=$opt
      row_sets[$name]=$sets
      md "| $name: $what | $(ms "$step") | $(ms "$fb") | $(ms "$opt") | ${nv:-?} | ${rss:-?} | $same | ok ($((SECONDS - t0)) s) |"
    else
      local why
      why=$(grep -m1 'strata train:' "$log" | head -c 300)
      md "| $name: $what | | | | | | | FAILED (exit $rc): ${why:-see logs/offload-$name.log} |"
      bad+=("$name: exit $rc")
    fi
    json+="$(json_str "$name"): {\"exit\": $rc, \"step_s\": $(json_num "$step"), \"fwd_bwd_s\": $(json_num "$fb"), \"optimizer_s\": $(json_num "$opt"), \"bytes\": $(json_str "$nv"), \"peak_rss\": $(json_str "$rss"), \"losses\": [${losses}], \"same_as_plain\": $(json_str "$same")},"
  done
  rm -rf "${nvme:?}"
  md ""
  md "Losses (plain): ${ref:-none}"
  # The step-time ratios per overlapped row: step / max(the plain schedule's fwd/bwd, optimizer);
  # step / bound, bound = max(compute alone, the planner's NVMe bytes for the row over the disk's
  # read and write rates, optimizer alone); and step / the schedule bound (the faster exact
  # schedule a clipped step runs: its pass's bytes gate the compute after the first forward's
  # share f0 when deferred, all of it after backward; tests/bench_step_bound.sh on the CPU).
  local ratios=""
  if [[ -n $rgb && -n $wgb && -n $comp && -n $optalone && -n ${row_fb[plain]:-} ]]; then
    md ""
    md "| row | step ms | step / max(plain fwd+bwd, plain opt) | disk ms (planner bytes / probe) | bound ms | step / bound | schedule bound ms | step / schedule bound |"
    md "|---|---|---|---|---|---|---|---|"
    for name in auto never host-4g; do
      [[ -n ${row_step[$name]:-} ]] || continue
      local targs=(--config "$cfg" "${shape[@]}" --set "device.backend=\"$backend\"") terms
      local IFS_SAVE=$IFS
      IFS=';'
      for kv in ${row_sets[$name]}; do targs+=(--set "$kv"); done
      IFS=$IFS_SAVE
      terms=$(plan_terms "$dir/plan-$name" "${targs[@]}") || terms=""
      [[ -n $terms ]] || { md "| $name | planner failed: see $dir/plan-$name.txt |"; continue; }
      local line
      line=$(awk -v t="$terms" -v r="$rgb" -v w="$wgb" -v c="$comp" -v o="$optalone" \
        -v s="${row_step[$name]}" -v fb="${row_fb[plain]}" -v po="${row_opt[plain]}" \
        -v cpu="$([[ $backend == cpu ]] && echo 1 || echo 0)" 'BEGIN {
          split(t, a, " "); disk = a[1] / (r * 1e9) + a[2] / (w * 1e9)
          pd = a[3] / (r * 1e9) + a[4] / (w * 1e9); pa = a[5] / (r * 1e9) + a[6] / (w * 1e9)
          f0 = a[7]; bound = c; if (disk > bound) bound = disk; if (o > bound) bound = o
          m = fb; if (po > m) m = po
          if (cpu) { d = c + o; x = c * (1 - f0) + (pd > c * f0 ? pd : c * f0); if (x > d) d = x }
          else { y = o; if (pd > y) y = pd; if (c * f0 > y) y = c * f0; d = c * (1 - f0) + y }
          if (disk > d) d = disk
          af = c + (o > pa ? o : pa); if (disk > af) af = disk
          sch = d < af ? d : af
          printf "%.0f|%.2f|%.0f|%.0f|%.2f|%.0f (%s)|%.2f", s * 1e3, s / m, disk * 1e3, bound * 1e3,
            s / bound, sch * 1e3, d < af ? "deferred" : "after backward", s / sch }')
      IFS='|' read -r a1 a2 a3 a4 a5 a6 a7 <<<"$line"
      md "| $name | $a1 | $a2 | $a3 | $a4 | $a5 | $a6 | $a7 |"
      ratios+="$(json_str "$name"): {\"step_over_max\": $(json_num "$a2"), \"disk_s\": $(json_num "$(awk -v x="$a3" 'BEGIN{print x/1e3}')"), \"step_over_bound\": $(json_num "$a5"), \"step_over_schedule_bound\": $(json_num "$a7")},"
    done
  else
    md ""
    md "No bound: the disk probe or the compute-alone run failed (logs/offload-io.log, logs/offload-alone.log)."
  fi
  printf '{"backend": "%s", "steps": %s, "disk_read_gbps": %s, "disk_write_gbps": %s, "compute_alone_s": %s, "optimizer_alone_s": %s, "rows": {%s}, "ratios": {%s}}\n' \
    "$backend" "$steps" "$(json_num "$rgb")" "$(json_num "$wgb")" "$(json_num "$comp")" \
    "$(json_num "$optalone")" "${json%,}" "${ratios%,}" >"$R/json/offload.json"
  if ((${#bad[@]})); then
    result failed "$(IFS=';'; echo "${bad[*]}")"
  else
    result ok "hostmem-190m ($backend): 4 schedules, the same losses bit for bit"
  fi
}

# --- the report ---------------------------------------------------------------------------------
write_report() {
  local md="$R/report.md" js="$R/report.json" p commit done_phases=()
  commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
  local -A st sum secs
  for p in "${ALL_PHASES[@]}"; do
    [[ -f $R/status/$p ]] || continue
    done_phases+=("$p")
    st[$p]=$(sed -n 1p "$R/status/$p")
    sum[$p]=$(sed -n 2p "$R/status/$p")
    secs[$p]=$(sed -n 3p "$R/status/$p")
  done
  {
    echo "# strata GPU check: ${GPU_NAME:-no GPU} ($(date -u +%Y-%m-%d))"
    echo
    echo "Command: \`tools/gpu_check.sh ${ARGS[*]}\` at commit $commit, $(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - START)) s."
    [[ $DRY = 1 ]] && echo && echo "**Dry run: no GPU was used; the numbers below are from the CPU backend at small shapes and mean nothing about a GPU.**"
    echo
    echo "| phase | status | seconds | summary |"
    echo "|---|---|---|---|"
    for p in "${done_phases[@]}"; do
      echo "| $p | ${st[$p]} | ${secs[$p]:-?} | ${sum[$p]//|/\\|} |"
    done
    for p in "${done_phases[@]}"; do
      echo
      echo "## $p"
      echo
      echo "${st[$p]}: ${sum[$p]} (log: logs/$p.log)"
      if [[ -s $R/md/$p.md ]]; then echo; cat "$R/md/$p.md"; fi
    done
  } >"$md.tmp" && mv "$md.tmp" "$md"
  {
    echo "{"
    echo "  \"magic\": \"strata-gpu-check\", \"version\": 1,"
    echo "  \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\", \"commit\": \"$commit\","
    echo "  \"dry_run\": $([[ $DRY = 1 ]] && echo true || echo false), \"seconds\": $((SECONDS - START)),"
    echo "  \"args\": $(json_str "${ARGS[*]}"),"
    echo "  \"phases\": {"
    local first=1
    for p in "${done_phases[@]}"; do
      ((first)) || echo ","
      first=0
      local res=null
      [[ -s $R/json/$p.json ]] && res=$(cat "$R/json/$p.json")
      printf '    "%s": {"status": "%s", "seconds": %s, "summary": %s, "log": "logs/%s.log",\n      "result": %s}' \
        "$p" "${st[$p]}" "$(json_num "${secs[$p]}")" "$(json_str "${sum[$p]}")" "$p" "$res"
    done
    echo
    echo "  }"
    echo "}"
  } >"$js.tmp" && mv "$js.tmp" "$js"
}

main() {
  START=$SECONDS
  R=${RESULTS:-$BUILD/gpu-check-$(date -u +%Y%m%d-%H%M%S)}
  [[ $R = /* ]] || R="$PWD/$R"
  mkdir -p "$R"/{logs,json,md,status,tests} || { echo "gpu_check: cannot create $R" >&2; exit 1; }
  touch "$R/state.env"  # kept: a later run with the same --results adds to this report
  [[ -n $DEADLINE ]] && export GPU_CHECK_END=$(($(date +%s) + DEADLINE))
  echo "gpu_check: results in $R$([[ $DRY = 1 ]] && echo ' (dry run: no GPU used)')"
  # Later phases read env's facts (the GPU's peak, compute-sanitizer, ...): a run without env
  # whose --results has none from an earlier run runs env first.
  if [[ " ${SELECTED[*]} " != *" env "* ]] && ! grep -q '^GPU_NAME=' "$R/state.env"; then
    SELECTED=(env "${SELECTED[@]}")
  fi
  local i=0 n=${#SELECTED[@]} failed=0
  for PHASE in "${SELECTED[@]}"; do
    i=$((i + 1))
    printf '== [%d/%d] %-10s ' $i "$n" "$PHASE"
    local t0=$SECONDS rc=0
    rm -f "$R/status/$PHASE" "$R/md/$PHASE.md" "$R/json/$PHASE.json"
    if [[ -n ${GPU_CHECK_END:-} ]] && (($(date +%s) + 30 > GPU_CHECK_END)); then
      printf 'skipped\nout of time (--deadline %s s)\n' "$DEADLINE" >"$R/status/$PHASE"
    else
      # shellcheck disable=SC1091
      (source "$R/state.env"; "phase_$PHASE") >"$R/logs/$PHASE.log" 2>&1
      rc=$?
    fi
    if [[ ! -f $R/status/$PHASE ]]; then
      printf 'failed\nthe phase stopped (exit %d) without a result; see logs/%s.log\n' "$rc" \
        "$PHASE" >"$R/status/$PHASE"
    fi
    echo "$((SECONDS - t0))" >>"$R/status/$PHASE"
    [[ $(sed -n 1p "$R/status/$PHASE") = failed ]] && failed=$((failed + 1))
    echo "$(sed -n 1p "$R/status/$PHASE") ($((SECONDS - t0)) s): $(sed -n 2p "$R/status/$PHASE")"
    # The report is rewritten after every phase, so a run cut short still leaves one.
    (source "$R/state.env"; write_report)
  done
  echo "report: $R/report.md"
  echo "json:   $R/report.json"
  ((failed == 0))
}

# --- self-test (no GPU needed) ------------------------------------------------------------------
self_test() {
  local tmp fails=0
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_selftest.XXXXXX")
  check() {  # check DESCRIPTION COMMAND...
    local what=$1
    shift
    if "$@" >>"$tmp/checks.log" 2>&1; then
      echo "  ok    $what"
    else
      echo "  FAIL  $what"
      fails=$((fails + 1))
    fi
  }
  expect_rc() { local want=$1; shift; "$@"; [[ $? -eq $want ]]; }
  echo "gpu_check self-test (build dir $BUILD)"
  check "--help exits 0" expect_rc 0 "$SELF" --help
  check "an unknown option exits 2" expect_rc 2 "$SELF" --bogus
  check "an unknown phase exits 2" expect_rc 2 "$SELF" --phases env,nope
  check "a missing value exits 2" expect_rc 2 "$SELF" --results
  check "a bad --jobs exits 2" expect_rc 2 "$SELF" --jobs zero
  check "a bad --deadline exits 2" expect_rc 2 "$SELF" --deadline soon
  check "bash -n (syntax)" bash -n "$SELF"
  check "peak table: H100 SXM" test "$(peak_for 'NVIDIA H100 80GB HBM3')" = 989
  check "peak table: H100 PCIe" test "$(peak_for 'NVIDIA H100 PCIe')" = 756
  check "peak table: A100" test "$(peak_for 'NVIDIA A100-SXM4-80GB')" = 312
  check "json_str escapes" test "$(json_str 'a"b\c')" = '"a\"b\\c"'
  local validator
  validator=$(bin_path bench_device_ops)
  if [[ ! -x $validator ]]; then
    echo "  FAIL  $validator is not built (build the default targets first)"
    rm -rf "$tmp"
    return 1
  fi
  # Every phase, dry: the same code path as on a GPU, on the CPU backend.
  local r="$tmp/results"
  "$SELF" --dry-run --results "$r" --build-dir "$BUILD" --nvme-path "$BUILD/gpu_check_swap" \
    >"$tmp/dry.log" 2>&1
  local rc=$?
  sed 's/^/    | /' "$tmp/dry.log"
  check "the dry run exits 0 (every phase ok or skipped)" test $rc -eq 0
  check "report.md written" test -s "$r/report.md"
  check "report.json is valid JSON with every phase" "$validator" validate-json "$r/report.json" \
    magic version phases/env/status phases/build/status phases/tests/status \
    phases/sanitizer/status phases/gemm/result/shapes phases/copy/result/cases \
    phases/attention/result/shapes phases/train/result/models/gpt2-124m/rows/device \
    phases/train/result/models/gpt2-124m/rows/device-opt-host \
    phases/train/result/models/gpt2-124m/rows/ratio phases/train/result/models/gpt2-124m/rows/host \
    phases/train/result/models/gpt2-124m/rows/nvme phases/train/result/models/llama-1b/rows/device \
    phases/train/result/models/llama-1b/rows/host phases/train/result/models/llama-1b/rows/nvme \
    phases/offload/result/rows/plain phases/offload/result/rows/auto \
    phases/offload/result/rows/never phases/offload/result/rows/host-4g \
    phases/offload/result/disk_read_gbps phases/offload/result/compute_alone_s \
    phases/offload/result/ratios/auto/step_over_bound \
    phases/offload/result/ratios/auto/step_over_schedule_bound \
    phases/offload/result/ratios/host-4g/step_over_bound
  for p in "${ALL_PHASES[@]}"; do
    check "report.md has a section for $p" grep -q "^## $p\$" "$r/report.md"
    check "phase $p is ok or skipped" grep -Eq "^\| $p \| (ok|skipped) \|" "$r/report.md"
  done
  check "the report says it was a dry run" grep -q "Dry run: no GPU was used" "$r/report.md"
  check "the fused attention ran in the attention benchmark" grep -q '| fused |' "$r/report.md"
  check "the training tables have 8 rows (5 GPT, 3 Llama)" test "$(grep -c '^| \(device\|device-opt-host\|ratio\|host\|nvme\): ' "$r/report.md")" -eq 8
  check "the offload rows have the plain schedule's losses" test "$(grep -c '| same bits | ok' "$r/report.md")" -eq 3
  check "the offload rows show NVMe bytes against the minimum" grep -q '| plain: .*| nvme [0-9.]* [KMG]iB ([0-9.]* [KMG]iB, [-+][0-9.]*%)' "$r/report.md"
  check "the offload phase has the step-time ratios for 3 rows" test "$(grep -cE '^\| (auto|never|host-4g) \| [0-9]+ \| [0-9.]+ \| [0-9]+ \| [0-9]+ \| [0-9.]+ \| [0-9]+ \((deferred|after backward)\) \| [0-9.]+ \|$' "$r/report.md")" -eq 3
  check "the paths are printed" grep -q "^report: $r/report.md" "$tmp/dry.log"
  # A failing phase is recorded and the script goes on: a build dir without binaries.
  "$SELF" --dry-run --phases build,gemm,train --results "$tmp/broken" --build-dir "$tmp/nobuild" \
    >"$tmp/broken.log" 2>&1
  rc=$?
  check "failing phases exit 1" test $rc -eq 1
  check "a failing phase is recorded and later phases still run" \
    grep -Eq '^\| train \| failed \|' "$tmp/broken/report.md"
  check "the failed run's JSON is valid" "$validator" validate-json "$tmp/broken/report.json" \
    phases/build/status phases/gemm/status phases/train/status
  # Out of time: phases that cannot start are recorded, not run.
  "$SELF" --dry-run --phases env,gemm --deadline 0 --results "$tmp/late" --build-dir "$BUILD" \
    >"$tmp/late.log" 2>&1
  check "--deadline: phases past it are skipped as out of time" \
    grep -Eq '^\| gemm \| skipped \| [0-9]+ \| out of time' "$tmp/late/report.md"
  # A second run with the same --results adds its phases to the report (a machine's time cut in parts).
  "$SELF" --dry-run --phases env --results "$tmp/parts" --build-dir "$BUILD" >/dev/null 2>&1
  "$SELF" --dry-run --phases copy --results "$tmp/parts" --build-dir "$BUILD" >/dev/null 2>&1
  check "runs with the same --results add up in one report" \
    "$validator" validate-json "$tmp/parts/report.json" phases/env/status phases/copy/result
  if ((fails)); then
    echo "gpu_check self-test: $fails check(s) FAILED (details: $tmp/checks.log, $tmp/dry.log)"
    return 1
  fi
  rm -rf "$tmp" "$BUILD/gpu_check_swap"
  echo "gpu_check self-test: OK"
}

if ((SELF_TEST)); then
  self_test
  exit $?
fi
main
