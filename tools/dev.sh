#!/usr/bin/env bash
# strata's set-up, build, demo and test in one place (README's two commands call this).
#
#   tools/dev.sh train [strata train options]  install what is missing, build (Release), and run
#                                              the default job: configs/tiny-cpu.json
#   tools/dev.sh test                          install what is missing, build, run every test,
#                                              then a short fuzz of every parser (clang)
#   tools/dev.sh fuzz [SECONDS]                libFuzzer+ASan+UBSan (clang) targets of the parsers
#                                              in build-fuzz, each run SECONDS (default 60)
#   tools/dev.sh sanitize                      tier, overlap, storage, I/O worker and ZeRO-3 tests
#                                              under ASan+UBSan (build-asan) and TSan (build-tsan)
#   tools/dev.sh deps | build                  just that step
#
# Environment: BUILD_DIR (default build), STRATA_CMAKE_ARGS (extra cmake flags),
# JOBS (parallel build jobs, default: all cores), STRATA_SKIP_FUZZ=1 (test without the fuzz
# step). Under CI (CI=true) CUDA is built for one architecture (sm_90) to keep the build short.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
PKGS=(build-essential cmake ninja-build pkg-config git clang-format
      libeigen3-dev libtbb-dev nlohmann-json3-dev libfmt-dev libisal-dev
      googletest libgtest-dev libgmock-dev libbenchmark-dev
      liburing-dev libaio-dev libopenmpi-dev openmpi-bin
      clang libclang-rt-dev)  # libFuzzer and the sanitizer runtimes for clang

deps() {
  local missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "== installing: ${missing[*]}"
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
  if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
    echo "== no CUDA toolkit found: building without the CUDA backend (CPU backend only)"
  fi
}

build() {
  local args=(-DCMAKE_BUILD_TYPE=Release)
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
    [ "${CI:-}" = "true" ] && args+=(-DSTRATA_CUDA_ARCHITECTURES=90)
  fi
  # shellcheck disable=SC2206
  args+=(${STRATA_CMAKE_ARGS:-})
  echo "== configuring ($BUILD_DIR)"
  cmake -S . -B "$BUILD_DIR" -G Ninja "${args[@]}" >/dev/null
  echo "== building with $JOBS jobs"
  cmake --build "$BUILD_DIR" -j "$JOBS"
}

# The fuzz targets only (tests/fuzz): clang, no CUDA, in build-fuzz. ccache when present.
fuzz_build() {
  local args=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
              -DSTRATA_WITH_CUDA=OFF -DSTRATA_BUILD_BENCHMARKS=OFF -DSTRATA_FUZZ=ON
              "-DSTRATA_FUZZ_SECONDS=$1")
  command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  echo "== configuring build-fuzz (clang, libFuzzer, ASan, UBSan)"
  cmake -S . -B build-fuzz -G Ninja "${args[@]}" >/dev/null
  cmake --build build-fuzz -j "$JOBS" --target fuzz_config fuzz_checkpoint fuzz_tokens fuzz_profile
}
fuzz_run() {
  echo "== fuzzing each parser for $1 s (new inputs: build-fuzz/tests/fuzz/corpus_*, crashes:"
  echo "   build-fuzz/tests/fuzz/crash-*)"
  (cd build-fuzz && ctest -R '^fuzz_' --output-on-failure)
}

# Sanitizers: ASan+UBSan and TSan builds (gcc, no CUDA) of the concurrent code's tests.
sanitize() {
  local targets=(tier_test overlap_test storage_test io_worker_test zero3_test)
  local fail=0 kind flags
  for kind in asan tsan; do
    case $kind in
      asan) flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" ;;
      tsan) flags="-fsanitize=thread" ;;
    esac
    local args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_WITH_CUDA=OFF
                -DSTRATA_BUILD_BENCHMARKS=OFF "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=$flags"
                "-DCMAKE_EXE_LINKER_FLAGS=$flags")
    command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    echo "== configuring build-$kind ($flags)"
    cmake -S . -B "build-$kind" -G Ninja "${args[@]}" >/dev/null
    cmake --build "build-$kind" -j "$JOBS" --target "${targets[@]}"
    for t in "${targets[@]}"; do
      echo "== $kind: $t"
      # Open MPI's own shared-memory transport is not instrumented: suppressed (tools/tsan.supp).
      ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        TSAN_OPTIONS="suppressions=$PWD/tools/tsan.supp:halt_on_error=0:exitcode=66" \
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        "build-$kind/tests/$t" || fail=1
    done
  done
  return $fail
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  deps) deps ;;
  build) deps; build ;;
  train)
    deps; build
    mkdir -p runs/swap  # the default job swaps optimizer state here (configs/tiny-cpu.json)
    # A fresh run never overwrites another run's checkpoints (strata refuses): the demo moves
    # the previous run's directory aside instead. `tools/dev.sh train --resume` continues it.
    if [ -e runs/tiny-cpu/latest ] && [[ " $* " != *" --resume"* ]] &&
       [[ " $* " != *"train.checkpoint_dir"* ]]; then
      prev="runs/tiny-cpu.$(date +%Y%m%d-%H%M%S)"
      echo "== runs/tiny-cpu holds an earlier run: moved to $prev (continue a run with --resume)"
      mv runs/tiny-cpu "$prev"
    fi
    echo "== strata train --config configs/tiny-cpu.json $*"
    exec "$BUILD_DIR/tools/strata" train --config configs/tiny-cpu.json "$@"
    ;;
  test)
    deps; build
    # The conventional build must configure too: CMake's default generator (Makefiles), no
    # -G Ninja (configure only; the build above is the one the tests run).
    echo "== configuring with CMake's default generator ($BUILD_DIR-default-generator)"
    gen_args=(-DCMAKE_BUILD_TYPE=Release)
    [ -x /usr/local/cuda/bin/nvcc ] && gen_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
    rm -rf "$BUILD_DIR-default-generator"
    cmake -S . -B "$BUILD_DIR-default-generator" "${gen_args[@]}" >"$BUILD_DIR-default-generator.log" 2>&1 ||
      { cat "$BUILD_DIR-default-generator.log"; echo "configure with the default generator failed"; exit 1; }
    rm -rf "$BUILD_DIR-default-generator" "$BUILD_DIR-default-generator.log"
    echo "== running tests"
    rc=0
    (cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" --timeout 1200) || rc=1
    if [ "${STRATA_SKIP_FUZZ:-}" != "1" ] && command -v clang++ >/dev/null; then
      fuzz_build 10 && fuzz_run 10 || rc=1
    else
      echo "== fuzz step skipped (STRATA_SKIP_FUZZ=1 or no clang++)"
    fi
    exit $rc
    ;;
  fuzz)
    deps; fuzz_build "${1:-60}"; fuzz_run "${1:-60}" ;;
  sanitize)
    deps; sanitize ;;
  *)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
