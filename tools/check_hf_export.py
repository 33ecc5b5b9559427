#!/usr/bin/env python3
"""Checks that transformers loads what `strata export` writes, and computes the same losses.

For each fixture of tests/fixtures/hf/ (tools/make_hf_fixtures.py, make_moe_fixtures.py): `strata
train` one step
from model.from_pretrained with learning rate 1e-12 (the weights stay as imported up to fp32 rounding), then
`strata export` of the run's checkpoint, then transformers' AutoModelForCausalLM.from_pretrained
on the exported directory: its per-token losses on the fixture's tokens must equal the
reference ones transformers computed on the original checkpoint (1e-5 relative). That checks
the exported config.json (architecture, shapes, rope, tied head) and the tensors' names,
layouts (GPT-2's Conv1D transposes) and dtype, through transformers itself.

Needs torch and transformers (a throwaway venv; never a dependency of the build). Without them
it prints why and exits 77, which ctest reports as skipped (tests/hf.cmake,
hf_export_transformers; STRATA_HF_PYTHON names the interpreter that has them).

usage: check_hf_export.py --strata build/tools/strata [--work DIR]
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = ["llama", "llama3", "qwen2", "qwen3", "phi3", "gpt2", "mixtral", "qwen2-moe",
            "qwen3-moe"]


def check_generate(transformers, torch, src, out, model):
    """The export is a complete model directory: AutoTokenizer loads it and encodes as the
    original's tokenizer does, and greedy generate() past model.context (16; the fixtures hold
    32 positions: GPT-2's table must come back whole) gives the original checkpoint's tokens.
    Returns why not, or ""."""
    try:
        tok = transformers.AutoTokenizer.from_pretrained(out)
    except Exception as e:  # noqa: BLE001 (any failure is the finding)
        return f"AutoTokenizer.from_pretrained(export) failed: {e}"
    orig_tok = transformers.AutoTokenizer.from_pretrained(src)
    text = "the model writes a fine tune"
    ids = tok(text, return_tensors="pt")["input_ids"]
    if ids.tolist() != orig_tok(text, return_tensors="pt")["input_ids"].tolist():
        return "the export's tokenizer encodes differently from the original's"
    orig = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    new_tokens = 28 - ids.shape[1]
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
        want = orig.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
    if got.tolist() != want.tolist():
        return f"generate() on the export gave {got.tolist()}, the original {want.tolist()}"
    if not tok.decode(got[0], skip_special_tokens=True):
        return "the generated tokens decode to nothing"
    return ""


def start(tag, modules):
    """A check script's start: its --strata and --work arguments, the work directory (--work,
    else a new temporary one named after `tag`), and `modules` imported (a list of names), or
    None after saying which is missing (the caller exits 77: skipped)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", required=True)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    try:
        imported = [importlib.import_module(m) for m in modules]
    except ImportError as e:
        print(f"SKIPPED: {e.name} is not installed for {sys.executable} (set STRATA_HF_PYTHON "
              f"to a python with {', '.join(modules)})")
        return None
    return args, args.work or tempfile.mkdtemp(prefix=f"strata_{tag}_check_"), imported


def main():
    started = start("hf_export", ["torch", "torch.nn.functional", "transformers",
                                  "safetensors.torch"])
    if started is None:
        return 77
    args, work, (torch, F, transformers, st) = started
    load_file = st.load_file
    with open(os.path.join(ROOT, "configs", "tiny-cpu.json")) as f:
        base = json.load(f)
    base.pop("model")
    failed = 0
    for name in FIXTURES:
        src = os.path.join(ROOT, "tests", "fixtures", "hf", name)
        run = os.path.join(work, name)
        os.makedirs(os.path.join(run, "swap"), exist_ok=True)
        cfg = json.loads(json.dumps(base))
        cfg["model"] = {"from_pretrained": src, "context": 16}
        cfg["bf16"] = {"enabled": False}
        cfg["optimizer"]["params"].update({"lr": 1e-12, "weight_decay": 0.0})  # > 0 required
        cfg["scheduler"]["params"]["warmup_num_steps"] = 1
        cfg["train"].update({"steps": 1, "eval_interval": 0, "checkpoint_dir": run + "/ckpt"})
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = run + "/swap"
        cfg_path = os.path.join(run, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        out = os.path.join(run, "hf")
        for cmd in ([args.strata, "train", "--config", cfg_path, "--quiet"],
                    [args.strata, "export", "--config", cfg_path, "--checkpoint", run + "/ckpt",
                     "--out", out]):
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"FAIL {name}: {' '.join(cmd)} exited {p.returncode}\n{p.stderr[-2000:]}")
                return 1
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, output_loading_info=True)
        model.eval()
        if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
            print(f"FAIL {name}: transformers' loading info {info}")
            failed += 1
            continue
        ref = load_file(os.path.join(src, "reference.safetensors"))
        tokens, targets = ref["tokens"].long(), ref["targets"].long()
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.float()
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                 reduction="none").reshape(tokens.shape)
        rel = ((losses - ref["losses"]).abs() / ref["losses"].abs()).max().item()
        ok = rel <= 1e-5
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {type(model).__name__} loaded from strata's "
              f"export; loss {losses.mean().item():.6f} vs reference {ref['loss'].item():.6f}, "
              f"max relative per-token difference {rel:.2e}")
        if not os.path.exists(os.path.join(src, "tokenizer.json")):
            print(f"ok   {name}: (no tokenizer in the fixture: generate() not checked)")
            failed += not ok
            continue
        why = check_generate(transformers, torch, src, out, model)
        if why:
            print(f"FAIL {name}: {why}")
        else:
            print(f"ok   {name}: AutoTokenizer loads the export, generate() gives the original's "
                  f"tokens past model.context (16)")
        failed += not ok or bool(why)
    print(f"{len(FIXTURES) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
