#!/usr/bin/env bash
# Fails (and prints file:line: match) where a tracked file speaks of how it was written rather than
# of the project: a numbered work period, an issue number given as the reason for a line, a word
# for borrowed machines, or an absolute path on one development machine. Comments say why, docs
# state what is; the history is in git.
#
# What it looks for (case-insensitive):
#   - a numbered work period: the word for one followed by a number;
#   - issue references used as explanations: "issue #N", "(#N)", a bare "#N" (write "step 3",
#     not "step #3"; "#include" and colours in quotes pass), "the issue's";
#   - the words for a borrowed machine and the tool that lent it (whole words only, so "release"
#     and "please" pass; "gpu_<word>" and "build-<word>" do not);
#   - absolute paths of a development machine: /work/..., /root/..., /home/<user>/...,
#     /Users/<user>/..., and a virtual environment under /tmp. Scratch paths such as
#     /tmp/strata_xxx (tests and benchmarks make them with mktemp) and system paths
#     (/usr/local/cuda, /dev/..., /proc/...) are fine.
#
# The patterns are built from pieces so that this file does not match itself; it is also skipped
# by name, since its comments describe what it rejects.
# Usage: tools/check_words.sh   (exit 0: clean, 1: matches printed, 77: not a git checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "skipped: $(pwd) is not a git checkout; the check reads the tracked files (git ls-files)"
  exit 77
fi
exec python3 - <<'PY'
import re
import subprocess
import sys

S = "ses" + "sion"
L = "le" + "ase"
I = "is" + "sue"
patterns = [
    (S + r"s?[\s-]+[0-9]", "numbered work period"),
    (r"helper\s+" + S, "work process"),
    (r"(?<![a-z])" + L + r"(s|d|r|rs)?(?![a-z])", "machine-lending word"),
    (r"\b" + "devi" + r"ce\s+tool\b", "machine-lending tool"),
    (I + r"s?\s+#[0-9]", "issue reference"),
    (r"\(#[0-9]+\)", "issue reference"),
    (r"(?<![\w&\"'#/])#[0-9]+\b", "issue reference"),
    (r"\bthe\s+" + I + "'s", "issue reference"),
    (r"(?<![\w.~-])/(wo" + "rk|ro" + r"ot)/", "development-machine path"),
    (r"(?<![\w.~-])/(home|Users)/[A-Za-z_][\w.-]*/", "development-machine path"),
    (r"(?<![\w.~-])/tmp/[\w.-]*v" + r"env\b", "development-machine path"),
]
compiled = [(re.compile(p, re.IGNORECASE), why) for p, why in patterns]
SELF = "tools/check_words.sh"

files = subprocess.run(["git", "ls-files", "-z"], check=True, capture_output=True).stdout
found = 0
for name in files.decode().split("\0"):
    if not name or name == SELF:
        continue
    try:
        with open(name, "rb") as f:
            data = f.read()
    except (FileNotFoundError, IsADirectoryError):
        continue  # deleted in the work tree, or a submodule
    if b"\0" in data[:8192]:
        continue  # binary
    text = data.decode("utf-8", errors="replace")
    for n, line in enumerate(text.splitlines(), 1):
        for rx, why in compiled:
            m = rx.search(line)
            if m:
                print(f"{name}:{n}: {m.group(0)!r} ({why}): {line.strip()[:160]}")
                found += 1
                break
if found:
    print(f"{found} line(s) speak of the work process or a development machine; say why, not when "
          "(tools/check_words.sh lists the patterns)")
    sys.exit(1)
print("no work-process words or development-machine paths in the tracked files")
PY
