"""The train phase: `strata train` of GPT-2 124M in five placements and a ~1B Llama in three
(with --quick without the optimizer on NVMe), then each with the optimizer ratio `strata plan`
recommends for its offloaded placement (at this machine's `strata probe` profile, or
--profile), and both offloaded rows again with the gradient norm under the clipping threshold
(each step speculated under backward), and a planned row that missed 1.10x the all-on-device
step again at the ratio the planner gives at the CPU rate the run measured; tokens/s and MFU
per row, with the
PyTorch peers (tools/peers/torch_gpt_gpu.py, torch_llama_gpu.py: the same shapes, everything on
the device) run between strata's rows and strata's all-on-device tokens/s over PyTorch's beside
the MFU, and the planner's row's step over the all-on-device step."""
import json
import os
import re
import shutil
import time
from pathlib import Path

from .common import ROOT, metric_median, ms

PEERS = ROOT / "tools" / "peers"


def bytes_vs_min(log_text):
    """A run summary's bytes per step beside the placement's minimum, e.g. "nvme 1.62 GiB
    (1.62 GiB, +0.0%); link 1.16 GiB (1.16 GiB, +0.0%)"; "" when it printed none."""
    out = []
    for what, label in (("nvme", "nvme"), ("host<->device", "link")):
        m = re.search(r"^%s bytes per step: (.*)$" % re.escape(what), log_text, re.M)
        if not m:
            continue
        s = re.sub(r" \(median of steps [^)]*\)", "", m.group(1))
        s = re.sub(r", the placement.s minimum ([^(]*?) ?\((.*)\)$", r" (\1, \2)", s)
        s = re.sub(r", the placement.s minimum (.*)$", r" (\1)", s)
        out.append("%s %s" % (label, s))
    return "; ".join(out)


def peak_rss(log_text):
    m = re.search(r"peak RSS \(VmHWM\) ([0-9.]+ [KMG]iB)", log_text)
    return m.group(1) if m else None


def rss_split(log_text):
    """What strata's summary says its peak RSS is made of (the host tier, its arena and undo
    room, the rest), or None."""
    m = re.search(r"peak RSS \(VmHWM\) [0-9.]+ [KMG]iB = (.*) \([0-9.]+ [KMG]iB at start\)", log_text)
    return m.group(1) if m else None


def why_failed(log_text):
    m = re.search(r"^.*strata train:.*$", log_text, re.M)
    return m.group(0)[:300] if m else ""


def train_config(path, micro, accum, activations, model, steps, backend):
    """A training config for the train phase."""
    cfg = {
        "train_batch_size": micro * accum, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum, "steps_per_print": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "model": model,
        "data": {"source": "synthetic", "eval_batches": 0},
        "device": {"backend": backend},
        "strata": {"activations": activations},
        "train": {"steps": steps, "eval_interval": 0, "seed": 1, "final_checkpoint": False},
    }
    path.write_text(json.dumps(cfg, indent=1) + "\n")


def torch_python(ctx):
    return ctx.opts.torch_python or shutil.which("python3") or "python3"


def run_torch_peer(ctx, key, script, args, n):
    """Runs a PyTorch peer once (the n-th time for this model); returns its JSON line's object,
    or a dict with "error"."""
    py = torch_python(ctx)
    log = ctx.log_path("train-%s-torch-%d" % (key, n))
    rc = ctx.run(240, [py, PEERS / script] + args, log=log)
    text = log.read_text(errors="replace")
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("tokens_per_s"), (int, float)):
                return rec
    return {"error": "exit %d, no result line (logs/%s)" % (rc, log.name)}


def torch_available(ctx):
    """Whether the PyTorch peers can run here: "" if so, else why not."""
    rc, out = ctx.capture(120, [torch_python(ctx), "-c",
                                "import torch; print(torch.__version__, torch.cuda.is_available())"])
    ctx.log("torch:", rc, out.strip())
    if rc != 0:
        return "no PyTorch for %s" % torch_python(ctx)
    if not out.strip().endswith("True"):
        return "PyTorch %s sees no GPU" % out.split()[0] if out.split() else "PyTorch sees no GPU"
    return ""


