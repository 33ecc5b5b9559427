"""The offload phase: configs/hostmem-190m.json (15 x 1024, bf16, clipping 1.0 biting every step,
parameters, optimizer state and gradients on NVMe) in four schedules and budgets. Every row must
give the same losses bit for bit; per row the step, fwd/bwd and optimizer times (medians after
the first two steps), NVMe bytes per step against the placement's minimum, the peak RSS, and
its bound: step / max(the all-on-device step, the row's own optimizer time), and the planner's
step for the row (`strata plan --json`: its schedule for a clipped step and the time it
predicts at its profile's rates) beside the measured step. In a dry run, a 2-layer shape of it
on the CPU backend."""
import json
import os
import re
import shutil
import time

from .common import ROOT, fmt, fmt_bytes, metric_list, metric_median, ms
from .phases_train import bytes_vs_min, peak_rss, why_failed

ROWS = [
    ("plain", "the plain schedule (strata.optimizer.overlap false)",
     ["strata.optimizer.overlap=false"]),
    ("auto", "as shipped (256 MiB host budget, gradients on NVMe, defer auto)", []),
    ("never", "the pass after backward (defer never)", ['strata.optimizer.defer="never"']),
    ("host-4g", "4 GiB host budget, gradients in host RAM, defer auto",
     ['strata.host_memory_limit="4GiB"', 'strata.placement.grads="host"']),
]


