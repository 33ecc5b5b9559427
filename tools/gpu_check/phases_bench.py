"""The gemm, copy and attention phases: bench_device_ops on the device (on the CPU backend at
small shapes in a dry run), its own JSON and Markdown kept, a summary read from the JSON."""
import json
import os


def _bench(ctx, mode):
    """Runs bench_device_ops MODE into json/ and md/; returns its JSON, or None after recording
    the failure."""
    exe = ctx.bin("bench_device_ops")
    if not os.access(exe, os.X_OK):
        ctx.result("failed", "bench_device_ops not built")
        return None
    backend, extra = "cuda", []
    if ctx.dry:
        backend, extra = "cpu", ["--quick", "--repeats", "2"]
    elif ctx.quick:
        extra = ["--repeats", "3"]
    if ctx.state.get("peak_tflops") is not None:
        extra += ["--peak-tflops", str(ctx.state["peak_tflops"])]
    if ctx.state.get("peak_gbs") is not None:
        extra += ["--peak-gbs", str(ctx.state["peak_gbs"])]
    out = ctx.R / "json" / ("%s.json" % mode)
    rc = ctx.run(420, [exe, mode, "--backend", backend] + extra +
                 ["--json", out, "--md", ctx.R / "md" / ("%s.md" % mode)])
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError):
        data = None
    if rc != 0 or data is None:
        ctx.result("failed", "bench_device_ops %s failed (exit %d; see log)" % (mode, rc))
        return None
    return data


def phase_gemm(ctx):
    data = _bench(ctx, "gemm")
    if data is None:
        return
    best = max((r.get("forward_tflops") or 0 for r in data.get("shapes", [])), default=0)
    peak = ctx.state.get("peak_tflops")
    ctx.md("")
    ctx.md("FLOPs: forward 2·N·C·OC, backward 4·N·C·OC (dinp and dweight); peak: %s TFLOP/s "
           "dense bf16." % (peak if peak is not None else "unknown"))
    elementwise = [r for r in data.get("elementwise", []) if isinstance(r, dict)]
    gbs = [r.get("gbps") or 0 for r in elementwise]
    speedups = [r["packed_speedup"] for r in elementwise if r.get("packed_speedup")]
    hbm = ctx.state.get("peak_gbs")
    ctx.md("Elementwise rows: GB/s of the bytes each op must move at least, against %s GB/s; "
           "one element a thread = the kernels with STRATA_CUDA_PACKED=0."
           % (hbm if hbm is not None else "an unknown memory bandwidth"))
    ctx.result("ok", "best forward %.3g TFLOP/s (peak %s); elementwise %.0f-%.0f GB/s%s"
               % (best, peak if peak else "unknown", min(gbs, default=0), max(gbs, default=0),
                  ", packs %.2f-%.2fx one element" % (min(speedups), max(speedups))
                  if speedups else ""))


def phase_copy(ctx):
    data = _bench(ctx, "copy")
    if data is None:
        return
    cases = data.get("cases", {})

    def gbps(name):
        c = cases.get(name)
        return c.get("gbps") if isinstance(c, dict) else None
    h2d, d2h = gbps("h2d_pinned"), gbps("d2h_pinned")
    link = ctx.state.get("link_gbps")
    ctx.md("")
    ctx.md("Link: %s GB/s per direction (PCIe generation x width from nvidia-smi)."
           % (link if link is not None else "unknown"))
    ctx.result("ok", "pinned h2d %.1f GB/s, d2h %.1f GB/s (link %s)"
               % (h2d or 0, d2h or 0, link if link is not None else "?"))


def attention_kernels(row):
    """The kernels a bench_device_ops attention row timed (an object with forward_s), in the
    order the tool wrote them; the others are strings saying why not ("n/a: ...")."""
    return [k for k, v in row.items() if isinstance(v, dict) and "forward_s" in v]


def _median_s(x):
    return x.get("median") if isinstance(x, dict) else x


