# Shared by the CLI test scripts (sourced, not run): a scratch directory `work` removed at exit
# (kept, and named, when KEEP is set), `fail` and check NAME CONDITION..., which runs CONDITION
# and prints "ok: NAME" or "FAILED: NAME" (then the script exits 1 through `exit $fail`).
work=$(mktemp -d)
[ -n "${KEEP:-}" ] && echo "work dir: $work"
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
fail=0
check() {  # check NAME CONDITION...
  local name=$1
  shift
  if "$@"; then echo "ok: $name"; else echo "FAILED: $name"; fail=1; fi
}
