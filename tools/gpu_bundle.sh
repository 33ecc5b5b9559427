#!/usr/bin/env bash
# tools/gpu_bundle.sh: run tools/gpu_check.py on a GPU machine that has the CUDA toolkit but
# none of strata's other build dependencies (no liburing, TBB, oneDNN, Open MPI, ... and no
# network to install them), without spending the GPU machine's time on a build: the binaries are
# built elsewhere and carried over as one bundle.
#
#   tools/gpu_bundle.sh pack [--build-dir DIR]     here: bundle the CUDA-enabled binaries that
#                                                  gpu_check.py runs, and the shared libraries
#                                                  they need that a CUDA image lacks, into
#                                                  build-gpu-bundle/bundle.tar.xz (~15 MB; cuDNN
#                                                  is not carried: "run" finds it there)
#   tools/gpu_bundle.sh --self-test BUILD_DIR      pack into a temporary directory and run the
#                                                  bundle dry (no GPU; ctest gpu_bundle_self_test)
#   tools/gpu_bundle.sh exec COMMAND [ARGS...]     there: unpack and find the libraries as "run"
#                                                  does, then run one command (a single
#                                                  training row by hand) with the bundle's
#                                                  binaries loadable
#   tools/gpu_bundle.sh run [gpu_check options]    there: unpack the bundle, find the CUDA
#                                                  libraries (cuBLASLt, NCCL, cuDNN from a
#                                                  Python environment) on that machine,
#                                                  check that every binary loads, then run
#                                                  tools/gpu_check.py --build-dir build-gpu-bundle
#                                                  with the options given; the results go to
#                                                  build-gpu-bundle-results/gpu-check (a later call
#                                                  adds to them) and, as one tarball of the logs
#                                                  and tables and report.md, to $OUT when set
#                                                  (a directory that is copied back from the
#                                                  GPU machine)
#
# The build directory must be configured with the CUDA backend (STRATA_WITH_CUDA AUTO finds
# nvcc) for the GPU's architecture (STRATA_CUDA_ARCHITECTURES, 90 for H100/H200). The binaries
# carry the source directory they were built from (tests read fixtures through it); "run" links
# that path to this checkout when it does not exist. For example:
#
#   tools/gpu_bundle.sh pack                      on the build machine
#   (copy the checkout with build-gpu-bundle/ to the GPU machine)
#   tools/gpu_bundle.sh run --deadline 200 --phases env,tests,copy   on the GPU machine
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# GPU_BUNDLE_DIR moves the bundle (its self-test packs into a temporary directory).
BUNDLE=${GPU_BUNDLE_DIR:-$ROOT/build-gpu-bundle}
BINS=(tools/strata tests/bench_device_ops tests/cuda_backend_test tests/cuda_train_test
      tests/cuda_flash_attention_test tests/flash_attention_test tests/llama_cuda_test)
# Libraries the GPU machine provides (glibc, the C++ runtime, the CUDA driver, cuBLAS(Lt), NCCL:
# too large to carry and matched to its driver) are not bundled; libcudart is (small, and the
# exact runtime the binaries were built with).
SYSTEM_LIBS='^(libc|libm|libdl|libpthread|librt|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s|libcuda|libcublas|libcublasLt|libnccl|linux-vdso)\.so'