def machine_profile(ctx, d):
    """The machine profile the planner's rows read: --profile, else a `strata probe` of this
    machine (its CPU optimizer, copies and device); None when the probe fails."""
    if ctx.opts.profile:
        return ctx.opts.profile
    path = d / "profile.json"
    if not path.exists():
        rc = ctx.run(120, [ctx.bin("strata"), "probe", "--json", path],
                     log=ctx.log_path("train-probe"))
        if rc != 0:
            return None
    return str(path)


# The rows with the norm under the clipping threshold: synthetic data's gradient norm is above
# 1.0 (every step clips), so these rows clip at 1e6, above any norm: each step's optimizer
# speculates under backward, the schedule a real run under the threshold takes. They step under
# backward every step (speculate "always": the other schedule `auto` weighs is the clipped
# rows'), and their first steps make the undo room's regions ready, one module a step
# (Homes::undo_ready): they run Table.under_steps steps, measured over the last UNDER_MEASURED.
NORM_UNDER = "-norm-under"
UNDER = ["gradient_clipping=1e6", 'strata.optimizer.speculate="always"']
UNDER_MEASURED = 4
PLAIN = "-plain"
# A planner's row that misses the bound (its step over MISSED x the all-on-device step) is run
# again at the ratio the planner gives at the CPU optimizer's measured rate: `planned` + AT_RATE.
MISSED = 1.10
AT_RATE = "-at-rate"
PLANNED_ROWS = ("planned", "planned" + AT_RATE, "planned" + NORM_UNDER,
                "planned" + NORM_UNDER + AT_RATE)


def planner_ratio(ctx, cfg, pdev, odev, profile, name, sets=(), rate=None):
    """The zero_optimization.offload_optimizer.ratio `strata plan` recommends for the config with
    this placement, and the whole advice (`optimizer_ratio_advice`: its expected step, CPU
    optimizer and compute times, the step at ratio 1); (None, None) when there is none. `rate`:
    the CPU optimizer's parameters/s beside the device that a run measured, in place of the
    profile's (`strata plan --cpu-optimizer-rate`)."""
    out = cfg.parent / ("%s.plan.json" % name)
    cmd = [ctx.bin("strata"), "plan", "--config", cfg, "--json", out, "--force",
           "--set", 'zero_optimization.offload_param.device="%s"' % pdev,
           "--set", 'zero_optimization.offload_optimizer.device="%s"' % odev]
    if profile:
        cmd += ["--profile", profile]
    if rate:
        cmd += ["--cpu-optimizer-rate", "%.6g" % rate]
    cmd += [x for kv in sets for x in ("--set", kv)]
    if ctx.run(60, cmd, log=ctx.log_path("train-%s-plan" % name)) != 0:
        return None, None
    try:
        rep = json.loads(out.read_text())
        advice = [a for a in rep.get("optimizer_ratio_advice", []) if a.get("option") == rep["asked"]]
        return (float(advice[0]["ratio"]), advice[0]) if advice else (None, None)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None, None


