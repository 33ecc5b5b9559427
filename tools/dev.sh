#!/usr/bin/env bash
# strata's set-up, build, demo and test in one place (README's two commands call this).
#
#   tools/dev.sh train [strata train options]  install what is missing, build (Release), and run
#                                              the default job: configs/tiny-cpu.json
#   tools/dev.sh test                          install what is missing, build, run every test,
#                                              then a short fuzz of every parser (clang)
#   tools/dev.sh fuzz [SECONDS]                libFuzzer+ASan+UBSan (clang) targets of the parsers
#                                              in build-fuzz, each run SECONDS (default 60)
#   tools/dev.sh sanitize [asan|tsan]          tier, overlap, grouped-forward, schedule fuzz,
#                                              storage, I/O worker and ZeRO-3 tests
#                                              under ASan+UBSan (build-asan) and TSan (build-tsan;
#                                              its libtbb built with TSan: downloaded once)
#   tools/dev.sh deps | build                  just that step
#   tools/dev.sh cudnn                         cuDNN 9 and cudnn-frontend from PyPI into
#                                              build-deps/python (not part of deps: ~520 MB of
#                                              download, ~1 GB installed); the next configure
#                                              finds them and builds the cuDNN fused attention
#                                              (deps installs only the frontend, ~11 MB, when
#                                              the CUDA toolkit has cuDNN)
#
# Environment: BUILD_DIR (default build), STRATA_CMAKE_ARGS (extra cmake flags),
# JOBS (parallel build jobs, default: all cores), STRATA_SKIP_FUZZ=1 (test without the fuzz
# step), SANITIZE_TARGETS (`sanitize`: only these of its nine test binaries). Under CI
# (CI=true) CUDA is built for one architecture (sm_90) to keep the build short.
# Every step fails loudly: a configure or build that fails prints its output, names the step and
# makes the script exit non-zero; a test step that finds no tests is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
# Every libFuzzer target in tests/fuzz (fuzz_<name>); `fuzz` and `test` build and run all of them.
FUZZ_TARGETS=(config checkpoint tokens profile safetensors hf_config loss_mask adapter_config
              export_dir plan_mark trace)
PKGS=(build-essential cmake ninja-build pkg-config git clang-format
      python3 python3-pip  # pip fills build-deps/ (cudnn-frontend; the Python tools' tests)
      libeigen3-dev libtbb-dev nlohmann-json3-dev libfmt-dev libisal-dev
      googletest libgtest-dev libgmock-dev libbenchmark-dev
      liburing-dev libaio-dev libopenmpi-dev openmpi-bin
      libdnnl-dev  # oneDNN: the GEMM path of AVX-512/AMX CPUs (optional to the build)
      clang libclang-rt-dev)  # libFuzzer and the sanitizer runtimes for clang

# cuDNN's wheels (tools/dev.sh cudnn; deps installs the frontend alone when the CUDA toolkit
# carries cuDNN), pinned to the versions kernels/cuda/cudnn_attention.cc was written against.
CUDNN_WHEELS=(nvidia-cudnn-cu13==9.28.1.4 nvidia-cudnn-frontend==1.32.0)

deps() {  # deps [extra packages]: PKGS and these
  local missing=()
  for p in "${PKGS[@]}" "$@"; do
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
  elif [ -e /usr/local/cuda/include/cudnn.h ] && [ ! -e build-deps/python/include/cudnn_frontend.h ]; then
    # The toolkit carries cuDNN: the header-only frontend (~11 MB wheel) is all the cuDNN fused
    # attention needs to build. Optional: without it the own kernels run.
    echo "== installing ${CUDNN_WHEELS[1]} into build-deps/python (cuDNN is the toolkit's)"
    python3 -m pip install --quiet --no-deps --target build-deps/python "${CUDNN_WHEELS[1]}" ||
      echo "== could not install ${CUDNN_WHEELS[1]}: building without the cuDNN attention"
  fi
  # tools/prepare_data.py's Python dependencies for its tests and the LoRA recipe's (ctest
  # prepare_data_shapes and lora_recipe put build-deps/python-tools on PYTHONPATH): transformers
  # (its tokenizers and chat templates; no torch), jinja2 and pyarrow (Parquet), ~450 MB. A
  # user's own runs need them in their Python.
  if ! python3 -c "import pyarrow, transformers, jinja2" 2>/dev/null &&
     [ ! -d build-deps/python-tools/transformers ]; then
    echo "== installing transformers, jinja2 and pyarrow into build-deps/python-tools (the tests" \
         "of prepare_data and the LoRA recipe)"
    python3 -m pip install --quiet --target build-deps/python-tools pyarrow transformers jinja2 ||
      echo "== could not install them: prepare_data's Parquet tests and the recipe test will skip"
  fi
}

