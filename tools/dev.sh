#!/usr/bin/env bash
# strata's set-up, build, demo and test in one place (README's two commands call this).
#
#   tools/dev.sh train [strata train options]  install what is missing, build (Release), and run
#                                              the default job: configs/tiny-cpu.json
#   tools/dev.sh test                          install what is missing, build, run every test
#   tools/dev.sh deps | build                  just that step
#
# Environment: BUILD_DIR (default build), STRATA_CMAKE_ARGS (extra cmake flags),
# JOBS (parallel build jobs, default: all cores). Under CI (CI=true) CUDA is built for one
# architecture (sm_90) to keep the build short.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
PKGS=(build-essential cmake ninja-build pkg-config git clang-format
      libeigen3-dev libtbb-dev nlohmann-json3-dev libfmt-dev libisal-dev
      googletest libgtest-dev libgmock-dev libbenchmark-dev
      liburing-dev libaio-dev libopenmpi-dev openmpi-bin)

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

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  deps) deps ;;
  build) deps; build ;;
  train)
    deps; build
    mkdir -p runs/swap  # the default job swaps optimizer state here (configs/tiny-cpu.json)
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
    cd "$BUILD_DIR"
    exec ctest --output-on-failure -j "$JOBS" --timeout 1200
    ;;
  *)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