def comparison_table(shapes):
    """Markdown lines: per shape, each timed kernel's forward and backward ms, and a kernel
    whose name has "cudnn" against the own fused kernel where both ran (whatever columns the
    tool writes: a kernel it does not time is shown as not run, with its reason)."""
    names = []
    for row in shapes:
        for k in attention_kernels(row):
            if k not in names:
                names.append(k)
    cudnn = [k for k in names if "cudnn" in k.lower()]
    own = "fused" if "fused" in names else None
    lines = ["| shape | " + " | ".join("%s fwd / bwd ms" % k for k in names) +
             "".join(" | %s / %s (fwd, bwd)" % (c, own) for c in cudnn if own) + " |",
             "|---|" + "---|" * (len(names) + (len(cudnn) if own else 0))]
    for row in shapes:
        cells = []
        for k in names:
            v = row.get(k)
            if isinstance(v, dict):
                f, b = _median_s(v.get("forward_s")), _median_s(v.get("backward_s"))
                cells.append("%s / %s" % ("?" if f is None else "%.3f" % (f * 1e3),
                                          "?" if b is None else "%.3f" % (b * 1e3)))
            else:
                cells.append(str(v)[:60] if v is not None else "")
        for c in cudnn if own else []:
            a, b = row.get(c), row.get(own)
            if isinstance(a, dict) and isinstance(b, dict):
                fa, fb = _median_s(a.get("forward_s")), _median_s(b.get("forward_s"))
                ba, bb = _median_s(a.get("backward_s")), _median_s(b.get("backward_s"))
                cells.append("%s, %s" % ("%.2f" % (fa / fb) if fa and fb else "?",
                                         "%.2f" % (ba / bb) if ba and bb else "?"))
            else:
                cells.append("")
        shape = "%s (B %s, T %s, heads %s/%s of %s)" % (row.get("name"), row.get("B"), row.get("T"),
                                                        row.get("NH"), row.get("NKV"), row.get("hs"))
        lines.append("| %s | %s |" % (shape, " | ".join(cells)))
    return lines, names, cudnn


def long_sequence_rates(shapes, names):
    """Per kernel, its best forward + backward TFLOP/s over the shapes with T >= 2048 and head
    size 128 (the GPU goal's shapes): the FLOPs of both passes over their two medians."""
    best = {}
    for row in shapes:
        if (row.get("T") or 0) < 2048 or row.get("hs") != 128:
            continue
        for k in names:
            v = row.get(k)
            if not isinstance(v, dict):
                continue
            tf, tb = v.get("forward_tflops"), v.get("backward_tflops")
            f, b = _median_s(v.get("forward_s")), _median_s(v.get("backward_s"))
            if not (tf and tb and f and b):
                continue
            rate = (tf * f + tb * b) / (f + b)
            best[k] = max(best.get(k, 0.0), rate)
    return best


def phase_attention(ctx):
    data = _bench(ctx, "attention")
    if data is None:
        return
    shapes = [r for r in data.get("shapes", []) if isinstance(r, dict)]
    lines, names, cudnn = comparison_table(shapes)
    ctx.md("")
    ctx.md("Attention memory: plain = the [B,NH,T,T] fp32 probabilities and their gradient "
           "scratch; fused = [B,NH,T] fp32 log-sum-exp and scratch; cudnn (deterministic "
           "backward) and cudnn-nd (non-deterministic) the same plus the workspace their path "
           "names in json/attention.json.")
    ctx.md("")
    ctx.md("Kernels side by side (medians; a ratio under 1 means the first is faster):")
    ctx.md("")
    for l in lines:
        ctx.md(l)
    counts = ", ".join("%d %s" % (sum(1 for r in shapes if isinstance(r.get(k), dict)), k)
                       for k in names)
    peak = ctx.state.get("peak_tflops")
    rates = long_sequence_rates(shapes, names)
    rate_text = "; ".join("%s %.0f TFLOP/s%s" % (k, r, " (%.0f%% of peak)" % (100 * r / peak)
                                                  if peak else "")
                          for k, r in sorted(rates.items(), key=lambda kv: -kv[1]))
    ctx.md("")
    ctx.md("Forward + backward at T >= 2048, head size 128 (the FLOPs of both passes over both "
           "times; the goal is half the dense bf16 peak): %s." % (rate_text or "no such shape ran"))
    ctx.result("ok", "cases measured: %s%s; fwd+bwd at T >= 2048, hs 128: %s"
               % (counts or "none", "" if cudnn else " (no cuDNN column)",
                  rate_text or "none ran"))
