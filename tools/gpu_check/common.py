"""What every phase of the GPU check shares: the run's options, its results directory, the
deadline, running a command with a time limit, the Markdown a phase appends, one median.

A phase is a function phase_<name>(ctx) that writes its Markdown with ctx.md(), its JSON result
with ctx.put_json(), facts for later phases with ctx.state[...] (kept in state.json, so a later
run with the same --results reads them), and ends with ctx.result(status, summary). An
exception in a phase is recorded as its failure with the traceback in its log.
"""
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALL_PHASES = ["env", "build", "tests", "sanitizer", "gemm", "copy", "attention", "train",
              "offload", "deepspeed"]
# The phases a plain run runs: deepspeed needs the DeepSpeed wheels that tools/gpu_peers.py
# packs and a call of its own (docs/GPU.md), so it runs only when named.
DEFAULT_PHASES = ALL_PHASES[:-1]


def median(values):
    """The median of a list of numbers (the lower middle one of an even count), None for an
    empty list."""
    v = sorted(x for x in values if x is not None)
    return v[(len(v) - 1) // 2] if v else None


def metric_median(path, key, skip=2):
    """The median of `key` over a metrics.jsonl's lines that have it, after the first `skip`
    (trace recording and allocation warm-up); None when the file or the key is missing."""
    vals = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get(key), (int, float)):
                    vals.append(float(rec[key]))
    except OSError:
        return None
    return median(vals[skip:])


def metric_list(path, key):
    """Every value of `key` in a metrics.jsonl, in order, as written (the text, for
    bit-for-bit comparison of losses)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                m = re.search(r'"%s":\s*([-0-9.eE+]+|null|NaN|-?Infinity)' % re.escape(key), line)
                if m:
                    out.append(m.group(1))
    except OSError:
        pass
    return out


# cudnn-frontend's log, asked for with GPU_CHECK_CUDNN_LOG=1 (tools/gpu_bundle.sh sets it):
# every graph cuDNN builds or refuses, and why, in the tests phase's logs. Only there: the
# frontend also logs every execution (~50 lines a call), host time a timed phase would count.
CUDNN_LOG_PHASES = ("tests",)


def cudnn_log_env(phase, env):
    """The environment a phase's command runs in: `env` (None: this process's), with the
    frontend's log on stderr in CUDNN_LOG_PHASES when GPU_CHECK_CUDNN_LOG=1."""
    base = dict(os.environ if env is None else env)
    if base.get("GPU_CHECK_CUDNN_LOG") != "1" or phase not in CUDNN_LOG_PHASES:
        return env
    base.setdefault("CUDNN_FRONTEND_LOG_INFO", "1")
    base.setdefault("CUDNN_FRONTEND_LOG_FILE", "stderr")
    return base


def find_tool(*candidates):
    """The first executable among the candidates (names on PATH or paths); "" if none."""
    for c in candidates:
        if not c:
            continue
        if "/" in c:
            if os.path.isfile(c) and os.access(c, os.X_OK):
                return c
        else:
            p = shutil.which(c)
            if p:
                return p
    return ""


def _by_name(table, name):
    """The value of the first (pattern, value) whose pattern the GPU's name matches; None."""
    for pattern, value in table:
        if re.search(pattern, name or ""):
            return value
    return None


def peak_for(name):
    """Dense bf16 tensor-core TFLOP/s (no sparsity) by GPU name; None if unknown."""
    return _by_name([(r"H100.*PCIe", 756), (r"H100.*NVL", 835), (r"GH200|H200|H100|H800", 989),
                     (r"B200", 2250), (r"B100", 1750), (r"A100|A800", 312), (r"L40S", 366),
                     (r"L40", 181), (r"L4", 121), (r"A10", 125)], name)


def hbm_gbs_for(name):
    """The GPU memory's GB/s by GPU name (datasheet figures); None if unknown."""
    return _by_name([(r"GH200", 4000), (r"H200", 4800), (r"H100.*PCIe", 2000),
                     (r"H100.*NVL", 3900), (r"H100|H800", 3350), (r"B200", 8000),
                     (r"A100.*80GB", 2039), (r"A100|A800", 1555), (r"L40", 864), (r"L4", 300),
                     (r"A10", 600)], name)


