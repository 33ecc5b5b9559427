"""report.md and report.json from the phases' status, Markdown and JSON under the results
directory (rewritten after every phase, so a run cut short still leaves one; a later run with
the same --results adds its phases)."""
import json
import subprocess
import time

from .common import ALL_PHASES, ROOT


def read_status(R, phase):
    """(status, summary, seconds) of a phase that ran, else None."""
    try:
        lines = (R / "status" / phase).read_text().split("\n")
    except OSError:
        return None
    lines += ["", "", ""]
    try:
        secs = int(lines[2])
    except ValueError:
        secs = None
    return lines[0], lines[1], secs


def write_status(R, phase, status, summary, seconds):
    (R / "status" / phase).write_text("%s\n%s\n%d\n" % (status, summary.replace("\n", " "), seconds))


def write_report(ctx, argv, start):
    R = ctx.R
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    commit = commit or "unknown"
    done = [(p, read_status(R, p)) for p in ALL_PHASES if read_status(R, p)]
    now = time.gmtime()
    md = ["# strata GPU check: %s (%s)" % (ctx.state.get("gpu_name") or "no GPU",
                                          time.strftime("%Y-%m-%d", now)), "",
          "Command: `tools/gpu_check.py %s` at commit %s, %s, %d s."
          % (" ".join(argv), commit, time.strftime("%Y-%m-%d %H:%M UTC", now), time.time() - start)]
    if ctx.dry:
        md += ["", "**Dry run: no GPU was used; the numbers below are from the CPU backend at small "
               "shapes and mean nothing about a GPU.**"]
    md += ["", "| phase | status | seconds | summary |", "|---|---|---|---|"]
    for p, (st, summary, secs) in done:
        md.append("| %s | %s | %s | %s |" % (p, st, "?" if secs is None else secs,
                                             summary.replace("|", "\\|")))
    phases = {}
    for p, (st, summary, secs) in done:
        md += ["", "## %s" % p, "", "%s: %s (log: logs/%s.log)" % (st, summary, p)]
        try:
            body = (R / "md" / ("%s.md" % p)).read_text()
        except OSError:
            body = ""
        if body.strip():
            md += ["", body.rstrip("\n")]
        try:
            res = json.loads((R / "json" / ("%s.json" % p)).read_text())
        except (OSError, ValueError):
            res = None
        phases[p] = {"status": st, "seconds": secs, "summary": summary, "log": "logs/%s.log" % p,
                     "result": res}
    tmp = R / "report.md.tmp"
    tmp.write_text("\n".join(md) + "\n")
    tmp.replace(R / "report.md")
    js = {"magic": "strata-gpu-check", "version": 2, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
          "commit": commit, "dry_run": ctx.dry, "seconds": int(time.time() - start),
          "args": " ".join(argv), "phases": phases}
    tmp = R / "report.json.tmp"
    tmp.write_text(json.dumps(js, indent=1) + "\n")
    tmp.replace(R / "report.json")
