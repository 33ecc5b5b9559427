#!/usr/bin/env bash
# Fails (and lists the files) if any C++/CUDA source is not formatted per .clang-format.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "clang-format not installed: run tools/dev.sh deps" >&2
  exit 1
fi
bad=()
while IFS= read -r f; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files -co --exclude-standard -- '*.h' '*.cc' '*.cu' '*.cuh')
if ((${#bad[@]})); then
  echo "not clang-formatted (run: clang-format -i <file>):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "all sources clang-formatted"