def pcie_lane_gbps(gen):
    """PCIe GB/s per lane and direction by generation; None if unknown."""
    return {"1": 0.25, "2": 0.5, "3": 0.985, "4": 1.969, "5": 3.938, "6": 7.563}.get(str(gen))


def ms(seconds):
    """Seconds as whole milliseconds for a table, "?" when unknown."""
    return "?" if seconds is None else "%.0f" % (seconds * 1e3)


def fmt_bytes(n):
    """Bytes as KiB, MiB or GiB with two decimals, "?" when unknown."""
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return "%.2f %s" % (n / size, unit)
    return "%d B" % n


def fmt(x, spec="%.2f"):
    return "?" if x is None else spec % x


class Context:
    """One run of the check: options, results directory, deadline, the phase being run."""

    def __init__(self, opts, results, build, end_time):
        self.opts = opts
        self.R = Path(results)
        self.build = Path(build)
        self.end = end_time  # time.time() by which the run must end, or None
        self.dry = opts.dry_run
        self.quick = opts.quick
        self.phase = None
        self.selected = []
        self._status = None
        for sub in ("logs", "json", "md", "status", "tests"):
            (self.R / sub).mkdir(parents=True, exist_ok=True)
        self.state_path = self.R / "state.json"
        try:
            self.state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            self.state = {}

    # --- paths ---
    def bin(self, name):
        """Where the build puts target `name`."""
        return self.build / ("tools" if name == "strata" else "tests") / name

    def log_path(self, name=None):
        return self.R / "logs" / ("%s.log" % (name or self.phase))

    # --- the phase's outputs ---
    def log(self, *parts):
        """A line in the phase's log."""
        with open(self.log_path(), "a") as f:
            f.write(" ".join(str(p) for p in parts) + "\n")

    def md(self, line=""):
        with open(self.R / "md" / ("%s.md" % self.phase), "a") as f:
            f.write(line + "\n")

    def put_json(self, value):
        (self.R / "json" / ("%s.json" % self.phase)).write_text(json.dumps(value, indent=1) + "\n")

    def result(self, status, summary):
        assert status in ("ok", "failed", "skipped"), status
        self._status = (status, summary)

    def save_state(self):
        self.state_path.write_text(json.dumps(self.state, indent=1) + "\n")

    # --- time ---
    def left(self):
        """Seconds left before --deadline, or None without one."""
        return None if self.end is None else self.end - time.time()

    def limit(self, seconds):
        """A command's time limit cut to what is left (20 s kept for the report)."""
        left = self.left()
        if left is None:
            return seconds
        return max(1, min(seconds, int(left - 20)))

    def run(self, timeout, cmd, log=None, env=None, cwd=None):
        """Runs cmd (a list) with a time limit, its output appended to `log` (a path; default the
        phase's log). Returns the exit status: 124 when it ran past its limit (then it is killed
        with its process group), 127 when it cannot start."""
        limit = self.limit(timeout)
        log = Path(log) if log else self.log_path()
        env = cudnn_log_env(self.phase, env)
        with open(log, "a") as f:
            f.write("$ %s\n" % " ".join(str(c) for c in cmd))
            f.flush()
            try:
                p = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                                     env=env, cwd=cwd, start_new_session=True)
            except OSError as e:
                f.write("cannot run %s: %s\n" % (cmd[0], e))
                return 127
            try:
                return p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                f.write("gpu_check: time limit of %d s reached; killing it\n" % limit)
                _kill_group(p)
                return 124

    def capture(self, timeout, cmd):
        """Runs cmd and returns (exit status, its stdout as text); stderr to the phase's log."""
        limit = self.limit(timeout)
        try:
            with open(self.log_path(), "a") as f:
                p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=f,
                                   text=True, timeout=limit)
            return p.returncode, p.stdout
        except subprocess.TimeoutExpired:
            return 124, ""
        except OSError:
            return 127, ""


def _kill_group(p):
    import signal
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except OSError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
