"""tools/gpu_check.py: strata's check on an NVIDIA GPU, in one command (about 10 minutes on one
H100/H200). Builds for the GPU's architecture, runs every CUDA test, runs compute-sanitizer
(memcheck, racecheck, synccheck) over the CUDA tests, and measures GEMM TFLOP/s, host<->device
copies, attention (plain, fused, and cuDNN where bench_device_ops has it), training tokens/s and
MFU for a GPT-2 124M shape (five placements) and a ~1B Llama shape (three) beside PyTorch on the
same shapes, and the hostmem-190m offload rows against their bound. The deepspeed phase (named
only: it needs the wheels `tools/gpu_peers.py pack` carries) runs DeepSpeed ZeRO-Offload and
ZeRO-Infinity on the offload rows' shape beside strata. Writes one Markdown report (for
docs/GPU.md) and one JSON file and prints where they are.

  tools/gpu_check.py [options]
  tools/gpu_check.py --self-test [--build-dir DIR]   check this tool on a machine without a GPU
                                                     (CI runs it; see tests/gpu_check.cmake)

Every phase fails soft: a failure is recorded in the report, and the next phase runs. Nothing
is installed system-wide (the GPU machine may have no network): missing tools and packages are
reported. Exit status: 0 every phase ok; 1 some phase failed (the report says which); 2 bad usage.
"""
import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from .common import ALL_PHASES, DEFAULT_PHASES, ROOT, Context
from .phases_bench import phase_attention, phase_copy, phase_gemm
from .phases_deepspeed import phase_deepspeed
from .phases_offload import phase_offload
from .phases_system import phase_build, phase_env
from .phases_tests import phase_sanitizer, phase_tests
from .phases_train import phase_train
from .report import read_status, write_report, write_status

PHASES = {"env": phase_env, "build": phase_build, "tests": phase_tests,
          "sanitizer": phase_sanitizer, "gemm": phase_gemm, "copy": phase_copy,
          "attention": phase_attention, "train": phase_train, "offload": phase_offload,
          "deepspeed": phase_deepspeed}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        sys.stderr.write("gpu_check: %s (see --help)\n" % message)
        sys.exit(2)


def parse_args(argv):
    p = _Parser(prog="tools/gpu_check.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter, add_help=True)
    p.add_argument("--results", help="where the report goes (default: <build dir>/gpu-check-<UTC "
                   "date-time>)")
    p.add_argument("--build-dir", default=str(ROOT / "build-gpu"),
                   help="build directory (default: build-gpu; an existing build is reused)")
    p.add_argument("--jobs", default=os.cpu_count() or 4, type=_positive,
                   help="parallel build jobs (default: all cores)")
    p.add_argument("--phases", type=_phases, default=None,
                   help="comma-separated subset of: %s (default: all but deepspeed)"
                   % ",".join(ALL_PHASES))
    p.add_argument("--arch", type=_arch, help="CUDA architecture, e.g. 90 (default: from "
                   "nvidia-smi's compute_cap)")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for GEMM share "
                   "and MFU (default: from its name)")
    p.add_argument("--nvme-path", help="swap directory of the NVMe rows (default: <results>/swap)")
    p.add_argument("--profile", help="a `strata probe --json` machine profile for the planner's "
                   "rates in the offload phase (default: the planner's defaults)")
    p.add_argument("--torch-python", help="the Python with PyTorch that runs the PyTorch peers "
                   "(default: python3 on PATH)")
    p.add_argument("--peers-dir", help="the DeepSpeed wheels and libaio that `tools/gpu_peers.py "
                   "pack` wrote (default: <build dir>/peers)")
    p.add_argument("--quick", action="store_true", help="fewer repeats and training steps")
    p.add_argument("--deadline", type=_seconds, help="finish within S seconds: every command's "
                   "time limit is cut to what is left, phases that cannot start are recorded as "
                   "skipped (for a 10-minute machine: --deadline 560). The report is rewritten after "
                   "each phase, and a later run with the same --results adds its phases to it.")
    p.add_argument("--dry-run", action="store_true", help="run every phase without a GPU: the "
                   "build is checked (not run), the tests run and skip, the benchmarks and the "
                   "training run on the CPU backend at small shapes (what --self-test runs)")
    p.add_argument("--self-test", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _positive(v):
    if not v.isdigit() or int(v) < 1:
        raise argparse.ArgumentTypeError("--jobs must be a positive integer")
    return int(v)


def _seconds(v):
    if not v.isdigit():
        raise argparse.ArgumentTypeError("--deadline must be seconds")
    return int(v)


def _arch(v):
    import re
    if not re.fullmatch(r"[0-9]+[af]?", v):
        raise argparse.ArgumentTypeError("--arch must look like 90")
    return v


def _phases(v):
    sel = [x for x in v.split(",") if x]
    for x in sel:
        if x not in ALL_PHASES:
            raise argparse.ArgumentTypeError("unknown phase '%s' (phases: %s)"
                                             % (x, " ".join(ALL_PHASES)))
    return sel


def run(opts, argv):
    start = time.time()
    build = Path(opts.build_dir).absolute()
    results = Path(opts.results).absolute() if opts.results else \
        build / ("gpu-check-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    end = start + opts.deadline if opts.deadline is not None else None
    try:
        ctx = Context(opts, results, build, end)
    except OSError as e:
        sys.stderr.write("gpu_check: cannot create %s: %s\n" % (results, e))
        return 1
    print("gpu_check: results in %s%s" % (results, " (dry run: no GPU used)" if opts.dry_run else ""),
          flush=True)
    selected = list(opts.phases or DEFAULT_PHASES)
    # Later phases read env's facts (the GPU's peak, compute-sanitizer, ...): a run without env
    # whose --results has none from an earlier run runs env first.
    if "env" not in selected and "gpu_name" not in ctx.state:
        selected.insert(0, "env")
    ctx.selected = selected
    failed = 0
    for i, phase in enumerate(selected, 1):
        print("== [%d/%d] %-10s " % (i, len(selected), phase), end="", flush=True)
        t0 = time.time()
        ctx.phase = phase
        ctx._status = None
        for sub, ext in (("status", ""), ("md", ".md"), ("json", ".json")):
            try:
                (ctx.R / sub / (phase + ext)).unlink()
            except OSError:
                pass
        ctx.log_path().write_text("")
        if end is not None and time.time() + 30 > end:
            ctx._status = ("skipped", "out of time (--deadline %d s)" % opts.deadline)
        else:
            try:
                PHASES[phase](ctx)
            except Exception:  # a phase's bug is its failure, and the next phase runs
                ctx.log(traceback.format_exc())
                if ctx._status is None:
                    ctx._status = ("failed", "the phase stopped (%s) without a result; see "
                                   "logs/%s.log" % (sys.exc_info()[1].__class__.__name__, phase))
            if ctx._status is None:
                ctx._status = ("failed", "the phase ended without a result; see logs/%s.log" % phase)
        ctx.save_state()
        status, summary = ctx._status
        write_status(ctx.R, phase, status, summary, int(time.time() - t0))
        failed += status == "failed"
        print("%s (%d s): %s" % (status, time.time() - t0, summary), flush=True)
        write_report(ctx, argv, start)
    print("report: %s" % (results / "report.md"))
    print("json:   %s" % (results / "report.json"))
    return 0 if failed == 0 else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    if opts.self_test:
        from .self_test import self_test
        return self_test(Path(opts.build_dir).absolute())
    return run(opts, argv)
