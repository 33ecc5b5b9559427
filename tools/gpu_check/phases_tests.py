"""The tests phase (every CUDA test binary, gtest JSON kept; then those that reach the kernel
table's attention again with STRATA_CUDNN=0, the own kernels) and the sanitizer phase
(compute-sanitizer's memcheck, racecheck and synccheck over short gtest filters)."""
import os
import re
import time

TEST_BINARIES = ["cuda_backend_test", "cuda_flash_attention_test", "cuda_train_test",
                 "llama_cuda_test", "flash_attention_test"]

# Then again with the own attention kernels (STRATA_CUDNN=0): the binaries whose calls go
# through the kernel table's choice of attention, without the tests of cuDNN itself (which
# skip without it).
FALLBACK_BINARIES = ["cuda_backend_test", "cuda_flash_attention_test", "cuda_train_test",
                     "llama_cuda_test"]
FALLBACK_ENV = "STRATA_CUDNN"
FALLBACK_FILTER = "-*Cudnn*"

# compute-sanitizer runs: tool, binary, gtest filter (kept short: sanitizers are 10-100x slower).
SANITIZER_RUNS = [
    ("memcheck", "cuda_backend_test", "AllDtypes/CudaOpTest.*/bf16:CudaBackendTest.*:CudaDeviceTest.*"),
    ("memcheck", "cuda_flash_attention_test",
     "CudaFlashAttentionTest.MatchesTheCpuBackendAndTheReference:"
     "CudaFlashAttentionTest.UnsupportedCallsFailAtTheNextSynchronize"),
    ("racecheck", "cuda_backend_test", "AllDtypes/CudaOpTest.Layernorm/bf16:"
     "AllDtypes/CudaOpTest.CrossEntropy/bf16:CudaBackendTest.NormSquaredAndNonfinite"),
    ("racecheck", "cuda_flash_attention_test", "CudaFlashAttentionTest.IsDeterministic"),
    ("synccheck", "cuda_backend_test", "AllDtypes/CudaOpTest.*/bf16"),
    ("synccheck", "cuda_flash_attention_test", "CudaFlashAttentionTest.IsDeterministic"),
]


def gtest_counts(text):
    """(passed, failed, skipped) from a gtest run's output."""
    def last(pattern):
        found = re.findall(pattern, text, re.M)
        return int(found[-1]) if found else 0
    return (last(r"^\[  PASSED  \] (\d+)"), last(r"^\[  FAILED  \] (\d+) test"),
            last(r"^\[  SKIPPED \] (\d+) test"))


def skip_reasons(text):
    """The line after each ': Skipped' (gtest prints the reason there)."""
    lines = text.splitlines()
    return [lines[i + 1] if i + 1 < len(lines) else ""
            for i, l in enumerate(lines) if l.endswith(": Skipped")]