def io_rates(path):
    """(read, write) GB/s medians from a `strata probe io --json` report; None when missing."""
    try:
        data = json.loads(open(path).read())
    except (OSError, ValueError):
        return None, None
    found = {}

    def walk(x):
        if isinstance(x, dict):
            if x.get("op") in ("read", "write") and isinstance(x.get("gbps_median"), (int, float)):
                found.setdefault(x["op"], x["gbps_median"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(data)
    return found.get("read"), found.get("write")


def planner_row(ctx, exe, out_prefix, args):
    """The planner's option for the placement a config asks for (`strata plan --json`), or
    None. Its fields as plan --json writes them: time_s (step, step_after_backward,
    step_clipped_deferred, step_clipped_plain, nvme, compute, ...), clipped_schedule,
    nvme_read_bytes, nvme_write_bytes."""
    txt, js = "%s.txt" % out_prefix, "%s.json" % out_prefix
    cmd = [exe, "plan"] + args + ["--json", js]
    if ctx.opts.profile:
        cmd += ["--profile", ctx.opts.profile]
    rc = ctx.run(60, cmd, log=txt)
    if rc != 0:
        return None
    m = re.search(r"^config .* asks for ([^:]+):", open(txt).read(), re.M)
    try:
        plan = json.loads(open(js).read())
    except (OSError, ValueError):
        return None
    if not m:
        return None
    for o in plan.get("options", []):
        if o.get("name") == m.group(1):
            o["rates"] = plan.get("rates")
            return o
    return None


def phase_offload(ctx):
    exe = ctx.bin("strata")
    if not os.access(exe, os.X_OK):
        return ctx.result("failed", "strata not built")
    cfg = ROOT / "configs" / "hostmem-190m.json"
    steps, backend, shape = 8, "cuda", []
    if ctx.quick:
        steps = 6
    if ctx.dry:
        backend, steps = "cpu", 3
        shape = ["--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=2"]
    d = ctx.R / "offload"
    nvme = os.path.join(ctx.opts.nvme_path or str(ctx.R / "swap"), "offload")
    d.mkdir(parents=True, exist_ok=True)
    os.makedirs(nvme, exist_ok=True)

    def clear_swap():
        for e in os.listdir(nvme):
            p = os.path.join(nvme, e)
            shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    base = ["--config", cfg] + shape + ["--set", 'device.backend="%s"' % backend]
    ctx.md("configs/hostmem-190m.json on the %s backend, %d steps, swap in %s." % (backend, steps, nvme))
    ctx.md("")
    # The swap disk by strata's own engine (1 MiB, QD 32, io_uring; fio is not on every machine).
    rgb = wgb = None
    if ctx.run(90, [exe, "probe", "io", "--path", nvme, "--size", "64MiB" if ctx.dry else "2GiB",
                    "--backends", "io_uring", "--block-sizes", "1MiB", "--queue-depths", "32",
                    "--repeats", "3", "--json", d / "io.json"],
               log=ctx.log_path("offload-io")) == 0:
        rgb, wgb = io_rates(d / "io.json")
    clear_swap()
    # Everything on the device (parameters, gradients, master and moments; the device's own
    # optimizer), the plain schedule: the step the offload rows are bounded by when their
    # optimizer is hidden.
    dev = {}
    if ctx.run(240, [exe, "train"] + base +
               ["--set", "train.steps=%d" % steps, "--set", 'train.checkpoint_dir="%s"' % (d / "device"),
                "--set", "train.final_checkpoint=false",
                "--set", 'zero_optimization.offload_param.device="none"',
                "--set", 'zero_optimization.offload_optimizer.device="none"',
                "--set", 'strata.placement.grads="device"', "--set", 'device.memory_limit="16GiB"',
                "--set", 'strata.host_memory_limit="16GiB"', "--set", "strata.optimizer.overlap=false"],
               log=ctx.log_path("offload-device")) == 0:
        m = d / "device" / "metrics.jsonl"
        dev = {k: metric_median(m, k) for k in ("step_s", "fwd_bwd_s", "optimizer_s")}
    dev_step = dev.get("step_s")
    ctx.md("Bound terms: disk read %s / write %s GB/s (`strata probe io`, 1 MiB, QD 32, io_uring); "
           "the all-on-device step %s ms (fwd/bwd %s ms, the device's optimizer %s ms: "
           "parameters, gradients, master and moments on the device, plain schedule); each row's "
           "optimizer alone is its own optimizer time." % (fmt(rgb), fmt(wgb), ms(dev_step),
                                                           ms(dev.get("fwd_bwd_s")),
                                                           ms(dev.get("optimizer_s"))))
    ctx.md("")
    ctx.md("| row | step ms | fwd/bwd ms | optimizer ms | bytes per step (the placement's minimum) "
           "| peak RSS | losses | result |")
    ctx.md("|---|---|---|---|---|---|---|---|")
    rows, bad, ref = {}, [], None
    for name, what, sets in ROWS:
        rdir = d / name
        log = ctx.log_path("offload-%s" % name)
        shutil.rmtree(rdir, ignore_errors=True)
        clear_swap()
        extra = [x for kv in sets for x in ("--set", kv)]
        t0 = time.time()
        rc = ctx.run(240, [exe, "train"] + base +
                     ["--set", "train.steps=%d" % steps, "--set", 'train.checkpoint_dir="%s"' % rdir,
                      "--set", "train.final_checkpoint=false",
                      "--set", 'zero_optimization.offload_param.nvme_path="%s"' % nvme,
                      "--set", 'zero_optimization.offload_optimizer.nvme_path="%s"' % nvme] + extra,
                     log=log)
        text = log.read_text(errors="replace")
        m = rdir / "metrics.jsonl"
        row = {"exit": rc, "sets": sets}
        if rc == 0 and m.exists():
            row.update({k: metric_median(m, k) for k in ("step_s", "fwd_bwd_s", "optimizer_s")})
            row["bytes"], row["peak_rss"] = bytes_vs_min(text), peak_rss(text)
            row["losses"] = metric_list(m, "loss")
            if ref is None:
                ref, same = row["losses"], "reference"
            elif row["losses"] == ref:
                same = "same bits"
            else:
                same = "DIFFER"
                bad.append("%s: losses differ from plain" % name)
            row["same_as_plain"] = same
            ctx.md("| %s: %s | %s | %s | %s | %s | %s | %s | ok (%d s) |"
                   % (name, what, ms(row["step_s"]), ms(row["fwd_bwd_s"]), ms(row["optimizer_s"]),
                      row["bytes"] or "?", row["peak_rss"] or "?", same, time.time() - t0))
        else:
            why = why_failed(text) or "see logs/%s" % log.name
            ctx.md("| %s: %s | | | | | | | FAILED (exit %d): %s |" % (name, what, rc, why))
            bad.append("%s: exit %d" % (name, rc))
        rows[name] = row
    shutil.rmtree(nvme, ignore_errors=True)
    ctx.md("")
    ctx.md("Losses (plain): %s" % (",".join(ref) if ref else "none"))

    # Per row: step / max(the all-on-device step, its optimizer alone), and the planner's step
    # for the row's own config (plan --json, its profile's rates: --profile, else its defaults).
    ctx.md("")
    ctx.md("| row | step ms | all-on-device step ms | optimizer alone ms | bound ms | step / bound "
           "| planner: NVMe bytes per step | planner: clipped step ms (schedule) | step / planner |")
    ctx.md("|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for name, what, sets in ROWS:
        r = rows[name]
        if r.get("step_s") is None:
            continue
        step, opt = r["step_s"], r.get("optimizer_s")
        bound = max(x for x in (dev_step, opt) if x is not None) if (dev_step or opt) else None
        args = [str(x) for x in base] + [x for kv in sets for x in ("--set", kv)]
        p = planner_row(ctx, exe, d / ("plan-%s" % name), args)
        if p is None:
            pstep, sched, pbytes = None, "planner failed: see %s" % (d / ("plan-%s.txt" % name)), None
        else:
            t = p.get("time_s", {})
            pstep = t.get("step_after_backward")
            sched = p.get("clipped_schedule", "?")
            pbytes = (p.get("nvme_read_bytes") or 0) + (p.get("nvme_write_bytes") or 0)
        ratios[name] = {"step_s": step, "all_on_device_step_s": dev_step, "optimizer_alone_s": opt,
                        "bound_s": bound, "step_over_bound": step / bound if bound else None,
                        "planner_clipped_step_s": pstep, "planner_schedule": sched,
                        "planner_nvme_bytes": pbytes,
                        "step_over_planner": step / pstep if pstep else None,
                        "planner_time_s": p.get("time_s") if p else None}
        ctx.md("| %s | %s | %s | %s | %s | %s | %s | %s (%s) | %s |"
               % (name, ms(step), ms(dev_step), ms(opt), ms(bound),
                  fmt(ratios[name]["step_over_bound"]),
                  fmt_bytes(pbytes), ms(pstep), sched,
                  fmt(ratios[name]["step_over_planner"])))
    ctx.md("")
    ctx.md("bound = max(the all-on-device step, the row's optimizer time): what the row would take "
           "if moving the state cost nothing and the optimizer overlapped nothing of the step. "
           "The planner's clipped step is `time_s.step_after_backward` of `strata plan --json` for "
           "the row's config (the schedule a clipped step runs: deferred into the next forward or "
           "after backward), at %s." % ("the rates of " + ctx.opts.profile if ctx.opts.profile
                                        else "the planner's default rates (no --profile)"))
    if dev_step is None:
        ctx.md("")
        ctx.md("No all-on-device step: its run failed (logs/offload-device.log).")
    ctx.put_json({"backend": backend, "steps": steps, "disk_read_gbps": rgb,
                  "disk_write_gbps": wgb, "all_on_device": dev, "rows": rows, "ratios": ratios})
    if dev_step is None:
        bad.append("the all-on-device run failed")
    if bad:
        ctx.result("failed", "; ".join(bad))
    else:
        ctx.result("ok", "hostmem-190m (%s): 4 schedules, the same losses bit for bit; step / bound "
                   "%s" % (backend, ", ".join("%s %s" % (k, fmt(v["step_over_bound"]))
                                              for k, v in ratios.items())))