def probe_optimizer_rate(profile):
    """The CPU optimizer's rate in a `strata probe` profile: (params/s, params stepped, threads
    of the best rate), or None."""
    try:
        c = json.loads(Path(profile).read_text())["cpu_optimizer"]
        best = max(c.get("by_threads", []), key=lambda t: t["params_per_s"], default={})
        return float(c["params_per_s"]), int(c.get("params", 0)), best.get("threads")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def planner_note(advice, profile, measured, kernel=None):
    """What the planner expected beside what ran: the probe's CPU optimizer rate, the step the
    planner weighs (the clipped one where clipping is on and the norm unknown), its CPU optimizer
    and compute at its ratio and its step at ratio 1, and the optimizer rate the row with the
    whole optimizer in host RAM measured (`measured`: (ms, parameters); `kernel`: its CPU
    optimizer kernel's parameters/s, the run's cpu_optimizer_params_per_s)."""
    ms1 = lambda s: "%.0f" % (1000 * s) if isinstance(s, (int, float)) else "?"
    rate = probe_optimizer_rate(profile) if profile else None
    parts = []
    if rate:
        parts.append("`strata probe` stepped the CPU optimizer at %.2f G parameters/s (%d M "
                     "parameters, %s threads)" % (rate[0] / 1e9, rate[1] // 1000000, rate[2]))
    parts.append("the planner weighs the %s: %s ms at ratio %g (CPU optimizer %s ms, compute %s "
                 "ms; %s ms at ratio 1)" % (advice.get("weighs", "expected step"),
                                           ms1(advice.get("step_s", advice.get("expected_s"))),
                                           advice.get("ratio"),
                                           ms1(advice.get("cpu_optimizer_s")),
                                           ms1(advice.get("compute_s")),
                                           ms1(advice.get("step_at_ratio_1_s"))))
    if measured and measured[0]:
        parts.append("the row with the whole optimizer in host RAM stepped it in %.0f ms (%.2f G "
                     "parameters/s%s)" % (measured[0], measured[1] / measured[0] / 1e6,
                                         "; its kernel %.2f" % (kernel / 1e9) if kernel else ""))
    return "Planner: " + "; ".join(parts) + "."


class Table:
    """One model's rows: strata in several placements, the PyTorch peer between them."""

    def __init__(self, ctx, key, cfg, flops_tok):
        self.ctx, self.key, self.cfg, self.flops_tok = ctx, key, cfg, flops_tok
        self.rows, self.bad, self.torch, self.notes = {}, [], [], []
        # The norm-under rows' steps (None: the config's): past the undo room's warm-up.
        self.under_steps = None

    def mfu(self, tps):
        peak = self.ctx.state.get("peak_tflops")
        if tps is None or not peak or self.ctx.dry:
            return None
        return tps * self.flops_tok / (peak * 1e12)

    def strata_row(self, name, pdev, odev, ratio, what, profile_ops=False, extra=(), skip=2):
        """One strata run. profile_ops: its second step's op profile (flops_profiler; the
        median of tokens/s leaves out the first 2 steps, so it costs the row nothing); extra:
        further --set KEY=VALUE; skip: the steps the medians leave out."""
        ctx = self.ctx
        nvme = ctx.opts.nvme_path or str(ctx.R / "swap")
        rdir = self.cfg.parent / ("%s-%s" % (self.key, name))
        log = ctx.log_path("train-%s-%s" % (self.key, name))
        shutil.rmtree(rdir, ignore_errors=True)
        prof = ctx.log_path("train-%s-%s-op-profile" % (self.key, name))
        if prof.exists():
            prof.unlink()
        sets = [x for kv in extra for x in ("--set", kv)]
        if profile_ops:
            sets += ["--set", "flops_profiler.enabled=true", "--set", "flops_profiler.profile_step=1",
                     "--set", 'flops_profiler.output_file="%s"' % prof]
        t0 = time.time()
        rc = ctx.run(300, [ctx.bin("strata"), "train", "--config", self.cfg, "--quiet",
                           "--set", 'zero_optimization.offload_param.device="%s"' % pdev,
                           "--set", 'zero_optimization.offload_optimizer.device="%s"' % odev,
                           "--set", "zero_optimization.offload_optimizer.ratio=%s" % ratio,
                           "--set", 'zero_optimization.offload_optimizer.nvme_path="%s"' % nvme,
                           "--set", 'train.checkpoint_dir="%s"' % rdir] + sets, log=log)
        text = log.read_text(errors="replace")
        m = rdir / "metrics.jsonl"
        row = {"offload_param": pdev, "offload_optimizer": odev, "ratio": ratio, "exit": rc,
               "what": what}
        if profile_ops:
            row["op_profile"] = (prof.read_text(errors="replace") if prof.exists()
                                 else "(no op profile: logs/%s)" % log.name)
        if rc == 0 and m.exists():
            row.update({k: metric_median(m, k, skip) for k in
                        ("tokens_per_s", "step_s", "fwd_bwd_s", "optimizer_s", "grad_norm",
                         "cpu_optimizer_params_per_s")})
            sched = re.search(r"the optimizer of those steps: (.*)", text)
            row["schedule"] = sched.group(1).strip() if sched else None
            warm = re.search(r"(\d+) step\(s\) stepped part of it after backward while undo room", text)
            row["undo_warmup_steps"] = int(warm.group(1)) if warm else 0
            row["measured_from_step"] = skip + 1
            row["mfu"] = self.mfu(row["tokens_per_s"])
            row["bytes"] = bytes_vs_min(text)
            row["seconds"] = int(time.time() - t0)
        else:
            row["why"] = why_failed(text) or "see logs/%s" % log.name
            self.bad.append("%s %s: exit %d" % (self.key, name, rc))
        self.rows[name] = row

    def planned_row(self, pdev, odev, profile, what, host_row, params, suffix="", extra=(),
                    skip=2):
        """The placement with the optimizer ratio `strata plan` recommends for it (the least
        state on the device within 5% of the fastest predicted step), when it is below 1; the
        planner's expectation beside the optimizer time of `host_row` (the same placement at
        ratio 1) goes to the notes."""
        name = "planned" + suffix
        ratio, advice = planner_ratio(self.ctx, self.cfg, pdev, odev, profile,
                                      "%s-%s" % (self.key, name), extra)
        r2 = None  # the planner's ratio at the rate `host_row` stepped, where that is 10% off
        if advice:
            host = self.rows.get(host_row, {})
            opt_s, kernel = host.get("optimizer_s"), host.get("cpu_optimizer_params_per_s")
            self.notes.append(planner_note(advice, profile,
                                           (1000 * opt_s, params) if opt_s else None, kernel))
            # The CPU optimizer's rate beside the GPU: the whole pass's (its copies and
            # conversions counted in: what the criterion's margin needs), else its kernel's. The
            # note gives both: where they differ, the rest of the pass is what slowed it.
            rate = params / opt_s if opt_s else kernel
            probe = probe_optimizer_rate(profile) if profile else None
            if rate and probe and abs(rate / probe[0] - 1) > 0.1:
                # The planner again at the rate the run stepped: what it would have chosen.
                r2, a2 = planner_ratio(self.ctx, self.cfg, pdev, odev, profile,
                                       "%s-at-rate%s" % (self.key, suffix), extra, rate=rate)
                if a2 and r2 is not None:
                    self.notes.append(
                        "At the rate that row stepped (%.2f G parameters/s) the planner "
                        "recommends ratio %g (the %s %.0f ms)."
                        % (rate / 1e9, r2, a2.get("weighs", "expected step"),
                           1000 * float(a2.get("step_s", a2.get("expected_s")) or 0)))
        if ratio is None:
            self.notes.append("The planner recommended no optimizer ratio for %s (logs/%s)."
                              % (what.lower(), self.ctx.log_path("train-%s-%s-plan"
                                                                 % (self.key, name)).name))
        elif ratio < 1 or self.ctx.dry:  # dry (the CPU backend: ratio 1), for the code path
            self.strata_row(name, pdev, odev, "%g" % ratio,
                            "%s, the optimizer ratio %g `strata plan` recommends" % (what, ratio),
                            extra=extra, skip=skip)
            self.at_rate_row(name, pdev, odev, ratio, r2, what, extra, skip)
        else:
            self.notes.append("The planner keeps the whole optimizer of %s in host RAM (ratio 1): "
                              "the row with it is the one above." % what.lower())

    def at_rate_row(self, planned, pdev, odev, ratio, r2, what, extra, skip):
        """Where the planner's row missed the bound (its step over MISSED x the all-on-device
        step) and the planner at the CPU optimizer's rate that the host-RAM row measured gives a
        lower ratio: that ratio too (`<planned>` + AT_RATE), so that the run shows whether the
        advice at the rate the CPU steps beside the GPU reaches it. Not when less than a
        minute of the deadline is left."""
        dev = self.rows.get("device", {}).get("step_s")
        step = self.rows.get(planned, {}).get("step_s")
        left = self.ctx.left()
        if (r2 is None or not dev or not step or step <= MISSED * dev or r2 >= ratio - 0.005
                or (left is not None and left < 60)):
            return
        self.strata_row(planned + AT_RATE, pdev, odev, "%g" % r2,
                        "%s, the optimizer ratio %g `strata plan` recommends at the CPU "
                        "optimizer's measured rate" % (what, r2), extra=extra, skip=skip)

    def planned_rows(self, pdev, where, host_row, profile, params, nvme):
        """The rows after the host RAM ones: the optimizer on NVMe (not with --quick), the
        offloaded placement (`pdev`: its parameters, `where` in words; `host_row`: its row at
        ratio 1, run already) at the planner's ratio, then both again with the norm under the
        clipping threshold."""
        if not self.ctx.quick:
            self.strata_row("nvme", "cpu", "nvme", 1,
                            "parameters in host RAM, optimizer on NVMe (%s)" % nvme)
        self.planned_row(pdev, "cpu", profile, where, host_row, params)
        under = ", the norm under the clipping threshold"
        extra, skip = UNDER, 2
        if self.under_steps:
            extra = UNDER + ["train.steps=%d" % self.under_steps]
            skip = self.under_steps - UNDER_MEASURED
        self.strata_row(host_row + NORM_UNDER, pdev, "cpu", 1,
                        self.rows.get(host_row, {}).get("what", where) + under, extra=extra,
                        skip=skip)
        self.planned_row(pdev, "cpu", profile, where + under, host_row + NORM_UNDER, params,
                         NORM_UNDER, extra, skip)
        # The plain schedule (overlap off: the optimizer after backward, nothing speculated):
        # the overlapped rows at ratio 1 should never be slower.
        self.strata_row(host_row + PLAIN, pdev, "cpu", 1,
                        self.rows.get(host_row, {}).get("what", where) + ", overlap off (the "
                        "plain schedule)", extra=["strata.optimizer.overlap=false"])
        base = self.rows.get(host_row + PLAIN, {}).get("step_s")
        steps = [(n, self.rows.get(n, {}).get("step_s")) for n in (host_row, host_row + NORM_UNDER)]
        if base and all(v for _, v in steps):
            self.notes.append("Against the plain schedule (%s ms a step, overlap off): %s."
                              % (ms(base), ", ".join("%s %s ms (%.2fx)" % (n, ms(v), v / base)
                                                     for n, v in steps)))

    def torch_run(self, script, args, why_not):
        if why_not:
            return
        self.torch.append(run_torch_peer(self.ctx, self.key, script, args, len(self.torch) + 1))

    def write(self, torch_why_not):
        ctx = self.ctx
        best = [t["tokens_per_s"] for t in self.torch if "tokens_per_s" in t]
        torch_tps = max(best) if best else None
        ctx.md("| row | parameters | optimizer state | tokens/s | MFU | strata / PyTorch | step ms "
               "| fwd/bwd ms | optimizer ms | bytes per step (the placement's minimum) | result |")
        ctx.md("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in self.rows.items():
            if r["exit"] == 0 and "tokens_per_s" in r:
                tps = r["tokens_per_s"]
                ratio = "%.2f" % (tps / torch_tps) if tps and torch_tps else "n/a"
                r["over_torch"] = tps / torch_tps if tps and torch_tps else None
                ctx.md("| %s: %s | %s | %s | %.0f | %s | %s | %s | %s | %s | %s | ok (%d s) |"
                       % (name, r["what"], r["offload_param"], r["offload_optimizer"], tps or 0,
                          "n/a" if r["mfu"] is None else "%.1f%%" % (100 * r["mfu"]), ratio,
                          ms(r["step_s"]), ms(r["fwd_bwd_s"]), ms(r["optimizer_s"]), r["bytes"],
                          r["seconds"]))
            else:
                ctx.md("| %s: %s | %s | %s | | | | | | | | FAILED (exit %d): %s |"
                       % (name, r["what"], r["offload_param"], r["offload_optimizer"], r["exit"],
                          r["why"]))
        ctx.md("")
        dev = self.rows.get("device", {})
        for name in PLANNED_ROWS:
            planned = self.rows.get(name, {})
            if dev.get("step_s") and planned.get("step_s"):
                planned["over_device"] = planned["step_s"] / dev["step_s"]
                ctx.md("With the planner's optimizer ratio %s%s%s: a step of %s ms, %.2fx the "
                       "all-on-device step (%s ms)."
                       % (planned["ratio"], " at the CPU optimizer's measured rate"
                          if AT_RATE in name else "", " and the norm under the clipping "
                          "threshold" if NORM_UNDER in name else "", ms(planned["step_s"]),
                          planned["over_device"], ms(dev["step_s"])))
                ctx.md("")
        regime = ["%s %s (%s%s)" % (name, "%.2f" % r["grad_norm"] if r.get("grad_norm") else "?",
                                    r.get("schedule") or "?",
                                    "; %d step(s) made the undo room ready" % r["undo_warmup_steps"]
                                    if r.get("undo_warmup_steps") else "")
                  for name, r in self.rows.items() if r.get("offload_optimizer") != "none"
                  and r["exit"] == 0]
        if regime:
            ctx.md("Gradient norm (median after 2 steps; clipping at 1.0 bites above it, the "
                   "`*%s` rows clip at 1e6 and step under backward every step) and the schedule "
                   "each step's optimizer ran, per offloaded row: %s."
                   % (NORM_UNDER, "; ".join(regime)))
            ctx.md("")
        if self.under_steps:
            ctx.md("The `*%s` rows run %d steps, their medians over the last %d: their first "
                   "steps make the undo room's regions ready, one module a step, and step the "
                   "modules without one after backward." % (NORM_UNDER, self.under_steps,
                                                            UNDER_MEASURED))
            ctx.md("")
        for note in self.notes:
            ctx.md(note)
            ctx.md("")
        for name, r in self.rows.items():
            if "op_profile" in r:
                ctx.md("Op profile of the `%s` row's second step (flops_profiler: each kernel and "
                       "copy timed on the device, by op and stream; FLOPs and bytes from the "
                       "simulated device's cost model, and its time for the same calls):" % name)
                ctx.md("")
                ctx.md("```")
                for line in r["op_profile"].rstrip().splitlines():
                    ctx.md(line)
                ctx.md("```")
                ctx.md("")
        if torch_why_not:
            ctx.md("PyTorch peer: not run (%s)." % torch_why_not)
        for i, t in enumerate(self.torch):
            if "tokens_per_s" in t:
                mfu = self.mfu(t["tokens_per_s"])
                ctx.md("PyTorch peer, run %d (%s): %.0f tokens/s, MFU %s, step %s ms, peak device "
                       "memory %s GiB." % (i + 1, t.get("mode", "eager"), t["tokens_per_s"],
                                           "n/a" if mfu is None else "%.1f%%" % (100 * mfu),
                                           t.get("step_ms", "?"), t.get("peak_mem_gib", "?")))
            else:
                ctx.md("PyTorch peer, run %d: FAILED (%s)." % (i + 1, t["error"]))
        if torch_tps:
            ctx.md("")
            ctx.md("strata / PyTorch: each row's tokens/s over the faster PyTorch run (%.0f "
                   "tokens/s; PyTorch keeps everything on the device)." % torch_tps)
        return {"flops_per_token": self.flops_tok, "rows": self.rows, "torch": self.torch,
                "torch_tokens_per_s": torch_tps}


def phase_train(ctx):
    exe = ctx.bin("strata")
    if not os.access(exe, os.X_OK):
        return ctx.result("failed", "strata not built")
    backend, steps = "cuda", 12
    if ctx.quick:
        steps = 6
    if ctx.dry:
        backend, steps = "cpu", 3
    d = ctx.R / "train"
    nvme = ctx.opts.nvme_path or str(ctx.R / "swap")
    d.mkdir(parents=True, exist_ok=True)
    os.makedirs(nvme, exist_ok=True)
    why_not = torch_available(ctx)
    peak = ctx.state.get("peak_tflops")
    bad = []
    # The planner's rates for its optimizer-ratio rows (the last of each model's).
    profile = machine_profile(ctx, d)

    # GPT-2 124M. Parameters: wte [Vp,C] + wpe [T,C] + L blocks (12C^2 + 13C) + final norm (2C);
    # tied head. FLOPs per token: 6 N + 6 L C T (llm.c's estimate: causal attention at half of
    # 12 L C T).
    L, NH, C, V, Vp, T, micro, accum = 12, 12, 768, 50257, 50304, 1024, 8, 2
    if ctx.dry:
        L, NH, C, V, Vp, T, micro, accum = 2, 2, 64, 256, 256, 64, 2, 1
    train_config(d / "gpt.json", micro, accum, "keep",
                 {"n_layer": L, "n_head": NH, "n_embd": C, "vocab_size": V,
                  "padded_vocab_size": Vp, "context": T}, steps, backend)
    params = Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    flops_tok = 6 * params + 6 * L * C * T
    ctx.md("### GPT-2 124M")
    ctx.md("")
    ctx.md("Model: GPT-2 shape L=%d, heads=%d, C=%d, T=%d, vocab %d (padded %d): %d parameters; "
           "micro-batch %d x %d, %d micro-batches per step, %d steps, bf16, AdamW; synthetic data. "
           "Backend: %s." % (L, NH, C, T, V, Vp, params, micro, T, accum, steps, backend))
    ctx.md("")
    ctx.md("MFU = tokens/s x (6 N + 6 L C T = %d FLOPs per token) / peak (%s TFLOP/s). tokens/s "
           "is the median of the per-step values after the first 2 steps. PyTorch: "
           "tools/peers/torch_gpt_gpu.py, the same shape, eager, fused AdamW, run after strata's "
           "first row%s." % (flops_tok, peak or "unknown", "" if ctx.quick else " and after its last"))
    ctx.md("")
    gpt_args = ["--layers", L, "--heads", NH, "--width", C, "--vocab", Vp, "--context", T,
                "--micro-batch", micro, "--accum", accum, "--steps", max(steps - 2, 3),
                "--warmup", 2]
    gpt_args = [str(x) for x in gpt_args]
    t = Table(ctx, "gpt2", d / "gpt.json", flops_tok)
    t.under_steps = (L + 2) + 2 + UNDER_MEASURED  # its modules: embeddings, L blocks, final norm
    t.strata_row("device", "none", "none", 1,
                 "everything on the device, the optimizer stepped by the device's kernel",
                 profile_ops=True)
    t.torch_run("torch_gpt_gpu.py", gpt_args, why_not)
    t.strata_row("device-opt-host", "none", "cpu", 1,
                 "parameters on the device, optimizer in host RAM", profile_ops=True)
    t.strata_row("ratio", "none", "cpu", 0.5, "parameters on the device, optimizer ratio 0.5 "
                 "(half on the device, half in host RAM)")
    t.strata_row("host", "cpu", "cpu", 1, "parameters and optimizer in host RAM")
    t.planned_rows("none", "parameters on the device", "device-opt-host", profile, params, nvme)
    if not ctx.quick:
        t.torch_run("torch_gpt_gpu.py", gpt_args, why_not)
    gpt = t.write(why_not)
    gpt.update({"params": params, "steps": steps})
    bad += t.bad

    # A ~1B Llama: TinyLlama-1.1B's shape (22 layers, width 2048, 32 query and 4 key-value heads,
    # SwiGLU 5632, vocab 32000, untied head), activations recomputed. Parameters: 2 V C
    # (embedding, head) + L (2 C^2 + 2 C (C KV/NH) + 3 C I + 2 C) + C. FLOPs per token:
    # 6 (N - V C) (every weight but the embedding lookup) + 6 L C T. Five steps (three measured):
    # with the optimizer on NVMe a step moves ~40 GB.
    KV, I, lsteps = 4, 5632, 5
    L, NH, C, V, T, micro, accum = 22, 32, 2048, 32000, 2048, 4, 1
    if ctx.dry:
        L, NH, KV, I, C, V, T, micro, accum, lsteps = 2, 4, 2, 176, 64, 256, 64, 2, 1, 3
    train_config(d / "llama.json", micro, accum, "recompute",
                 {"type": "llama", "n_layer": L, "n_head": NH, "num_key_value_heads": KV,
                  "n_embd": C, "intermediate_size": I, "vocab_size": V, "context": T,
                  "tied_embeddings": False}, lsteps, backend)
    params = 2 * V * C + L * (2 * C * C + 2 * C * (C * KV // NH) + 3 * C * I + 2 * C) + C
    flops_tok = 6 * (params - V * C) + 6 * L * C * T
    ctx.md("")
    ctx.md("### Llama ~1B")
    ctx.md("")
    ctx.md("Model: Llama (TinyLlama-1.1B's shape) L=%d, heads=%d (key-value %d), C=%d, SwiGLU %d, "
           "T=%d, vocab %d, untied head: %d parameters; micro-batch %d x %d, %d micro-batches per "
           "step, %d steps, bf16, AdamW, activations recomputed; synthetic data. Backend: %s."
           % (L, NH, KV, C, I, T, V, params, micro, T, accum, lsteps, backend))
    ctx.md("")
    ctx.md("MFU = tokens/s x (6 (N - V C) + 6 L C T = %d FLOPs per token) / peak (%s TFLOP/s). "
           "PyTorch: tools/peers/torch_llama_gpu.py (TinyLlama's shape, 4 x 2048, activation "
           "checkpointing per block), run after strata's first row%s."
           % (flops_tok, peak or "unknown", "" if ctx.quick else " and after its last"))
    ctx.md("")
    t = Table(ctx, "llama", d / "llama.json", flops_tok)
    t.under_steps = (L + 3) + 2 + UNDER_MEASURED  # its modules: embedding, L blocks, norm, head
    t.strata_row("device", "none", "none", 1,
                 "everything on the device, the optimizer stepped by the device's kernel",
                 profile_ops=True)
    t.torch_run("torch_llama_gpu.py", [], why_not)
    t.strata_row("host", "cpu", "cpu", 1, "parameters and optimizer in host RAM")
    t.planned_rows("cpu", "parameters in host RAM", "host", profile, params, nvme)
    if not ctx.quick:
        t.torch_run("torch_llama_gpu.py", [], why_not)
    llama = t.write(why_not)
    llama.update({"params": params, "steps": lsteps})
    bad += t.bad
    torch_failed = [k for k, m in (("gpt2", gpt), ("llama", llama))
                    if any("error" in x for x in m["torch"])]
    ctx.put_json({"backend": backend, "torch": why_not or "ran",
                  "models": {"gpt2-124m": gpt, "llama-1b": llama}})
    # A PyTorch peer that cannot run on a GPU machine is a failure of the comparison; in a dry
    # run (no GPU) it is expected and reported.
    if why_not and not ctx.dry:
        bad.append("PyTorch peers not run: %s" % why_not)
    bad += ["PyTorch peer failed (%s)" % k for k in torch_failed]
    if bad:
        ctx.result("failed", "; ".join(bad))
    else:
        ratio = gpt["rows"].get("device", {}).get("over_torch")
        runs = len(gpt["rows"]) + len(llama["rows"])
        planned = ", ".join("%s planner's ratio%s%s %.2fx all-on-device"
                            % (k, " at the measured rate" if AT_RATE in r else "",
                               " (norm under)" if NORM_UNDER in r else "",
                               m["rows"][r]["over_device"])
                            for k, m in (("GPT-2", gpt), ("Llama", llama))
                            for r in PLANNED_ROWS if m["rows"].get(r, {}).get("over_device"))
        ctx.result("ok", "%d runs trained (%s): GPT-2 124M in %d placements, Llama ~1B in %d%s; "
                   "PyTorch %s" % (runs, backend, len(gpt["rows"]), len(llama["rows"]),
                                   "; " + planned if planned else "",
                                   why_not or ("GPT-2 strata/PyTorch %.2f" % ratio if ratio
                                               else "ran")))
