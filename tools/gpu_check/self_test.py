"""tools/gpu_check.py --self-test: the check without a GPU (CI runs it: tests/gpu_check.cmake).

Argument parsing, the helpers, then every phase in --dry-run mode against a CPU build (the same
code path as on a GPU, on the CPU backend at small shapes), the PyTorch peers through a stand-in
interpreter that prints a result line, and the report and JSON it writes; then a broken build
directory (phases fail soft, exit 1), --deadline 0 (phases skipped as out of time), and two
runs adding up in one report."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import (ALL_PHASES, ROOT, cudnn_log_env, hbm_gbs_for, median, metric_median,
                     peak_for)
from .phases_bench import comparison_table, long_sequence_rates
from .phases_deepspeed import PAIRS as DS_PAIRS, _config, _shape
from .phases_train import (AT_RATE, Table, bytes_vs_min, peak_rss,
                           probe_optimizer_rate, rss_split)

TOOL = ROOT / "tools" / "gpu_check.py"

FAKE_TORCH = """#!/bin/sh
# A stand-in for a Python with PyTorch: the availability probe, then a peer's result line.
case "$1" in
  -c) echo "2.9.0+fake True" ;;
  *) echo '{"peer": "torch", "mode": "eager", "step_ms": 10.0, "tokens_per_s": 1000, "peak_mem_gib": 0.1}' ;;
esac
"""


def dig(obj, path):
    for part in path.split("/"):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def report_keys():
    """The report.json keys every phase's dry run must fill."""
    keys = ["magic", "version", "phases/env/status", "phases/build/status", "phases/tests/status",
            "phases/sanitizer/status", "phases/gemm/result/shapes",
            "phases/gemm/result/elementwise", "phases/copy/result/cases",
            "phases/attention/result/shapes"]
    for model, rows in (("gpt2-124m", ["device", "device-opt-host", "ratio", "host", "nvme",
                                       "planned"]),
                        ("llama-1b", ["device", "host", "nvme", "planned"])):
        keys += ["phases/train/result/models/%s/rows/%s/tokens_per_s" % (model, x) for x in rows]
        keys.append("phases/train/result/models/%s/torch_tokens_per_s" % model)
    keys += ["phases/train/result/models/gpt2-124m/rows/device/over_torch",
             "phases/offload/result/disk_read_gbps", "phases/offload/result/all_on_device/step_s"]
    for x in ("plain", "auto", "never", "host-4g"):
        keys += ["phases/offload/result/rows/%s/step_s" % x,
                 "phases/offload/result/ratios/%s/step_over_bound" % x,
                 "phases/offload/result/ratios/%s/planner_clipped_step_s" % x]
    return keys


def check_tables(check, md):
    """The dry run's report tables: the attention benchmark, the training tables (rows, the
    PyTorch peer, the planner's ratio) and the offload phase's rows and bounds."""
    check("the fused attention ran in the attention benchmark", "| fused |" in md)
    check("the training tables have 10 rows (6 GPT, 4 Llama) with a strata / PyTorch ratio",
          len(re.findall(r"^\| (device|device-opt-host|ratio|host|nvme|planned): .*\| n/a \| "
                         r"[0-9.]+ \| [0-9?]+ \| .*\| ok \(", md, re.M)) == 10)
    check("each training table compares the planner's ratio row with the all-on-device step",
          len(re.findall(r"^With the planner's optimizer ratio [0-9.]+: a step of [0-9]+ ms, "
                         r"[0-9.]+x the all-on-device step", md, re.M)) == 2)
    check("the all-on-device rows and GPT-2's optimizer-in-host-RAM row have their second "
          "step's op profile, matmuls timed",
          len(re.findall(r"^op profile of step 2 on .*\n.*\n(?:.*\n)*?matmul_forward +compute +"
                         r"[0-9]+ +[0-9.]+", md, re.M)) == 3)
    check("the PyTorch peer ran twice per model (before and after strata's rows)",
          len(re.findall(r"^PyTorch peer, run \d", md, re.M)) == 4)
    check("the norm-under rows run past the undo room's warm-up, measured over their last steps",
          len(re.findall(r"The `\*-norm-under` rows run [0-9]+ steps, their medians over the "
                         r"last 4", md)) == 2)
    check("each training table has the plain schedule's row and the offloaded rows against it",
          len(re.findall(r"^Against the plain schedule \([0-9]+ ms a step, overlap off\): "
                         r"[a-z0-9-]+ [0-9]+ ms \([0-9.]+x\)", md, re.M)) == 2)
    check("the offload rows have the plain schedule's losses",
          len(re.findall(r"\| same bits \| ok", md)) == 3)
    check("the offload rows show NVMe bytes against the minimum",
          re.search(r"\| plain: .*\| nvme [0-9.]+ [KMG]iB \([0-9.]+ [KMG]iB, [-+][0-9.]+%\)", md)
          is not None)
    check("the offload phase has step / bound and the planner's step for 4 rows",
          len(re.findall(r"^\| (plain|auto|never|host-4g) \| [0-9]+ \| [0-9]+ \| [0-9]+ \| "
                         r"[0-9]+ \| [0-9.]+ \| [0-9.]+ [KMG]iB \| [0-9]+ \((deferred|after "
                         r"backward)\) \| [0-9.]+ \|$", md, re.M)) == 4)