def phase_tests(ctx):
    tp = tf = ts = tgpu = 0
    any_built = False
    bad, reasons, failures, res = [], [], [], {}
    ctx.md("| binary | passed | failed | skipped | seconds |")
    ctx.md("|---|---|---|---|---|")
    runs = [(b, False) for b in TEST_BINARIES] + [(b, True) for b in FALLBACK_BINARIES]
    for b, fallback in runs:
        exe = ctx.bin(b)
        name = b + (" (%s=0)" % FALLBACK_ENV if fallback else "")
        if not os.access(exe, os.X_OK):
            ctx.md("| %s | not built | | | |" % name)
            if not ctx.dry and not fallback:
                bad.append("%s not built" % b)
            continue
        any_built = True
        tag = b + ("-own-attention" if fallback else "")
        log = ctx.log_path("tests-%s" % tag)
        t0 = time.time()
        # flash_attention_test (the CUDA kernels on a CPU emulation) is slow and needs no GPU: on
        # the GPU machine it runs in full; in a dry run CI already runs it, so only its listing.
        listing = ctx.dry and b == "flash_attention_test"
        cmd = [exe] + (["--gtest_list_tests"] if listing else []) + \
            (["--gtest_filter=%s" % FALLBACK_FILTER] if fallback else []) + \
            ["--gtest_output=json:%s" % (ctx.R / "tests" / ("%s.json" % tag))]
        env = dict(os.environ, **{FALLBACK_ENV: "0"}) if fallback else None
        rc = ctx.run(600, cmd, log=log, env=env)
        text = log.read_text(errors="replace")
        p, f, s = gtest_counts(text)
        secs = int(time.time() - t0)
        if listing:
            p = len([l for l in text.splitlines() if l.startswith("  ")])
            ctx.md("| %s | listed %d tests (dry run) | | | %d |" % (name, p, secs))
        else:
            ctx.md("| %s | %d | %d | %d | %d |" % (name, p, f, s, secs))
            for line in sorted(set(re.findall(r"^\[  FAILED  \] ([A-Za-z].*)$", text, re.M))):
                failures.append("%s: %s" % (name, line))
        tp, tf, ts = tp + p, tf + f, ts + s
        why = skip_reasons(text)
        # The one skip a GPU machine should give: the no-GPU path's test, which needs no GPU.
        tgpu += sum(1 for w in why if "a GPU is visible" in w)
        if rc != 0:
            bad.append("%s exited %d" % (name, rc))
        if s > 0:
            # A skip must say why (never a silent pass).
            if why and why[0].strip():
                reasons.append("%s: `%s`" % (name, why[0][:240]))
            else:
                bad.append("%s skipped tests without a reason" % name)
        res[tag] = {"passed": p, "failed": f, "skipped": s, "exit": rc}
    if failures:
        ctx.md("")
        ctx.md("Failed tests:")
        for x in failures:
            ctx.md("- " + x)
    if reasons:
        ctx.md("")
        ctx.md("Skip reasons (first per binary):")
        for x in reasons:
            ctx.md("- " + x)
    res["total"] = {"passed": tp, "failed": tf, "skipped": ts}
    ctx.put_json(res)
    if not ctx.dry and ts > tgpu:
        bad.append("%d skipped on a GPU machine (see logs)" % (ts - tgpu))
    if not any_built:
        if ctx.dry:
            return ctx.result("skipped", "no CUDA test binaries (built without CUDA)")
        return ctx.result("failed", "no test binaries")
    summary = "%d passed, %d failed, %d skipped" % (tp, tf, ts)
    if bad:
        ctx.result("failed", summary + "; " + "; ".join(bad))
    else:
        ctx.result("ok", summary)


def phase_sanitizer(ctx):
    sanitizer = ctx.state.get("sanitizer", "")
    bad, runs, n_ok = [], [], 0
    ctx.md("| tool | binary | gtest filter | result | seconds |")
    ctx.md("|---|---|---|---|---|")
    for tool, b, flt in SANITIZER_RUNS:
        exe = ctx.bin(b)
        if not os.access(exe, os.X_OK):
            ctx.md("| %s | %s | `%s` | not built | |" % (tool, b, flt))
            if not ctx.dry:
                bad.append("%s not built" % b)
            continue
        # The filter must select tests, or the run proves nothing.
        rc, out = ctx.capture(60, [exe, "--gtest_list_tests", "--gtest_filter=%s" % flt])
        listed = len([l for l in out.splitlines() if l.startswith("  ")])
        if listed == 0:
            ctx.md("| %s | %s | `%s` | FILTER MATCHES NO TEST | |" % (tool, b, flt))
            bad.append("%s/%s: the filter matches no test" % (tool, b))
            continue
        if ctx.dry or not sanitizer:
            ctx.md("| %s | %s | `%s` | not run (%d tests selected; %s) | |"
                   % (tool, b, flt, listed, "dry run" if ctx.dry else "compute-sanitizer not found"))
            continue
        log = ctx.log_path("sanitizer-%s-%s" % (tool, b))
        t0 = time.time()
        rc = ctx.run(300, [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit",
                           "20", exe, "--gtest_filter=%s" % flt], log=log)
        found = re.findall(r"ERROR SUMMARY: (\d+) error", log.read_text(errors="replace"))
        errors = int(found[-1]) if found else None
        if rc == 0 and not errors:
            verdict = "clean (%d tests)" % listed
            n_ok += 1
        elif rc in (124, 137):
            verdict = "TIMED OUT"
            bad.append("%s/%s timed out" % (tool, b))
        else:
            verdict = "%s errors, exit %d" % ("?" if errors is None else errors, rc)
            bad.append("%s/%s: %s" % (tool, b, verdict))
        ctx.md("| %s | %s | `%s` | %s | %d |" % (tool, b, flt, verdict, time.time() - t0))
        runs.append({"tool": tool, "binary": b, "errors": errors, "exit": rc})
    ctx.put_json({"runs": runs})
    if bad:
        ctx.result("failed", "; ".join(bad))
    elif ctx.dry:
        ctx.result("ok", "dry run: every filter selects tests; compute-sanitizer %s"
                   % (sanitizer or "not found"))
    elif not sanitizer:
        ctx.result("failed", "compute-sanitizer not found (it ships with the CUDA toolkit: "
                   "cuda-sanitizer package)")
    else:
        ctx.result("ok", "%d runs clean" % n_ok)