# cuDNN for the CUDA backend's fused attention (kernels/cuda/cudnn_attention.cc): the wheels'
# headers are what the build needs (the frontend is header-only; libcudnn is dlopened at run
# time, first from where CMake found it).
cudnn() {
  local dir=build-deps/python
  if [ -e "$dir/nvidia/cudnn/include/cudnn.h" ] && [ -e "$dir/include/cudnn_frontend.h" ]; then
    echo "== cuDNN already in $dir"
    return 0
  fi
  echo "== installing ${CUDNN_WHEELS[*]} into $dir"
  python3 -m pip install --quiet --no-deps --upgrade --target "$dir" "${CUDNN_WHEELS[@]}" ||
    { echo "== FAILED: pip install of ${CUDNN_WHEELS[*]}"; return 1; }
}

# configure DIR [cmake args]: cmake -S . -B DIR; on failure its output, the step, and return 1.
configure() {
  local dir=$1 out
  shift
  echo "== configuring $dir"
  if ! out=$(cmake -S . -B "$dir" "$@" 2>&1); then
    printf '%s\n' "$out"
    echo "== FAILED: configuring $dir (cmake $*)"
    return 1
  fi
}
# build_targets DIR [targets]: on failure names the step and returns 1.
build_targets() {
  local dir=$1
  shift
  local t=()
  (($#)) && t=(--target "$@")
  cmake --build "$dir" -j "$JOBS" "${t[@]}" || { echo "== FAILED: building $dir $*"; return 1; }
}

build() {
  local args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
  command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
    command -v ccache >/dev/null && args+=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    [ "${CI:-}" = "true" ] && args+=(-DSTRATA_CUDA_ARCHITECTURES=90)
  fi
  # shellcheck disable=SC2206
  args+=(${STRATA_CMAKE_ARGS:-})
  configure "$BUILD_DIR" "${args[@]}" || return 1
  echo "== building with $JOBS jobs"
  build_targets "$BUILD_DIR" || return 1
}

# The fuzz targets only (tests/fuzz): clang, no CUDA, in build-fuzz. ccache when present.
fuzz_build() {
  local args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang
              -DCMAKE_CXX_COMPILER=clang++ -DSTRATA_WITH_CUDA=OFF -DSTRATA_BUILD_BENCHMARKS=OFF
              -DSTRATA_FUZZ=ON "-DSTRATA_FUZZ_SECONDS=$1")
  command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  echo "== fuzz targets (clang, libFuzzer, ASan, UBSan): ${FUZZ_TARGETS[*]}"
  configure build-fuzz "${args[@]}" || return 1
  build_targets build-fuzz "${FUZZ_TARGETS[@]/#/fuzz_}" || return 1
}
fuzz_run() {
  echo "== fuzzing each parser for $1 s (new inputs: build-fuzz/tests/fuzz/corpus_*, crashes:"
  echo "   build-fuzz/tests/fuzz/crash-*)"
  # Exactly the targets above, each once: a target missing from tests/fuzz/CMakeLists.txt (or a
  # build-fuzz configured without STRATA_FUZZ) must not pass as "no tests ran".
  local re listed
  re="^fuzz_($(IFS='|'; echo "${FUZZ_TARGETS[*]}"))\$"
  listed=$(cd build-fuzz && ctest -N -R "$re" | sed -n 's/^Total Tests: //p')
  if [ "$listed" != "${#FUZZ_TARGETS[@]}" ]; then
    echo "== FAILED: build-fuzz has ${listed:-no} of the ${#FUZZ_TARGETS[@]} fuzz tests (${FUZZ_TARGETS[*]})"
    return 1
  fi
  (cd build-fuzz && ctest -R "$re" --no-tests=error --output-on-failure -j "$JOBS") ||
    { echo "== FAILED: a fuzz target found a crash or did not run (see above)"; return 1; }
}

# ThreadSanitizer only sees synchronisation in instrumented code. Debian's libtbb is not: a task
# that one TBB worker hands to another (parallel_for's range splits, its pooled task objects, the
# kernels' disjoint slices) looks like a data race, hundreds per test (tier_test's first minute:
# 150 reports, every one through libtbb.so; no suppression can drop them without also dropping
# every race inside a parallel kernel). So the TSan build links a libtbb built with
# -fsanitize=thread from the same oneTBB release as the system's (Debian 12: 2021.8.0; the
# upstream tarball from Debian's archive, its checksum checked), installed in build-tsan/tbb.
TBB_VERSION=2021.8.0
TBB_SHA256=7e9111b8bb59c8800bf6d0b06afe7b0891937443d2dae1ee1101c8e2ede6a7ef
TBB_URL=http://deb.debian.org/debian/pool/main/o/onetbb/onetbb_${TBB_VERSION}.orig.tar.xz
tsan_tbb() {
  local root=$1 src=$1/tbb-src prefix=$1/tbb
  [ -e "$prefix/lib/cmake/TBB/TBBConfig.cmake" ] && return 0
  echo "== building oneTBB $TBB_VERSION with -fsanitize=thread into $prefix"
  rm -rf "$src" "$prefix"
  mkdir -p "$src"
  curl -fsSL -o "$src/tbb.tar.xz" "$TBB_URL" || { echo "== FAILED: downloading $TBB_URL"; return 1; }
  echo "$TBB_SHA256  $src/tbb.tar.xz" | sha256sum -c --quiet - ||
    { echo "== FAILED: $TBB_URL does not have the expected sha256 $TBB_SHA256"; return 1; }
  tar -xJf "$src/tbb.tar.xz" -C "$src" --strip-components=1
  local args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTBB_SANITIZE=thread -DTBB_TEST=OFF
              -DTBB_STRICT=OFF -DTBBMALLOC_BUILD=OFF -DTBB_DISABLE_HWLOC_AUTOMATIC_SEARCH=ON
              "-DCMAKE_INSTALL_PREFIX=$prefix")
  command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  (cd "$src" && configure build "${args[@]}") || return 1
  build_targets "$src/build" || return 1
  cmake --install "$src/build" >/dev/null || { echo "== FAILED: installing oneTBB into $prefix"; return 1; }
}