def at_rate_runs(planned_step, ratio, r2, left):
    """The rows Table.at_rate_row runs after a planned row of `planned_step` seconds beside an
    all-on-device step of 35 ms, as "name ratio", with `left` seconds of the deadline."""
    class Ctx:
        def left(self):
            return left
    t = Table(Ctx(), "gpt2", Path("gpt.json"), 1)
    t.rows = {"device": {"step_s": 0.035}, "planned": {"step_s": planned_step}}
    ran = []
    t.strata_row = lambda name, pdev, odev, r, what, **kw: ran.append("%s %s" % (name, r))
    t.at_rate_row("planned", "none", "cpu", ratio, r2, "parameters on the device", [], 2)
    return ran


def self_test(build):
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_selftest."))
    fails = []
    checks_log = open(tmp / "checks.log", "w")

    def check(what, ok):
        print("  %s  %s" % ("ok  " if ok else "FAIL", what), flush=True)
        if not ok:
            fails.append(what)

    def tool(*args, log=None):
        p = subprocess.run([sys.executable, str(TOOL)] + [str(a) for a in args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        (log or checks_log).write(p.stdout)
        return p.returncode, p.stdout

    print("gpu_check self-test (build dir %s)" % build)
    check("--help exits 0", tool("--help")[0] == 0)
    check("an unknown option exits 2", tool("--bogus")[0] == 2)
    check("an unknown phase exits 2", tool("--phases", "env,nope")[0] == 2)
    check("a missing value exits 2", tool("--results")[0] == 2)
    check("a bad --jobs exits 2", tool("--jobs", "zero")[0] == 2)
    check("a bad --deadline exits 2", tool("--deadline", "soon")[0] == 2)
    import py_compile
    ok = True
    for f in list((ROOT / "tools" / "gpu_check").glob("*.py")) + \
            list((ROOT / "tools" / "peers").glob("*.py")) + [TOOL, ROOT / "tools" / "gpu_peers.py"]:
        try:
            py_compile.compile(str(f), cfile=str(tmp / "pyc"), doraise=True)
        except py_compile.PyCompileError as e:
            checks_log.write(str(e))
            ok = False
    check("every module compiles (tools/gpu_check, tools/peers)", ok)
    asked = {"GPU_CHECK_CUDNN_LOG": "1", "PATH": "/bin"}
    check("cuDNN's frontend log: in the tests phase when asked, never in a timed phase",
          cudnn_log_env("tests", asked).get("CUDNN_FRONTEND_LOG_INFO") == "1"
          and "CUDNN_FRONTEND_LOG_INFO" not in (cudnn_log_env("train", asked) or {})
          and cudnn_log_env("tests", {"PATH": "/bin"}) == {"PATH": "/bin"})
    check("peak table: H100 SXM", peak_for("NVIDIA H100 80GB HBM3") == 989)
    check("peak table: H100 PCIe", peak_for("NVIDIA H100 PCIe") == 756)
    check("peak table: H200", peak_for("NVIDIA H200") == 989)
    check("peak table: A100", peak_for("NVIDIA A100-SXM4-80GB") == 312)
    check("memory table: H200, H100 SXM and PCIe, unknown",
          hbm_gbs_for("NVIDIA H200") == 4800 and hbm_gbs_for("NVIDIA H100 80GB HBM3") == 3350
          and hbm_gbs_for("NVIDIA H100 PCIe") == 2000 and hbm_gbs_for("NVIDIA GH200 480GB") == 4000
          and hbm_gbs_for("a CPU") is None)
    check("median: odd, even (lower middle), empty",
          median([3, 1, 2]) == 2 and median([4, 1, 3, 2]) == 2 and median([]) is None)
    (tmp / "m.jsonl").write_text("".join('{"step":%d,"step_s":%d}\n' % (i, v)
                                         for i, v in enumerate([100, 50, 3, 1, 2])))
    check("metric_median skips the first two steps", metric_median(tmp / "m.jsonl", "step_s") == 2)
    log = ("nvme bytes per step: 1.62 GiB (median of steps 3-6), the placement's minimum "
           "1.62 GiB (+0.0%)\nhost<->device bytes per step: 1.16 GiB (median of steps 3-6), the "
           "placement's minimum 1.10 GiB (+5.5%)\nhost memory: peak RSS (VmHWM) 31.1 GiB = ...\n")
    check("bytes_vs_min reads a run's summary",
          bytes_vs_min(log) == "nvme 1.62 GiB (1.62 GiB, +0.0%); link 1.16 GiB (1.10 GiB, +5.5%)")
    check("peak_rss reads a run's summary", peak_rss(log) == "31.1 GiB")
    (tmp / "probe.json").write_text(json.dumps({"cpu_optimizer": {
        "params_per_s": 8e9, "params": 5e7,
        "by_threads": [{"threads": 8, "params_per_s": 6e9, "spread": {}},
                       {"threads": 16, "params_per_s": 8e9, "spread": {}}]}}))
    check("probe_optimizer_rate reads a profile's CPU optimizer",
          probe_optimizer_rate(tmp / "probe.json") == (8e9, 50000000, 16)
          and probe_optimizer_rate(tmp / "missing.json") is None)
    check("a planner's row that missed the bound runs again at the ratio for the measured rate",
          at_rate_runs(0.050, 0.4, 0.3, None) == ["planned" + AT_RATE + " 0.3"]
          and at_rate_runs(0.038, 0.4, 0.3, None) == []  # within 1.10x of the device's 35 ms
          and at_rate_runs(0.050, 0.4, None, None) == []  # no ratio at the measured rate
          and at_rate_runs(0.050, 0.4, 0.4, None) == []  # the same ratio
          and at_rate_runs(0.050, 0.4, 0.3, 30) == [])  # under a minute of the deadline left
    check("rss_split reads what the RSS is made of",
          rss_split("host memory: peak RSS (VmHWM) 3.9 GiB = host tier 3.0 GiB (arena 2.1 GiB + "
                    "undo room 900.0 MiB) + the rest 900.0 MiB (150.0 MiB at start)\n")
          == "host tier 3.0 GiB (arena 2.1 GiB + undo room 900.0 MiB) + the rest 900.0 MiB"
          and rss_split(log) is None)
    row = {"name": "gpt2", "B": 8, "T": 1024, "NH": 12, "NKV": 12, "hs": 64,
           "plain": {"forward_s": {"median": 0.002}, "backward_s": {"median": 0.004}},
           "fused": {"forward_s": {"median": 0.001}, "backward_s": {"median": 0.002}},
           "cudnn": {"forward_s": {"median": 0.0005}, "backward_s": {"median": 0.002}}}
    lines, names, cudnn = comparison_table([row, {"name": "long", "fused": {"forward_s": 0.1},
                                                  "plain": "n/a: slow", "cudnn": "n/a: no"}])
    check("attention: a cuDNN column is compared with the fused kernel",
          cudnn == ["cudnn"] and "| 0.50, 1.00 |" in lines[2] and "n/a: slow" in lines[3])
    check("attention: no cuDNN column, no comparison",
          comparison_table([{k: v for k, v in row.items() if k != "cudnn"}])[2] == [])
    long_row = {"name": "t4096", "T": 4096, "hs": 128,
                "fused": {"forward_s": {"median": 1.0}, "backward_s": {"median": 3.0},
                          "forward_tflops": 100.0, "backward_tflops": 60.0},
                "cudnn": {"forward_s": {"median": 0.5}, "backward_s": {"median": 0.5},
                          "forward_tflops": 600.0, "backward_tflops": 400.0}}
    check("attention: forward + backward rates at T >= 2048 and hs 128 only",
          long_sequence_rates([row, long_row], ["fused", "cudnn", "plain"])
          == {"fused": 70.0, "cudnn": 500.0})

    bench = build / "tests" / "bench_device_ops"
    strata = build / "tools" / "strata"
    if not (os.access(bench, os.X_OK) and os.access(strata, os.X_OK)):
        print("  FAIL  %s or %s is not built (cmake --build %s --target strata bench_device_ops)"
              % (strata, bench, build))
        shutil.rmtree(tmp, ignore_errors=True)
        return 1
    fake = tmp / "fake_torch_python"
    fake.write_text(FAKE_TORCH)
    fake.chmod(0o755)
    # Every phase, dry: the same code path as on a GPU, on the CPU backend.
    r = tmp / "results"
    swap = build / "gpu_check_swap"
    with open(tmp / "dry.log", "w") as f:
        rc, out = tool("--dry-run", "--results", r, "--build-dir", build, "--nvme-path", swap,
                       "--torch-python", fake, log=f)
    print("".join("    | %s\n" % l for l in out.splitlines()), end="")
    check("the dry run exits 0 (every phase ok or skipped)", rc == 0)
    md = (r / "report.md").read_text() if (r / "report.md").exists() else ""
    check("report.md written", bool(md))
    try:
        js = json.loads((r / "report.json").read_text())
    except (OSError, ValueError):
        js = {}
    keys = report_keys()
    missing = [k for k in keys if dig(js, k) is None]
    checks_log.write("missing keys: %s\n" % missing)
    check("report.json has every phase's result (%d keys)" % len(keys), not missing)
    for p in ALL_PHASES[:-1]:
        check("report.md has a section for %s" % p, re.search(r"^## %s$" % p, md, re.M) is not None)
        check("phase %s is ok or skipped" % p,
              re.search(r"^\| %s \| (ok|skipped) \|" % p, md, re.M) is not None)
    check("the report says it was a dry run", "Dry run: no GPU was used" in md)
    check_tables(check, md)
    check("the paths are printed", ("report: %s" % (r / "report.md")) in out)
    # The deepspeed phase's pairs: each strata config's shape is DeepSpeed's.
    with tempfile.TemporaryDirectory() as t:
        shapes = {p[0]: _shape(_config(Path(t), p[2])) for p in DS_PAIRS}
    check("the deepspeed pairs train hostmem-190m's, GPT-2 124M's and the Llama's shapes on both "
          "sides",
          shapes["offload"][:2] == ["--n-layer", "15"] and shapes["infinity"] == shapes["offload"]
          and shapes["infinity-4g"] == shapes["offload"]
          and shapes["offload-gpt2"] == ["--n-layer", "12", "--n-head", "12", "--n-embd", "768",
                                         "--vocab", "50257", "--context", "1024",
                                         "--micro-batch", "8", "--grad-accum", "2"]
          and shapes["offload-llama"] == ["--n-layer", "22", "--n-head", "32", "--n-embd", "2048",
                                          "--vocab", "32000", "--context", "2048",
                                          "--micro-batch", "4", "--grad-accum", "1",
                                          "--arch", "llama", "--n-kv-head", "4",
                                          "--intermediate", "5632"])
    # The deepspeed phase, named, without its bundle: skipped with the reason.
    rc, out = tool("--dry-run", "--phases", "deepspeed", "--results", r, "--build-dir", build,
                   "--peers-dir", tmp / "nopeers")
    md = (r / "report.md").read_text()
    check("deepspeed without its bundle is skipped, saying why",
          re.search(r"^\| deepspeed \| skipped \| [0-9]+ \| no DeepSpeed bundle", md, re.M)
          is not None and rc == 0)
    # A failing phase is recorded and the tool goes on: a build dir without binaries.
    rc, _ = tool("--dry-run", "--phases", "build,gemm,train", "--results", tmp / "broken",
                 "--build-dir", tmp / "nobuild")
    check("failing phases exit 1", rc == 1)
    bmd = (tmp / "broken" / "report.md").read_text() if (tmp / "broken" / "report.md").exists() else ""
    check("a failing phase is recorded and later phases still run",
          re.search(r"^\| train \| failed \|", bmd, re.M) is not None)
    try:
        bjs = json.loads((tmp / "broken" / "report.json").read_text())
    except (OSError, ValueError):
        bjs = {}
    check("the failed run's JSON is valid",
          all(dig(bjs, "phases/%s/status" % p) for p in ("build", "gemm", "train")))
    # Out of time: phases that cannot start are recorded, not run.
    tool("--dry-run", "--phases", "env,gemm", "--deadline", "0", "--results", tmp / "late",
         "--build-dir", build)
    lmd = (tmp / "late" / "report.md").read_text() if (tmp / "late" / "report.md").exists() else ""
    check("--deadline: phases past it are skipped as out of time",
          re.search(r"^\| gemm \| skipped \| [0-9]+ \| out of time", lmd, re.M) is not None)
    # A second run with the same --results adds its phases to the report.
    tool("--dry-run", "--phases", "env", "--results", tmp / "parts", "--build-dir", build)
    tool("--dry-run", "--phases", "copy", "--results", tmp / "parts", "--build-dir", build)
    try:
        pjs = json.loads((tmp / "parts" / "report.json").read_text())
    except (OSError, ValueError):
        pjs = {}
    check("runs with the same --results add up in one report",
          dig(pjs, "phases/env/status") and dig(pjs, "phases/copy/result") is not None)
    checks_log.close()
    if fails:
        print("gpu_check self-test: %d check(s) FAILED (details: %s, %s)"
              % (len(fails), tmp / "checks.log", tmp / "dry.log"))
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(swap, ignore_errors=True)
    print("gpu_check self-test: OK")
    return 0