pack() {
  local build=$ROOT/build
  while (($#)); do
    case "$1" in
      --build-dir) build=$2; shift 2 ;;
      *) echo "gpu_bundle pack: unknown option '$1'" >&2; exit 2 ;;
    esac
  done
  grep -q '^STRATA_CUDA_ARCHITECTURES' "$build/CMakeCache.txt" 2>/dev/null ||
    { echo "gpu_bundle pack: $build is not a configured strata build" >&2; exit 2; }
  local b missing=()
  for b in "${BINS[@]}"; do [[ -x $build/$b ]] || missing+=("$b"); done
  if ((${#missing[@]})); then
    echo "gpu_bundle pack: not built in $build: ${missing[*]}" >&2
    echo "  (cmake --build $build --target $(printf '%s ' "${missing[@]##*/}"))" >&2
    exit 2
  fi
  if ! grep -q 'cudaMalloc' <(strings "$build/tools/strata"); then
    echo "gpu_bundle pack: $build/tools/strata has no CUDA backend (configure with nvcc found)" >&2
    exit 2
  fi
  local stage
  stage=$(mktemp -d "${TMPDIR:-/tmp}/gpu_bundle.XXXXXX")
  mkdir -p "$stage/tools" "$stage/tests" "$stage/lib"
  for b in "${BINS[@]}"; do cp "$build/$b" "$stage/$b"; done
  local lib
  while read -r lib; do
    cp -L "$lib" "$stage/lib/"
  done < <(for b in "${BINS[@]}"; do ldd "$build/$b"; done | awk '/=>/ && $3 ~ /^\// {print $3}' |
           sort -u | while read -r l; do
             [[ $(basename "$l") =~ $SYSTEM_LIBS && ! $(basename "$l") =~ ^libcudart ]] || echo "$l"
           done)
  echo "$ROOT" >"$stage/SOURCE_DIR"
  (cd "$ROOT" && git rev-parse HEAD 2>/dev/null && git status --short | head -20) >"$stage/COMMIT"
  grep -E '^(STRATA_CUDA_ARCHITECTURES|CMAKE_BUILD_TYPE)' "$build/CMakeCache.txt" >>"$stage/COMMIT"
  mkdir -p "$BUNDLE"
  tar -C "$stage" -cJf "$BUNDLE/bundle.tar.xz.tmp" . && mv "$BUNDLE/bundle.tar.xz.tmp" "$BUNDLE/bundle.tar.xz"
  rm -rf "$stage"
  echo "gpu_bundle: $BUNDLE/bundle.tar.xz ($(du -h "$BUNDLE/bundle.tar.xz" | cut -f1)): ${#BINS[@]} binaries, $(tar -tJf "$BUNDLE/bundle.tar.xz" | grep -c '^./lib/.') libraries"
}

# Unpacks the bundle and makes its binaries loadable here: LD_LIBRARY_PATH and STRATA_CUDNN_LIB
# exported (the arguments are gpu_check's: --torch-python names the interpreter asked first).
setup_there() {
  [[ -f $BUNDLE/bundle.tar.xz ]] || { echo "gpu_bundle run: no $BUNDLE/bundle.tar.xz (pack it first)" >&2; exit 2; }
  tar -C "$BUNDLE" -xJf "$BUNDLE/bundle.tar.xz" || exit 1
  cat "$BUNDLE/COMMIT"
  # The source directory the binaries were built in (their fixtures are read through it).
  local src
  src=$(cat "$BUNDLE/SOURCE_DIR")
  if [[ ! -e $src ]]; then
    mkdir -p "$(dirname "$src")" && ln -s "$ROOT" "$src" && echo "gpu_bundle: linked $src -> $ROOT"
  fi
  # cuBLASLt and NCCL from this machine: the system's, the CUDA toolkit's, or a Python wheel's.
  local dirs="$BUNDLE/lib" lib d
  for lib in libcublasLt.so.13 libcublas.so.13 libnccl.so.2; do
    if ldconfig -p 2>/dev/null | grep -q "$lib "; then continue; fi
    d=""
    for cand in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
      [[ -e $cand/$lib ]] && { d=$cand; break; }
    done
    [[ -n $d ]] || d=$(find /usr /opt -name "$lib" -print -quit 2>/dev/null | xargs -r dirname)
    if [[ -n $d ]]; then
      [[ :$dirs: == *:$d:* ]] || dirs="$dirs:$d"
      echo "gpu_bundle: $lib from $d"
    else
      echo "gpu_bundle: $lib not found on this machine"
    fi
  done
  # cuDNN (the fused attention's library path; too large to carry: ~1 GB): dlopened by the
  # binaries at run time. STRATA_CUDNN_LIB when set, else a Python environment's wheel (PyTorch
  # ships nvidia-cudnn-cu12/-cu13), whose neighbours (cuBLAS, NVRTC) cuDNN's engines load too.
  # The PyTorch peers' interpreter (--torch-python) is asked first: its environment's cuDNN is
  # the one PyTorch runs on that machine.
  local tp="" a prev=""
  for a in "$@"; do
    [[ $prev == --torch-python ]] && tp=$a
    [[ $a == --torch-python=* ]] && tp=${a#--torch-python=}
    prev=$a
  done
  if [[ -z ${STRATA_CUDNN_LIB:-} ]]; then
    local sp py
    for py in $tp python3 python; do
      command -v "$py" >/dev/null || continue
      for sp in $("$py" -c 'import site, sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null); do
        if [[ -e $sp/nvidia/cudnn/lib/libcudnn.so.9 ]]; then
          export STRATA_CUDNN_LIB=$sp/nvidia/cudnn/lib/libcudnn.so.9
          for d in "$sp"/nvidia/{cudnn,cublas,cuda_nvrtc,cu13}/lib; do
            [[ -d $d && :$dirs: != *:$d:* ]] && dirs="$dirs:$d"
          done
          break 2
        fi
      done
    done
  fi
  [[ -z ${STRATA_CUDNN_LIB:-} ]] &&
    STRATA_CUDNN_LIB=$(find /usr /opt /root -name libcudnn.so.9 -print -quit 2>/dev/null) &&
    [[ -n $STRATA_CUDNN_LIB ]] && export STRATA_CUDNN_LIB
  echo "gpu_bundle: cuDNN: ${STRATA_CUDNN_LIB:-not found on this machine (fused attention on the own kernels)}"
  export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local b bad=0
  for b in "${BINS[@]}"; do
    if ldd "$BUNDLE/$b" | grep -q 'not found'; then
      echo "gpu_bundle: $b cannot load: $(ldd "$BUNDLE/$b" | grep 'not found' | tr -s ' \t' ' ')"
      bad=1
    fi
  done
  ((bad)) && echo "gpu_bundle: going on; the phases that need those binaries will fail"
  return 0
}

run_there() {
  setup_there "$@" || exit 1
  # Outside build-gpu-bundle, which a fresh copy of the bundle replaces: a later call on the
  # same machine adds its phases to the same report.
  local results=$BUNDLE-results/gpu-check
  # cudnn-frontend's own log (every graph it builds, and why one is refused) on the tests
  # phase's processes' stderr, so in its logs, unless the caller set one (the frontend truncates
  # a log file at each process's start): the tests say what cuDNN decided. Not in the timed
  # phases: the frontend also logs every execution.
  if [[ -z ${CUDNN_FRONTEND_LOG_FILE:-} ]]; then
    export GPU_CHECK_CUDNN_LOG=1
  fi
  python3 "$ROOT/tools/gpu_check.py" --build-dir "$BUNDLE" --results "$results" "$@"
  local rc=$?
  if [[ -n ${OUT:-} ]]; then
    cp "$results/report.md" "$OUT/" 2>/dev/null
    # The text the phases wrote (logs, tables, JSON, metrics, the probe's profile and the
    # planner's reports), never the runs' checkpoints and swap files (gigabytes, and slow to
    # compress inside the call's time): files under 4 MiB, or under 256 KiB when those do not
    # fit the 16 MiB a file copied back from the GPU machine may have.
    local limit
    for limit in 4M 256k; do
      (cd "$(dirname "$results")" &&
       find gpu-check -type f -size -"$limit" \( -name '*.log' -o -name '*.md' -o -name '*.json' \
         -o -name '*.jsonl' -o -name '*.csv' -o -name '*.txt' \) -print0 |
       tar --null -T - -czf "$OUT/gpu-check.tar.gz")
      (($(stat -c %s "$OUT/gpu-check.tar.gz") < 16 << 20)) && break
    done
  fi
  return $rc
}

# Packs from BUILD into a temporary directory, checks the bundle's contents, then runs it as
# "run" would on a GPU machine, dry (gpu_check --dry-run: the CPU backend, no GPU needed).
self_test() {
  local build=${1:?build directory} tmp rc=0
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_bundle_selftest.XXXXXX")
  export GPU_BUNDLE_DIR=$tmp/bundle
  BUNDLE=$GPU_BUNDLE_DIR
  fail() { echo "gpu_bundle self-test: FAIL: $*"; rc=1; }
  ( pack --build-dir "$build" ) || fail "pack exited non-zero"
  local listing
  listing=$(tar -tJf "$BUNDLE/bundle.tar.xz" 2>/dev/null)
  for b in "${BINS[@]}"; do grep -qx "./$b" <<<"$listing" || fail "the bundle lacks $b"; done
  for l in liburing.so.2 libtbb.so.12 libcudart.so.13; do
    grep -q "^./lib/$l\$" <<<"$listing" || fail "the bundle lacks $l"
  done
  grep -q '^./lib/libcublasLt' <<<"$listing" && fail "the bundle carries cuBLASLt (the machine's is used)"
  ( OUT=$tmp/out; mkdir -p "$OUT"; export OUT
    run_there --dry-run --phases env,copy ) >"$tmp/run.log" 2>&1 || fail "run --dry-run exited non-zero (see $tmp/run.log)"
  [[ -s $tmp/out/report.md && -s $tmp/out/gpu-check.tar.gz ]] || fail "run left no report in \$OUT"
  grep -q '| copy | ok |' "$tmp/out/report.md" 2>/dev/null || fail "the dry run's copy phase did not pass"
  if ((rc == 0)); then
    echo "gpu_bundle self-test: OK ($(du -h "$BUNDLE/bundle.tar.xz" | cut -f1) bundle)"
    rm -rf "$tmp"
  fi
  return $rc
}

# One command with the bundle's binaries (build-gpu-bundle/tools/strata, ...) loadable: a single
# run by hand beside the check's phases, e.g. a row the check's report showed failing.
exec_there() {
  (($#)) || { echo "gpu_bundle exec: no command given" >&2; exit 2; }
  setup_there || exit 1
  "$@"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run_there "$@" ;;
  exec) shift; exec_there "$@" ;;
  --self-test) shift; self_test "$@" ;;
  -h | --help | "") sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//'; [[ -n ${1:-} ]] ;;
  *) echo "gpu_bundle: unknown command '$1' (pack, run or exec; see --help)" >&2; exit 2 ;;
esac
