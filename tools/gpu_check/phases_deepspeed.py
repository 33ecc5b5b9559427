"""The deepspeed phase: DeepSpeed ZeRO-Offload (optimizer state in host RAM) beside strata on the
offload phase's shape (configs/hostmem-190m.json: GPT-2-style 15 x 1024, 16 heads, vocab 256, T
128, micro-batch 1, 2 micro-batches per step) and on the train phase's GPT-2 124M (12 x 768, T
1024, 8 x 2 micro-batches) and ~1B Llama (TinyLlama's shape, 4 x 2048, recomputed), and
ZeRO-Infinity (parameters and optimizer state on NVMe) on the
former, strata as shipped (256 MiB of host memory) and with a 4 GiB host budget (beside the same
DeepSpeed run); bf16, AdamW, clipping 1.0; alternated run by run, tokens/s and peak RSS for both.

DeepSpeed comes from the bundle tools/gpu_peers.py packs (--peers-dir, default
<build dir>/peers): installed with no network into a virtual environment under the results
(--system-site-packages: the machine's PyTorch and CUDA), its CPU Adam and async I/O ops
compiled first (torch's JIT, with the carried libaio), time-boxed; the environment and the
compiled ops are kept beside the results, so a later call on the same machine reuses them. The driver is
tools/peers/ds_zero_gpu.py."""
import json
import os
import re
import shutil
import time
from pathlib import Path

from .common import ROOT, find_tool, fmt, median, metric_median
from .peers_bundle import install
from .phases_train import peak_rss, rss_split, torch_python, train_config, why_failed

DRIVER = ROOT / "tools" / "peers" / "ds_zero_gpu.py"
# The pairs: a name, what strata runs, strata's config ("hostmem-190m": configs/hostmem-190m.json;
# "gpt2-124m": the train phase's GPT-2 124M shape), its --set placement, and DeepSpeed's mode.
# DeepSpeed trains the shape of strata's config (one description of it).
OFFLOAD = ['zero_optimization.offload_param.device="none"',
           'zero_optimization.offload_optimizer.device="cpu"', 'strata.placement.grads="host"']
# In the order a cut call loses least: the train phase's GPT-2, ZeRO-Infinity (strata as shipped,
# then at 4 GiB of host memory), the Llama (the longest), hostmem-190m's ZeRO-Offload.
PAIRS = [
    ("offload-gpt2", "GPT-2 124M (8 x 1024, 2 micro-batches): optimizer state in host RAM, "
     "parameters and gradients on the device", "gpt2-124m", OFFLOAD, "offload"),
    ("infinity", "hostmem-190m as shipped: parameters, gradients and optimizer state on NVMe, "
     "256 MiB host budget", "hostmem-190m", [], "infinity"),
    ("infinity-4g", "hostmem-190m with a 4 GiB host budget (about half the RSS DeepSpeed's "
     "ZeRO-Infinity run takes): parameters and optimizer state on NVMe, gradients in host RAM; "
     "beside the infinity pair's DeepSpeed run",
     "hostmem-190m", ['strata.host_memory_limit="4GiB"', 'strata.placement.grads="host"'],
     "infinity"),
    ("offload-llama", "Llama ~1B (TinyLlama's shape, 4 x 2048, recompute): optimizer state in "
     "host RAM, parameters and gradients on the device", "llama-1b", OFFLOAD, "offload"),
    ("offload", "hostmem-190m's shape: optimizer state in host RAM, parameters and gradients on "
     "the device", "hostmem-190m",
     OFFLOAD + ['strata.host_memory_limit="16GiB"', 'device.memory_limit="16GiB"'], "offload"),
]


def _config(d, which):
    """The path of strata's config for a pair: hostmem-190m, or the train phase's shapes."""
    if which == "hostmem-190m":
        return ROOT / "configs" / "hostmem-190m.json"
    path = d / ("%s.json" % which)
    if which == "gpt2-124m":
        train_config(path, 8, 2, "keep", {"n_layer": 12, "n_head": 12, "n_embd": 768,
                                          "vocab_size": 50257, "padded_vocab_size": 50304,
                                          "context": 1024}, 6, "cuda")
    else:
        train_config(path, 4, 1, "recompute",
                     {"type": "llama", "n_layer": 22, "n_head": 32, "num_key_value_heads": 4,
                      "n_embd": 2048, "intermediate_size": 5632, "vocab_size": 32000,
                      "context": 2048, "tied_embeddings": False}, 6, "cuda")
    return path