# Sanitizers: ASan+UBSan and TSan builds (gcc, no CUDA, no benchmarks) of the concurrent code's
# tests, only those nine targets. `sanitize [asan|tsan]`: one of them, or both. Every report goes
# to a file under build-<kind>/sanitizer-logs (log_path), from the test binary and from every
# process it starts (zero3_test's mpirun ranks inherit the environment): a report in a rank,
# whose exit status the test may only see as "a rank failed", is still found and printed, and
# any report fails the step. GTEST_FILTER narrows a run (gtest reads it); SANITIZE_TARGETS (a
# space-separated subset of the nine) builds and runs only those binaries, in that order.
sanitize() {
  local all=(tier_test overlap_test storage_test io_worker_test zero3_test cpu_device_test
              host_memory_test grouped_forwards_test schedule_fuzz_test) targets=() t
  # shellcheck disable=SC2206
  targets=(${SANITIZE_TARGETS:-${all[*]}})
  for t in "${targets[@]}"; do
    [[ " ${all[*]} " == *" $t "* ]] || { echo "sanitize: '$t' is not one of: ${all[*]}"; return 2; }
  done
  local fail=0 kind flags kinds=("$@")
  ((${#kinds[@]})) || kinds=(asan tsan)
  for kind in "${kinds[@]}"; do
    case $kind in
      asan) flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" ;;
      tsan) flags="-fsanitize=thread" ;;
      *) echo "sanitize: '$kind' is not asan or tsan"; return 2 ;;
    esac
    local args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_WITH_CUDA=OFF
                -DSTRATA_BUILD_BENCHMARKS=OFF "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=$flags"
                "-DCMAKE_EXE_LINKER_FLAGS=$flags")
    command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    echo "== $kind: $flags"
    if [ "$kind" = tsan ]; then
      tsan_tbb "$PWD/build-tsan" || return 1
      args+=("-DTBB_DIR=$PWD/build-tsan/tbb/lib/cmake/TBB")
    fi
    configure "build-$kind" "${args[@]}" || return 1
    build_targets "build-$kind" "${targets[@]}" || return 1
    local logs="$PWD/build-$kind/sanitizer-logs" tsan_supp="$PWD/build-tsan/tsan.supp"
    rm -rf "$logs"
    mkdir -p "$logs"
    # Open MPI dlcloses its components (mca_*.so) in MPI_Finalize. ASan: LeakSanitizer then sees
    # what they kept as leaks from "<unknown module>" (3,347 of them in a plain MPI_Init /
    # MPI_Finalize program), which no suppression can name. TSan: a library that a
    # called_from_lib suppression matched must never be unloaded (TSan dies: "library
    # '.../libpmix.so.2' that was matched against called_from_lib suppression 'libpmix.so' is
    # unloaded", in every rank). A preloaded dlclose that unloads nothing keeps every library
    # mapped, so each leak names its library and tools/lsan.supp can suppress exactly Open
    # MPI's, and TSan's ignore list stays valid. verify_asan_link_order=0: the shim precedes
    # libasan.
    local keep="$PWD/build-$kind/libkeep_dlopened.so"
    printf 'int dlclose(void* h) { (void)h; return 0; }\n' |
      cc -shared -fPIC -O2 -x c - -o "$keep" || { echo "== FAILED: building $keep"; return 1; }
    if [ "$kind" = tsan ]; then
      # Open MPI's components are uninstrumented code like libmpi itself: a receive that one
      # thread's MPI progress copies into another thread's buffer (its memcpy is intercepted),
      # completed through Open MPI's own atomics (not seen), looked like a race in the buffer's
      # owner (zero3_test: 312 reports in the first test's ranks). called_from_lib names one
      # library per entry (an entry matching two makes TSan die), so every component of this
      # Open MPI installation gets its own, after tools/tsan.supp's.
      local pkglib
      pkglib=$(ompi_info --parsable --path pkglibdir 2>/dev/null | sed -n 's/^path:pkglibdir://p')
      [ -d "$pkglib" ] || { echo "== FAILED: ompi_info names no component directory"; return 1; }
      { cat tools/tsan.supp
        echo "# Generated by tools/dev.sh: every Open MPI component in $pkglib"
        find "$pkglib" -maxdepth 1 -name 'mca_*.so' -printf 'called_from_lib:%f\n' | sort
      } > "$tsan_supp"
    fi
    for t in "${targets[@]}"; do
      echo "== $kind: $t"
      local rc=0 t0=$SECONDS
      # Suppressions: tools/tsan.supp (+ Open MPI's components) and tools/lsan.supp, each entry
      # with why it is not a bug.
      env "LD_PRELOAD=$keep" \
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:verify_asan_link_order=0:log_path=$logs/$t" \
        LSAN_OPTIONS="suppressions=$PWD/tools/lsan.supp:print_suppressions=0" \
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/$t" \
        TSAN_OPTIONS="suppressions=$tsan_supp:halt_on_error=0:exitcode=66:log_path=$logs/$t" \
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        "build-$kind/tests/$t" || rc=$?
      local reports=("$logs/$t".*)
      [ -e "${reports[0]}" ] || reports=()
      for r in "${reports[@]}"; do
        echo "== $kind: $t: sanitizer report $r"
        cat "$r"
      done
      if ((rc == 0 && ${#reports[@]} == 0)); then
        echo "== $kind: $t clean ($((SECONDS - t0)) s)"
      else
        echo "== FAILED: $kind: $t (exit $rc, ${#reports[@]} sanitizer report files, $((SECONDS - t0)) s)"
        fail=1
      fi
    done
  done
  return $fail
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  deps) deps ;;
  cudnn) cudnn ;;
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
    gen_args=(-DCMAKE_BUILD_TYPE=Release)
    [ -x /usr/local/cuda/bin/nvcc ] && gen_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
    rm -rf "$BUILD_DIR-default-generator"
    configure "$BUILD_DIR-default-generator" "${gen_args[@]}"
    rm -rf "$BUILD_DIR-default-generator"
    echo "== running tests"
    rc=0
    (cd "$BUILD_DIR" && ctest --no-tests=error --output-on-failure -j "$JOBS" --timeout 1200) ||
      { echo "== FAILED: ctest in $BUILD_DIR"; rc=1; }
    if [ "${STRATA_SKIP_FUZZ:-}" = "1" ]; then
      echo "== fuzz step skipped (STRATA_SKIP_FUZZ=1)"
    elif ! command -v clang++ >/dev/null; then
      # deps installs clang; without it the fuzz step cannot run, which is a failure, not a skip.
      echo "== FAILED: no clang++ for the fuzz step (install clang libclang-rt-dev, or STRATA_SKIP_FUZZ=1)"
      rc=1
    else
      { fuzz_build 10 && fuzz_run 10; } || rc=1
    fi
    ((rc == 0)) && echo "== all steps passed" || echo "== FAILED: see the FAILED lines above"
    exit $rc
    ;;
  fuzz)
    deps; fuzz_build "${1:-60}"; fuzz_run "${1:-60}" ;;
  sanitize)
    deps curl xz-utils; sanitize "$@" ;;
  *)
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