# Pairs whose DeepSpeed side is another pair's run (the same DeepSpeed configuration): strata
# alone runs, and the row shows that pair's DeepSpeed numbers.
SAME_DEEPSPEED = {"infinity-4g": "infinity"}


def _shape(cfg):
    """DeepSpeed's driver arguments for the shape of a strata config."""
    c = json.loads(Path(cfg).read_text())
    m = c["model"]
    shape = ["--n-layer", m["n_layer"], "--n-head", m["n_head"], "--n-embd", m["n_embd"],
             "--vocab", m["vocab_size"], "--context", m["context"],
             "--micro-batch", c["train_micro_batch_size_per_gpu"],
             "--grad-accum", c["gradient_accumulation_steps"]]
    if m.get("type") == "llama":
        shape += ["--arch", "llama", "--n-kv-head", m["num_key_value_heads"],
                  "--intermediate", m["intermediate_size"]]
    return [str(x) for x in shape]


def _rss_mib(text):
    """strata's peak RSS line as MiB."""
    v = peak_rss(text)
    if not v:
        return None
    n, unit = v.split()
    return float(n) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[unit]


def _gpu_arch(ctx):
    """The GPU's compute capability as TORCH_CUDA_ARCH_LIST spells it ("9.0"), or None."""
    smi = find_tool("nvidia-smi")
    if not smi:
        return None
    rc, out = ctx.capture(30, [smi, "--query-gpu=compute_cap", "--format=csv,noheader"])
    cc = out.strip().splitlines()[0].strip() if rc == 0 and out.strip() else ""
    return cc if re.fullmatch(r"\d+\.\d+", cc) else None


def _env(peers, ext_dir, arch):
    env = dict(os.environ)
    aio = Path(peers) / "libaio"
    lib, inc = str(aio / "lib"), str(aio / "include")
    for k, v in (("LD_LIBRARY_PATH", lib), ("LIBRARY_PATH", lib), ("CPATH", inc)):
        env[k] = v + (":" + env[k] if env.get(k) else "")
    env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    env["MAX_JOBS"] = str(os.cpu_count() or 8)
    env["DS_ACCELERATOR"] = "cuda"
    # DeepSpeed's JIT parses the arch list as numbers: a machine's list with architecture
    # suffixes ("9.0a", "10.0a") stops its async I/O build. Its own GPU's is all it needs.
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    return env


def phase_deepspeed(ctx):
    exe = ctx.bin("strata")
    if not os.access(exe, os.X_OK):
        return ctx.result("failed", "strata not built")
    peers = Path(ctx.opts.peers_dir) if ctx.opts.peers_dir else ctx.build / "peers"
    if not (peers / "wheels").is_dir():
        return ctx.result("skipped" if ctx.dry else "failed",
                          "no DeepSpeed bundle at %s (tools/gpu_peers.py pack, carried with "
                          "the strata bundle)" % peers)
    if ctx.dry:
        return ctx.result("skipped", "dry run: DeepSpeed needs a GPU (the bundle at %s is "
                          "checked by tools/gpu_peers.py verify)" % peers)
    d = ctx.R / "deepspeed"
    d.mkdir(parents=True, exist_ok=True)
    # 1. The throwaway environment, with no network; it and the compiled ops live beside the
    # results (not in them: the results are what a machine sends back), and a later call on the
    # same machine reuses the ops.
    t0 = time.time()
    python, err = install(peers, ctx.R.parent / "deepspeed-venv", base_python=torch_python(ctx),
                          log=ctx.log)
    if err:
        return ctx.result("failed", "install: " + err)
    t_install = time.time() - t0
    env = _env(peers, ctx.R.parent / "deepspeed-torch-extensions", _gpu_arch(ctx))
    # 2. The ops DeepSpeed's offload needs, compiled now (time-boxed) rather than inside the
    # first timed run: CPU Adam (both pairs), async I/O (ZeRO-Infinity's NVMe only).
    ops = {}
    for op, builder in (("cpu_adam", "CPUAdamBuilder"), ("async_io", "AsyncIOBuilder")):
        t0 = time.time()
        log = ctx.log_path("deepspeed-%s" % op)
        rc = ctx.run(240, [python, "-c",
                           "import numpy, torch, deepspeed\n"
                           "from deepspeed.ops.op_builder import %s\n"
                           "print('torch', torch.__version__, 'cuda', torch.version.cuda, "
                           "'deepspeed', deepspeed.__version__, flush=True)\n"
                           "%s().load(); print('built', flush=True)\n" % (builder, builder)],
                     log=log, env=env)
        text = log.read_text(errors="replace")
        ops[op] = {"exit": rc, "seconds": round(time.time() - t0, 1),
                   "why": "numpy missing" if "No module named 'numpy'" in text else
                   "see logs/%s" % log.name}
        ctx.md("DeepSpeed's %s: %s in %.0f s (logs/%s)."
               % (op, "compiled" if rc == 0 else "FAILED (exit %d)" % rc, ops[op]["seconds"],
                  log.name))
    ctx.md("")
    ctx.md("DeepSpeed from %s, installed in %.0f s." % (peers, t_install))
    ctx.md("")
    if ops["cpu_adam"]["exit"] != 0:
        ctx.put_json({"install_s": t_install, "ops": ops})
        return ctx.result("failed", "DeepSpeed's CPU Adam did not build (exit %d: %s)"
                          % (ops["cpu_adam"]["exit"], ops["cpu_adam"]["why"]))
    pairs = [p for p in PAIRS if p[4] != "infinity" or ops["async_io"]["exit"] == 0]
    # 3. The rows, alternated: strata, DeepSpeed, strata, DeepSpeed, ... per pair; two rounds
    # unless --quick (the median of the rounds is reported).
    steps = 6 if ctx.quick else 8
    rounds = 1 if ctx.quick else 2
    nvme = os.path.join(ctx.opts.nvme_path or str(ctx.R / "swap"), "deepspeed")
    res = {p[0]: {"strata": [], "deepspeed": []} for p in pairs}
    bad = [] if len(pairs) == len(PAIRS) else ["DeepSpeed's async I/O did not build: no "
                                               "ZeRO-Infinity pair"]
    for rnd in range(rounds):
        for name, what, which, sets, mode in pairs:
            cfg = _config(d, which)
            shutil.rmtree(nvme, ignore_errors=True)
            os.makedirs(nvme, exist_ok=True)
            rdir = d / ("strata-%s-%d" % (name, rnd))
            log = ctx.log_path("deepspeed-strata-%s-%d" % (name, rnd))
            shutil.rmtree(rdir, ignore_errors=True)
            rc = ctx.run(240, [exe, "train", "--config", cfg, "--set", 'device.backend="cuda"',
                               "--set", "train.steps=%d" % steps,
                               "--set", 'train.checkpoint_dir="%s"' % rdir,
                               "--set", "train.final_checkpoint=false",
                               "--set", 'zero_optimization.offload_param.nvme_path="%s"' % nvme,
                               "--set", 'zero_optimization.offload_optimizer.nvme_path="%s"' % nvme]
                         + [x for kv in sets for x in ("--set", kv)], log=log)
            text = log.read_text(errors="replace")
            m = rdir / "metrics.jsonl"
            if rc == 0 and m.exists():
                res[name]["strata"].append({"tokens_per_s": metric_median(m, "tokens_per_s"),
                                            "step_s": metric_median(m, "step_s"),
                                            "peak_rss_mib": _rss_mib(text),
                                            "rss_split": rss_split(text)})
            else:
                res[name]["strata"].append({"error": "exit %d: %s" % (rc, why_failed(text))})
                bad.append("strata %s: exit %d" % (name, rc))
            shutil.rmtree(nvme, ignore_errors=True)
            if name in SAME_DEEPSPEED:
                continue
            log = ctx.log_path("deepspeed-ds-%s-%d" % (name, rnd))
            rc, out = _capture_json(ctx, [python, DRIVER, "--mode", mode, "--steps", str(steps - 2),
                                          "--warmup", "2", "--nvme-path", nvme] + _shape(cfg),
                                    log, env)
            if out:
                res[name]["deepspeed"].append(out)
            else:
                res[name]["deepspeed"].append({"error": "exit %d (logs/%s)" % (rc, log.name)})
                bad.append("DeepSpeed %s: exit %d" % (name, rc))
    shutil.rmtree(nvme, ignore_errors=True)
    ctx.md("hostmem-190m: configs/hostmem-190m.json's shape (15 x 1024, T 128, 1 x 2 micro-batches); "
           "GPT-2 124M: 12 x 768, T 1024, 8 x 2 micro-batches; Llama ~1B: TinyLlama's shape, 4 x 2048, "
           "recompute; bf16, clipping 1.0, on the GPU, "
           "%d steps (medians after 2), %d round%s alternated strata / DeepSpeed."
           % (steps, rounds, "" if rounds == 1 else "s"))
    ctx.md("")
    ctx.md("| placement | strata tokens/s | DeepSpeed tokens/s | strata / DeepSpeed | strata peak RSS "
           "MiB | DeepSpeed peak RSS MiB | DeepSpeed optimizer |")
    ctx.md("|---|---|---|---|---|---|---|")
    summary = []
    for name, other in SAME_DEEPSPEED.items():
        if name in res and other in res:
            res[name]["deepspeed"] = res[other]["deepspeed"]
    for name, what, _, _, _ in pairs:
        s = [x["tokens_per_s"] for x in res[name]["strata"] if x.get("tokens_per_s")]
        g = [x["tokens_per_s"] for x in res[name]["deepspeed"] if x.get("tokens_per_s")]
        sr = [x["peak_rss_mib"] for x in res[name]["strata"] if x.get("peak_rss_mib")]
        gr = [x["peak_rss_mib"] for x in res[name]["deepspeed"] if x.get("peak_rss_mib")]
        st, gt = median(s), median(g)
        ratio = st / gt if st and gt else None
        res[name].update({"strata_tokens_per_s": st, "deepspeed_tokens_per_s": gt,
                          "strata_over_deepspeed": ratio, "what": what})
        opt = next((x.get("optimizer") for x in res[name]["deepspeed"] if x.get("optimizer")), "?")
        ctx.md("| %s: %s | %s | %s | %s | %s | %s | %s |"
               % (name, what, fmt(st, "%.0f"), fmt(gt, "%.0f"), fmt(ratio), fmt(max(sr) if sr else None, "%.0f"),
                  fmt(max(gr) if gr else None, "%.0f"), opt))
        summary.append("%s %s" % (name, fmt(ratio)))
    splits = [(name, x["rss_split"]) for name, _, _, _, _ in pairs
              for x in res[name]["strata"][:1] if x.get("rss_split")]
    if splits:
        ctx.md("")
        ctx.md("strata's peak RSS, what it is made of (first round): "
               + "; ".join("%s: %s" % s for s in splits) + ".")
    ctx.put_json({"install_s": t_install, "ops": ops, "steps": steps, "rounds": rounds,
                  "pairs": res})
    if bad:
        ctx.result("failed", "; ".join(bad))
    else:
        ctx.result("ok", "strata / DeepSpeed tokens/s: " + ", ".join(summary))


def _capture_json(ctx, cmd, log, env):
    """Runs a driver whose stdout's last line is its JSON result (its stderr to the log)."""
    out_path = Path(str(log) + ".out")
    rc = ctx.run(240, ["sh", "-c", 'exec "$@" > "%s"' % out_path, "sh"] + [str(c) for c in cmd],
                 log=log, env=env)
    try:
        lines = [l for l in out_path.read_text().splitlines() if l.strip().startswith("{")]
        return rc, json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return rc, None
